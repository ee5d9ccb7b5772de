"""Activations and gradients between neighbouring stages, with torch.distributed isend/irecv.

A stage's output is a tensor or a tuple of tensors. Its shapes are sent once,
in a small header before the first iteration's payload of each micro-batch;
afterwards both sides know them, and a sender whose output changes shape stops
with an error (the receiver could not know). Gradients travel back with the
shapes of the activations they belong to (one per floating-point tensor), so
they need no header::

    stage j                                    stage j + 1
    SEND_F  header (first iteration), payload ──►  RECV_F  (header), payload
    RECV_B  gradients                    ◄──────  SEND_B  gradients

Under NCCL, forward traffic and backward traffic go over two process groups,
so the two directions never queue behind each other (NCCL serialises all
operations of one pair of ranks in a group on one stream); Gloo matches
messages by peer and tag, and one group serves both. Sends are posted and not waited
for (the schedule's semantics): ``wait_sends`` waits for them before the
optimizer step. Receives wait at most ``timeout_s`` and name the peer.

Gloo (and NCCL) move a payload only once both sides have posted. The executor
posts each receive one ahead of the RECV that waits for it (``early_receives``,
sync option ``early_receives = "always"``), so that the data lands while the
receiver computes, and so that the sender, which finds the receive already
posted, writes the payload itself inside its ``isend``. Posted at the RECV
(``"never"``, as torch.distributed.pipelining does), the transfer starts when
the receiver asks and, on Gloo, needs the sender's progress thread to run at that
moment: on a host whose CPU is the bottleneck that waits for the sender's next
slice of CPU. Measured (benchmarks/RESULTS.md, "Receives posted ahead"): on the
emulated clusters whose ranks are throttled, posting at the RECV cut the 1F1B
pipeline from 1.21x / 1.36x of torch's Schedule1F1B to 0.92x / 0.96x; on an
unthrottled 2-core host with 1 kB transfers (a pipeline bound by per-micro-batch
overhead) it was 4% faster, since each receive waiting posted keeps Gloo's
progress thread busier.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hetrain.amp import from_wire, to_wire, wire_dtype
from hetrain.distributed.health import Health, PeerError
from hetrain.plan import Plan

#: dtypes a header can name, by code (the index)
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)
HEADER_LEN = 64  # int64 entries: [is_tuple, count, (dtype code, ndim, *dims) per tensor, 0...]
_TAGS_PER_MICRO_BATCH = 64  # tag = i * 64 + k for tensor k of micro-batch i; 63 is the header


#: (is_tuple, ((dtype, shape), ...)): what a stage sends for one micro-batch
Spec = tuple[bool, tuple[tuple[torch.dtype, tuple[int, ...]], ...]]


def early_receives(plan: Plan, device: str) -> tuple[bool, bool]:
    """Whether ``device``'s stage posts its receives ahead of its RECVs: (from the previous stage, from the next).

    The plan's sync option ``early_receives``: ``always`` (the default) or ``never``. A device
    without a stage, or a side without a neighbour: False.

    Example:
        >>> early_receives(plan, "n0:1")    # doctest: +SKIP
        (True, True)     # a middle stage, early_receives "always"
    """
    early = plan.sync_options.early_receives == "always"
    for vw in plan.virtual_workers:
        for j, stage in enumerate(vw.stages):
            if device in stage.devices:
                return early and j > 0, early and j + 1 < len(vw.stages)
    return False, False


def flatten(value: Any) -> tuple[list[torch.Tensor], bool]:
    """A stage output as a list of tensors, and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return list(value), True
    raise TypeError(f"its output goes to the next stage, which takes a tensor or a tuple of tensors, "
                    f"but it is {_kind(value)}; return a tuple of tensors from it, or plan with no cut after it")


def _kind(value: Any) -> str:
    """What a stage output is, where it is not a tensor or a tuple of tensors: ``a dict``, ``a tuple holding
    NoneType at index 1``."""
    if isinstance(value, (tuple, list)):
        bad = next(k for k, t in enumerate(value) if not isinstance(t, torch.Tensor))
        return f"a {type(value).__name__} holding {type(value[bad]).__name__} at index {bad}"
    return f"a {type(value).__name__}"


def spec_of(tensors: Sequence[torch.Tensor], is_tuple: bool) -> Spec:
    return (is_tuple, tuple((t.dtype, tuple(t.shape)) for t in tensors))


def encode_header(spec: Spec, device: torch.device) -> torch.Tensor:
    """The header of ``spec``: ``HEADER_LEN`` int64 values."""
    is_tuple, parts = spec
    values = [int(is_tuple), len(parts)]
    for dtype, shape in parts:
        if dtype not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {dtype} between stages; supported: {DTYPES}")
        values += [DTYPES.index(dtype), len(shape), *shape]
    if len(values) > HEADER_LEN:
        raise ValueError(f"a stage output of {len(parts)} tensors with shapes {[s for _, s in parts]} does not fit "
                         f"a {HEADER_LEN}-entry header")
    values += [0] * (HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> Spec:
    values = header.tolist()
    is_tuple, count = bool(values[0]), values[1]
    parts, k = [], 2
    for _ in range(count):
        code, ndim = values[k], values[k + 1]
        parts.append((DTYPES[code], tuple(int(v) for v in values[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return (is_tuple, tuple(parts))


def grad_slots(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the tensors that carry a gradient back: the floating-point ones."""
    return [k for k, t in enumerate(tensors) if t.is_floating_point()]


class Transport:
    """Sends and receives of one rank to its pipeline neighbours.

    Args:
        health: names peers in errors.
        forward_group: process group of activations (SEND_F / RECV_F).
        backward_group: process group of gradients (SEND_B / RECV_B).
        device: where received tensors are allocated.
        timeout_s: the longest one receive, or the wait for one send, may take.
        precision: the plan's precision: under bf16 / fp16, fp32 activations and gradients travel in
            the compute dtype and are fp32 again on arrival (``hetrain.amp``).
    """

    def __init__(self, health: Health, forward_group: Any, backward_group: Any, device: torch.device,
                 timeout_s: float, precision: str = "fp32") -> None:
        self.health = health
        self.precision = precision
        self._wire = wire_dtype(precision)
        self.groups = {True: forward_group, False: backward_group}
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._recv_specs: dict[tuple[int, int], Spec] = {}  # (peer rank, i) -> what it sends
        self._sent_specs: dict[tuple[int, int], Spec] = {}
        self._pending: list[tuple[Any, list[torch.Tensor], object, int]] = []  # (work, tensors kept alive, what, peer)
        self._posted: dict[tuple[bool, int, int], tuple[list[torch.Tensor], list[Any]]] = {}  # receives posted early

    # --- waiting ---------------------------------------------------------------

    def wait(self, work: Any, what: object, peer: int) -> None:
        """Wait for one operation with ``peer``; a PeerError naming it and ``what`` when it fails or times out."""
        self.health.wait(work, what, [peer], self.timeout_s)

    # --- sending ---------------------------------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], is_tuple: bool, peer: int, i: int, forward: bool,
             what: object) -> None:
        """Post the sends of ``tensors`` to ``peer`` (micro-batch ``i``); returns at once.

        Forward sends carry a header the first time micro-batch ``i`` goes to ``peer``.
        """
        group = self.groups[forward]
        payload = [to_wire(t.detach(), self.precision).contiguous() for t in tensors]
        if len(payload) >= _TAGS_PER_MICRO_BATCH:
            raise ValueError(f"{what}: a stage output of {len(payload)} tensors; at most {_TAGS_PER_MICRO_BATCH - 1}")
        if forward:
            spec = spec_of(payload, is_tuple)
            known = self._sent_specs.get((peer, i))
            if known is None:
                self._sent_specs[(peer, i)] = spec
                header = encode_header(spec, self.device)
                self._post(dist.isend(header, peer, group=group, tag=self._tag(i, _TAGS_PER_MICRO_BATCH - 1)),
                           [header], what, peer)
            elif known != spec:
                raise ValueError(f"{what}: the stage's output changed from {known} to {spec} since the first "
                                 "iteration; shapes must stay fixed (the same micro-batch sizes every iteration)")
        for k, t in enumerate(payload):
            self._post(dist.isend(t, peer, group=group, tag=self._tag(i, k)), [t], what, peer)

    def _post(self, work: Any, keep: list[torch.Tensor], what: object, peer: int) -> None:
        self._pending.append((work, keep, what, peer))

    def wait_sends(self, what: object) -> None:
        """Wait for every posted send (before the optimizer step)."""
        pending, self._pending = self._pending, []
        for work, _, sent, peer in pending:
            self.wait(work, f"{what} (for {sent})", peer)

    # --- receiving -------------------------------------------------------------

    def can_post_activation(self, peer: int, i: int) -> bool:
        """Whether micro-batch ``i``'s activation from ``peer`` can be received early (its shapes are known)."""
        return (peer, i) in self._recv_specs

    def post_activation(self, peer: int, i: int) -> None:
        """Post the receive of micro-batch ``i``'s activation now; ``recv_activation`` waits for it later.

        A receive posted before the sender sends lets the data land while this rank
        computes (Gloo sends a payload only once the receiver has asked for it).
        """
        parts = self._recv_specs[(peer, i)][1]
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in parts]
        works = [dist.irecv(t, peer, group=self.groups[True], tag=self._tag(i, k)) for k, t in enumerate(tensors)]
        self._keep_posted((True, peer, i), tensors, works)

    def post_gradients(self, like: Sequence[torch.Tensor], peer: int, i: int) -> None:
        """Post the receive of the gradients of ``like`` now; ``recv_gradients`` waits for it later."""
        grads = [torch.empty_like(t, memory_format=torch.contiguous_format,
                                  dtype=self._wire if self._wire is not None and t.dtype == torch.float32 else None)
                 for t in like]
        works = [dist.irecv(g, peer, group=self.groups[False], tag=self._tag(i, k)) for k, g in enumerate(grads)]
        self._keep_posted((False, peer, i), grads, works)

    def posted_receives(self) -> list[tuple[bool, int, int]]:
        """(forward?, peer, micro-batch) of the receives posted ahead and not yet waited for."""
        return list(self._posted)

    def _keep_posted(self, key: tuple[bool, int, int], tensors: list[torch.Tensor], works: list[Any]) -> None:
        if key in self._posted:  # a second receive would take the message meant for the first
            raise RuntimeError(f"internal error: the receive of micro-batch {key[2]} from rank {key[1]} is "
                               "posted twice")
        self._posted[key] = (tensors, works)

    def recv_activation(self, peer: int, i: int, what: object) -> tuple[list[torch.Tensor], bool]:
        """Receive micro-batch ``i``'s activation from ``peer``: its tensors, and whether they form a tuple."""
        if (True, peer, i) not in self._posted:
            spec = self._recv_specs.get((peer, i))
            if spec is None:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                tag = self._tag(i, _TAGS_PER_MICRO_BATCH - 1)
                self.wait(dist.irecv(header, peer, group=self.groups[True], tag=tag), what, peer)
                self._recv_specs[(peer, i)] = decode_header(header)
            self.post_activation(peer, i)
        tensors, works = self._posted.pop((True, peer, i))
        for w in works:
            self.wait(w, what, peer)
        if self._wire is not None:
            tensors = [from_wire(t) for t in tensors]
        return tensors, self._recv_specs[(peer, i)][0]

    def recv_gradients(self, like: Sequence[torch.Tensor], peer: int, i: int, what: object) -> list[torch.Tensor]:
        """Receive the gradients of ``like`` (this stage's outputs that are floating point) from ``peer``."""
        if (False, peer, i) not in self._posted:
            self.post_gradients(like, peer, i)
        grads, works = self._posted.pop((False, peer, i))
        for w in works:
            self.wait(w, what, peer)
        if self._wire is not None:  # each in its output's dtype again
            grads = [g.to(t.dtype) for g, t in zip(grads, like, strict=True)]
        return grads

    @staticmethod
    def _tag(i: int, k: int) -> int:
        return i * _TAGS_PER_MICRO_BATCH + k


__all__ = ["DTYPES", "HEADER_LEN", "PeerError", "Spec", "Transport", "decode_header",
           "early_receives", "encode_header", "flatten", "grad_slots", "spec_of"]

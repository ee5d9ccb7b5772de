"""ZeRO-1 and ZeRO-2 among a bsp segment's owners, with uneven shards.

Where the plan shards a segment (``Segment.shard``: ``optimizer`` or
``optimizer+gradients``, Rajbhandari et al., "ZeRO", 2020), owner ``j`` keeps
elements ``[lo_j, hi_j)`` of each of the segment's flat buffers
(``Segment.shard_bounds``: sized by the plan's ``shard_weights``, so a device with
more free memory keeps more)::

    flat buffer of segment s (one per dtype; the parameters are views of it, and under ZeRO-1 their .grad too)
    |<------ n0:0 keeps 3/4 ------>|<- n0:1: 1/4 ->|
    backward   each bucket's slice:  reduce(SUM, dst=n0:0) of its part in [lo_0, hi_0),
                                     reduce(SUM, dst=n0:1) of its part in [lo_1, hi_1)
    STEP       owner j steps its range only: one nn.Parameter over flat_param[lo_j:hi_j],
               whose optimizer state is the range's alone
    after it   broadcast(src=owner j) of flat_param[lo_j:hi_j], for every j: all owners hold every weight

    optimizer              each owner holds: weights whole, gradients whole, state of its range
    optimizer+gradients    weights whole, gradients of its range (+ the last backward's buckets in flight), state
                           of its range

Why our own code and not torch's: FSDP2 and ``ZeroRedundancyOptimizer`` cut even
shards (or whole parameters); the plan's shards follow each owner's free memory,
and a segment may be part of a pipeline stage. What is torch's stays torch's: the
collectives, and the user's optimizer, which steps the shard as one parameter.

Elementwise optimizers (SGD, momentum, AdamW, each with weight decay) make the same
update on a slice of a flat buffer as on the parameters it cuts: training equals the
unsharded run. An optimizer factory that sorts parameters into groups by their shape or
name (no weight decay on biases) sees only the 1-D shards: that is not supported.

Which collectives. Gloo (torch 2.13) runs ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` for even parts only, so uneven shards would be padded to
the largest; it has no uneven ``all_gather``. The choice, by the bytes: one
``reduce(dst=owner)`` per owner moves each range once, what a reduce-scatter moves,
half an all-reduce's bytes on a ring (NCCL's reduce is a ring too); padding makes every
rank move the largest range once per owner; an all-reduce would give every owner every
sum. Measured on one host (``benchmarks/shard_collectives.py``, RESULTS.md "Uneven
shards"; Gloo, CPU, a 16 MB buffer), ms per iteration:

    ranks, shares   all_reduce  reduce/owner  padded reduce_scatter  broadcast/owner  padded all_gather
    2, 3:1             19.3        21.1             51.9                  7.7              37.7
    3, 1:2:1           39.6        35.4             95.9                 15.7              64.1

So gradients go by one ``reduce`` per owner of the bucket's part in its range, and
weights come back by one ``broadcast`` per owner of its range: each owner's bytes
once, no padding. Every collective goes to the segment's own group, posted in the
same order on every owner (buckets in the schedule's order, owners in the segment's
order), and every wait is at most ``timeout_s`` and names the owners.

ZeRO-2 and micro-batches. A ZeRO-2 segment has no flat gradient buffer: its parameters' ``.grad`` are their
own tensors. VWs run different numbers of micro-batches, so a reduce per micro-batch (DeepSpeed's way, which
also multiplies the gradient traffic by the micro-batches) would have owners issue different numbers of
collectives; the gradients of the earlier backwards accumulate in the ``.grad``, whole, and are reduced once,
from the last backward, bucket by bucket (``post``, ``land``)::

    last backward, bucket k complete (the hook of its last parameter's gradient):
        land k-1      wait for its reduces; the owner adds its part into its fp32 range; its temporary freed
        pack k        its parameters' .grad (their part in k) -> a bucket-sized temporary, in the wire dtype
        free          each .grad no later bucket needs (a parameter a bucket's bound cuts is in several)
        post k        reduce(SUM, dst=owner j) of its part in [lo_j, hi_j), for every j, in the owners' order
    ALLREDUCE_WAIT    lands what is still in flight

During the last backward a rank holds its range, one bucket in flight, and the ``.grad`` of the buckets not
complete yet: with one micro-batch per iteration, never the gradients whole; with several, whole until the last
backward, which frees them bucket by bucket. The memory model counts the last backward
(``cost.estimate_weight_memory``'s ``grad_share``, plus ``cost.zero2_transient_bytes`` in
``cost.estimate_stage_memory``). Landing k-1 before packing k keeps one bucket in flight while the next fills
(DeepSpeed's double buffer); the wait is at most ``timeout_s`` and names the owners. Clipping and fp16's
unscaling read this rank's range in place of the whole buffer (``GradientSync.step_grads``).

Checkpoints keep whole tensors and per-parameter optimizer state, as without sharding
(``runtime.state.stage_state``): at a save, the owners send their ranges of the state to
the segment's lead, which writes the layers (it holds the segment's whole state for the
save's duration); at a resume each owner cuts its range out of the per-parameter state. So a plan with other
shards, or none, loads any checkpoint.

Example:
    >>> shards = ShardedState(plan, sync, "n0:1", rank_of, health, timeout_s=300)   # doctest: +SKIP
    >>> optimizer = ShardedOptimizer(optimizer_fn(shards.optimizer_params(module)), shards)  # doctest: +SKIP
    >>> optimizer.step()           # ZeRO-2's last reduces landed, the ranges stepped, the weights gathered
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.distributed.health import Health
from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.sync.allreduce import GradientSync

#: ``SyncOptions.shard`` of ZeRO-2: the owners shard the gradients too
SHARD_GRADIENTS = "optimizer+gradients"


@dataclass
class _Shard:
    """One flat buffer (one dtype) of a sharded segment, as this rank holds it.

    Attributes:
        segment: the segment's index in ``GradientSync.segments``.
        flat_grad: ``GradientSync``'s flat gradient buffer (ZeRO-1: the parameters' ``.grad`` are views of it;
            ZeRO-2: freed at the start, its shape and dtype alone are read).
        flat_param: the flat parameter buffer the parameters' data are views of.
        placed: (parameter, its gradient view), in the buffers' order.
        spans: each parameter's elements ``[a, b)`` in the flat buffers.
        bounds: per owner (the segment's ``owners`` order), the elements ``[lo, hi)`` it keeps.
        ranks: per owner, its global rank.
        mine: this rank's index among the owners.
        param: this rank's range of ``flat_param`` (shares its memory), which the optimizer steps.
        group: the owners' process group.
        gradients: whether the owners shard the gradients too (ZeRO-2).
    """

    segment: int
    flat_grad: torch.Tensor
    flat_param: torch.Tensor
    placed: list[tuple[nn.Parameter, torch.Tensor]]
    spans: list[tuple[int, int]]
    bounds: list[tuple[int, int]]
    ranks: list[int]
    mine: int
    param: nn.Parameter
    group: Any
    gradients: bool

    @property
    def lo(self) -> int:
        return self.bounds[self.mine][0]

    @property
    def hi(self) -> int:
        return self.bounds[self.mine][1]

    @property
    def numel(self) -> int:
        return self.flat_grad.numel()


@dataclass
class _Piece:
    """One bucket's part of one ZeRO-2 flat buffer: elements ``[lo, hi)``, and the parameters with elements in it.

    Attributes:
        shard: the flat buffer's shard.
        lo: the bucket's first element in the flat buffer.
        hi: one past its last.
        params: (parameter, its elements ``[a, b)`` in the flat buffer), for every parameter with elements in
            ``[lo, hi)``.
    """

    shard: _Shard
    lo: int
    hi: int
    params: list[tuple[nn.Parameter, int, int]]


@dataclass
class _InFlight:
    """A ZeRO-2 bucket posted and not yet landed: its packed gradients and their reduces.

    Attributes:
        key: (segment, bucket).
        sent: per piece, the bucket-sized temporary the reduces went from (the owner's sum lands in its range).
        works: the reduces.
        what: the action, for messages.
    """

    key: tuple[int, int]
    sent: list[tuple[_Piece, torch.Tensor]]
    works: list[Any]
    what: object


def check_shard(plan: Plan, tied: Sequence[Any]) -> None:
    """Refuse sharding a plan whose model ties weights across layers: a tie sums its copies' gradients before the
    step, and a sharded owner holds the sum of its range only.

    Raises:
        InputError: naming the sync option.
    """
    if tied and any(seg.sharded for seg in plan.segments()):
        raise InputError(f"sync option shard={plan.sync_options.shard}: the model ties weights across layers "
                         f"({len(tied)} tie(s)), whose summed gradients a sharded owner does not hold whole; "
                         "use shard=none for this model")


def is_sharded(plan: Plan) -> bool:
    """Whether the plan shards any segment among its owners."""
    return any(seg.sharded and seg.shared for seg in plan.segments())


class ShardedState:
    """This stage's sharded segments: flat parameter buffers, the ranges this rank steps, and their collectives.

    Built after ``GradientSync`` (whose flat gradient buffers it cuts) and its start broadcast; attaches
    itself as ``sync.shards``, so that the segment and bucket all-reduces of sharded segments become reduces
    to their owners; frees ZeRO-2's whole gradient buffers for good (``post`` packs each bucket instead).

    Args:
        plan: the plan (its segments say who keeps which range).
        sync: this stage's gradient buffers.
        device: this rank's device in the plan.
        rank_of: device -> global rank.
        health: names peers in errors.
        timeout_s: the longest one collective may take.
    """

    def __init__(self, plan: Plan, sync: GradientSync, device: str, rank_of: Mapping[str, int], health: Health,
                 timeout_s: float) -> None:
        self.health = health
        self.timeout_s = timeout_s
        self.shards: dict[int, list[_Shard]] = {}
        for s, entries in sync.buffers.items():
            seg = sync.segments[s]
            if not (seg.sharded and seg.shared):
                continue
            ranks = [rank_of[d] for d in seg.owners]
            mine = seg.owners.index(device)
            for flat_grad, placed in entries:
                numel = flat_grad.numel()
                assert flat_grad.storage_offset() == 0
                spans = [(int(g.storage_offset()), int(g.storage_offset()) + g.numel()) for _, g in placed]
                flat_param = torch.empty(numel, dtype=flat_grad.dtype, device=flat_grad.device)
                with torch.no_grad():
                    for (p, _), (a, b) in zip(placed, spans, strict=True):
                        flat_param[a:b].copy_(p.data.reshape(-1))
                        p.data = flat_param[a:b].view_as(p)  # the weights live in the flat buffer
                bounds = seg.shard_bounds(numel)
                lo, hi = bounds[mine]
                param = nn.Parameter(flat_param[lo:hi])  # a view: stepping it steps the weights
                gradients = seg.shard == SHARD_GRADIENTS
                param.grad = torch.zeros_like(param) if gradients else flat_grad[lo:hi]
                self.shards.setdefault(s, []).append(
                    _Shard(s, flat_grad, flat_param, list(placed), spans, bounds, ranks, mine, param,
                           sync.groups[seg.owners], gradients))
        # ZeRO-2: each bucket's pieces (one per flat buffer it has elements of), cut before the whole buffers go
        self.pieces: dict[tuple[int, int], list[_Piece]] = {}
        by_storage = {sh.flat_grad.untyped_storage().data_ptr(): sh for sh in self.entries() if sh.gradients}
        for key, views in sync.bucket_views.items():
            for view in views:
                owner = by_storage.get(view.untyped_storage().data_ptr())
                if owner is None:
                    continue
                first, end = int(view.storage_offset()), int(view.storage_offset()) + view.numel()
                inside = [(q, a, b) for (q, _), (a, b) in zip(owner.placed, owner.spans, strict=True)
                          if (a < end and b > first) or (a == b and first <= a < end)]  # GradientSync's rule
                self.pieces.setdefault(key, []).append(_Piece(owner, first, end, inside))
        # how many buckets need each ZeRO-2 parameter's gradient (several where bucket bounds cut it: bucket_cut exact)
        self._uses: dict[int, int] = {}
        for pieces in self.pieces.values():
            for q_id in {id(q) for piece in pieces for q, _, _ in piece.params}:
                self._uses[q_id] = self._uses.get(q_id, 0) + 1
        self._left: dict[int, int] = {}  # in this iteration: parameter -> buckets still to pack its gradient
        self._in_flight: list[_InFlight] = []  # posted, not landed, in the order posted
        for sh in self.entries():
            if sh.gradients:  # no whole gradient buffer: autograd gives each parameter its own .grad
                for q, _ in sh.placed:
                    q.grad = None
                sh.flat_grad.untyped_storage().resize_(0)
        self.steps = 0  # optimizer steps taken (for messages)
        sync.shards = self

    # --- what the optimizer and the norm see -----------------------------------------------------

    def covers(self, s: int) -> bool:
        """Whether segment ``s`` is sharded here (its gradients go to their owners, not to everyone)."""
        return s in self.shards

    def sheds(self, s: int) -> bool:
        """Whether segment ``s``'s gradients are ZeRO-2's here: no whole flat buffer, each bucket packed, reduced
        to its owners and freed in the last backward (``post``, ``land``)."""
        return any(sh.gradients for sh in self.shards.get(s, ()))

    def entries(self) -> list[_Shard]:
        return [sh for entries in self.shards.values() for sh in entries]

    def optimizer_params(self, module: nn.Module) -> list[nn.Parameter]:
        """What the optimizer steps: the module's parameters outside sharded segments (in module order), then
        this rank's range of each sharded buffer."""
        inside = {id(p) for sh in self.entries() for p, _ in sh.placed}
        return [p for p in module.parameters() if id(p) not in inside] + [sh.param for sh in self.entries()]

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's range of each sharded gradient buffer, summed over the owners once the iteration's
        reduces are waited for (before STEP): what it counts in the global norm (``runtime.step.clip``)."""
        return [sh.param.grad if sh.gradients else sh.flat_grad[sh.lo:sh.hi] for sh in self.entries()]  # type: ignore[misc]

    def shed_grads(self) -> list[torch.Tensor]:
        """ZeRO-2: this rank's summed range of each segment's gradients, which the STEP reads (scaled by clipping
        and by fp16's unscaling in place of the whole buffers: ``GradientSync.step_grads``)."""
        return [sh.param.grad for sh in self.entries() if sh.gradients]  # type: ignore[misc]

    # --- the iteration -------------------------------------------------------------------------

    def reduce(self, s: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], what: object) -> list[Any]:
        """Post, for each (gradient view of a flat buffer, what travels for it), one SUM-reduce per owner of the
        view's part in that owner's range, to that owner; return the works."""
        by_storage = {sh.flat_grad.untyped_storage().data_ptr(): sh for sh in self.shards[s]}
        works = []
        for view, wire in pairs:
            sh = by_storage[view.untyped_storage().data_ptr()]
            base, end = view.storage_offset(), view.storage_offset() + view.numel()
            for (lo, hi), rank in zip(sh.bounds, sh.ranks, strict=True):
                a, b = max(lo, base), min(hi, end)
                if a < b:
                    try:
                        works.append(dist.reduce(wire[a - base:b - base], dst=rank, op=dist.ReduceOp.SUM,
                                                 group=sh.group, async_op=True))
                    except RuntimeError as e:
                        raise self.health.peer_error(f"{what}: the reduce to {self.health.name(rank)} failed",
                                                     sh.ranks, e) from None
        return works

    def begin(self) -> None:
        """ZeRO-2, at an iteration's start: zero this rank's summed range, which the coming reduces fill; no
        gradient is held whole (the parameters' ``.grad`` are None until the backward gives them one)."""
        self._land_all()
        for sh in self.entries():
            if sh.gradients:
                assert sh.param.grad is not None
                sh.param.grad.zero_()
                for q, _ in sh.placed:
                    q.grad = None
        self._left = dict(self._uses)

    def post(self, key: tuple[int, int], wire_dtype: torch.dtype | None, what: object) -> tuple[list[Any], int]:
        """ZeRO-2: pack bucket ``key``'s gradients (its parameters' ``.grad``, accumulated over the iteration's
        backwards; none: zeros) into a bucket-sized temporary in ``wire_dtype`` (None: theirs), free every
        ``.grad`` no later bucket needs, and post one SUM-reduce per owner of its part in that owner's range.

        The buckets posted before are landed first (``land``): during the backward a rank holds its range, the
        bucket in flight, and the gradients of the parameters whose bucket is not complete yet.

        Returns:
            The reduces, and the bytes handed to them.
        """
        self._land_all()
        sent: list[tuple[_Piece, torch.Tensor]] = []
        for piece in self.pieces.get(key, ()):
            sh = piece.shard
            wire = torch.empty(piece.hi - piece.lo, dtype=sh.flat_grad.dtype if wire_dtype is None else wire_dtype,
                               device=sh.flat_grad.device)  # (bucket elements,)
            for q, a, b in piece.params:
                lo, hi = max(a, piece.lo), min(b, piece.hi)
                part = wire[lo - piece.lo:hi - piece.lo]
                if q.grad is None:  # no gradient in this iteration (a parameter the loss does not use)
                    part.zero_()
                else:
                    part.copy_(q.grad.reshape(-1)[lo - a:hi - a])
            sent.append((piece, wire))
        for q in {id(q): q for piece in self.pieces.get(key, ()) for q, _, _ in piece.params}.values():
            self._left[id(q)] = self._left.get(id(q), 1) - 1
            if self._left[id(q)] <= 0:
                q.grad = None
        works = []
        for piece, wire in sent:
            sh = piece.shard
            for (lo, hi), rank in zip(sh.bounds, sh.ranks, strict=True):
                a, b = max(lo, piece.lo), min(hi, piece.hi)
                if a < b:
                    try:
                        works.append(dist.reduce(wire[a - piece.lo:b - piece.lo], dst=rank, op=dist.ReduceOp.SUM,
                                                 group=sh.group, async_op=True))
                    except RuntimeError as e:
                        raise self.health.peer_error(f"{what}: the reduce to {self.health.name(rank)} failed",
                                                     sh.ranks, e) from None
        self._in_flight.append(_InFlight(key, sent, works, what))
        return works, sum(w.numel() * w.element_size() for _, w in sent)

    def land(self, key: tuple[int, int]) -> None:
        """ZeRO-2: wait for bucket ``key``'s reduces (and those posted before it), at most ``timeout_s`` each,
        naming the owners; add this rank's summed part into its range and free the temporaries."""
        while any(f.key == key for f in self._in_flight):
            self._land_first()

    def temporaries(self) -> list[torch.Tensor]:
        """ZeRO-2: the packed buckets in flight now (what a rank holds beyond its range and the parameters'
        ``.grad`` during a backward: ``measure_weight_bytes`` does not see them)."""
        return [wire for flight in self._in_flight for _, wire in flight.sent]

    def _land_all(self) -> None:
        while self._in_flight:
            self._land_first()

    def _land_first(self) -> None:
        flight = self._in_flight[0]
        ranks = sorted({r for piece, _ in flight.sent for r in piece.shard.ranks})
        for work in flight.works:
            self.health.wait(work, flight.what, ranks, self.timeout_s)
        for piece, wire in flight.sent:
            sh = piece.shard
            a, b = max(sh.lo, piece.lo), min(sh.hi, piece.hi)
            if a < b:
                assert sh.param.grad is not None
                sh.param.grad[a - sh.lo:b - sh.lo].add_(wire[a - piece.lo:b - piece.lo])  # the owner's sum
        self._in_flight.pop(0)  # the temporaries go with it

    def settle(self) -> None:
        """ZeRO-2, at STEP: land whatever reduce is still in flight (the schedule's ALLREDUCE_WAITs have, as a
        rule); this rank's range then holds the iteration's summed gradients."""
        self._land_all()

    def gather(self) -> None:
        """After the step: every owner broadcasts its range of the weights to the others; waits for all, at most
        ``timeout_s`` each, naming the owners."""
        what = f"the gather of the weights after step {self.steps}"
        posted: list[tuple[Any, list[int]]] = []
        for sh in self.entries():
            for (lo, hi), rank in zip(sh.bounds, sh.ranks, strict=True):
                if lo < hi:
                    try:
                        posted.append((dist.broadcast(sh.flat_param[lo:hi], src=rank, group=sh.group,
                                                      async_op=True), sh.ranks))
                    except RuntimeError as e:
                        raise self.health.peer_error(f"{what}: the broadcast from {self.health.name(rank)} "
                                                     f"failed", sh.ranks, e) from None
        for work, ranks in posted:
            self.health.wait(work, what, ranks, self.timeout_s)

    # --- checkpoints -------------------------------------------------------------------------------

    def gather_state(self, inner: torch.optim.Optimizer, name_of: Mapping[int, str]) -> dict[str, dict[str, Any]]:
        """The whole per-parameter optimizer state of the sharded segments this rank leads (their lead writes
        them, ``stage_state.owned_names``), by parameter name; collective over each segment's owners: the others
        send their ranges to the lead and get nothing back."""
        out: dict[str, dict[str, Any]] = {}
        for sh in self.entries():
            state = inner.state.get(sh.param, {})
            per_element = sorted(k for k, v in state.items() if _per_element(k, v))
            lead = sh.ranks[0]
            what = f"the gather of segment {sh.segment}'s optimizer state for a checkpoint"
            works = []
            full: dict[str, torch.Tensor] = {}
            for key in per_element:
                mine = state[key]
                if sh.mine != 0:
                    if sh.hi > sh.lo:
                        works.append(dist.isend(mine.contiguous(), dst=lead, group=sh.group))
                    continue
                full[key] = torch.empty(sh.numel, dtype=mine.dtype, device=mine.device)
                full[key][sh.lo:sh.hi].copy_(mine)
                for (lo, hi), rank in zip(sh.bounds[1:], sh.ranks[1:], strict=True):
                    if lo < hi:
                        works.append(dist.irecv(full[key][lo:hi], src=rank, group=sh.group))
            for work in works:
                self.health.wait(work, what, sh.ranks, self.timeout_s)
            if sh.mine != 0 or not state:
                continue
            scalars = {k: v for k, v in state.items() if k not in full}
            for (p, _), (a, b) in zip(sh.placed, sh.spans, strict=True):
                # a tensor of its own per parameter (AdamW's ``step``): one shared by several parameters would be
                # loaded shared, and an unsharded optimizer would count each of its steps once per parameter
                out[name_of[id(p)]] = {**{k: (v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v)
                                          for k, v in scalars.items()},
                                       **{k: f[a:b].view(p.shape).cpu() for k, f in full.items()}}
        return out

    def load_state(self, inner: torch.optim.Optimizer, saved: Mapping[str, Mapping[str, Any]],
                   name_of: Mapping[int, str]) -> None:
        """Cut this rank's range of each sharded buffer out of whole per-parameter state (a checkpoint's, written
        under any plan); a buffer some of whose parameters have no saved state starts afresh."""
        for sh in self.entries():
            states = [saved.get(name_of[id(p)]) for p, _ in sh.placed]
            if not states or any(st is None for st in states):
                continue
            first = states[0]
            assert first is not None
            loaded: dict[str, Any] = {}
            for key, value in first.items():
                if not _per_element(key, value):
                    loaded[key] = (value.to(sh.param.device) if key != "step" else value.clone()) \
                        if isinstance(value, torch.Tensor) else value
                    continue
                part = torch.empty(sh.hi - sh.lo, dtype=value.dtype, device=sh.param.device)
                for st, (a, b) in zip(states, sh.spans, strict=True):
                    lo, hi = max(a, sh.lo), min(b, sh.hi)
                    if lo < hi:
                        assert st is not None
                        part[lo - sh.lo:hi - sh.lo].copy_(st[key].reshape(-1)[lo - a:hi - a])
                loaded[key] = part
            inner.state[sh.param] = loaded


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer over the unsharded parameters and this rank's ranges, with ZeRO's steps around its own.

    It shares the inner optimizer's ``param_groups`` and ``state`` (the learning-rate schedule sets them as
    ever); ``step`` lands ZeRO-2's last reduces, steps the inner optimizer, and gathers the weights.

    Args:
        inner: built over ``shards.optimizer_params(module)``.
        shards: this stage's sharded segments.
    """

    def __init__(self, inner: torch.optim.Optimizer, shards: ShardedState) -> None:
        super().__init__([p for g in inner.param_groups for p in g["params"]], dict(inner.defaults))
        self.inner = inner
        self.shards = shards
        self.param_groups = inner.param_groups
        self.state = inner.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """ZeRO-2's last reduces landed, the inner optimizer's step over the ranges, then every owner's weights to
        all."""
        self.shards.settle()
        loss = self.inner.step(closure)
        self.shards.steps += 1
        self.shards.gather()
        return loss

    def state_by_name(self, module: nn.Module) -> dict[str, dict[str, Any]]:
        """Whole per-parameter state by global name: the unsharded parameters' own, and the sharded segments'
        gathered on their lead (collective over their owners: every owner calls it)."""
        name_of = {id(p): n for n, p in module.named_parameters()}
        out = {name_of[id(p)]: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
               for p, st in self.inner.state.items() if id(p) in name_of}
        out.update(self.shards.gather_state(self.inner, name_of))
        return out

    def load_state_by_name(self, module: nn.Module, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Load whole per-parameter state (``state_by_name``'s form): the unsharded parameters' as they are, each
        sharded range cut out of its parameters'."""
        name_of = {id(p): n for n, p in module.named_parameters()}
        inside = {id(p) for sh in self.shards.entries() for p, _ in sh.placed}
        for name, p in module.named_parameters():
            if id(p) not in inside and name in saved:
                self.inner.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v)
                                       for k, v in saved[name].items()}
        self.shards.load_state(self.inner, saved, name_of)


def _per_element(key: str, value: Any) -> bool:
    """Whether an optimizer state entry holds one number per element (AdamW's ``exp_avg``, SGD's
    ``momentum_buffer``); ``step`` and other scalars do not (``stage_state``'s rule)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0


def measure_weight_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients and optimizer state, from the tensors' storages (each
    storage once: views of one flat buffer count it once; a freed buffer counts 0). Compare with
    ``cost.estimate_weight_memory`` at the rank's shares.

    Returns:
        ``{"params": ..., "grads": ..., "state": ...}`` in bytes.
    """
    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        seen: dict[tuple[int, int], int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                seen[(st.data_ptr(), id(st) if st.data_ptr() == 0 else 0)] = st.nbytes()
        return sum(seen.values())

    params = list(module.parameters())
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    return {"params": total(params),
            "grads": total([p.grad for p in params] + [p.grad for p in stepped]),
            "state": total(v for st in optimizer.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor))}


__all__ = ["SHARD_GRADIENTS", "ShardedOptimizer", "ShardedState", "check_shard", "is_sharded",
           "measure_weight_bytes"]

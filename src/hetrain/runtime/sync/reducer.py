"""Segments that are whole stages, all-reduced by DistributedDataParallel's C++ reducer inside the backward.

Under ``bsp`` a segment whose layers are one whole stage on every owner (each
owner's stage holds exactly the segment's layers, without TP) and whose plan
all-reduces it over one flat ring is plain data parallelism among its owners:
torch's ``DistributedDataParallel`` (DDP) runs that well, its bucketing, posting
and waiting in C++ inside the backward. ``reducer_segments`` decides which
segments go that way (one function, read by the runtime only; the planner and
the simulator cost both paths alike), and ``SegmentReducer`` wraps one::

    segment s, owners {n0:0, n0:1}, both stages [0, 6)    ->  DDP(ModuleList(layers 0..5), group of s)
    segment s, owners {n0:0, n0:2}, n0:2's stage [0, 4)   ->  hetrain's own buckets (GradientSync)

What matches DDP, and what hetrain adds:

- DDP's module is a ``ModuleList`` of the stage's layers (the very modules the
  stage runs); its forward is never called: the stage runs its layers itself,
  as ``torch.distributed.pipelining`` runs a DDP-wrapped stage under ``no_sync``.
  ``prepare(roots)`` (``Reducer.prepare_for_backward``, as pipelining's
  ``backward_maybe_with_nosync`` does) arms the reducer for the iteration's last
  backward only, from that backward's roots (the executor calls it through
  ``GradientSync.before_backward``); the backwards before it accumulate into
  ``.grad`` untouched (the reducer's hooks return at once when not armed).
- ``find_unused_parameters`` is on: a parameter the last backward does not reach
  (an MoE expert no token was routed to, a branch the batch did not take) is
  marked ready with a zero gradient, the reducer walking the autograd graph from
  the roots once per iteration, in C++: the sum hetrain's own path posts for a
  bucket whose hooks did not all fire.
- ``gradient_as_bucket_view`` is on: the reducer's buckets are the gradients
  (each ``.grad`` a view of its bucket), so the stage holds one copy of them
  and no gradient is copied into a bucket and back (DDP's default copies both
  ways). GradientSync's flat buffers of the segment are then the reducer's
  buckets (``buffers``, read again after the re-cut below): clipping, fp16's
  unscaling, the gradient zeroing and the optimizer read them as they read
  hetrain's own.
- The comm hook sums (``sum_hook``): DDP averages by default, and c10d's builtin
  ``ALLREDUCE`` hook divides by the group's size too (torch 2.13); hetrain's
  losses are scaled by samples / global batch, so the sum is the mean gradient.
  Under ``reduce_dtype = "bf16"`` the hook casts the bucket to bfloat16, sums
  the copy and casts back (``bf16_sum_hook``), as GradientSync's own path does.
  A Python hook costs one call per bucket and one callback when it lands
  (tens of microseconds), not one per parameter.
- Buckets: the reducer's are cut where the plan's are (``Segment.buckets``,
  bucket 0 the last layers), by giving DDP each bucket's bytes as its cap
  (``bucket_cap_mb_list``). DDP cuts between two parameters: where the plan
  cuts inside a parameter (``bucket_cut = "exact"``), the parameter goes whole
  to the bucket of the later layers. The reducer cuts once, walking the
  parameters in registration order (layer order), so the caps go in that
  order (the first layers' bucket first); it never re-cuts where it looks for
  unused parameters (``Reducer._rebuild_buckets`` returns False): the plan's
  buckets from the first iteration on.
- The weights start equal: DDP's constructor broadcasts the parameters and
  buffers from the group's lowest rank (``GradientSync.broadcast_weights`` does
  the other segments).
- Errors: a peer that dies or hangs during the reducer's all-reduce makes the
  backward raise (Gloo's operation fails, or times out after the segment
  group's timeout); ``GradientSync.backward_failure`` turns that into the
  project's PeerError naming the segment's owners. A reduction left
  unfinished all the same (a backward that did not run from the roots it was
  armed with) is refused by ``check`` in one line at the first ALLREDUCE_WAIT,
  before the optimizer steps on gradients not summed.

Own code remains for the segments DDP cannot run: those that split stages,
TP shards, hierarchical all-reduces (GradientSync).
"""

# no ``from __future__ import annotations``: DDP's register_comm_hook reads the hooks' annotations as objects
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, the annotation DDP's hook check asks for
from torch.nn.parallel import DistributedDataParallel

from hetrain.plan import Plan


def reducer_segments(plan: Plan) -> frozenset[int]:
    """The segments (indices into ``plan.segments()``) that DDP's reducer all-reduces: under ``bsp``, shared,
    not sharded (ZeRO's reduce to each owner is ``runtime.sync.shard``'s), every owner's stage exactly the
    segment's layers without TP, and every all-reduce of it a flat ring.

    Example:
        >>> sorted(reducer_segments(dp_plan))   # 2 VWs of one stage each   # doctest: +SKIP
        [0]
    """
    if not plan.sync_mode.synchronous:
        return frozenset()
    stage_of = {s.device: s for vw in plan.virtual_workers for s in vw.stages}
    out = set()
    for k, seg in enumerate(plan.segments()):
        stages = [stage_of[d] for d in seg.owners]
        whole = all(st.tp == 1 and (st.first_layer, st.end_layer) == (seg.first_layer, seg.end_layer)
                    for st in stages)
        flat = seg.algorithm != "hierarchical" and all(b.algorithm != "hierarchical" for b in seg.buckets)
        if seg.shared and whole and flat and not seg.sharded:
            out.add(k)
    return frozenset(out)


_SUM = dist.AllreduceOptions()  # reduceOp SUM (the default), the group's own timeout


def post_sum(t: torch.Tensor, group: Any) -> Any:
    """Post a SUM all-reduce of ``t`` over ``group`` (a process group this rank is in); returns its Work.

    What ``dist.all_reduce(t, group=group, async_op=True)`` does, through the group's own C++ method, without
    c10d's Python checks around it: they are half of a post's cost on a loaded CPU (measured, a one-rank Gloo
    group on a 2-core host shared with other work: 0.30 ms a post through ``dist.all_reduce``, 0.14 ms
    direct), and have nothing to catch here (``t`` a dense real tensor of this rank, ``group`` one it is in).
    """
    return group.allreduce([t], _SUM)


def sum_hook(state: tuple[Any, Callable[[int], None]], bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: SUM-all-reduce the bucket over the group (``state``: the group, and a counter of the
    bytes handed to the all-reduce)."""
    group, count = state
    buffer = bucket.buffer()
    count(buffer.numel() * buffer.element_size())
    fut = post_sum(buffer, group).get_future()
    return cast(torch.futures.Future[torch.Tensor], fut.then(lambda f: f.value()[0]))


def bf16_sum_hook(state: tuple[Any, Callable[[int], None]],
                  bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket cast to bfloat16, SUM-all-reduced, cast back into the bucket."""
    group, count = state
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16)
    count(wire.numel() * wire.element_size())
    fut = post_sum(wire, group).get_future()

    def back(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(f.value()[0])

    return cast(torch.futures.Future[torch.Tensor], fut.then(back))


def bucket_caps_mb(layers: Sequence[nn.Module], bucket_elements: Sequence[tuple[int, int]]) -> list[float]:
    """DDP's per-bucket caps (MiB, in the order the reducer fills them: bucket 0, the last layers, first) that cut
    the parameters of ``layers`` (in order) where the plan's buckets end: ``bucket_elements`` gives each plan
    bucket's ``[lo, hi)`` in the segment's flat buffer (elements, layer order). A bucket closes once it holds at
    least its cap, so each cap is the bytes of the parameters it must hold: walking the parameters backwards,
    those that end inside the bucket's elements (a parameter cut by a bound goes to the later layers' bucket).
    Empty buckets (a bound and the next inside one parameter) are dropped."""
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    ends, offset = [], 0
    for p in params:
        offset += p.numel()
        ends.append(offset)
    caps = []
    for lo, hi in bucket_elements:  # bucket 0 first: the highest elements
        held = sum(p.numel() * p.element_size() for p, end in zip(params, ends, strict=True) if lo < end <= hi)
        if held:
            caps.append(held / 2**20)
    return caps


class SegmentReducer:
    """DDP's reducer over one segment that is a whole stage on every owner.

    Args:
        layers: the segment's layers, in order (the stage's own modules).
        group: the segment's process group (created with the job's timeout).
        caps_mb: the buckets' caps (``bucket_caps_mb``).
        wire_dtype: None (sum in the gradients' dtype) or ``torch.bfloat16`` (sync option ``reduce_dtype``).
        count: called with the bytes of each bucket handed to the all-reduce.

    Example:
        >>> r = SegmentReducer([l0, l1], group, [1.0, 25.0], None, print)    # doctest: +SKIP
        >>> r.prepare(); loss.backward(); r.check("ALLREDUCE_WAIT seg0 bucket0")
    """

    def __init__(self, layers: Sequence[nn.Module], group: Any, caps_mb: Sequence[float],
                 wire_dtype: torch.dtype | None, count: Callable[[int], None]) -> None:
        self.calls = 0  # buckets all-reduced by the reducer
        self.rebuilt = False
        self.params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        # find_unused_parameters: a parameter the last backward does not reach (an MoE expert no token was routed
        # to, a branch the batch did not take) is marked ready with a zero gradient, as hetrain's own path posts
        # a bucket whose hooks did not all fire: the reducer walks the autograd graph from the backward's roots
        self.ddp = DistributedDataParallel(nn.ModuleList(layers), process_group=group,
                                           # the first cut walks the parameters forwards, its caps in that order (the
                                           # reducer never re-cuts where it finds unused parameters): the plan's buckets
                                           # from the first iteration
                                           bucket_cap_mb_list=list(reversed(caps_mb)) or None,  # type: ignore[arg-type]  # MiB, int() of x 2**20
                                           gradient_as_bucket_view=True, find_unused_parameters=True)

        def counted(n: int) -> None:
            self.calls += 1
            count(n)

        hook = bf16_sum_hook if wire_dtype == torch.bfloat16 else sum_hook
        self.ddp.register_comm_hook((group, counted), hook)

    def recut(self) -> bool:
        """Before the coming armed backward: re-cut the buckets once, before the second armed backward, in the
        order the first one produced the gradients (a collective of the group: the owners agree on the cut;
        the gradients so far move to the new buckets). Returns whether it re-cut them now (``buffers`` are then
        new)."""
        recut = False
        if not self.rebuilt:
            self.rebuilt = recut = self.ddp.reducer._rebuild_buckets()
        return recut

    def prepare(self, roots: Sequence[torch.Tensor]) -> None:
        """Arm the reducer for the backward from ``roots`` (the iteration's last on this stage): it all-reduces
        each bucket as its gradients are final, the parameters ``roots`` do not reach with zeros, and finishes
        within that backward."""
        self.ddp.reducer.prepare_for_backward(list(roots))

    def buffers(self) -> list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]]:
        """The reducer's buckets as GradientSync's flat buffers: ``[(bucket, [(param, its .grad: a view of
        it)])]``, in the parameters' order. Every parameter's ``.grad`` is a view of its bucket from the
        reducer's start (it re-points a gradient that exists, and GradientSync made them all)."""
        out: dict[int, tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]] = {}
        for p in self.params:
            g = p.grad
            base = g._base if g is not None else None
            if g is None or base is None:
                raise RuntimeError(f"internal error: a parameter of shape {tuple(p.shape)} has no gradient that "
                                   "is a view of DDP's bucket")
            out.setdefault(id(base), (base, []))[1].append((p, g))
        return list(out.values())

    def check(self) -> None:
        """Raise RuntimeError if the armed backward did not finish the reduction (a parameter got no gradient)."""
        self.ddp.reducer._check_reducer_finalized()

    def close(self) -> None:
        """Take the reducer's hooks off the parameters."""
        self.ddp.reducer._remove_autograd_hooks()


__all__ = ["SegmentReducer", "bf16_sum_hook", "bucket_caps_mb", "post_sum", "reducer_segments", "sum_hook"]

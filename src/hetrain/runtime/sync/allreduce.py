"""Synchronous data parallelism across VWs: each segment's gradients all-reduced among its owners.

``Plan.segments()`` cuts the layers where the set of devices holding them
changes; segment ``s`` is reduced among exactly its owners, so VWs may
partition the model differently::

    VW0   n0:0 [0..2)        n0:1 [2..6)
    VW1   n0:2 [0..4)                   n0:3 [4..6)
    seg   0: [0..2) {n0:0, n0:2}   1: [2..4) {n0:1, n0:2}   2: [4..6) {n0:1, n0:3}

Torch's engine first: a segment that is a whole stage on every owner, without
TP, all-reduced over one flat ring, is plain data parallelism among its owners,
and DistributedDataParallel's C++ reducer sums it inside the backward
(``runtime.sync.reducer``; ``GradientSync.reducers``); this module keeps its
flat buffers (``.grad`` stay their views) and lets ``arm`` / ``wait`` hand it to
the reducer. Its own buckets remain for what DDP has no form for: a segment that
splits a stage (owners whose stages cut the model at other layers, so that one
rank's backward feeds several segments, each over its own group), a TP stage's
shards, and the hierarchical all-reduce across nodes.

One process group per distinct owner set, created in segment order on every
rank (``new_group`` is collective over the whole job). A rank's gradients live
in one flat buffer per (segment, dtype) that the parameters' ``.grad`` are views
of, so an all-reduce needs no copy. The losses are scaled by samples / global
batch, so the SUM over owners is the global batch's mean gradient.

Where the plan's sync layout (``Segment.algorithm``, ``Bucket.algorithm``: the
planner's choice, which the simulator costs) says ``"hierarchical"``, the
all-reduce runs in three phases instead of one flat all-reduce: ``reduce`` (SUM)
to a leader per node (its lowest-ranked owner), ``all_reduce`` among the
leaders, ``broadcast`` from each leader to its node. Each NIC then carries one
node's buffer between nodes, not one per owner on the node. Gloo has no
reduce-scatter, so the intra-node phases are a reduce and a broadcast of the
whole buffer rather than the cost model's reduce-scatter and all-gather; the
bytes each NIC moves between nodes are the same.

Under ``bsp`` the schedule all-reduces each segment in gradient buckets
(the plan's ``Segment.buckets``), overlapped with the last backward, as
DistributedDataParallel does. A segment's flat buffer holds its layers in
order, so each bucket (a run of layers) is one contiguous slice of it; under
``bucket_cut = "exact"`` a bucket's bound may fall inside a layer (``Bucket.span``),
and the slice ends at the element it gives, inside a parameter if it falls there
(that parameter then belongs to both buckets, each waiting for its gradient). Every
parameter has a post-accumulate-grad hook; ``arm`` (called by the executor
before the backward that the ALLREDUCE_STARTs follow) tells them which buckets
to launch: once every parameter of a bucket has its gradient of that backward,
the bucket's all-reduce is posted (``async_op=True``) while autograd goes on
through the earlier layers; buckets are posted strictly in the schedule's order
(the owners of a process group must issue its collectives in one order), a
ready bucket waiting for the ones before it. ``ALLREDUCE_START`` posts whatever
the hooks have not (a parameter that got no gradient); ``ALLREDUCE_WAIT`` waits
for the bucket, at most ``timeout_s``, naming the peers. A hierarchical bucket
posts its reduce to the node leader from the hook and runs the leaders'
all-reduce and the broadcast from a background thread as soon as the reduce
has landed, so that the later phases overlap the rest of the backward (and the
next buckets) as the simulator has them, not wait for the ALLREDUCE_WAIT.

A segment the plan shards (ZeRO, ``Segment.shard``) has its buckets reduced to their owners' ranges
instead (``runtime.sync.shard``, which sets ``GradientSync.shards``). Under ZeRO-2 such a segment has no
flat buffer: its parameters' ``.grad`` are their own tensors, and each bucket is packed, reduced and freed
in the last backward (``ShardedState.post`` and ``land``).

With the sync option ``reduce_dtype = "bf16"`` a bucket (or segment) is cast to
bfloat16 when it is posted and every phase all-reduces the copy; ``wait`` (or
``allreduce``) copies the sum back into the fp32 gradients: half the bytes on
every link (``wire_bytes`` counts what this rank handed to its all-reduces).

The owners of a process group must issue its collectives in one order. The
reduces are posted by the main thread in bucket order; the later phases by one
thread per rank (``_Chain``) that takes the buckets in the order their reduces
were posted. The node's broadcast goes over a group of its own (``bcast_group``),
so that the main thread's next reduces and the thread's broadcasts never
interleave on one group in an order that differs between ranks.
"""

from __future__ import annotations

import functools
import itertools
import math
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.distributed.health import Health, PeerError
from hetrain.distributed.work import completed_within, is_timeout
from hetrain.errors import RunError
from hetrain.plan import Plan
from hetrain.runtime.sync.reducer import SegmentReducer, bucket_caps_mb, post_sum, reducer_segments
from hetrain.runtime.tp import is_dtensor
from hetrain.sync_layout import Segment


@dataclass(frozen=True)
class Hierarchy:
    """This rank's part in the hierarchical all-reduce of one owner set.

    Attributes:
        leader: the global rank of this rank's node leader (its node's lowest-ranked owner).
        node_ranks: the owners on this rank's node (global ranks, sorted).
        node_group: the group of ``node_ranks`` (None when this rank is alone on its node).
        leaders: every node's leader (global ranks, sorted).
        leaders_group: the group of ``leaders`` (None unless this rank is a leader).
        bcast_group: a second group of ``node_ranks``, for the broadcast (None with ``node_group``).
    """

    leader: int
    node_ranks: tuple[int, ...]
    node_group: Any
    leaders: tuple[int, ...]
    leaders_group: Any
    bcast_group: Any = None


class SegmentGroups(dict[tuple[str, ...], Any]):
    """Owner set -> its flat process group; ``hierarchical``: owner set -> ``Hierarchy``.

    ``hierarchical`` holds only the owner sets the plan all-reduces hierarchically.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hierarchical: dict[tuple[str, ...], Hierarchy] = {}


def member_segments(plan: Plan, t: int) -> tuple[Segment, ...]:
    """The plan's segments with each owner (a stage's lead device) replaced by member ``t`` of its TP group: whom
    TP rank ``t`` all-reduces its shards with (every VW splits a layer alike, ``plan._check_tp_degrees``). A stage
    without TP, or ``t`` 0, keeps its device.

    Example:
        >>> [s.owners for s in member_segments(plan, 1)]     # VW0 on n0:0+n0:1, VW1 on n0:2+n0:3   # doctest: +SKIP
        [('n0:1', 'n0:3')]
    """
    if t == 0 or plan.max_tp == 1:
        return plan.segments()
    member = {s.device: s.devices[t % s.tp] for vw in plan.virtual_workers for s in vw.stages}
    return tuple(replace(seg, owners=tuple(member[d] for d in seg.owners)) for seg in plan.segments())


def is_split(p: torch.Tensor) -> bool:
    """Whether ``p`` is a TP-split parameter (a DTensor sharded on its mesh), whose gradient is a shard."""
    return is_dtensor(p) and any(not pl.is_replicate() for pl in p.placements)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t``: a DTensor's local part (its shard, or its whole replica), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def grad_view(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient over ``view`` (a slice of a flat buffer): a DTensor of ``p``'s placements over it where
    ``p`` is a DTensor, so that autograd accumulates into the buffer."""
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor  # imported already: ``p`` is one

        local = view.view(p.to_local().shape)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return view.view_as(p)


def _hierarchical_owner_sets(plan: Plan) -> set[tuple[str, ...]]:
    """Owner sets whose segment, or one of its buckets, the plan all-reduces hierarchically."""
    segments = [seg for t in range(plan.max_tp) for seg in member_segments(plan, t)]
    return {seg.owners for seg in segments if seg.shared and (
        seg.algorithm == "hierarchical" or any(b.algorithm == "hierarchical" for b in seg.buckets))}


def build_segment_groups(plan: Plan, rank_of: Mapping[str, int], timeout_s: float) -> SegmentGroups:
    """A process group per owner set of more than one device, for the owner sets this rank is in.

    Where the plan all-reduces an owner set hierarchically (one of its segments or
    gradient buckets), also a
    group per node holding more than one of its owners (in the cluster's node
    order) and one of the node leaders, right after the owner set's own group.
    Must run on every rank of the job, in the same order (it does: segment order).
    """
    me = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    node_of = {d.name: d.node for d in plan.cluster.devices}
    node_order = {n.name: k for k, n in enumerate(plan.cluster.nodes)}
    groups = SegmentGroups()
    hierarchical = _hierarchical_owner_sets(plan)
    made: set[tuple[str, ...]] = set()
    for seg in (seg for t in range(plan.max_tp) for seg in member_segments(plan, t)):
        if len(seg.owners) < 2 or seg.owners in made:
            continue
        made.add(seg.owners)
        ranks = sorted(rank_of[d] for d in seg.owners)
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            groups[seg.owners] = group
        if seg.owners not in hierarchical:
            continue
        by_node: dict[str, list[int]] = {}
        for d in seg.owners:
            by_node.setdefault(node_of[d], []).append(rank_of[d])
        nodes = sorted(by_node, key=lambda n: node_order[n])
        mine: Hierarchy | None = None
        node_groups: dict[str, tuple[Any, Any]] = {}
        for n in nodes:
            members = sorted(by_node[n])
            if len(members) > 1:  # the reduce's group, then the broadcast's
                node_groups[n] = (dist.new_group(members, timeout=timeout), dist.new_group(members, timeout=timeout))
        leaders = tuple(sorted(min(by_node[n]) for n in nodes))
        leaders_group = dist.new_group(list(leaders), timeout=timeout)
        for n in nodes:
            members = sorted(by_node[n])
            if me in members:
                reduce_group, bcast_group = node_groups.get(n, (None, None))
                mine = Hierarchy(members[0], tuple(members), reduce_group, leaders,
                                 leaders_group if me == members[0] else None, bcast_group)
        if mine is not None:
            groups.hierarchical[seg.owners] = mine
    return groups


class _Done:
    """The end of one hierarchical all-reduce run by ``_Chain``: set when it finished or failed."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


class _Chain:
    """One background thread that runs, in order, the later phases of hierarchical all-reduces.

    Jobs are taken in the order they were queued (that of their first phases), so every
    owner issues the collectives of each group in the same order. After a failure the
    remaining jobs are not run (their ``_Done`` carries the first error), so nothing more is
    posted to groups whose peers may be gone.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], _Done] | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetrain-allreduce-chain", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> _Done:
        done = _Done()
        self._jobs.put((job, done))
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            if self._failed is None:
                try:
                    job()
                except BaseException as e:  # handed to the main thread's wait, which raises it
                    self._failed = e
            done.error = self._failed
            done.event.set()


def _element_at(x: float, starts: Mapping[int, int]) -> int:
    """The element of a flat buffer at bound ``x`` (in layers, ``Bucket.bounds``): layer ``floor(x)``'s first
    element, plus the fraction ``x - floor(x)`` of that layer's elements in the buffer (``starts``: layer ->
    its first element; the segment's end layer -> the buffer's length)."""
    k = math.floor(x)
    if k == x:
        return starts[k]
    return starts[k] + round((x - k) * (starts[k + 1] - starts[k]))


#: the dtype gradients are all-reduced in, by sync option ``reduce_dtype`` (None: their own)
WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def _is_comm_error(e: BaseException) -> bool:
    """Whether an error raised through a backward comes from a collective (Gloo's or NCCL's failure or timeout),
    not from a layer's backward."""
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer"))


def _from_wire(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each all-reduced wire tensor back into the gradients it was cast from (``GradientSync._to_wire``)."""
    for grad, wire in pairs:
        if wire is not grad:
            grad.copy_(wire)


class GradientSync:
    """Flat gradient buffers of one stage, per segment, and their all-reduce among the segment's owners.

    Whole segments (``allreduce``, the blocking ALLREDUCE action) or gradient buckets overlapped with the
    backward (``arm``, ``start``, ``wait``: ALLREDUCE_START and ALLREDUCE_WAIT).

    Args:
        plan: the plan.
        layers: this stage's layers by global index.
        groups: from ``build_segment_groups``.
        rank_of: device -> rank (for messages).
        health: names peers in errors.
        timeout_s: the longest one all-reduce may take.
        tp_member: this rank's index in its stage's TP group: it syncs its shards with member ``tp_member`` of
            the other owners' groups (0 without TP).

    Example:
        >>> sync.arm([(1, 0), (1, 1)])        # before the last backward     # doctest: +SKIP
        >>> loss.backward()                   # posts bucket (1, 0), then (1, 1), as their gradients are final
        >>> sync.start(1, 0); sync.start(1, 1); sync.wait(1, 0, "..."); sync.wait(1, 1, "...")
    """

    def __init__(self, plan: Plan, layers: Mapping[int, nn.Module], groups: Mapping[tuple[str, ...], Any],
                 rank_of: Mapping[str, int], health: Health, timeout_s: float, tp_member: int = 0) -> None:
        self.health = health
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        # with TP, member t of each owner's TP group: the owners of this rank's shards (``member_segments``)
        self.segments = member_segments(plan, tp_member)
        self.split_flats: list[torch.Tensor] = []  # the buffers of TP-split parameters' shards (``is_split``)
        self.rank_of = dict(rank_of)
        self.groups = dict(groups)
        # owner set -> this rank's part in its hierarchical all-reduce, where the plan says so
        self.hierarchical: dict[tuple[str, ...], Hierarchy] = dict(getattr(groups, "hierarchical", {}))
        # all-reduces run (segments or buckets), by algorithm; "ddp": buckets all-reduced by DDP's reducer
        self.calls = {"ring": 0, "hierarchical": 0, "ddp": 0}
        self.posted_early = 0  # buckets of its own posted during the backward, before their ALLREDUCE_START
        # the dtype gradients travel in where it is not theirs (sync option reduce_dtype), and what went out
        self.wire_dtype: torch.dtype | None = WIRE_DTYPES[plan.sync_options.reduce_dtype]
        self.wire_bytes = 0  # bytes this rank handed to its gradient all-reduces (once per all-reduce, all phases)
        self._unpack: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}  # bucket -> copies
        # segment index -> [(flat buffer, [(param, its .grad: a view of the buffer)])], one entry per dtype
        self.buffers: dict[int, list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]]] = {}
        # (segment, bucket) -> its slice of each flat buffer, its parameters, whether it goes hierarchically
        self.bucket_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.bucket_placed: dict[tuple[int, int], list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self.bucket_hierarchical: dict[tuple[int, int], bool] = {}
        self.segment_hierarchical = [seg.algorithm == "hierarchical" for seg in self.segments]
        # (segment) -> each bucket's [lo, hi) in its flat buffer, for DDP's caps (a segment of one dtype)
        bucket_elements = self._lay_out(layers)
        # whole stages on every owner: DDP's reducer sums them in the backward (runtime.sync.reducer)
        self.reducers: dict[int, SegmentReducer] = {
            s: self._build_reducer(s, layers, bucket_elements.get(s, []))
            for s in sorted(reducer_segments(plan) if tp_member == 0 else ()) if s in self.buffers}
        self._reduced: set[int] = set()  # segments whose reducer was armed for this iteration's last backward
        self._to_prepare: list[int] = []  # of those, the reducers to arm once the backward's roots are known
        self._place_buckets()
        # the buckets armed for the coming backward, in the order they must be posted
        self._queue: list[tuple[int, int]] = []
        self._next = 0  # queue[:next] are posted
        self._pending: dict[tuple[int, int], int] = {}  # armed bucket -> parameters still without their gradient
        self._posted: dict[tuple[int, int], list[Any] | _Done] = {}  # bucket -> its works, or its chain's end
        self._chain: _Chain | None = None  # started with the first hierarchical all-reduce
        # ZeRO: the sharded segments (``runtime.sync.shard.ShardedState`` sets it), whose buckets are reduced to
        # their owners' ranges instead of all-reduced; None: no segment is sharded
        self.shards: Any = None

    def _lay_out(self, layers: Mapping[int, nn.Module]) -> dict[int, list[tuple[int, int]]]:
        """Make each segment's flat buffers per dtype (the parameters' ``.grad`` views of them) and its buckets'
        slices; returns, per segment, each bucket's ``[lo, hi)`` in its flat buffer (DDP's caps)."""
        bucket_elements: dict[int, list[tuple[int, int]]] = {}
        for s, seg in enumerate(self.segments):
            if not any(k in layers for k in range(seg.first_layer, seg.end_layer)):
                continue
            # TP: a split parameter's buffer holds its local shard; split and whole parameters get buffers apart
            by_dtype: dict[tuple[torch.dtype, torch.device, bool], list[tuple[int, nn.Parameter]]] = {}
            for k in range(seg.first_layer, seg.end_layer):
                if k in layers:
                    for p in layers[k].parameters():
                        if p.requires_grad:
                            by_dtype.setdefault((p.dtype, p.device, is_split(p)), []).append((k, p))
            entries = []
            for (dtype, device, split), ps in by_dtype.items():
                flat = torch.zeros(sum(local_of(p).numel() for _, p in ps), dtype=dtype, device=device)
                if split:
                    self.split_flats.append(flat)
                placed, spans, offset = [], [], 0
                numel = dict.fromkeys(range(seg.first_layer, seg.end_layer), 0)
                for k, p in ps:  # in layer order: a bucket's layers are one slice of the buffer
                    n = local_of(p).numel()
                    p.grad = grad_view(p, flat[offset:offset + n])
                    placed.append((p, p.grad))
                    spans.append((offset, offset + n))
                    offset += n
                    numel[k] += n
                starts = dict(zip(range(seg.first_layer, seg.end_layer + 1),  # layer -> its first element
                                  itertools.accumulate(numel.values(), initial=0), strict=True))
                entries.append((flat, placed))
                for bucket in seg.buckets:
                    lo, hi = (_element_at(x, starts) for x in bucket.bounds)
                    bucket_elements.setdefault(s, []).append((lo, hi))
                    # its parameters: every one with an element in [lo, hi) (an empty one: at lo or after); where
                    # the bucket's bound falls inside a parameter (bucket_cut "exact"), it is in both buckets
                    inside = [n for n, (a, b) in enumerate(spans) if (a < hi and b > lo) or (a == b and lo <= a < hi)]
                    if inside:
                        key = (s, bucket.index)
                        self.bucket_views.setdefault(key, []).append(flat[lo:hi])
                        self.bucket_placed.setdefault(key, []).extend(placed[n] for n in inside)
            self.buffers[s] = entries
            for bucket in seg.buckets:
                self.bucket_hierarchical[(s, bucket.index)] = bucket.algorithm == "hierarchical"
        return bucket_elements

    def _take_buckets(self, segments: Sequence[int] | Mapping[int, Any]) -> None:
        """Make the reducer's buckets the flat buffers of ``segments`` (its gradients are views of them); its own
        bucket slices of the old buffers go (an ALLREDUCE_START it did not arm sums the whole segment)."""
        for s in segments:
            self.buffers[s] = self.reducers[s].buffers()
            for key in [k for k in self.bucket_views if k[0] == s]:
                del self.bucket_views[key], self.bucket_placed[key]

    def _place_buckets(self) -> None:
        """DDP's segments take the reducer's buckets as their flat buffers; every parameter of hetrain's own
        buckets gets a post-accumulate-grad hook."""
        self._take_buckets(self.reducers)
        for key, placed_params in self.bucket_placed.items():
            if key[0] in self.reducers:
                continue
            for p, _ in placed_params:
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, key))  # type: ignore[no-untyped-call]

    def broadcast_weights(self) -> None:
        """Give every owner of a shared segment its lowest-ranked owner's weights, as DistributedDataParallel
        does at its start: replicas then start equal even where a user's build function is not deterministic
        under the layer's seed (a draw from an unseeded generator). Collective over each segment's owners, in
        segment order; waits at most ``timeout_s``, naming the peers."""
        for s, entries in self.buffers.items():
            seg = self.segments[s]
            if not seg.shared or s in self.reducers:  # DDP's constructor broadcast those
                continue
            peers = sorted(self.rank_of[d] for d in seg.owners)
            group = self.groups[seg.owners]
            works = [dist.broadcast(local_of(p.data), src=peers[0], group=group, async_op=True)
                     for _, placed in entries for p, _ in placed]
            self._wait_all(works, s, f"the start's broadcast of segment {s}'s weights", peers)

    def zero(self) -> None:
        """Zero every gradient of the stage (in place: ``.grad`` stay views of the buffers; ZeRO-2's segments
        have no whole buffer, and start the iteration with no ``.grad``: ``runtime.sync.shard``); a new iteration."""
        self._reduced.clear()
        if self.shards is not None:
            self.shards.begin()
        for s, entries in self.buffers.items():
            if self._sheds(s):
                continue
            for flat, placed in entries:
                flat.zero_()
                self._repoint(placed, keep_value=False)

    def _sheds(self, s: int) -> bool:
        """Whether segment ``s``'s gradients are ZeRO-2's: packed, reduced and freed bucket by bucket, with no
        whole flat buffer (``runtime.sync.shard.ShardedState.sheds``)."""
        return self.shards is not None and bool(self.shards.sheds(s))

    def step_grads(self) -> list[torch.Tensor]:
        """The gradients the STEP reads, once the iteration's all-reduces are waited for (what clipping scales
        and fp16 unscales): every flat buffer, and for a ZeRO-2 segment this rank's summed range instead."""
        whole = [flat for s, entries in self.buffers.items() if not self._sheds(s) for flat, _ in entries]
        return whole + (list(self.shards.shed_grads()) if self.shards is not None else [])

    @staticmethod
    def _repoint(placed: Sequence[tuple[nn.Parameter, torch.Tensor]], keep_value: bool = True) -> None:
        """Make every ``.grad`` its view of the flat buffer again where something replaced it (copying its value).

        Autograd accumulates into an existing ``.grad`` in place, so this finds nothing to do
        unless other code (an optimizer's ``zero_grad(set_to_none=True)``, say) replaced one.
        """
        for p, view in placed:
            g = p.grad
            if g is not view:
                if g is not None and keep_value:
                    view.copy_(g)
                p.grad = view

    def allreduce(self, s: int, what: object) -> None:
        """SUM-all-reduce segment ``s``'s gradients among its owners; waits, at most ``timeout_s``.

        Hierarchical (reduce to node leaders, all-reduce among them, broadcast) where
        the plan's layout says so for the segment, else one flat all-reduce.
        """
        if s in self._reduced:  # DDP's reducer summed it in the last backward
            self._check_reduced(s, what)
            return
        seg = self.segments[s]
        if self._sheds(s):  # ZeRO-2: bucket by bucket, each packed, reduced to its owners and freed
            for key in sorted(k for k in self.bucket_placed if k[0] == s):
                self.wait(*key, what)
            return
        flats = []
        for flat, placed in self.buffers.get(s, []):
            self._repoint(placed)
            flats.append(flat)
        pairs = self._to_wire(flats)
        sent = [w for _, w in pairs]
        h = self.hierarchical.get(seg.owners) if self.segment_hierarchical[s] else None
        if self.shards is not None and self.shards.covers(s):  # ZeRO: each range reduced to its owner
            self._wait_all(self.shards.reduce(s, pairs, what), s, what, sorted(self.rank_of[d] for d in seg.owners))
        elif h is None:
            peers = sorted(self.rank_of[d] for d in seg.owners)
            group = self.groups[seg.owners]
            self._wait_all([post_sum(f, group) for f in sent],
                           s, what, peers)
            self.calls["ring"] += 1
        else:
            self._wait_done(self._post_hierarchical(h, sent, s, what), s, what, seg.owners)
        _from_wire(pairs)

    def close(self) -> None:
        """Stop the background thread of the hierarchical all-reduces (if one was started); take DDP's hooks off."""
        for r in self.reducers.values():
            r.close()
        self.reducers.clear()
        if self._chain is not None:
            self._chain.close()
            self._chain = None

    # --- buckets, overlapped with the backward -------------------------------------------

    def arm(self, buckets: Sequence[tuple[int, int]]) -> None:
        """Post the all-reduces of ``buckets`` ((segment, bucket) pairs), in this order, during the coming
        backward, each once every parameter of it has received its gradient. A segment that DDP's reducer
        all-reduces is armed as a whole: its reducer posts its own buckets during the backward."""
        own = []
        for key in buckets:
            s = key[0]
            if s not in self.reducers:
                own.append(key)
            elif s not in self._reduced:
                self._reduced.add(s)
                self._to_prepare.append(s)
                try:
                    if self.reducers[s].recut():  # new buckets, the gradients moved into them
                        self._take_buckets([s])
                except RuntimeError as e:  # its re-cut of the buckets is a collective of the owners
                    raise self.health.peer_error(self._failure(s, f"the re-cut of segment {s}'s DDP buckets", e),
                                                 self._peers(s), e) from None
        self._queue = own
        self._next = 0
        self._pending = {key: len(self.bucket_placed.get(key, ())) for key in self._queue}
        self._post_ready()

    def before_backward(self, roots: Sequence[torch.Tensor]) -> None:
        """The armed backward is about to run from ``roots``: arm the DDP reducers ``arm`` took (each walks the
        graph from ``roots`` for the parameters it will not reach)."""
        for s in self._to_prepare:
            self.reducers[s].prepare(roots)
        self._to_prepare.clear()

    def start(self, s: int, b: int) -> None:
        """Post bucket ``b`` of segment ``s`` now if the backward has not (with every armed bucket before it)."""
        key = (s, b)
        if key in self._posted or s in self._reduced:
            return
        if s in self.reducers:  # not armed by a backward (a schedule written by hand): the whole segment, now
            self.allreduce(s, f"ALLREDUCE_START seg{s} bucket{b}")
            self._reduced.add(s)
            return
        q = self._queue
        if key in q[self._next:]:
            stop = q.index(key, self._next)
            while self._next <= stop:
                self._post(q[self._next])
                self._next += 1
            if self._next == len(q):
                self._pending.clear()
        else:
            self._post(key)

    def wait(self, s: int, b: int, what: object) -> None:
        """Wait for bucket ``b`` of segment ``s`` (posting it first if needed), at most ``timeout_s``."""
        if s in self._reduced:  # the reducer finished it within the backward
            self._check_reduced(s, what)
            return
        key = (s, b)
        if key not in self._posted:
            self.start(s, b)
        works = self._posted.pop(key)
        if self._sheds(s):  # ZeRO-2: the owner's sum into its range, the bucket's temporary freed
            self.shards.land(key)
            self.calls["ring"] += 1
            return
        if isinstance(works, _Done):
            self._wait_done(works, s, what, self.segments[s].owners)
        else:
            self._wait_all(works, s, what, sorted(self.rank_of[d] for d in self.segments[s].owners))
            self.calls["ring"] += 1
        _from_wire(self._unpack.pop(key, ()))

    def landed(self, s: int, b: int, timeout_s: float = 0.0) -> bool:
        """Whether bucket ``b`` of segment ``s``, posted and not yet waited for, has finished all its
        phases by itself within ``timeout_s`` (no wait needed to drive it)."""
        if s in self._reduced:
            return True
        works = self._posted[(s, b)]
        if isinstance(works, _Done):
            return works.event.wait(timeout_s)
        return completed_within(works, timeout_s)

    def backward_failure(self, e: RuntimeError, what: object) -> BaseException:
        """What to raise for ``e``, raised by a backward that armed DDP's reducer (``what``: the B action): a
        PeerError naming the owners of the reducer's segments where ``e`` is a failed or timed-out all-reduce,
        else ``e`` itself."""
        if not self._reduced or isinstance(e, PeerError) or not _is_comm_error(e):
            return e
        s = min(self._reduced)
        return self.health.peer_error(self._failure(s, f"{what}: the all-reduce of segment {s} (DDP's reducer)", e),
                                      sorted({r for k in self._reduced for r in self._peers(k)}), e)

    def _build_reducer(self, s: int, layers: Mapping[int, nn.Module],
                       elements: Sequence[tuple[int, int]]) -> SegmentReducer:
        """DDP's reducer over segment ``s`` (collective over its owners: DDP checks the parameters' shapes and
        broadcasts the lowest-ranked owner's weights)."""
        seg = self.segments[s]
        mine = [layers[k] for k in range(seg.first_layer, seg.end_layer)]
        caps = bucket_caps_mb(mine, elements) if len(self.buffers[s]) == 1 else []  # one dtype: the plan's cut
        try:
            return SegmentReducer(mine, self.groups[seg.owners], caps, self.wire_dtype, self._count_wire)
        except RuntimeError as e:
            raise self.health.peer_error(self._failure(s, f"the start of segment {s}'s DDP reducer", e),
                                         self._peers(s), e) from None

    def _count_wire(self, n: int) -> None:
        """DDP's comm hook: one bucket of ``n`` bytes handed to the all-reduce."""
        self.calls["ddp"] += 1
        self.wire_bytes += n

    def _check_reduced(self, s: int, what: object) -> None:
        """Refuse a reduction that DDP's reducer left unfinished: a parameter of the segment got no gradient."""
        try:
            self.reducers[s].check()
        except RuntimeError:
            raise RunError(f"{what}: a parameter of layers [{self.segments[s].first_layer}, "
                           f"{self.segments[s].end_layer}) got no gradient in the iteration's last backward, and "
                           "DistributedDataParallel's reducer, which sums these layers (a whole stage on every "
                           "owner), waits for every one: a layer's parameters must all take part in its forward"
                           ) from None

    def _peers(self, s: int) -> list[int]:
        return sorted(self.rank_of[d] for d in self.segments[s].owners)

    def _grad_ready(self, key: tuple[int, int], param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of every parameter of bucket ``key``."""
        n = self._pending.get(key)
        if n is not None:
            self._pending[key] = n - 1
            if n == 1:
                self._post_ready()

    def _post_ready(self) -> None:
        """Post the armed buckets whose gradients are all final, in order, up to the first that is not."""
        q, pending = self._queue, self._pending
        while self._next < len(q) and pending.get(q[self._next], 0) <= 0:
            self._post(q[self._next])
            self._next += 1
            self.posted_early += 1
        if q and self._next == len(q):
            pending.clear()

    def _post(self, key: tuple[int, int]) -> None:
        """Post the (first phase of the) all-reduce of bucket ``key``, without waiting."""
        s, b = key
        if self._sheds(s):  # ZeRO-2: packed from the parameters' .grad, which it frees (runtime.sync.shard)
            works, sent = self.shards.post(key, self.wire_dtype, f"ALLREDUCE_START seg{s} bucket{b}")
            self.wire_bytes += sent
            self._posted[key] = works
            return
        self._repoint(self.bucket_placed.get(key, ()))
        pairs = self._to_wire(self.bucket_views.get(key, []))
        if any(v is not w for v, w in pairs):
            self._unpack[key] = pairs
        views = [w for _, w in pairs]
        owners = self.segments[s].owners
        if self.shards is not None and self.shards.covers(s):  # ZeRO: each range reduced to its owner
            self._posted[key] = self.shards.reduce(s, pairs, f"ALLREDUCE_START seg{s} bucket{b}")
            return
        h = self.hierarchical.get(owners) if self.bucket_hierarchical.get(key) else None
        if h is not None:
            self._posted[key] = self._post_hierarchical(h, views, s, f"ALLREDUCE seg{s} bucket{b}")
            return
        try:
            group = self.groups[owners]
            works = [post_sum(v, group) for v in views]
        except RuntimeError as e:
            peers = sorted(self.rank_of[d] for d in owners)
            raise self.health.peer_error(self._failure(s, f"ALLREDUCE_START seg{s} bucket{b}", e), peers,
                                         e) from None
        self._posted[key] = works

    def _to_wire(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(gradients, what the all-reduce sends) per tensor: a ``wire_dtype`` copy, or the tensor itself
        where it is in that dtype already or no other is asked for; counts the bytes in ``wire_bytes``."""
        dtype = self.wire_dtype
        pairs = [(t, t if dtype is None or t.dtype == dtype else t.to(dtype)) for t in tensors]
        self.wire_bytes += sum(w.numel() * w.element_size() for _, w in pairs)
        return pairs

    def _post_hierarchical(self, h: Hierarchy, tensors: Sequence[torch.Tensor], s: int, what: object) -> _Done:
        """Post the first phase now; the chain thread runs the rest as soon as it has landed."""
        try:
            first = self._first_phase(h, tensors)
        except RuntimeError as e:
            raise self.health.peer_error(self._failure(s, what, e), list(h.node_ranks or h.leaders), e) from None
        if self._chain is None:
            self._chain = _Chain()
        return self._chain.submit(functools.partial(self._hierarchical_rest, h, list(tensors), first, s, what))

    def _wait_done(self, done: _Done, s: int, what: object, owners: Sequence[str]) -> None:
        """Wait for a hierarchical all-reduce's last phase (each phase waits at most ``timeout_s``)."""
        if not done.event.wait(3 * self.timeout_s + 5):
            peers = sorted(self.rank_of[d] for d in owners)
            raise self.health.peer_error(self._failure(s, what, None), peers)
        if done.error is not None:
            if isinstance(done.error, PeerError):
                raise done.error
            raise self.health.peer_error(self._failure(s, what, done.error),
                                         sorted(self.rank_of[d] for d in owners), done.error) from None

    @staticmethod
    def _first_phase(h: Hierarchy, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """Post the hierarchical all-reduce's first phase: the reduce to the node leader, or, for a leader alone
        on its node, the leaders' all-reduce."""
        if h.node_group is not None:
            return [dist.reduce(t, dst=h.leader, op=dist.ReduceOp.SUM, group=h.node_group, async_op=True)
                    for t in tensors]
        return [post_sum(t, h.leaders_group) for t in tensors]

    def _hierarchical_rest(self, h: Hierarchy, tensors: Sequence[torch.Tensor], first: Sequence[Any], s: int,
                           what: object) -> None:
        """Wait for the first phase, then run the leaders' all-reduce and the broadcast to the node
        (on the chain thread)."""
        if h.node_group is None:
            self._wait_all(first, s, what, list(h.leaders))
        else:
            self._wait_all(first, s, what, list(h.node_ranks))
            if h.leaders_group is not None:
                self._wait_all([post_sum(t, h.leaders_group) for t in tensors], s, what, list(h.leaders))
            self._wait_all([dist.broadcast(t, src=h.leader, group=h.bcast_group, async_op=True) for t in tensors],
                           s, what, list(h.node_ranks))
        self.calls["hierarchical"] += 1

    def _wait_all(self, works: Sequence[Any], s: int, what: object, peers: Sequence[int]) -> None:
        for w in works:
            self.health.wait(w, what, peers, self.timeout_s)

    def _failure(self, s: int, what: object, e: BaseException | None) -> str:
        owners = ", ".join(self.health.name(self.rank_of[d]) for d in self.segments[s].owners)
        if e is None or is_timeout(e):
            return f"{what} among {owners} did not finish within {self.timeout_s:g} s"
        return f"{what} among {owners} failed: a peer failed or closed its connection"

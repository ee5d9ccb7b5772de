"""Cost of synchronous data parallelism across VWs that partition the model differently.

Layers are grouped into segments with the same owner devices; each segment's
gradients are all-reduced among exactly its owners. Segments with disjoint
owners run at once; a device runs its segments one after another, so the
closed form is the largest per-device sum, less what the gradient buckets hide
behind the last backward micro-batch, or more where segments and pipeline
transfers queue on the NICs they share (``planner.sharing``)::

    VW0: d0 [0..4)  d1 [4..8)        segment [0..3) owners {d0, d2}
    VW1: d2 [0..3)  d3 [3..8)        segment [3..4) owners {d0, d3}
                                     segment [4..8) owners {d1, d3}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetrain.cluster import Cluster
from hetrain.cost import (
    LinkKey,
    allreduce_shape,
    estimate_allreduce,
    estimate_allreduce_time,
    estimate_layer_times,
    estimate_p2p_time,
    estimate_ps_loads,
    estimate_samples_to_accuracy_factor,
)
from hetrain.plan import Plan
from hetrain.planner.partition import PartitionResult, priced_as
from hetrain.planner.sharing import (
    PipelineTraffic,
    SegmentJob,
    estimate_cut_ins,
    estimate_pipeline_traffic,
    estimate_shared_pipeline_times,
    estimate_shared_sync_time,
    estimate_tail,
    exchange_slowdown,
    exchange_stretch,
)
from hetrain.profile import ModelProfile
from hetrain.sync_layout import (
    Layout,
    SyncOptions,
    backward_after,
    cut_buckets,
    cut_buckets_exact,
    modes_for,
    place_ps_shards,
)
from hetrain.sync_layout import group_segments as build_segments
from hetrain.sync_mode import sync_mode

#: a plan's simulated iteration seconds (the simulator's, handed in by the caller: the planner imports no simulator)
Scorer = Callable[[Plan], float]


def estimate_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                       hide_s: Mapping[int, float] | None = None,
                       bucket_bytes: float = SyncOptions.bucket_bytes,
                       traffic: PipelineTraffic | None = None,
                       first_bucket_bytes: float = SyncOptions.first_bucket_bytes,
                       bucket_cut: str = SyncOptions.bucket_cut, wire: float | Sequence[float] = 1.0) -> float:
    """Seconds of BSP gradient all-reduce left after the backward pass: the busiest device's, or the busiest
    shared link's.

    Without ``hide_s``: the device's sum over its segments, as if every all-reduce waited for the
    whole backward. With ``hide_s`` (device index -> seconds of its last micro-batch's backward):
    the runtime all-reduces gradient buckets while that backward still runs (schedule
    ``ALLREDUCE_START``, as DistributedDataParallel does), so a device's exposed sync is
    ``max(sum - hide, the last bucket's all-reduce)``, the last bucket (a segment's first layers,
    at most ``bucket_bytes``) being ready only when backward ends. The simulator replays the
    buckets one by one on the links; this is its closed form.

    ``traffic`` (``planner.sharing.estimate_pipeline_traffic``) has each device's lead, the seconds before
    the end of the pipeline its last backward starts (default: ``hide_s``). A device whose pipeline ends
    early starts its buckets early: ``max(sum - lead, last bucket - (lead - hide))``. With ``traffic`` (the
    planner's BSP estimate) a segment is all-reduced bucket by bucket as the plan cuts it
    (``sync_layout.cut_buckets``, or ``cut_buckets_exact`` where ``bucket_cut`` is ``"exact"``), each bucket
    paying the latency terms, and its first bucket (at least ``first_bucket_bytes``, exactly that where
    cut exactly) is ready after its share of the backward (a layer cut inside counting its bytes' share).

    Segments of other devices, and the pipelines' transfers (``traffic``), share the links
    (``planner.sharing``): every segment's all-reduce holds the NICs and intra-node links of its ring for
    its duration, from when the last of its owners has its first bucket. The result is the largest of

    - the per-device form above;
    - the busiest link's makespan after the pipeline's end (``estimate_shared_sync_time``);
    - with ``traffic``: the per-device form after the delay the all-reduces put on the pipeline's last
      transfers through a NIC, and when the walk over every VW's last backward and every all-reduce ends
      (``estimate_tail``).

    Where every all-reduce has its links to itself the per-device form is the largest.

    ``wire`` is the bytes each all-reduce moves per byte of gradient (``SyncOptions.reduce_wire``: 0.5 where
    they travel in bf16); or per segment (in ``group_segments``' order: ``SyncOptions.wire_for`` its shard mode)
    where a plan shards some segments and not others. Buckets are cut on the gradients' own bytes, as the runtime
    cuts its fp32 buffer.
    """
    lead_s = traffic.lead_s if traffic is not None else hide_s
    per_device: dict[int, float] = {}
    by_device: dict[int, list[tuple[int, float]]] = {}  # device -> (index in jobs, seconds) of its segments
    tail: dict[int, float] = {}
    jobs: list[SegmentJob] = []
    layer_bytes = [x.param_bytes for x in profile.layers]
    stage_of = {d: (k, l) for layout in layouts for d, k, l in layout}  # device -> its stage's layers
    for s, (first, end, owners) in enumerate(build_segments(profile.num_layers, layouts)):
        if len(owners) < 2:
            continue
        seg_wire = wire if isinstance(wire, float | int) else wire[s]
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        t = estimate_allreduce_time(cluster, owners, num_bytes * seg_wire)
        job = SegmentJob(owners, num_bytes * seg_wire)
        if traffic is not None and t > 0:  # the planner's BSP estimate: bucket by bucket, as the plan cuts them
            cut = cut_buckets_exact if bucket_cut == "exact" else cut_buckets
            cuts = cut(layer_bytes, first, end, first_bucket_bytes, bucket_bytes)
            job, t = _bucketed_job(cluster, profile, job, first, end, num_bytes, cuts, bucket_cut == "exact",
                                   seg_wire, [stage_of[d] for d in owners])
        last = t if num_bytes <= bucket_bytes else estimate_allreduce_time(cluster, owners, bucket_bytes * seg_wire)
        for d in owners:
            per_device[d] = per_device.get(d, 0.0) + t
            by_device.setdefault(d, []).append((len(jobs), t))
            tail[d] = max(tail.get(d, 0.0), last)
        jobs.append(job)
    released = [j._replace(lead_s=_segment_lead(j, lead_s, hide_s)) for j in jobs]
    shared, delay = estimate_shared_sync_time(cluster, released, traffic)
    if hide_s is None or lead_s is None:
        return max(max(per_device.values(), default=0.0), shared)
    own = max((max(t - lead_s.get(d, 0.0), tail[d] - (lead_s.get(d, 0.0) - hide_s.get(d, 0.0)))
               for d, t in per_device.items()), default=0.0)
    if traffic is None or not jobs:
        return max(delay + own, shared)
    delayed = _estimate_delayed_own(cluster, released, traffic, by_device, lead_s, hide_s, tail, own)
    if not traffic.waves:
        return max(delayed, shared)
    pipeline_end, sync_end = estimate_tail(cluster, jobs, traffic.waves)
    return max(delayed, shared, pipeline_end, sync_end)


def _bucketed_job(cluster: Cluster, profile: ModelProfile, job: SegmentJob, first: int, end: int, num_bytes: float,
                  cuts: Sequence[tuple[float, float, float]], exact: bool, wire: float,
                  stages: Sequence[tuple[int, int]]) -> tuple[SegmentJob, float]:
    """Segment ``[first, end)``'s all-reduce (``job``, of ``num_bytes`` of gradients) bucket by bucket, as ``cuts``
    (last layers first) cut it:
    the job with its scale, its first bucket's share of the backward, its bucket count and algorithm, and its
    seconds (each bucket paying the latency terms).

    ``exact``: the cuts fall inside layers (``sync_layout.cut_buckets_exact``), a layer cut inside counting its
    bytes' share of its backward.
    """
    owners = job.owners
    shape = allreduce_shape(cluster, owners)
    priced = [estimate_allreduce(size * wire, shape) for _, _, size in cuts]
    by_bucket = sum(s for s, _ in priced)
    # the replay runs each bucket by its own algorithm (sync_layout): the phases are its largest
    # bucket's; 134 hierarchical buckets hold the NICs as no flat ring of the whole segment does
    algorithm = max(zip(cuts, priced, strict=True), key=lambda x: x[0][2])[1][1]
    whole = estimate_allreduce(num_bytes * wire, shape, algorithm)[0]
    # the first bucket is final once the backward of its layers is over: its share of the segment's
    # backward seconds (a head of 8 kB and 105 GFLOPs is most of its bucket's time, none of its bytes)
    g = estimate_layer_times(profile, cluster.devices[owners[0]], 1)[1]
    seg_s = float(g[first:end].sum())
    before = float(g[int(cuts[0][0]):end].sum()) if not exact else backward_after(g, cuts[0][0], end)
    share = before / seg_s if seg_s > 0 else cuts[0][2] / num_bytes
    # each owner's stage [k, l) runs the backward of l-1 down to k: the segment's layers begin theirs after those of
    # [end, l) (the same device's figures as ``share``: the stages' shares, not their seconds)
    prefix = np.concatenate([[0.0], np.cumsum(g)])
    place = []
    for k, l in stages:
        stage_s = float(prefix[l] - prefix[k])
        place.append((float(prefix[l] - prefix[end]) / stage_s, seg_s / stage_s) if stage_s > 0 else (0.0, 1.0))
    return job._replace(scale=by_bucket / whole, share=share, buckets=len(cuts), algorithm=algorithm,
                        place=tuple(place)), by_bucket


def _estimate_delayed_own(cluster: Cluster, jobs: Sequence[SegmentJob], traffic: PipelineTraffic,
                          by_device: Mapping[int, Sequence[tuple[int, float]]], lead_s: Mapping[int, float],
                          hide_s: Mapping[int, float], tail: Mapping[int, float], own: float) -> float:
    """The per-device form after the delay the all-reduces put on the pipeline's last transfers through a
    NIC: ``max_r (delay_r + own_r)``, at least ``own``.

    The all-reduces that cut in between NIC r's transfers (``sharing.estimate_cut_ins``) are served before its
    last transfer, so by the delayed end of the pipeline they are over: ``own_r`` is the per-device form
    over each device's other segments, ``max_d max(sum_{s not cut in} t_s - lead_d, last bucket - (lead_d -
    hide_d))``. Charging them again after the delay counted them twice (a 64-device plan whose segments
    cut in on the NICs of the stage before: 537 ms closed form against 428 ms simulated).
    """
    devices = list(by_device)
    pair_dev = np.array([i for i, d in enumerate(devices) for _ in by_device[d]], dtype=np.int64)
    pair_job = np.array([k for d in devices for k, _ in by_device[d]], dtype=np.int64)
    pair_s = np.array([t for d in devices for _, t in by_device[d]])
    lead = np.array([lead_s.get(d, 0.0) for d in devices])
    last = np.array([tail[d] - (lead_s.get(d, 0.0) - hide_s.get(d, 0.0)) for d in devices])
    best = own
    own_of: dict[bytes, float] = {}  # NICs with the same all-reduces cut in: one per-device form
    for delay_r, cut in sorted(estimate_cut_ins(cluster, jobs, traffic), key=lambda x: -x[0]):
        if delay_r + own <= best:
            break  # own_r <= own: no later NIC can give more
        key = cut.tobytes()
        if key not in own_of:
            kept = pair_s * ~np.isin(pair_job, cut)
            left = np.bincount(pair_dev, weights=kept, minlength=len(devices)) - lead
            own_of[key] = float(np.maximum(left, last).max()) if len(devices) else 0.0
        best = max(best, delay_r + own_of[key])
    return best


def _segment_lead(job: SegmentJob, lead_s: Mapping[int, float] | None, hide_s: Mapping[int, float] | None) -> float:
    """Seconds before the pipeline's end a segment's all-reduce can start: when the last of its owners has
    the first bucket ready, ``share`` into its last backward (``hide_s``), which starts ``lead_s`` before."""
    if lead_s is None:
        return 0.0
    hide = hide_s or {}
    return min(lead_s.get(d, 0.0) - job.share * hide.get(d, 0.0) for d in job.owners)


def estimate_local_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout]) -> float:
    """Seconds of the node-local gradient all-reduce of ``hybrid-ps`` and ``daso``: each segment among its
    owners on one node; the busiest device's sum."""
    per_device: dict[int, float] = {}
    for first, end, owners in build_segments(profile.num_layers, layouts):
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        by_node: dict[str, list[int]] = {}
        for d in owners:
            by_node.setdefault(cluster.devices[d].node, []).append(d)
        for members in by_node.values():
            if len(members) > 1:
                t = estimate_allreduce_time(cluster, members, num_bytes)
                for d in members:
                    per_device[d] = per_device.get(d, 0.0) + t
    return max(per_device.values(), default=0.0)


@dataclass(frozen=True)
class PsTraffic:
    """What one wave's pushes and pulls put on the links (``estimate_ps_traffic``).

    Attributes:
        push_s: seconds the busiest link resource carries pushes.
        pull_s: seconds the busiest link resource carries pulls.
        busiest_s: seconds the busiest link resource carries both: the least a wave occupies the links.
    """

    push_s: float = 0.0
    pull_s: float = 0.0
    busiest_s: float = 0.0

    @property
    def round_trip_s(self) -> float:
        """One wave's exchange: every push arrived, then every pull back (a shard broadcasts once it holds every
        owner's update). At least ``busiest_s``."""
        return self.push_s + self.pull_s


def pipeline_nic_loads(cluster: Cluster, traffic: PipelineTraffic | None, every: int = 1) -> dict[LinkKey, float]:
    """Seconds the pipelines' transfers hold each NIC in ``every`` iterations (``PipelineTraffic``'s NIC
    resources: node k's NIC out is k, its NIC in ``nodes + k``), keyed as ``cost.estimate_ps_loads`` keys them."""
    if traffic is None:
        return {}
    n = len(cluster.nodes)
    return {("out", cluster.nodes[r].name) if r < n else ("in", cluster.nodes[r - n].name): every * float(t)
            for r, t in zip(traffic.resources, traffic.duration_s, strict=True)}


#: per link resource, the seconds one wave's pushes hold it, and its pulls (``estimate_ps_link_loads``)
PsLoads = tuple[dict[LinkKey, float], dict[LinkKey, float]]


def estimate_ps_traffic(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                        placement: str = SyncOptions.placement,
                        pipeline_s: Mapping[LinkKey, float] | None = None,
                        loads: PsLoads | None = None) -> PsTraffic:
    """One wave's pushes and pulls on the link resources the simulator models (``simulator.links``): each
    node's NIC out and NIC in (full duplex), and each ordered pair of devices in a node.

    Segment s's parameter server is cut into shards as ``place_ps_shards`` places them (``Segment.ps_shards``):
    each node's owners sum the shard's range of their updates at the node's leader for the shard, which pushes
    the sum to the host and pulls the range's global weights back, ``latency + f bytes / bandwidth`` each way
    (``cost.estimate_ps_loads``). A transfer between nodes loads the sender's NIC out and the receiver's NIC
    in; the segments' loads add up per resource. Sharded by NIC bandwidth, the one-host server's
    ``(nodes - 1) bytes`` through one NIC become about ``(nodes - 1) bytes / nodes`` through each::

        one host:  n1 ──┐                    sharded:  n1 ◄──► n0 ◄──► n2
                   n2 ──┼──► n0 NIC in                 each NIC: its node's pushes out and its shard's pulls out
                   n3 ──┘

    ``pipeline_s`` (``pipeline_nic_loads``): what the pipelines' transfers put on each NIC in one wave's
    iterations. They share the NICs with the pushes and pulls, so they count in the busiest link's seconds
    (``busiest_s``), not in the round trip: on pipetorch's 2-stage VWs under wsp the NIC that hosts a shard
    carried 0.24 s of activations beside 1.53 s of pushes and pulls per wave (benchmarks/closed_form_modes.py).

    ``loads``: the pushes' and pulls' seconds per link, ``estimate_ps_link_loads`` of the same arguments, where
    the caller has them (``SyncTerms``: wsp and hybrid-ps differ only in ``pipeline_s``).
    """
    push, pull = loads if loads is not None else estimate_ps_link_loads(cluster, profile, layouts, placement)
    pipeline_s = pipeline_s or {}
    both = {r: push.get(r, 0.0) + pull.get(r, 0.0) + pipeline_s.get(r, 0.0) for r in push.keys() | pull.keys()}
    return PsTraffic(max(push.values(), default=0.0), max(pull.values(), default=0.0),
                     max(both.values(), default=0.0))


def estimate_ps_link_loads(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                           placement: str = SyncOptions.placement) -> PsLoads:
    """Per link resource, the seconds one wave's pushes hold it, and its pulls: every segment's parameter-server
    shards (``place_ps_shards``) and their loads (``cost.estimate_ps_loads``) added up (``estimate_ps_traffic``)."""
    nic_of = {n.name: n.nic.bandwidth_bytes_per_s for n in cluster.nodes}
    push: dict[LinkKey, float] = {}
    pull: dict[LinkKey, float] = {}
    for s, (first, end, owners) in enumerate(build_segments(profile.num_layers, layouts)):
        if len(owners) < 2:
            continue
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        in_order = sorted(owners)
        shards = place_ps_shards(in_order, [cluster.devices[d].node for d in in_order], nic_of, s, placement)
        seg_push, seg_pull = estimate_ps_loads(cluster, in_order, shards, num_bytes)
        for total, part in ((push, seg_push), (pull, seg_pull)):
            for key, t in part.items():
                total[key] = total.get(key, 0.0) + t
    return push, pull


def estimate_ps_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                     placement: str = SyncOptions.placement) -> float:
    """Seconds of one wave's exchange with the parameter servers: its pushes on the busiest link, then its
    pulls on the busiest link (``estimate_ps_traffic``'s ``round_trip_s``)."""
    return estimate_ps_traffic(cluster, profile, layouts, placement).round_trip_s


class SyncTerms:
    """The closed forms' terms that sync modes share on one plan's VWs (``estimate_mode_sync_time``), each worked
    out on its first use: ``S`` without buckets (local-sgd, daso), ``L`` (daso, hybrid-ps) and the loads of
    ``P`` (wsp, hybrid-ps, which differ only in the pipelines' share of the links). A table of every mode
    (``estimate_sync_predictions``) asks for each twice; at 4096 devices ``P``'s loads take half a second."""

    def __init__(self, cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                 placement: str = SyncOptions.placement) -> None:
        self.cluster, self.profile, self.layouts, self.placement = cluster, profile, layouts, placement
        self._exchange_s: float | None = None
        self._local_s: float | None = None
        self._ps_loads: PsLoads | None = None
        self._slowdown: tuple[PipelineTraffic, tuple[float, float]] | None = None

    def exchange_s(self) -> float:
        """``S``: the whole segments all-reduced, every owner's in turn (``estimate_sync_time`` without buckets)."""
        if self._exchange_s is None:
            self._exchange_s = estimate_sync_time(self.cluster, self.profile, self.layouts)
        return self._exchange_s

    def local_s(self) -> float:
        """``L``: the node-local all-reduce (``estimate_local_sync_time``)."""
        if self._local_s is None:
            self._local_s = estimate_local_sync_time(self.cluster, self.profile, self.layouts)
        return self._local_s

    def ps_loads(self) -> PsLoads:
        """``P``'s pushes and pulls per link (``estimate_ps_link_loads``)."""
        if self._ps_loads is None:
            self._ps_loads = estimate_ps_link_loads(self.cluster, self.profile, self.layouts, self.placement)
        return self._ps_loads

    def exchange_slowdown(self, traffic: PipelineTraffic) -> tuple[float, float]:
        """``X``'s terms for the pipelines of ``traffic`` under the exchange of ``P`` (``sharing.exchange_slowdown``:
        the longest hold of a NIC they cross, their seconds lost with it doubled), kept for the last traffic asked
        (a table of every mode asks with one)."""
        if self._slowdown is None or self._slowdown[0] is not traffic:
            push, pull = self.ps_loads()
            held = {r: push.get(r, 0.0) + pull.get(r, 0.0) for r in push.keys() | pull.keys()}
            self._slowdown = (traffic, exchange_slowdown(self.cluster, traffic, held))
        return self._slowdown[1]


def estimate_sync_predictions(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                              options: SyncOptions, compute_s: float, global_batch: int,
                              hide_s: Mapping[int, float] | None = None, traffic: PipelineTraffic | None = None,
                              segment_shards: Sequence[str] = (),
                              known: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Every mode's closed form for one plan's VWs (``options["sync_predictions"]``, docs/plan.md): per mode that
    can run with ``options`` (``modes_for``), its ``sync_s`` (``estimate_mode_sync_time``), ``iteration_s``
    (``compute_s`` and the sync) and ``samples_per_s``. The terms the modes share are worked out once
    (``SyncTerms``); ``known``: modes whose ``sync_s`` the caller has already (the planner's candidate was
    priced under its own mode with the same arguments), taken as they are."""
    terms = SyncTerms(cluster, profile, layouts, options.placement)
    known = known or {}
    table = {}
    for mode in modes_for(options):
        s = known[mode] if mode in known else estimate_mode_sync_time(
            cluster, profile, layouts, mode, options, compute_s, hide_s, traffic, segment_shards, terms)
        table[mode] = {"sync_s": s, "iteration_s": compute_s + s,
                       "samples_per_s": global_batch / (compute_s + s) if compute_s + s > 0 else 0.0}
    return table


def estimate_mode_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout], mode: str,
                            options: SyncOptions, compute_s: float,
                            hide_s: Mapping[int, float] | None = None,
                            traffic: PipelineTraffic | None = None, segment_shards: Sequence[str] = (),
                            terms: SyncTerms | None = None) -> float:
    """Seconds of synchronisation per iteration under sync mode ``mode`` (closed forms; docs/sync.md).

    ``compute_s`` is the iteration's pipeline and optimizer time, what asynchronous traffic can hide behind;
    ``hide_s`` per device the backward its BSP gradient buckets overlap, ``traffic`` how long before the
    pipeline's end that backward starts and the transfers on the links (``estimate_sync_time``);
    ``segment_shards`` each segment's shard mode where they differ (``Plan.segment_shards``; empty: every
    segment's is ``options.shard``).
    With ``S`` the BSP all-reduce, ``L`` the node-local all-reduce, ``P`` one wave's push and pull traffic::

        bsp        S, less what the buckets hide behind the last backward
        local-sgd  S / k                              (parameters averaged every k iterations, blocking)
        daso       L + max(0, S - (compute + L)) / k     (global average every k, merged after the next iteration;
                   S / k where it holds a NIC the pipelines cross: ``average_holds_pipeline_nics``)
        hybrid-ps  L + X + max(0, (P - D a c) / (D + 1), W - a c) / a, c = compute + L + X   (a push per a iterations)
        wsp        X + max(0, (P - D c) / (D + 1), W - c), c = compute + X          (a push per wave)

    ``P`` is one wave's round trip to the sharded parameter servers (pushes, then pulls, each on its busiest
    link: ``estimate_ps_traffic``), ``W`` what the busiest link carries per wave, the pipelines' transfers
    through it included (they share it: ``simulator.links.share``). A wave is pushed when its
    compute ends, and the pull of wave k gates the compute of wave k + D + 1, so D + 1 waves span one round
    trip and one wave's compute: ``(D + 1) wave >= P + compute``, the waves overlapping on the links (the pulls
    of one with the pushes of the next); however much slack D gives, the links carry one wave's traffic per
    wave, ``wave >= W``. With D = 0 a wave waits for its whole round trip. ``X``: what the pipelines lose while
    the exchange holds the NICs their transfers cross, which then carry them at half rate
    (``sharing.estimate_exchange_stretch``; 0 for one-stage VWs).

    Warm-up and cool-down iterations of DASO (blocking) are not counted: they are a fixed cost per run.

    ``terms``: ``S`` (without buckets), ``L`` and ``P``'s loads of the same cluster, profile, layouts and placement,
    worked out once for several modes (``estimate_sync_predictions``); the same figures.
    """
    terms = terms if terms is not None else SyncTerms(cluster, profile, layouts, options.placement)
    rules = sync_mode(mode)
    if rules.synchronous:
        # the gradients travel as the runtime keeps them (ModelProfile.gradient_wire: half where they are 16-bit)
        g = profile.gradient_wire
        wire = [g * options.wire_for(m) for m in segment_shards] if segment_shards else g * options.reduce_wire
        return estimate_sync_time(cluster, profile, layouts, hide_s, options.bucket_bytes, traffic,
                                  options.first_bucket_bytes, options.bucket_cut, wire)
    every = rules.period(options)
    # L: every iteration's node-local all-reduce, before the step; the exchange across nodes hides behind it too
    local_s = terms.local_s() if rules.local_mean else 0.0
    busy_s = compute_s + local_s
    stretch_s = 0.0
    if rules.parameter_servers:  # P: one wave's pushes and pulls; the links carry one wave per push period
        loads = terms.ps_loads()
        ps = estimate_ps_traffic(cluster, profile, layouts, options.placement,
                                 pipeline_nic_loads(cluster, traffic, every), loads)
        if traffic is not None:  # the pipelines' transfers at half rate while the exchange holds their NICs
            stretch_s = exchange_stretch(terms.exchange_slowdown(traffic), every * busy_s)
            busy_s += stretch_s
        # wave k's pull gates the compute of wave k + D + 1: (D + 1) waves hold one round trip and a wave's compute
        d = rules.overlap_iterations(options)
        hidden_s = max(0.0, (ps.round_trip_s - d * every * busy_s) / (d + 1),
                       ps.busiest_s - every * busy_s) / every
    else:  # S: the whole segments all-reduced (an average of the weights moves their bytes)
        exchange_s = terms.exchange_s()
        overlap = rules.overlap_iterations(options)
        if overlap and average_holds_pipeline_nics(cluster, profile, layouts, traffic):
            overlap = 0  # the pipelines' transfers queue behind the posted average on their NICs: it hides nothing
        hidden_s = max(0.0, exchange_s - overlap * busy_s) / every
    return local_s + stretch_s + hidden_s


def average_holds_pipeline_nics(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout],
                                traffic: PipelineTraffic | None) -> bool:
    """Whether a posted average of the segments across nodes (DASO's) holds a NIC the pipelines' transfers cross.

    A NIC carries one transfer at a time, in the order they ask for it (``simulator.links``; a NIC's queue).
    DASO posts its global average after an iteration's step; the next iteration's first transfer that
    crosses a NIC the average holds waits behind it, and the pipeline behind that transfer waits as long:
    the average then hides behind nothing, as a blocking one (nvlink-nodes, gpt2-large, 16 VWs of 2 stages
    across nodes: the average's 0.75 s on a NIC; the replay's iteration with it 0.72 s longer,
    benchmarks/closed_form_modes.py). Pipelines inside nodes, or an average inside nodes, do not meet."""
    crossed = {key[1] for key, t in pipeline_nic_loads(cluster, traffic).items() if t > 0}  # ("out" | "in", node)
    if not crossed:
        return False
    for _, _, owners in build_segments(profile.num_layers, layouts):
        nodes = {cluster.devices[d].node for d in owners}
        if len(nodes) > 1 and nodes & crossed:
            return True
    return False


# ---------------------------------------------------------------------------
# choosing a mode: predicted time to accuracy with a staleness penalty
# ---------------------------------------------------------------------------


def estimate_mode_staleness(mode: str, options: SyncOptions, num_vws: int) -> float:
    """Mean staleness of a mode in iterations: how late, on average, a VW sees the other VWs' updates.

    With k = ``period``, a = ``aggregate``, D = ``staleness`` (docs/sync.md)::

        bsp        0
        local-sgd  (k - 1) / 2            others' updates arrive at the next average, on average (k - 1) / 2 late
        daso       (k + 1) / 2            the same, and the non-blocking average is merged one iteration late
        wsp        D                      a VW that runs ahead (the fast ones do) misses up to D waves of the others
        hybrid-ps  (a - 1) / 2 + D a      one push per a iterations, pulls up to D pushes old

    One VW has nobody to be stale with: 0. DASO's blocking warm-up and cool-down are left out.
    """
    rules = sync_mode(mode)
    if num_vws < 2 or rules.synchronous:
        return 0.0
    every = rules.period(options)
    # how late the others' updates come on top of the wait for the next exchange, (every - 1) / 2 on average
    if rules.parameter_servers:
        late = options.staleness * every  # pulls up to D pushes old
    else:
        late = 1 if rules.posted else 0  # a posted average is merged one iteration after it starts
    return (every - 1) / 2 + late


@dataclass(frozen=True)
class ModeEstimate:
    """One row of the planner's comparison of sync modes for one plan's VWs.

    Attributes:
        mode: the sync mode.
        samples_per_s: predicted throughput (closed form, or simulated when ``simulated``).
        staleness: mean staleness in iterations (``estimate_mode_staleness``).
        effective_samples_per_s: ``samples_per_s / (1 + penalty * staleness)``.
        time_to_accuracy_s: ``target_samples * batch_factor / effective_samples_per_s``.
        simulated: whether ``samples_per_s`` comes from the simulator.
    """

    mode: str
    samples_per_s: float
    staleness: float
    effective_samples_per_s: float
    time_to_accuracy_s: float
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "samples_per_s": self.samples_per_s, "staleness": self.staleness,
                "effective_samples_per_s": self.effective_samples_per_s,
                "time_to_accuracy_s": self.time_to_accuracy_s, "simulated": self.simulated}


def estimate_time_to_accuracy(samples_per_s: float, staleness: float, staleness_penalty: float,
                              target_samples: float, batch_factor: float = 1.0) -> float:
    """Seconds to reach the target: ``target_samples * batch_factor * (1 + penalty * staleness) / samples_per_s``.

    A stale mode computes on weights that miss some of the other VWs' updates, and so needs more samples
    to reach the same loss; the penalty P says how many more per iteration of staleness (a user's
    figure; 0 ignores statistical efficiency). ``batch_factor`` is the large-batch factor
    (``cost.estimate_samples_to_accuracy_factor``), the same for every mode of one plan.

    Example:
        >>> estimate_time_to_accuracy(100.0, 2.0, 0.25, 1000.0)
        15.0
    """
    if samples_per_s <= 0:
        return float("inf")
    if staleness_penalty < 0:
        raise ValueError(f"staleness penalty must be >= 0, got {staleness_penalty}")
    return target_samples * batch_factor * (1.0 + staleness_penalty * staleness) / samples_per_s


def estimate_mode_table(samples_per_s: Mapping[str, float], options: SyncOptions, num_vws: int,
                        staleness_penalty: float, target_samples: float, batch_factor: float = 1.0,
                        simulated: bool = False) -> list[ModeEstimate]:
    """Every mode's predicted throughput, staleness and time to accuracy, best (soonest) first."""
    rows = []
    for mode, sps in samples_per_s.items():
        stale = estimate_mode_staleness(mode, options, num_vws)
        rows.append(ModeEstimate(mode, sps, stale, sps / (1.0 + staleness_penalty * stale),
                                 estimate_time_to_accuracy(sps, stale, staleness_penalty, target_samples,
                                                           batch_factor), simulated))
    return sorted(rows, key=lambda r: (r.time_to_accuracy_s, r.staleness))


def format_mode_table(rows: Sequence[Mapping[str, Any]], chosen: str | None = None) -> str:
    """The table ``hetrain plan --sync auto`` prints (rows as ``ModeEstimate.to_dict``)."""
    lines = [f"  {'mode':<10} {'samples/s':>10} {'staleness':>9} {'effective/s':>11} {'time to acc.':>12}"]
    for r in rows:
        mark = "  <- chosen" if r["mode"] == chosen else ""
        lines.append(f"  {r['mode']:<10} {r['samples_per_s']:>10.1f} {r['staleness']:>9.2f} "
                     f"{r['effective_samples_per_s']:>11.1f} {r['time_to_accuracy_s']:>11.1f}s{mark}")
    return "\n".join(lines)


def choose_sync_mode(plan: Plan, staleness_penalty: float, target_samples: float,
                     critical_batch: float | None = None, score: Scorer | None = None) -> Plan:
    """``plan`` under the sync mode with the soonest predicted time to accuracy, for its VWs and layouts.

    Each mode's throughput is the plan's own prediction (``options["sync_predictions"]``, the
    closed forms), or ``global_batch / score(plan under the mode)`` when a scorer (the simulator) is
    given; its time to accuracy is discounted by its staleness (``estimate_time_to_accuracy``). The
    returned plan records the table in ``options["sync_choice"]`` and carries the chosen mode's prediction.

    Raises:
        ValueError: a plan without ``sync_predictions`` (not made by the planner).
    """
    predictions = plan.options.get("sync_predictions")
    if not isinstance(predictions, Mapping) or not predictions:
        raise ValueError("choosing a sync mode needs the plan's sync_predictions (a plan made by the planner)")
    samples = {mode: float(v["samples_per_s"]) for mode, v in predictions.items()}
    if score is not None:
        samples = {mode: plan.global_batch / score(plan.with_sync(mode)) for mode in predictions}
    factor = estimate_samples_to_accuracy_factor(plan.global_batch, critical_batch) if critical_batch else 1.0
    rows = estimate_mode_table(samples, plan.sync_options, len(plan.virtual_workers), staleness_penalty,
                               target_samples, factor, score is not None)
    best = rows[0]
    chosen = predictions[best.mode]
    prediction = replace(plan.prediction, sync_s=float(chosen["sync_s"]), iteration_s=float(chosen["iteration_s"]),
                         samples_per_s=float(chosen["samples_per_s"]), time_to_accuracy_s=best.time_to_accuracy_s,
                         simulated_iteration_s=plan.global_batch / best.samples_per_s if score else None)
    options = {**plan.options, "sync_choice": {"staleness_penalty": staleness_penalty,
                                               "target_samples": target_samples,
                                               "modes": [r.to_dict() for r in rows]}}
    return replace(plan.with_sync(best.mode), prediction=prediction, options=options)


def plan_layouts(plan: Plan) -> list[list[tuple[int, int, int]]]:
    """Per VW, ``(device index, first layer, end layer)`` per stage: the closed forms' view of a plan's stages."""
    index = {d.name: d.index for d in plan.cluster.devices}
    return [[(index[s.device], s.first_layer, s.end_layer) for s in vw.stages] for vw in plan.virtual_workers]


def plan_traffic(plan: Plan) -> PipelineTraffic:
    """What ``plan``'s pipelines put on the links and when each device's last backward starts
    (``planner.sharing.estimate_pipeline_traffic``), from its stages' predicted figures: the closed forms'
    view of a plan made earlier, so that a re-prediction counts sharing as the planner did: each pipeline priced
    by its schedule's form (``partition.priced_as``)."""
    cluster, profile = plan.cluster, plan.profile
    index = {d.name: d.index for d in cluster.devices}
    parts = []
    blocking = plan.sync_options.transfers == "blocking"
    for vw in plan.virtual_workers:
        devices = tuple(cluster.devices[index[s.device]] for s in vw.stages)
        b = vw.micro_batch_size
        link_s = tuple(2 * estimate_p2p_time(b * profile.sent_bytes_per_sample(s.end_layer - 1),
                                             cluster.link(x.index, y.index))
                       for s, x, y in zip(vw.stages, devices, devices[1:], strict=False))
        stage_s = tuple(s.predicted_forward_s + s.predicted_backward_s for s in vw.stages)
        parts.append(priced_as(PartitionResult(
            devices, (*(s.first_layer for s in vw.stages), vw.stages[-1].end_layer),
            tuple(s.recompute for s in vw.stages), stage_s, tuple(s.predicted_forward_s for s in vw.stages),
            tuple(s.predicted_backward_s for s in vw.stages), link_s, sum(stage_s) + sum(link_s),
            max(stage_s + link_s), vw.micro_batches, b, True), plan.schedule, blocking))
    vw_pipeline_s = estimate_shared_pipeline_times(cluster, parts, plan.schedule, blocking)
    return estimate_pipeline_traffic(cluster, parts, vw_pipeline_s, plan.schedule, blocking)


def repredict_sync(plan: Plan, mode: str, options: SyncOptions, score: Scorer | None = None) -> Plan:
    """``plan``'s stages under sync ``mode`` with ``options``: its layout made anew and its prediction's sync,
    iteration and throughput re-estimated (closed form; and ``score``, the simulator, when given).

    This is how a plan changes mode (``hetrain plan --from PLAN --sync MODE``): the runtime never does.
    """
    layouts = plan_layouts(plan)
    index = {d.name: d.index for d in plan.cluster.devices}
    hide = {index[s.device]: s.predicted_backward_s for vw in plan.virtual_workers for s in vw.stages}
    traffic = plan_traffic(plan)
    pr = plan.prediction
    compute_s = pr.pipeline_s + pr.optimizer_s
    new = plan.with_sync(mode, options)
    # every mode's closed form, as the planner records them (docs/sync.md)
    table = estimate_sync_predictions(plan.cluster, plan.profile, layouts, options, compute_s, plan.global_batch,
                                      hide, traffic, new.segment_shards)
    prediction = replace(pr, sync_s=table[mode]["sync_s"], iteration_s=table[mode]["iteration_s"],
                         samples_per_s=table[mode]["samples_per_s"],
                         simulated_iteration_s=score(new) if score is not None else None)
    options_out = {**{k: v for k, v in plan.options.items() if k != "sync_choice"}, "sync_predictions": table}
    return replace(new, prediction=prediction, options=options_out)

"""Links the whole plan shares: what every all-reduce and every pipeline transfer puts on each node's NIC and
each intra-node link, and how long the busiest one keeps the iteration waiting.

The per-device closed forms (``planner.sync``, ``planner.partition``) charge each segment's all-reduce and each
stage boundary's transfer as if it had its links to itself. The simulator does not (simulator/links.py): every
node has one NIC out and one NIC in, each ordered pair of devices in a node one link, and a transfer or a phase
of an all-reduce holds *all* its resources for its whole duration, one holder at a time per resource, first
come first served. Hundreds of segment rings that cross one node queue on its NIC::

    segment s0 ring ─┐                          ┌─ n0 NIC out ═ network ═ n1 NIC in ─┐
    segment s1 ring ─┼─► all wait for ──────────┤                                     ├─► one at a time
    VW 2 stage 3→4  ─┘                          └─ ...                                ┘

This module counts that sharing in closed form. Resources are numbered ``out(node) = node``,
``in(node) = N + node`` (N nodes) and ``pair(a, b) = 2 N + a K + position of b in its node`` (devices
a -> b in one node, K the most devices in one node).

- All-reduces (``estimate_shared_sync_time``): each segment's all-reduce puts its phases' seconds on the
  resources the simulator's phases hold (``collective_loads``) and is released when the last of its owners
  starts its last backward. One resource serving jobs in release order finishes at
  ``max_k (release_k + sum_{j: release_j >= release_k} seconds_j)`` (the makespan of one machine with release
  dates; here in one vectorised pass over all resources). The plan's exposed sync is bounded below by the
  busiest resource's.
- Pipeline transfers (``estimate_shared_pipeline_times``): each NIC carries, per iteration, the forward and
  backward transfers of every VW whose stage boundary crosses it: ``P_r = sum m_v c_v / 2`` over those
  boundaries (``c_v``: activation + gradient seconds, half each way). A VW's micro-batches cannot pass the NIC
  faster than one every ``P_r / m_v``, so the NIC is one more stage of the pipeline formula:
  ``sum_s + wait + (m - 1) * max(max_s, max_r P_r / m)``. Alone on its links, a VW's NIC time per micro-batch
  is at most its own largest transfer, ``wait`` is 0, and the formula is the partition's own. Under 1F1B each
  transfer sits in a cycle of the steady state, and one that waits at a NIC the other VWs hold lengthens the
  period: ``max_s`` is priced again with each transfer half waiting there (``_queued_periods``).
- An exchange in the background (``estimate_exchange_stretch``): a parameter server's pushes and pulls share
  a NIC with the pipelines' transfers, half each; the pipelines priced with the transfers through it doubled,
  for the exchange's share of the wave.
- The tail (``estimate_tail``): where the all-reduces meet the pipelines. A segment's ring released while the
  last micro-batch's backward still flows takes the NICs first; the gradient queues behind it. A walk in time
  order over every VW's last backward and every all-reduce's phases books each on its resources as the
  simulator does.

docs/planner.md ("Links the whole plan shares") has the formulas and tests/test_sharing.py the hand-computed
cases.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from hetrain.cluster import Cluster
from hetrain.cost import (
    LinkKey,
    allreduce_shape,
    estimate_1f1b_period,
    estimate_allreduce,
    estimate_hierarchical_allreduce_time,
    estimate_ring_allreduce_time,
)
from hetrain.planner.partition import PartitionResult, priced_as


class SegmentJob(NamedTuple):
    """One segment's all-reduce as the shared-link estimates see it.

    Attributes:
        owners: its owners' device indices.
        num_bytes: the bytes its all-reduce moves: its gradient bytes, times ``SyncOptions.reduce_wire``.
        scale: its seconds over one all-reduce of ``num_bytes`` by ``algorithm`` (bucket by bucket, each bucket
            pays the latency terms: ``sum_b t(b) / t(num_bytes)``; 1 for one all-reduce of the whole segment).
        lead_s: seconds before the pipeline's end it may start (``estimate_shared_sync_time``).
        share: the share of the segment's own backward before its first bucket is ready (``estimate_tail``).
        place: per owner (in ``owners``' order), where the segment's layers sit in its stage's last backward: (the
            share of it before they begin theirs, their share of it); a backward runs the last layers first, so
            the segment of a stage's last layers is ready early in it. Empty: each owner's stage is the segment.
        buckets: how many buckets the plan cuts it into (``estimate_tail`` releases them over the backward).
        algorithm: the phases its all-reduce runs as (``collective_phases``): its buckets' algorithm, which
            may not be the one of a single all-reduce of ``num_bytes`` ("auto": that one).
    """

    owners: Sequence[int]
    num_bytes: float
    scale: float = 1.0
    lead_s: float = 0.0
    share: float = 0.0
    buckets: int = 1
    algorithm: str = "auto"
    place: tuple[tuple[float, float], ...] = ()


#: the most pieces ``estimate_tail`` releases one segment's all-reduce in (its buckets, grouped)
MAX_TAIL_PIECES = 32


class Load(NamedTuple):
    """Seconds ``duration_s`` that one job holds every resource in ``resources`` (resource numbers)."""

    resources: np.ndarray
    duration_s: float


def nic_out(cluster: Cluster, node: int) -> int:
    """The resource number of node ``node``'s NIC out (what every transfer leaving the node holds)."""
    return node


def nic_in(cluster: Cluster, node: int) -> int:
    """The resource number of node ``node``'s NIC in (what every transfer entering the node holds)."""
    return len(cluster.nodes) + node


def _positions(cluster: Cluster) -> tuple[np.ndarray, int]:
    """(each device's position in its node, the most devices in one node), cached on the cluster."""
    cached: tuple[np.ndarray, int] | None = cluster.__dict__.get("_node_positions")
    if cached is None:
        node = cluster.node_index
        start = {int(n): k for k, n in reversed(list(enumerate(node.tolist())))}
        pos = np.array([k - start[int(n)] for k, n in enumerate(node.tolist())], dtype=np.int64)
        cached = cluster.__dict__["_node_positions"] = (pos, int(pos.max()) + 1 if len(pos) else 1)
    return cached


def resource_count(cluster: Cluster) -> int:
    """How many resource numbers there are: 2 per node (NIC out, in), then one per device and position in its
    node (the pair links: ``2 N + a K + position(b)``, K the most devices in one node)."""
    return 2 * len(cluster.nodes) + len(cluster.devices) * _positions(cluster)[1]


def edge_resources(cluster: Cluster, a: int, b: int) -> tuple[int, ...]:
    """The resources a transfer from device index ``a`` to ``b`` holds (``simulator.links.edge_links``)."""
    na, nb = int(cluster.node_index[a]), int(cluster.node_index[b])
    if na == nb:
        pos, most = _positions(cluster)
        return (2 * len(cluster.nodes) + a * most + int(pos[b]),)
    return (nic_out(cluster, na), nic_in(cluster, nb))


def ring_resources(cluster: Cluster, order: Sequence[int]) -> np.ndarray:
    """The resources a ring over device indices ``order`` holds, each once (``simulator.links.ring_links``)."""
    if len(order) < 2:
        return np.zeros(0, dtype=np.int64)
    a = np.asarray(order, dtype=np.int64)
    b = np.roll(a, -1)
    na, nb = cluster.node_index[a], cluster.node_index[b]
    pos, most = _positions(cluster)
    n_nodes = len(cluster.nodes)
    same = na == nb
    # per hop: (the pair link, -1) inside a node, (NIC out, NIC in) across: in ring order, then each once
    hops = np.stack([np.where(same, 2 * n_nodes + a * most + pos[b], na), np.where(same, -1, n_nodes + nb)], 1)
    ids = hops.ravel()
    ids = ids[ids >= 0]
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


def _hierarchical_resources(cluster: Cluster, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the intra-node rings' links, every node's NIC out and in) of a hierarchical all-reduce over ``order``."""
    by_node: dict[int, list[int]] = {}
    for d, n in zip(order, cluster.node_index[np.asarray(order, dtype=np.int64)].tolist(), strict=True):
        by_node.setdefault(n, []).append(d)
    # each node's ring (``ring_resources`` of its members) in one pass: inside one node every hop a -> b is the
    # pair link 2 N + a K + position(b), one per member (each is the source of one hop), so none repeats
    a: list[int] = []
    b: list[int] = []
    for members in by_node.values():
        if len(members) > 1:
            a.extend(members)
            b.extend(members[1:] + members[:1])
    pos, most = _positions(cluster)
    intra = 2 * len(cluster.nodes) + np.array(a, dtype=np.int64) * most + pos[np.array(b, dtype=np.int64)]
    nics = [r for n in by_node for r in (nic_out(cluster, n), nic_in(cluster, n))]
    return intra, np.array(nics, dtype=np.int64)


def collective_phases(cluster: Cluster, owners: Sequence[int], num_bytes: float,
                      algorithm: str = "auto") -> list[Load]:
    """Each phase of one all-reduce of ``num_bytes`` among device indices ``owners``, in order: the resources it
    holds and for how long, as the simulator runs it (``simulator.links.allreduce_phases``).

    A flat ring holds all its links for the reduce-scatter, then again for the all-gather (half the
    all-reduce each); the hierarchical scheme holds the intra-node rings for ``intra``, every node's NIC for
    ``inter``, the intra-node rings again for ``intra`` (``cost.estimate_hierarchical_allreduce_time``).
    The seconds add up to ``cost.estimate_allreduce``'s.

    Example:
        >>> [(list(x.resources), x.duration_s) for x in collective_phases(c, [0, 8], 1e9)]   # doctest: +SKIP
        [([0, 3, 1, 2], 0.04), ([0, 3, 1, 2], 0.04)]   # n0 out, n1 in, n1 out, n0 in (2 nodes of 100 Gbit/s);
                                                       # each half of 2 (2 - 1) / 2 * 1 GB / 12.5 GB/s
    """
    shape = allreduce_shape(cluster, owners)
    total, chosen = estimate_allreduce(num_bytes, shape, algorithm)
    if total <= 0:
        return []
    cache: dict[tuple[tuple[int, ...], str], tuple[np.ndarray, ...]] = \
        cluster.__dict__.setdefault("_shared_resource_cache", {})
    key = (shape.order, chosen)
    if key not in cache:
        cache[key] = ((ring_resources(cluster, shape.order),) if chosen == "ring"
                      else _hierarchical_resources(cluster, shape.order))
    if chosen == "ring":
        return [Load(cache[key][0], total / 2), Load(cache[key][0], total / 2)]
    inter = estimate_ring_allreduce_time(num_bytes, shape.nodes, shape.inter_bandwidth_bytes_per_s,
                                         shape.inter_latency_s)
    intra = (estimate_hierarchical_allreduce_time(num_bytes, shape) - inter) / 2
    intra_ids, nic_ids = cache[key]
    return [x for x in (Load(intra_ids, intra), Load(nic_ids, inter), Load(intra_ids, intra))
            if x.duration_s > 0 and len(x.resources)]


def collective_loads(cluster: Cluster, owners: Sequence[int], num_bytes: float,
                     algorithm: str = "auto") -> list[Load]:
    """What one all-reduce puts on each resource over all its phases (``collective_phases``, a flat ring's two
    phases as one): on every resource an all-reduce alone holds, ``cost.estimate_allreduce``'s seconds."""
    phases = collective_phases(cluster, owners, num_bytes, algorithm)
    if len(phases) == 2 and phases[0].resources is phases[1].resources:
        return [Load(phases[0].resources, phases[0].duration_s + phases[1].duration_s)]
    if len(phases) == 3:
        return [Load(phases[0].resources, phases[0].duration_s + phases[2].duration_s), phases[1]]
    return phases


def estimate_release_makespan(resources: np.ndarray, release_s: np.ndarray, duration_s: np.ndarray) -> float:
    """When the busiest resource has served its jobs: entry k is job k's ``duration_s[k]`` on resource
    ``resources[k]``, ready from ``release_s[k]``.

    One resource serving its jobs as they become ready, never idle while one waits, ends at
    ``max_k (release_k + sum_{j: release_j >= release_k} duration_j)`` (a single machine with release dates);
    the largest over resources is returned (-inf for no jobs). One sort and one cumulative sum over all entries::

        resource 0: jobs (release 0, 2 s), (release 1, 1 s)  -> max(0 + 3, 1 + 1) = 3
    """
    if len(resources) == 0:
        return float("-inf")
    order = np.lexsort((-release_s, resources))  # by resource, latest release first
    res, rel, dur = resources[order], release_s[order], duration_s[order]
    cum = np.cumsum(dur)
    first = np.flatnonzero(np.r_[True, res[1:] != res[:-1]])  # where each resource's run of entries starts
    before = np.repeat(np.r_[0.0, cum[first[1:] - 1]], np.diff(np.r_[first, len(res)]))
    return float((rel + cum - before).max())


def estimate_shared_sync_time(cluster: Cluster, jobs: Sequence[SegmentJob],
                              traffic: PipelineTraffic | None = None) -> tuple[float, float]:
    """(seconds after the end of the pipeline until the busiest link has carried every segment's all-reduce,
    seconds the all-reduces that cut into the pipelines' transfers delay the end of the pipeline).

    ``jobs``: per segment, its owners, bytes and seconds before the pipeline's end its all-reduce may start
    (the owners' least lead; ``SegmentJob``). Each all-reduce's phases go on the links the simulator gives them
    (``collective_loads``); ``traffic``'s pipeline transfers are on the NICs too, each NIC's as one job from
    its first transfer on. The first figure is ``estimate_release_makespan`` over them all, at least 0.

    The second: the largest of ``estimate_cut_ins``'s delays, at least 0 (0 without ``traffic``).
    """
    sync_res, sync_rel, sync_dur, _ = _sync_entries(cluster, jobs)
    if not len(sync_res):
        return 0.0, 0.0
    if traffic is None or len(traffic.resources) == 0:
        return max(0.0, estimate_release_makespan(sync_res, sync_rel, sync_dur)), 0.0
    shared = estimate_release_makespan(np.concatenate([sync_res, traffic.resources]),
                                       np.concatenate([sync_rel, traffic.release_s]),
                                       np.concatenate([sync_dur, traffic.duration_s]))
    delay = max((d for d, _ in estimate_cut_ins(cluster, jobs, traffic)), default=0.0)
    return max(0.0, shared), max(0.0, delay)


def _sync_entries(cluster: Cluster, jobs: Sequence[SegmentJob]) -> tuple[np.ndarray, ...]:
    """Every all-reduce's loads as flat arrays, one entry per (job, resource): (resource, release seconds from
    the pipeline's end, seconds, the job's index in ``jobs``)."""
    res: list[np.ndarray] = []
    rel: list[np.ndarray] = []
    dur: list[np.ndarray] = []
    who: list[np.ndarray] = []
    for k, job in enumerate(jobs):
        for load in collective_loads(cluster, job.owners, job.num_bytes, job.algorithm):
            n = len(load.resources)
            res.append(load.resources)
            rel.append(np.full(n, -job.lead_s))
            dur.append(np.full(n, load.duration_s * job.scale))
            who.append(np.full(n, k, dtype=np.int64))
    if not res:
        return np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    return np.concatenate(res), np.concatenate(rel), np.concatenate(dur), np.concatenate(who)


def estimate_cut_ins(cluster: Cluster, jobs: Sequence[SegmentJob],
                     traffic: PipelineTraffic) -> list[tuple[float, np.ndarray]]:
    """Per NIC that carries pipeline transfers: (seconds the all-reduces that cut in between its transfers
    delay the end of the pipeline, the indices in ``jobs`` of those all-reduces).

    The simulator's links serve in order of request, so an all-reduce released while a NIC still carries
    transfers goes between them, and the pipeline ends that much later. A NIC whose first transfer can start
    at ``head``, which carries ``P`` seconds of transfers and ``S`` of all-reduces released before the
    pipeline's last transfer through it, and after whose last transfer the pipeline still runs ``drain``
    seconds, ends the pipeline no sooner than ``head + P + S + drain``; the delay is that less the pipeline's
    closed form. The all-reduces that cut in are served before that last transfer: they are over when the
    delayed pipeline ends (``planner.sync.estimate_sync_time`` does not charge them again after it).
    """
    sync_res, sync_rel, sync_dur, sync_job = _sync_entries(cluster, jobs)
    n_nics = 2 * len(cluster.nodes)
    last_transfer = np.full(n_nics, -np.inf)
    # an all-reduce requested with or after the last transfer goes behind it (the links serve in order of request)
    last_transfer[traffic.resources] = -(traffic.request_s if len(traffic.request_s) else traffic.drain_s)
    on_nic = sync_res < n_nics
    nic, when, secs, job = sync_res[on_nic], sync_rel[on_nic], sync_dur[on_nic], sync_job[on_nic]
    early = when < last_transfer[nic] - 1e-9  # a tie (the same backward ends both) is not a cut-in
    cut_in = np.bincount(nic[early], weights=secs[early], minlength=n_nics)[traffic.resources]
    delays = traffic.release_s + traffic.duration_s + cut_in + traffic.drain_s
    return [(float(d), np.unique(job[early & (nic == r)])) for d, r in zip(delays, traffic.resources, strict=True)]


class Wave(NamedTuple):
    """The last micro-batch's backward through one VW: its devices by stage, each stage's backward seconds,
    each boundary's gradient transfer seconds (between stage j and j + 1), and when the last stage starts it."""

    devices: tuple[int, ...]
    backward_s: tuple[float, ...]
    gradient_s: tuple[float, ...]
    start_s: float


class PipelineTraffic(NamedTuple):
    """What the pipelines of a plan leave for its all-reduces, seen from the end of the pipeline (time 0).

    Attributes:
        lead_s: per device index, seconds before the end its last backward starts (``estimate_sync_leads``).
        resources / release_s / duration_s: per NIC the plan's transfers cross, its whole iteration's
            transfer seconds ``P_r`` as one job, ready from its first transfer (negative: before the end).
        drain_s: per NIC, how long the pipeline runs on after its last transfer through it: the lead of the
            stage before the boundary, whose backward follows the last gradient through it.
        waves: per VW, its last micro-batch's backward (``estimate_tail``), from its lead at the last stage.
        request_s: per NIC, seconds before the end its last transfer is requested: ``drain_s`` and that
            gradient's own seconds (empty: ``drain_s``).
        parts, schedule, blocking: the VWs' partitions and how their pipelines are priced
            (``partition.priced_as``), for a re-pricing with slower links (``estimate_exchange_stretch``).
        pipeline_s: the slowest VW's pipeline seconds, as given (``estimate_shared_pipeline_times``).
    """

    lead_s: dict[int, float]
    resources: np.ndarray
    release_s: np.ndarray
    duration_s: np.ndarray
    drain_s: np.ndarray
    waves: tuple[Wave, ...] = ()
    request_s: np.ndarray = np.zeros(0)
    parts: tuple[PartitionResult, ...] = ()
    schedule: str = "1f1b"
    blocking: bool = False
    pipeline_s: float = 0.0


class _Crossings(NamedTuple):
    """Every stage boundary of every VW that crosses nodes, four entries each (forward: the sender's NIC out
    and the receiver's NIC in; backward: the receiver's NIC out and the sender's NIC in), as flat arrays."""

    vw: np.ndarray  # the VW of each entry
    nic: np.ndarray  # its resource number
    load_s: np.ndarray  # the VW's seconds on it per iteration: m c / 2
    head_s: np.ndarray  # the first micro-batch's forward up to the boundary
    drain_s: np.ndarray  # the lead of the device before the boundary (inf without leads)
    gradient_s: np.ndarray  # the boundary's gradient seconds: c / 2
    boundary: np.ndarray  # the stage boundary's number in its VW (k: between stage k and k + 1)


def _crossings(cluster: Cluster, parts: Sequence[PartitionResult],
               lead_s: dict[int, float] | None = None) -> _Crossings:
    """The ``_Crossings`` of ``parts``: one pass over the boundaries in Python, the rest in numpy."""
    node = cluster.node_index
    vw: list[int] = []
    a: list[int] = []
    b: list[int] = []
    load: list[float] = []
    head: list[float] = []
    drain: list[float] = []
    grad: list[float] = []
    boundary: list[int] = []
    for v, r in enumerate(parts):
        reach = 0.0
        for k in range(len(r.devices) - 1):
            reach += r.forward_s[k] + (r.link_s[k - 1] / 2 if k > 0 else 0.0)
            x, y = r.devices[k].index, r.devices[k + 1].index
            if node[x] == node[y]:
                continue
            vw.append(v)
            a.append(x)
            b.append(y)
            load.append(r.link_s[k] / 2 * r.m)
            head.append(reach)
            drain.append(lead_s[x] if lead_s else np.inf)
            grad.append(r.link_s[k] / 2)
            boundary.append(k)
    na, nb, n_nodes = node[np.array(a, dtype=np.int64)], node[np.array(b, dtype=np.int64)], len(cluster.nodes)
    return _Crossings(np.tile(np.array(vw, dtype=np.int64), 4), np.concatenate([na, n_nodes + nb, nb, n_nodes + na]),
                      np.tile(np.array(load), 4), np.tile(np.array(head), 4), np.tile(np.array(drain), 4),
                      np.tile(np.array(grad), 4), np.tile(np.array(boundary, dtype=np.int64), 4))


def estimate_shared_pipeline_times(cluster: Cluster, parts: Sequence[PartitionResult], schedule: str = "gpipe",
                                   blocking: bool = False) -> list[float]:
    """Each VW's pipeline seconds with every NIC shared by the transfers of all VWs that cross it.

    ``P_r = sum m_v c_v / 2`` per NIC direction over every stage boundary through it (forward on the
    sender's NIC out and the receiver's NIC in, backward the other way); VW v's pipeline is
    ``sum_s + wait + (m - 1) * max(period, max_r P_r / m)`` over the NICs its boundaries hold. ``wait``
    is what its first micro-batch queues behind the other VWs' on the NIC where they put the most, half
    their traffic of one micro-batch there (the other half goes the other way): ``max_r (P_r - P_r,v) / 2m``.
    ``period`` is the partition's ``max_s``; under 1F1B and 1F1B-eager (``schedule``, transfers that do not
    block), where each transfer sits in a cycle of the steady state, it is priced again with each transfer
    half queueing at its NICs (``_queued_periods``). Transfers inside a node hold a link of their own device
    pair, which no other VW uses: they are the partition's ``c_j``. A VW alone on its NICs gets the
    partition's own ``sum_s + (m - 1) * max_s``.

    Two VWs a:0 -> b:0 -> a:2 and a:1 -> b:1 -> a:3, stages of 0.3 s, transfers of 0.5 s each way, m = 4:
    every NIC direction carries 4 transfers per micro-batch, 2 s; ``2.9 + 0.5 + 3 * 2 = 9.4`` s for each
    (GPipe's replay: 9.4 s), against ``2.9 + 3 * 1 = 5.9`` alone (tests/test_sharing.py).
    """
    x = _crossings(cluster, parts)
    if not len(x.vw):
        return [r.pipeline_s for r in parts]
    n_nics = 2 * len(cluster.nodes)
    per_nic = np.bincount(x.nic, weights=x.load_s, minlength=n_nics)
    busiest = np.zeros(len(parts))
    np.maximum.at(busiest, x.vw, per_nic[x.nic])
    pairs, where = np.unique(x.vw * n_nics + x.nic, return_inverse=True)  # (VW, NIC) pairs
    own = np.bincount(where, weights=x.load_s)
    others = np.zeros(len(parts))
    np.maximum.at(others, pairs // n_nics, per_nic[pairs % n_nics] - own)
    m = np.array([r.m for r in parts], dtype=float)
    period = np.array([r.max_s for r in parts])
    if schedule in ("1f1b", "1f1b-eager") and not blocking:
        period = _queued_periods(parts, x, (per_nic[x.nic] - own[where]) / m[x.vw], busiest / m, schedule)
    bottleneck = np.maximum(period, busiest / m)
    out = np.array([r.sum_s for r in parts]) + others / (2 * m) + (m - 1) * bottleneck
    return [float(t) for t in out]


def _queued_periods(parts: Sequence[PartitionResult], x: _Crossings, others_s: np.ndarray, floor_s: np.ndarray,
                    schedule: str) -> np.ndarray:
    """Per VW, its 1F1B (or 1F1B-eager) period with each transfer half queueing at the NICs it crosses.

    ``others_s``: per entry of ``x``, the other VWs' transfer seconds per micro-batch on that entry's NIC. A
    half through a NIC the others hold ``rho = others_s / T`` of a period ``T`` finds it busy that share of
    the time, if the VWs' phases are independent, and then waits what is left of a transfer like its own, half
    of one on average: ``c/2 (1 + rho / 2)``, with ``rho`` the larger of its two NICs'. Only this first term of
    the FIFO queue's delay: the VWs' transfers of one boundary are alike, and VWs that meet fall out of step
    after (two VWs on one NIC at a third of a period: the replay waits nothing, the form is 4% above it), so
    the queue of random arrivals, ``c/2 / (1 - rho)``, does not build up (nvlink-nodes, 8 VWs at 83%: that
    form 6% above the replay, this one 6% below it). The period depends on ``T`` and ``T`` is the period: the
    fixed point, by bisection between the shared bottleneck (``floor_s``, no longer) and the period priced there.
    """
    n = len(x.vw) // 4
    fwd = np.maximum(others_s[:n], others_s[n:2 * n])  # sender's NIC out, receiver's NIC in
    bwd = np.maximum(others_s[2 * n:3 * n], others_s[3 * n:])  # the gradient: the other two
    period = np.array([r.max_s for r in parts])
    queues: dict[int, list[tuple[int, float, float]]] = {}
    for e in np.flatnonzero((fwd > 0) | (bwd > 0)).tolist():
        queues.setdefault(int(x.vw[e]), []).append((int(x.boundary[e]), float(fwd[e]), float(bwd[e])))
    done: dict[tuple[object, ...], float] = {}  # VWs of one partition and alike queues: one fixed point
    for v, queue in queues.items():
        r = parts[v]
        key = (id(r), tuple(queue))
        if key not in done:
            done[key] = _fixed_period(r, queue, max(r.max_s, float(floor_s[v])), schedule)
        period[v] = max(period[v], done[key])
    return period


def _fixed_period(r: PartitionResult, queue: Sequence[tuple[int, float, float]], low_s: float,
                  schedule: str) -> float:
    """``_queued_periods``' fixed point for one partition: boundary k's halves waiting ``rho_f`` and ``rho_b``
    (forward, backward; ``queue`` holds (k, forward others, backward others) per boundary that shares)."""
    def priced(period_s: float) -> float:
        links = list(r.link_s)
        for k, f, b in queue:
            links[k] = r.link_s[k] / 2 * (2.0 + (min(1.0, f / period_s) + min(1.0, b / period_s)) / 2)
        return estimate_1f1b_period(r.stage_s, links, r.m, schedule)

    if low_s <= 0:  # stages and transfers of no time: nothing to wait behind
        return low_s
    high = priced(low_s)
    if high <= low_s:
        return low_s
    for _ in range(40):  # priced() falls as the period grows: one crossing
        mid = (low_s + high) / 2
        if priced(mid) > mid:
            low_s = mid
        else:
            high = mid
        if high - low_s <= 1e-6 * high:
            break
    return high


def _stagger(x: _Crossings, m: np.ndarray, num_vws: int) -> np.ndarray:
    """Per VW, how late its last micro-batch passes the NICs it shares with other VWs: a NIC serves one
    micro-batch of each VW in turn, so VW v's comes after the earlier VWs' of that micro-batch there
    (``load / m`` each); the largest over its NICs."""
    out = np.zeros(num_vws)
    per_mb = x.load_s / m[x.vw] if len(x.vw) else x.load_s
    done: dict[int, float] = {}
    seen: set[tuple[int, int]] = set()
    for e in np.lexsort((x.vw, x.nic)).tolist():  # by NIC, then VW
        nic, v = int(x.nic[e]), int(x.vw[e])
        if (nic, v) not in seen:
            seen.add((nic, v))
            out[v] = max(out[v], done.get(nic, 0.0))
        done[nic] = done.get(nic, 0.0) + float(per_mb[e])
    return out


def estimate_pipeline_traffic(cluster: Cluster, parts: Sequence[PartitionResult],
                              vw_pipeline_s: Sequence[float], schedule: str = "1f1b",
                              blocking: bool = False) -> PipelineTraffic:
    """The plan's ``PipelineTraffic``: its devices' leads and its NICs' transfer seconds, from the VWs'
    partitions and their (shared) pipeline seconds ``vw_pipeline_s`` (``estimate_shared_pipeline_times``), each
    priced by ``schedule``'s form (``blocking``: transfers that hold both ends)."""
    pipeline_s = max(vw_pipeline_s)
    lead = estimate_sync_leads([([d.index for d in r.devices], r.backward_s, r.link_s, t)
                                for r, t in zip(parts, vw_pipeline_s, strict=True)], pipeline_s)
    x = _crossings(cluster, parts, lead)
    n_nics = 2 * len(cluster.nodes)
    per_nic = np.bincount(x.nic, weights=x.load_s, minlength=n_nics)
    first, drain = np.full(n_nics, np.inf), np.full(n_nics, np.inf)
    np.minimum.at(first, x.nic, x.head_s)
    np.minimum.at(drain, x.nic, x.drain_s)
    request = np.full(n_nics, np.inf)
    np.minimum.at(request, x.nic, x.drain_s + x.gradient_s)
    used = np.flatnonzero(per_nic > 0)
    stagger = _stagger(x, np.array([r.m for r in parts], dtype=float), len(parts))
    waves = tuple(Wave(tuple(d.index for d in r.devices), r.backward_s, tuple(c / 2 for c in r.link_s),
                       -lead[r.devices[-1].index] + float(stagger[v])) for v, r in enumerate(parts))
    return PipelineTraffic(lead, used, first[used] - pipeline_s, per_nic[used], drain[used], waves, request[used],
                           tuple(parts), schedule, blocking, pipeline_s)


def estimate_exchange_stretch(cluster: Cluster, traffic: PipelineTraffic, exchange_s: Mapping[LinkKey, float],
                              wave_s: float) -> float:
    """Seconds per iteration the pipelines lose to an exchange in the background (a parameter server's pushes
    and pulls) on the NICs their transfers cross.

    A transfer that meets such an exchange on its NIC shares it, half each (``simulator.links.share``), so
    while the exchange holds NIC r, ``exchange_s[r]`` seconds a wave of ``wave_s``, every pipeline transfer
    through r takes twice as long. The pipelines are priced again with every boundary half (forward: the
    sender's NIC out and the receiver's NIC in; backward: the other two) through such a NIC doubled
    (``estimate_shared_pipeline_times``, each pipeline by its schedule's form), and they run so for the
    exchange's share of the wave, its longest hold of a NIC they cross::

        stretch = min(1, max_r exchange_s[r] / wave_s) * (pipeline with those halves doubled - pipeline)

    On cloud-mixed, gpt2-medium under wsp (4x2 + 4x3 VWs, each T4 node's NIC held 0.29 s a wave of 0.97 s, the
    pipelines doubled 1.39 s against 0.96 s): 0.13 s, 1.096 s in all against the simulator's 1.094 s
    (benchmarks/closed_form_modes.py). 0 where no pipeline crosses a NIC the exchange holds."""
    return exchange_stretch(exchange_slowdown(cluster, traffic, exchange_s), wave_s)


def exchange_stretch(slowdown: tuple[float, float], wave_s: float) -> float:
    """``estimate_exchange_stretch`` of its two terms (``exchange_slowdown``) and a wave of ``wave_s``."""
    longest, gained = slowdown
    return min(1.0, longest / wave_s) * gained if wave_s > 0 else 0.0


def exchange_slowdown(cluster: Cluster, traffic: PipelineTraffic,
                      exchange_s: Mapping[LinkKey, float]) -> tuple[float, float]:
    """``estimate_exchange_stretch``'s two terms, whatever the wave: the exchange's longest hold of a NIC the
    pipelines cross, and the pipelines' seconds with every transfer half through a held NIC doubled, less
    theirs (wsp and hybrid-ps differ only in the wave: ``planner.sync.SyncTerms`` works these out once)."""
    parts = traffic.parts
    if not any(len(r.devices) > 1 for r in parts):
        return 0.0, 0.0
    node, names = cluster.node_index, [n.name for n in cluster.nodes]

    def held(kind: str, n: int) -> float:
        return exchange_s.get((kind, names[n]), 0.0)

    longest = 0.0
    slowed: list[PartitionResult] = []
    for r in parts:
        links = list(r.link_s)
        for k in range(len(r.devices) - 1):
            a, b = int(node[r.devices[k].index]), int(node[r.devices[k + 1].index])
            if a == b:
                continue
            forward, backward = max(held("out", a), held("in", b)), max(held("out", b), held("in", a))
            longest = max(longest, forward, backward)
            links[k] = r.link_s[k] / 2 * ((2 if forward > 0 else 1) + (2 if backward > 0 else 1))
        slowed.append(r if links == list(r.link_s) else priced_as(
            replace(r, link_s=tuple(links), sum_s=float(sum(r.stage_s) + sum(links))), traffic.schedule,
            traffic.blocking))
    if longest <= 0:
        return 0.0, 0.0
    slowed_s = max(estimate_shared_pipeline_times(cluster, slowed, traffic.schedule, traffic.blocking))
    return longest, max(0.0, slowed_s - traffic.pipeline_s)


def estimate_sync_leads(vws: Sequence[tuple[Sequence[int], Sequence[float], Sequence[float], float]],
                        pipeline_s: float) -> dict[int, float]:
    """Per device index, seconds before the end of the pipeline (``pipeline_s``, the slowest VW's) its last
    backward starts: when its gradient buckets begin to be ready for the all-reduce.

    ``vws``: per VW, (device indices by stage, backward seconds per micro-batch by stage, transfer seconds
    per boundary (activation + gradient, half of it the gradient), the VW's pipeline seconds). The last
    micro-batch's backward runs from the last stage to the first, so stage j's ends
    ``sum_{k<j} (B_k + c_k / 2)`` before stage 0's, which ends with its VW's pipeline::

        lead_j = B_j + sum_{k<j} (B_k + c_k / 2) + (pipeline_s - pipeline_v)
    """
    lead: dict[int, float] = {}
    for devices, backward_s, link_s, vw_pipeline_s in vws:
        before = pipeline_s - vw_pipeline_s
        for j, d in enumerate(devices):
            lead[d] = before + backward_s[j]
            before += backward_s[j] + (link_s[j] / 2 if j < len(link_s) else 0.0)
    return lead


class _Kind(IntEnum):
    STAGE = 0  # a stage starts the last backward: its segments' owners arrive
    CROSS = 1  # the gradient leaves a stage for the one before it
    PHASE = 2  # an all-reduce's phase is due (or the all-reduce ends)


def _piece_phases(cluster: Cluster, job: SegmentJob, pieces: int) -> list[Load]:
    """The phases of one of a segment's ``pieces`` pieces: buckets / pieces buckets of the mean size, split
    into phases as one such bucket is (each bucket's latency terms in the phase that pays them), scaled so
    that the pieces add up to the job's seconds."""
    whole = collective_phases(cluster, job.owners, job.num_bytes, job.algorithm)
    one = whole if job.buckets <= 1 else \
        collective_phases(cluster, job.owners, job.num_bytes / job.buckets, job.algorithm)
    f = job.scale * sum(x.duration_s for x in whole) / (pieces * sum(x.duration_s for x in one)) if one else 0.0
    return [x._replace(duration_s=x.duration_s * f) for x in one]


def _pieces_ready_s(backwards: Sequence[tuple[float, float]], n: int, share: float) -> list[float]:
    """When each of a segment's ``n`` pieces is ready, its owners' backwards of its layers given as (start, seconds):
    piece i once every owner is ``share + (1 - share) i / (n - 1)`` into it."""
    fractions = [share + (1 - share) * i / (n - 1) if n > 1 else share for i in range(n)]
    if len(backwards) < 16:
        return [max(t0 + f * b for t0, b in backwards) for f in fractions]
    start, seconds = np.array(backwards).T  # thousands of owners: the same sums and products, in numpy
    out: list[float] = (start + np.outer(fractions, seconds)).max(axis=1).tolist()
    return out


def _edge(cluster: Cluster, edges: dict[tuple[int, int], np.ndarray], key: tuple[int, int]) -> np.ndarray:
    """The resources of the transfer from device ``key[0]`` to ``key[1]``, looked up once into ``edges``."""
    links = edges.get(key)
    if links is None:
        links = edges[key] = np.array(edge_resources(cluster, *key))
    return links


def estimate_tail(cluster: Cluster, jobs: Sequence[SegmentJob],
                  waves: Sequence[Wave]) -> tuple[float, float]:
    """(when the last VW's pipeline ends, when the last all-reduce ends): the last micro-batch's backward in
    every VW and every segment's all-reduce, on links served first come first served.

    The tail of an iteration is where the all-reduces meet the pipelines: stage j's segments are released as
    its last backward starts, their rings take the NICs, and the gradient of that micro-batch, sent next,
    queues behind them on its way to stage j - 1, whose segments are then released later. The recurrence
    below walks every VW's last backward wave (``Wave``) and every all-reduce's phases (``collective_phases``)
    in time order, booking each on its resources as the simulator does (a phase starts when all its
    resources are free and holds them all): O(stages + the resources of every phase) per plan. ``jobs``:
    per segment, its owners, bytes, buckets, the share of its layers' backward before its first bucket is ready,
    and where those layers sit in each owner's stage (``SegmentJob``). Transfers of earlier micro-batches are left
    out (the pipeline's closed form and ``estimate_shared_pipeline_times`` count them).

    A segment's buckets become ready one after another through its owners' last backward, each one an
    all-reduce of its own that the links serve in order of request; a gradient sent during that backward
    goes after the buckets requested before it. The walk releases each segment in ``buckets`` pieces (at
    most ``MAX_TAIL_PIECES``), piece i once every owner is ``share + (1 - share) i / (n - 1)`` into its backward
    of the segment's layers, which begins ``place``'s share into its stage's last backward: a stage of layers 3-26
    runs the backward of 24-26 first, so that segment is ready early in it, not at its end (on a 64-device plan
    the replay all-reduced segment 24-26 before the 21 buckets of segment 3-24, which then held back segment 0-3;
    the walk, with 24-26 ready at the stage's end, put it after most of them: 279 ms against 428 ms, tests/
    test_sharing.py); each piece holds its resources phase by phase as one bucket of the segment's mean size does, by
    the buckets' algorithm (``SegmentJob.algorithm``), a hierarchical bucket paying its NIC latency steps
    in its NIC phase, and the pieces add up to the segment's bucket-by-bucket seconds. The VWs that share a
    NIC pass it one after another (``Wave.start_s`` has that stagger), so the
    later ones' last gradients queue behind more pieces: on a 1024-device plan (8 VWs per node, a segment of
    134 buckets, 540 ms on every NIC of its ring) the replay's last gradients waited 0, 39, 82, ... 517 ms,
    where one piece per segment let the walk charge them at most half of it.
    """
    free = np.full(resource_count(cluster), -np.inf)
    edges: dict[tuple[int, int], np.ndarray] = cluster.__dict__.setdefault("_edge_resource_cache", {})
    pieces = [max(1, min(job.buckets, MAX_TAIL_PIECES)) for job in jobs]
    phases = [_piece_phases(cluster, job, n) for job, n in zip(jobs, pieces, strict=True)]
    segments_of: dict[int, list[int]] = {}
    for s, job in enumerate(jobs):
        for d in job.owners:
            segments_of.setdefault(d, []).append(s)
    arrived = [0] * len(jobs)
    backwards: list[list[tuple[float, float]]] = [[] for _ in jobs]  # per segment, its owners' (start, seconds)
    place = [dict(zip(job.owners, job.place, strict=bool(job.place))) for job in jobs]  # owner -> SegmentJob.place
    queue: list[tuple[float, int, _Kind, int, int, int]] = []
    seq = itertools.count()
    for v, w in enumerate(waves):
        heapq.heappush(queue, (w.start_s, next(seq), _Kind.STAGE, v, len(w.devices) - 1, 0))
    pipeline_end = sync_end = float("-inf")

    def book(resources: np.ndarray, t: float, duration_s: float) -> float:
        end = max(t, float(free[resources].max())) + duration_s
        free[resources] = end
        return end

    while queue:
        t, _, kind, a, j, c = heapq.heappop(queue)
        if kind is _Kind.STAGE:
            w = waves[a]
            for s in segments_of.get(w.devices[j], ()):
                arrived[s] += 1
                before, share = place[s].get(w.devices[j], (0.0, 1.0))  # its layers within the stage's backward
                backwards[s].append((t + before * w.backward_s[j], share * w.backward_s[j]))
                if arrived[s] == len(jobs[s].owners):
                    for i, ready in enumerate(_pieces_ready_s(backwards[s], pieces[s], jobs[s].share)):
                        heapq.heappush(queue, (ready, next(seq), _Kind.PHASE, s, 0, i))
            end = t + w.backward_s[j]
            if j == 0:
                pipeline_end = max(pipeline_end, end)
            else:
                heapq.heappush(queue, (end, next(seq), _Kind.CROSS, a, j, 0))
        elif kind is _Kind.CROSS:
            w = waves[a]
            links = _edge(cluster, edges, (w.devices[j], w.devices[j - 1]))
            heapq.heappush(queue, (book(links, t, w.gradient_s[j - 1]), next(seq), _Kind.STAGE, a, j - 1, 0))
        elif j == len(phases[a]):
            sync_end = max(sync_end, t)
        else:
            phase = phases[a][j]
            heapq.heappush(queue, (book(phase.resources, t, phase.duration_s), next(seq), _Kind.PHASE,
                                   a, j + 1, c))
    return pipeline_end, sync_end

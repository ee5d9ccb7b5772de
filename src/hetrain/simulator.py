"""Discrete-event replay of a schedule, with durations from cost.py and link contention.

The simulator runs every device's Actions (``hetrain.schedule``) in global time
order. Durations come from the one cost model (DESIGN.md decision 4); what the
closed forms cannot see comes from the replay: the exact action order, transfers
queueing on shared links, all-reduces of different segments contending for NICs,
and sync of one segment overlapping the backward passes still running elsewhere.

What each action costs:

- ``jFi`` / ``jBi``: the stage's layer times at micro-batch i's size
  (``estimate_layer_times``) plus the device's overhead per action
  (``estimate_action_overhead``); a backward also re-runs the forward of the
  recompute set.
- ``SEND_F`` / ``SEND_B``: ``estimate_p2p_time`` of ``b_i x`` the output bytes per
  sample of the layer before the stage boundary (activation forward, its gradient
  of the same size backward). The sender does not wait (the runtime posts an
  ``isend``); the transfer starts when its link resources are free and the
  receiver's ``RECV`` holds it until the data has arrived.
- ``ALLREDUCE segN``: when every owner of the segment has reached it,
  ``estimate_allreduce`` of the segment's gradient bytes, run as phases over the
  link resources it crosses: a flat ring as reduce-scatter then all-gather over
  its ring's links; the hierarchical scheme as intra-node reduce-scatter,
  inter-node all-reduce over the NICs, intra-node all-gather.
- ``ALLREDUCE_START segN bucketK`` (after a backward): the same, for the bucket's
  gradient bytes, started once every owner's backward has computed the bucket's
  gradients: on each owner, at the backward's start plus the backward time of the
  stage's layers from its last down to the bucket's first (with the recomputed
  forwards among them). The device does not wait: its backward goes on while the
  bucket's phases occupy the links. ``ALLREDUCE_WAIT segN bucketK`` holds the
  device until that all-reduce has ended; the time held counts as sync.
- ``STEP``: ``estimate_optimizer_time`` of the stage's parameters.

Link resources and contention::

    same node:    n0:0 ──(resource "n0:0->n0:1")──► n0:1        one per ordered pair
    across nodes: a:0 ──► ("a NIC out") ═══ network ═══ ("b NIC in") ──► b:1

A resource carries one transfer at a time, in the order transfers ask for it
(FIFO; each transfer gets the link's full bandwidth). We chose this over fair
bandwidth sharing because (1) it is what the runtime does: NCCL and Gloo run
the operations of one communicator in issue order, and a NIC's queue pairs
drain largely in order; (2) for the equal-sized, in-order messages of a
pipeline it finishes the last message at the same time as sharing would and
the first ones earlier, which is when their receivers need them; (3) a
transfer's end is known when it starts, so one event per transfer suffices,
where sharing would re-time every active transfer at each start and end. All
transfers leaving one node share its NIC out, all entering it share its NIC in
(full duplex).

Memory: weights, gradients and optimizer state from t = 0; a micro-batch's kept
activations are added when its forward ends and freed when its backward ends;
the largest recomputed layer's activations reappear during each backward, and
the optimizer step's transient lasts for the step. Figures come from
``estimate_stage_memory``, so the simulated peak equals the closed form with
``in_flight`` for the schedule.

Example:
    >>> result = simulate(load_plan("plan.json"))        # doctest: +SKIP
    >>> print(result.summary())                          # doctest: +SKIP
"""

from __future__ import annotations

import gc
import heapq
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hetrain.cluster import Cluster
from hetrain.cost import (
    allreduce_shape,
    estimate_action_overhead,
    estimate_allreduce,
    estimate_hierarchical_allreduce_time,
    estimate_layer_times,
    estimate_optimizer_step_memory,
    estimate_optimizer_time,
    estimate_p2p_time,
    estimate_ring_allreduce_time,
    estimate_stage_memory,
)
from hetrain.plan import DeviceMemory, Plan, PlanError, Prediction, load_plan
from hetrain.schedule import (
    COLLECTIVE_KINDS,
    ActionKind,
    Schedule,
    ScheduleError,
    advance_sync_state,
    build_schedule,
    initial_sync_state,
    validate,
)
from hetrain.timeline import Event, Timeline
from hetrain.units import format_bytes, format_time


@dataclass(frozen=True)
class DeviceStats:
    """What one device did during the simulated iteration.

    ``busy_s`` is compute (forward, backward, optimizer step), ``sync_s`` time in
    all-reduces, ``bubble_s`` the rest of the iteration: waiting for data, for
    the other owners of a segment, or for the slowest device to finish.
    """

    device: str
    vw: int
    stage: int
    iteration_s: float
    busy_s: float
    sync_s: float
    bubble_s: float
    peak_memory_bytes: float
    capacity_bytes: float
    max_in_flight: int

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def sync_fraction(self) -> float:
        return self.sync_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.iteration_s if self.iteration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "vw": self.vw, "stage": self.stage,
            "busy_fraction": self.busy_fraction, "sync_fraction": self.sync_fraction,
            "bubble_fraction": self.bubble_fraction, "busy_s": self.busy_s, "sync_s": self.sync_s,
            "bubble_s": self.bubble_s, "peak_memory_bytes": self.peak_memory_bytes,
            "capacity_bytes": self.capacity_bytes, "max_in_flight": self.max_in_flight,
        }


@dataclass(frozen=True)
class SimResult:
    """The simulated iteration.

    Attributes:
        timeline: events per device and per link, memory per device over time.
        iteration_s: from start to the last device's end (its optimizer step).
        pipeline_s: from start to the end of the last backward on any device.
        samples_per_s: global batch / iteration_s.
        devices: per device: busy, sync and bubble time, peak memory, activations in flight.
        closed_form_iteration_s: the plan's own prediction (``Plan.prediction.iteration_s``).
    """

    timeline: Timeline
    iteration_s: float
    pipeline_s: float
    samples_per_s: float
    devices: Mapping[str, DeviceStats]
    closed_form_iteration_s: float = 0.0

    def memory_curve(self, device: str) -> list[tuple[float, float]]:
        """``[(time_s, bytes), ...]`` of ``device``: a step function over the iteration."""
        return self.timeline.memory[device]

    def to_dict(self) -> dict[str, Any]:
        """Metrics as JSON (the timeline is written separately, it can be large)."""
        return {
            "iteration_s": self.iteration_s,
            "pipeline_s": self.pipeline_s,
            "samples_per_s": self.samples_per_s,
            "closed_form_iteration_s": self.closed_form_iteration_s,
            "devices": [s.to_dict() for s in self.devices.values()],
        }

    def summary(self, max_rows: int = 64) -> str:
        """Iteration time, throughput, and a per-device table."""
        cf = (f"; closed form {format_time(self.closed_form_iteration_s)}"
              if self.closed_form_iteration_s > 0 else "")
        lines = [
            f"simulated iteration {format_time(self.iteration_s)} (pipeline {format_time(self.pipeline_s)}), "
            f"{self.samples_per_s:.1f} samples/s{cf}",
            f"  {'device':<14} {'VW':>4} {'stage':>5} {'busy':>6} {'sync':>6} {'bubble':>6} "
            f"{'peak memory':>11} / {'capacity':<9} {'in flight':>9}",
        ]
        for s in list(self.devices.values())[:max_rows]:
            over = "  OVER" if s.peak_memory_bytes > s.capacity_bytes else ""
            lines.append(
                f"  {s.device:<14} {s.vw:>4} {s.stage:>5} {100 * s.busy_fraction:>5.1f}% "
                f"{100 * s.sync_fraction:>5.1f}% {100 * s.bubble_fraction:>5.1f}% "
                f"{format_bytes(s.peak_memory_bytes):>11} / {format_bytes(s.capacity_bytes):<9} "
                f"{s.max_in_flight:>9}{over}"
            )
        if len(self.devices) > max_rows:
            lines.append(f"  ... {len(self.devices) - max_rows} more devices (--json lists all)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# link resources
# ---------------------------------------------------------------------------


class _Resources:
    """Named link resources, each free from ``free_at[r]``; FIFO in the order of requests."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.free_at: list[float] = []
        self.events: list[list[Event]] = []

    def id(self, name: str) -> int:
        r = self.ids.get(name)
        if r is None:
            r = self.ids[name] = len(self.names)
            self.names.append(name)
            self.free_at.append(0.0)
            self.events.append([])
        return r


def _edge(cluster: Cluster, a: int, b: int, res: _Resources) -> tuple[int, ...]:
    """The resources a transfer from device index ``a`` to ``b`` occupies."""
    da, db = cluster.devices[a], cluster.devices[b]
    if da.node == db.node:
        return (res.id(f"{da.name}->{db.name}"),)
    return (res.id(f"{da.node} NIC out"), res.id(f"{db.node} NIC in"))


def _ring_edges(cluster: Cluster, order: Sequence[int], res: _Resources) -> tuple[int, ...]:
    if len(order) < 2:
        return ()
    ids = [r for k in range(len(order)) for r in _edge(cluster, order[k], order[(k + 1) % len(order)], res)]
    return tuple(dict.fromkeys(ids))


def _allreduce_phases(cluster: Cluster, owners: Sequence[int], num_bytes: float,
                      res: _Resources, algorithm: str) -> list[tuple[float, tuple[int, ...], str]]:
    """(seconds, resources, name) of each phase of one all-reduce by ``algorithm`` (the plan's ``"ring"`` or
    ``"hierarchical"``); the seconds add up to ``estimate_allreduce``'s."""
    shape = allreduce_shape(cluster, owners)
    total, algorithm = estimate_allreduce(num_bytes, shape, algorithm)
    if total <= 0:
        return []
    if algorithm == "ring":
        ring = _ring_edges(cluster, shape.order, res)
        return [(total / 2, ring, "reduce-scatter"), (total / 2, ring, "all-gather")]
    # hierarchical: 2 * intra + inter (estimate_hierarchical_allreduce_time)
    inter = estimate_ring_allreduce_time(num_bytes, shape.nodes, shape.inter_bandwidth_bytes_per_s,
                                         shape.inter_latency_s)
    intra = (estimate_hierarchical_allreduce_time(num_bytes, shape) - inter) / 2
    by_node: dict[str, list[int]] = {}
    for d in shape.order:
        by_node.setdefault(cluster.devices[d].node, []).append(d)
    intra_ids = tuple(r for members in by_node.values() for r in _ring_edges(cluster, members, res))
    nic_ids = tuple(r for node in by_node for r in (res.id(f"{node} NIC out"), res.id(f"{node} NIC in")))
    return [(intra, intra_ids, "intra-node reduce-scatter"), (inter, nic_ids, "inter-node all-reduce"),
            (intra, intra_ids, "intra-node all-gather")]


# ---------------------------------------------------------------------------
# the replay
# ---------------------------------------------------------------------------

def _occupy(free_at: list[float], rids: Sequence[int], t: float, dur: float) -> tuple[float, float]:
    """Reserve link resources ``rids`` for ``dur`` seconds from the first moment at or after ``t``
    when all are free (one transfer per direction at a time); returns (start, end)."""
    start = t
    for r in rids:
        if free_at[r] > start:
            start = free_at[r]
    end = start + dur
    for r in rids:
        free_at[r] = end
    return start, end


# op codes of the precompiled actions
_F, _B, _SEND, _RECV, _SYNC, _STEP, _ASYNC, _WAIT, _PUSH, _PULL, _BSTART, _BWAIT = range(12)

#: iterations replayed for a sync mode whose iterations differ (the result is their average)
ASYNC_ITERATIONS = 12


def simulated_iterations(plan: Plan) -> int:
    """How many iterations ``simulate`` replays: 1 for ``bsp``; for the other modes enough to cover their periods."""
    if plan.sync == "bsp":
        return 1
    opts = plan.sync_options
    period = opts.aggregate if plan.sync == "hybrid-ps" else opts.period
    return max(ASYNC_ITERATIONS, 3 * period, 2 * (opts.staleness + 1))


def build_schedules(plan: Plan, n: int) -> list[Schedule]:
    """The schedules of iterations 0..n-1 of a run of ``n``: the sync state advanced after each
    (``schedule.advance_sync_state``, as the trainer does; the plan's DASO period throughout)."""
    state, out = initial_sync_state(plan), []
    for _ in range(n):
        out.append(build_schedule(plan, state, n))
        state = advance_sync_state(plan, state, n)
    return out


def simulate(plan: Plan, schedule: Schedule | None = None, iterations: int | None = None) -> SimResult:
    """Replay ``plan``'s iterations and time every action; the result is per iteration (an average over several
    for the sync modes other than ``bsp``, whose iterations differ and whose fast VWs may run ahead).

    Args:
        plan: the plan (cluster and profile included).
        schedule: the Actions of one iteration to replay; by default ``build_schedules(plan, n)``.
            A schedule passed in is validated first and replayed once.
        iterations: how many iterations to replay (default ``simulated_iterations(plan)``).

    Raises:
        ScheduleError: an invalid schedule, or an action kind the simulator cannot time.

    Example:
        >>> r = simulate(plan)                                     # doctest: +SKIP
        >>> r.iteration_s, r.devices["n0:0"].bubble_fraction       # doctest: +SKIP
    """
    if schedule is None:
        schedules = build_schedules(plan, simulated_iterations(plan) if iterations is None else iterations)
    else:
        validate(schedule, plan)
        schedules = [schedule]
    # The replay allocates one tuple per event and frees none: the cyclic garbage collector
    # would re-scan them over and over (a third of the time on 1024 devices) and find nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Replay(plan, schedules).run()
    finally:
        if enabled:
            gc.enable()


class _Replay:
    """Precompiles every action to a tuple of figures, then runs the event loop."""

    def __init__(self, plan: Plan, schedules: Sequence[Schedule]) -> None:
        self.plan = plan
        self.schedules = schedules
        self.iterations = len(schedules)
        schedule = schedules[0]
        self.schedule = schedule
        cluster, profile = plan.cluster, plan.profile
        self.names = list(schedule)
        index = {name: k for k, name in enumerate(self.names)}
        cluster_index = {d.name: d.index for d in cluster.devices}
        self.res = _Resources()
        segments = plan.segments()
        self.segments = segments
        self.node_of = {dev.name: dev.node for dev in cluster.devices}
        self.staleness = plan.sync_options.staleness
        # collectives: (kind, segment, members, iteration started) -> id; their phases, members and label
        self.cids: dict[tuple[ActionKind, int, tuple[Any, ...], int], int] = {}
        self.phases: dict[int, list[tuple[float, tuple[int, ...], str]]] = {}
        self.owners: dict[int, list[int]] = {}
        self.clabel: dict[int, str] = {}
        self.last_start: dict[tuple[int, int], int] = {}  # (device, segment) -> iteration of its AVERAGE_START
        n = len(self.names)
        self.fwd: list[list[float]] = [[] for _ in range(n)]
        self.bwd: list[list[float]] = [[] for _ in range(n)]
        self.act: list[list[float]] = [[] for _ in range(n)]
        self.transient: list[list[float]] = [[] for _ in range(n)]
        self.weights = [0.0] * n
        self.step_memory = [0.0] * n  # the optimizer step's transient
        self.optimizer_s = [0.0] * n
        self.where: list[tuple[int, int]] = []
        self.ops: list[list[tuple[Any, ...]]] = []
        p2p_cache: dict[tuple[int, int, float], tuple[float, tuple[int, ...]]] = {}

        where = {s.device: (v, j) for v, vw in enumerate(plan.virtual_workers) for j, s in enumerate(vw.stages)}
        devices = {dev.name: dev for dev in cluster.devices}
        labels: dict[tuple[str, int, int], list[str]] = {}  # "jFi" strings, shared by devices of equal (j, m)
        for d, name in enumerate(self.names):
            if name not in where:
                raise ScheduleError(f"{name} has actions but holds no stage in the plan")
            v, j = where[name]
            self.where.append((v, j))
            vw = plan.virtual_workers[v]
            stage = vw.stages[j]
            device = devices[name]
            first, end, rc = stage.first_layer, stage.end_layer, list(stage.recompute)
            weights = estimate_stage_memory(profile, first, end, rc, 0, 0, plan.optimizer, with_step=False)
            self.weights[d] = weights
            param_bytes = float(sum(profile.layers[i].param_bytes for i in stage.layers))
            self.step_memory[d] = estimate_optimizer_step_memory(param_bytes, profile.bytes_per_element,
                                                                 plan.optimizer)
            self.optimizer_s[d] = estimate_optimizer_time(param_bytes, profile.bytes_per_element, device,
                                                          plan.optimizer, profile)
            per_size: dict[int, tuple[float, float, float, float]] = {}
            layer_times = {}
            overhead = estimate_action_overhead(profile, device)
            for b in set(vw.micro_batch_sizes):
                f, g = estimate_layer_times(profile, device, b)
                layer_times[b] = (f, g)
                held0 = estimate_stage_memory(profile, first, end, rc, b, 0, plan.optimizer, with_step=False)
                held1 = estimate_stage_memory(profile, first, end, rc, b, 1, plan.optimizer, with_step=False)
                per_size[b] = (float(f[first:end].sum()) + overhead,
                               float(g[first:end].sum() + f[rc].sum()) + overhead,
                               held1 - held0, held0 - weights)
            sizes = vw.micro_batch_sizes
            self.fwd[d] = [per_size[b][0] for b in sizes]
            self.bwd[d] = [per_size[b][1] for b in sizes]
            self.act[d] = [per_size[b][2] for b in sizes]
            self.transient[d] = [per_size[b][3] for b in sizes]
            out_bytes = profile.layers[end - 1].output_bytes_per_sample
            in_bytes = profile.layers[first - 1].output_bytes_per_sample if first > 0 else 0.0
            m = len(sizes)
            for letter in "FB":
                if (letter, j, m) not in labels:
                    labels[(letter, j, m)] = [f"{j}{letter}{i}" for i in range(m)]
            f_labels, b_labels = labels[("F", j, m)], labels[("B", j, m)]

            ops: list[tuple[Any, ...]] = []
            wave = 0
            for it, sched in enumerate(schedules):
                for a in sched[name]:
                    ops.append(self._op(a, it, wave, d, name, sizes, out_bytes, in_bytes, f_labels, b_labels,
                                        index, cluster_index, p2p_cache))
                if any(a.kind is ActionKind.PULL for a in sched[name]):
                    wave += 1
            # each ALLREDUCE_START rides on the backward before it: its bucket's gradients are final
            # this long after that backward starts (the stage's layers run backwards, last layer first)
            last_b = -1
            for n, op in enumerate(ops):
                if op[0] == _B:
                    last_b = n
                elif op[0] == _BSTART:
                    if last_b < 0:
                        raise ScheduleError(f"{op[2]} on {name} follows no backward")
                    i, bucket = ops[last_b][1], op[3]
                    if bucket.first_layer <= first:
                        offset = self.bwd[d][i]
                    else:
                        f, g = layer_times[sizes[i]]
                        later = [x for x in rc if x >= bucket.first_layer]
                        offset = overhead + float(g[bucket.first_layer:end].sum() + f[later].sum())
                    b_op = ops[last_b]
                    ops[last_b] = (*b_op[:3], (*b_op[3], (offset, op[1])))
            self.ops.append(ops)

    def _op(self, a: Any, it: int, wave: int, d: int, name: str, sizes: Sequence[int], out_bytes: float,
            in_bytes: float, f_labels: Sequence[str], b_labels: Sequence[str], index: Mapping[str, int],
            cluster_index: Mapping[str, int],
            p2p_cache: dict[tuple[int, int, float], tuple[float, tuple[int, ...]]]) -> tuple[Any, ...]:
        """One action, precompiled to a tuple of figures (its code first)."""
        k, i = a.kind, a.micro_batch
        cluster = self.plan.cluster
        if k is ActionKind.F:
            return (_F, i, f_labels[i])
        if k is ActionKind.B:
            return (_B, i, b_labels[i], ())  # (offset in the backward, collective) of the buckets it starts
        if k is ActionKind.ALLREDUCE_START or k is ActionKind.ALLREDUCE_WAIT:
            assert a.segment is not None and a.bucket is not None
            bucket = self.segments[a.segment].buckets[a.bucket]
            key = (ActionKind.ALLREDUCE_START, a.segment, (a.bucket,), it)
            if key not in self.cids:
                cid = self.cids[key] = len(self.cids)
                members = self.segments[a.segment].owners
                self.phases[cid] = _allreduce_phases(cluster, [cluster_index[o] for o in members],
                                                     bucket.param_bytes, self.res, bucket.algorithm)
                self.owners[cid] = [index[o] for o in members]
                self.clabel[cid] = f"ALLREDUCE seg{a.segment} bucket{a.bucket}"
            if k is ActionKind.ALLREDUCE_START:
                return (_BSTART, self.cids[key], str(a), bucket)
            return (_BWAIT, self.cids[key], str(a))
        if k is ActionKind.SEND_F or k is ActionKind.SEND_B:
            assert a.peer is not None and i is not None
            peer = index[a.peer]
            num_bytes = sizes[i] * (out_bytes if k is ActionKind.SEND_F else in_bytes)
            ckey = (d, peer, num_bytes)
            if ckey not in p2p_cache:
                a_idx, b_idx = cluster_index[name], cluster_index[a.peer]
                p2p_cache[ckey] = (estimate_p2p_time(num_bytes, cluster.link(a_idx, b_idx)),
                                   _edge(cluster, a_idx, b_idx, self.res))
            dur, rids = p2p_cache[ckey]
            src, dst = a.stages_joined
            label = f"{k.value} {src}->{dst} mb{i} {name}->{a.peer}"
            return (_SEND, i, label, (k is ActionKind.SEND_B, d, peer, i), dur, rids,
                    "send_f" if k is ActionKind.SEND_F else "send_b")
        if k is ActionKind.RECV_F or k is ActionKind.RECV_B:
            assert a.peer is not None
            return (_RECV, i, a, (k is ActionKind.RECV_B, index[a.peer], d, i))  # label: str(a) when it waits
        if k is ActionKind.STEP:
            return (_STEP, 0, str(a))
        if k in COLLECTIVE_KINDS or k is ActionKind.AVERAGE_START or k is ActionKind.AVERAGE_MERGE:
            assert a.segment is not None
            seg = self.segments[a.segment]
            members = list(seg.owners)
            if k is ActionKind.LOCAL_ALLREDUCE:
                members = [o for o in members if self.node_of[o] == self.node_of[name]]
            kind = ActionKind.AVERAGE if k in (ActionKind.AVERAGE_START, ActionKind.AVERAGE_MERGE) else k
            started = it - 1 if k is ActionKind.AVERAGE_MERGE else it
            if k is ActionKind.AVERAGE_START:
                self.last_start[(d, a.segment)] = it
            elif k is ActionKind.AVERAGE_MERGE:  # the average this device started last
                started = self.last_start[(d, a.segment)]
            key = (kind, a.segment, tuple(members), started)
            if key not in self.cids:
                self.cids[key] = len(self.cids)
                algorithm = seg.algorithm if len(members) == len(seg.owners) else "ring"  # one node: ring
                self.phases[self.cids[key]] = _allreduce_phases(cluster, [cluster_index[o] for o in members],
                                                                seg.param_bytes, self.res, algorithm)
                self.owners[self.cids[key]] = [index[o] for o in members]
                self.clabel[self.cids[key]] = f"{k.value if k in COLLECTIVE_KINDS else 'AVERAGE'} seg{a.segment}"
            cid = self.cids[key]
            if k is ActionKind.AVERAGE_START:
                return (_ASYNC, cid, str(a))
            if k is ActionKind.AVERAGE_MERGE:
                return (_WAIT, cid, str(a))
            return (_SYNC, cid, str(a))
        if k is ActionKind.PUSH or k is ActionKind.PULL:
            assert a.segment is not None
            seg = self.segments[a.segment]
            host = seg.ps_host
            assert host is not None, f"segment {a.segment} has no parameter-server host under {self.plan.sync}"
            num_bytes = seg.param_bytes
            here, there = cluster_index[name], cluster_index[host]
            dur = estimate_p2p_time(num_bytes, cluster.link(here, there)) if host != name else 0.0
            if k is ActionKind.PUSH:
                rids = _edge(cluster, here, there, self.res) if host != name else ()
                return (_PUSH, (a.segment, wave), f"PUSH seg{a.segment} {name}->{host}", dur, rids,
                        len(seg.owners))
            back = _edge(cluster, there, here, self.res) if host != name else ()  # the shard's broadcast to it
            return (_PULL, (a.segment, wave - self.staleness), f"PULL seg{a.segment} {host}->{name}", dur, back)
        raise ScheduleError(f"the simulator cannot time {a} on {name}")

    def run(self) -> SimResult:
        n = len(self.names)
        ops_of, fwd, bwd, act, transient = self.ops, self.fwd, self.bwd, self.act, self.transient
        free_at, link_events = self.res.free_at, self.res.events
        heap: list[tuple[float, int, int, int]] = [(0.0, d, 0, d) for d in range(n)]  # (time, seq, what, who)
        seq = n
        push, pop = heapq.heappush, heapq.heappop
        new = tuple.__new__  # Event(...) without NamedTuple's Python-level __new__: the loop's hot path
        pc = [0] * n
        finish = [0.0] * n
        last_backward = 0.0
        events: list[list[Event]] = [[] for _ in range(n)]
        memory = list(self.weights)
        curves: list[list[tuple[float, float]]] = [[(0.0, w)] for w in self.weights]
        in_flight = [0] * n
        max_in_flight = [0] * n
        busy = [0.0] * n
        sync = [0.0] * n
        arrivals: dict[tuple[bool, int, int, int], float] = {}
        waiting: dict[tuple[bool, int, int, int], tuple[int, float]] = {}
        arrived: dict[int, list[int]] = {}
        phase_of: dict[int, int] = {}
        sync_start: dict[int, float] = {}
        async_done: dict[int, float] = {}  # posted averages and bucket all-reduces: cid -> end (-1 while running)
        bucket_ready: dict[int, int] = {}  # bucket all-reduce -> owners whose gradients of it are final
        cid_waiters: dict[int, list[int]] = {}
        pushed: dict[tuple[int, int], list[float]] = {}  # (segment, wave) -> [pushes arrived, latest arrival]
        ready: dict[tuple[int, int], float] = {}  # (segment, wave) -> when the shard holds every owner's update
        pull_waiters: dict[tuple[int, int], list[int]] = {}
        waits_since: dict[int, float] = {}

        while heap:
            t, _, what, who = pop(heap)
            if what == 2:  # a bucket's gradients are final on one more owner: start its all-reduce after the last
                s = who
                bucket_ready[s] = bucket_ready.get(s, 0) + 1
                if bucket_ready[s] == len(self.owners[s]):
                    async_done[s] = -1.0
                    phase_of[s] = 0
                    sync_start[s] = t
                    push(heap, (t, seq, 1, s))
                    seq += 1
                continue
            if what == 1:  # an all-reduce phase ended at t (or the collective starts): run the next phase
                s = who
                k = phase_of[s]
                phases = self.phases[s]
                if k == len(phases):
                    start = sync_start[s]
                    if s in async_done:  # a posted average: nobody waited; wake who waits at its merge
                        async_done[s] = t
                        for w in cid_waiters.pop(s, []):
                            push(heap, (t, seq, 0, w))
                            seq += 1
                        continue
                    for o in self.owners[s]:
                        if t > start:
                            events[o].append(Event(start, t, "sync", self.clabel[s]))
                            sync[o] += t - start
                        pc[o] += 1
                        push(heap, (t, seq, 0, o))
                        seq += 1
                    continue
                dur, rids, name = phases[k]
                start = max(t, *(free_at[r] for r in rids)) if rids else t
                end = start + dur
                for r in rids:
                    free_at[r] = end
                    link_events[r].append(Event(start, end, "allreduce", f"{self.clabel[s]} {name}"))
                if k == 0:
                    sync_start[s] = start
                phase_of[s] = k + 1
                push(heap, (end, seq, 1, s))
                seq += 1
                continue

            d = who
            ops = ops_of[d]
            k = pc[d]
            while True:
                if k == len(ops):
                    finish[d] = t
                    break
                op = ops[k]
                code = op[0]
                if code == _F:
                    i = op[1]
                    end = t + fwd[d][i]
                    events[d].append(new(Event, (t, end, "forward", op[2], i)))
                    busy[d] += end - t
                    memory[d] += act[d][i]
                    curves[d].append((end, memory[d]))
                    in_flight[d] += 1
                    if in_flight[d] > max_in_flight[d]:
                        max_in_flight[d] = in_flight[d]
                    k += 1
                    push(heap, (end, seq, 0, d))
                    seq += 1
                    break
                if code == _B:
                    i = op[1]
                    end = t + bwd[d][i]
                    events[d].append(new(Event, (t, end, "backward", op[2], i)))
                    busy[d] += end - t
                    if transient[d][i] > 0:
                        curves[d].append((t, memory[d] + transient[d][i]))
                    memory[d] -= act[d][i]
                    curves[d].append((end, memory[d]))
                    in_flight[d] -= 1
                    if end > last_backward:
                        last_backward = end
                    for offset, cid in op[3]:
                        push(heap, (t + offset, seq, 2, cid))
                        seq += 1
                    k += 1
                    push(heap, (end, seq, 0, d))
                    seq += 1
                    break
                if code == _BSTART:  # started by the backward before it (what == 2 above)
                    k += 1
                    continue
                if code == _BWAIT:
                    s = op[1]
                    if async_done.get(s, -1.0) < 0:
                        cid_waiters.setdefault(s, []).append(d)
                        waits_since.setdefault(d, t)
                        break
                    since = waits_since.pop(d, t)
                    if t > since:
                        events[d].append(Event(since, t, "sync", op[2]))
                        sync[d] += t - since
                    k += 1
                    continue
                if code == _SEND:
                    _, i, label, key, dur, rids, kind = op
                    start, end = _occupy(free_at, rids, t, dur)
                    for r in rids:
                        link_events[r].append(new(Event, (start, end, kind, label, i)))
                    waiter = waiting.pop(key, None)
                    if waiter is None:
                        arrivals[key] = end
                    else:
                        w, since = waiter
                        if end > since:
                            events[w].append(new(Event, (since, end, "recv", str(ops_of[w][pc[w]][2]), i)))
                        pc[w] += 1
                        push(heap, (end, seq, 0, w))
                        seq += 1
                    k += 1
                    continue
                if code == _RECV:
                    key = op[3]
                    at = arrivals.pop(key, None)
                    if at is None:
                        waiting[key] = (d, t)
                        break
                    k += 1
                    if at > t:
                        events[d].append(new(Event, (t, at, "recv", str(op[2]), op[1])))
                        push(heap, (at, seq, 0, d))
                        seq += 1
                        break
                    continue
                if code == _SYNC:
                    s = op[1]
                    here = arrived.setdefault(s, [])
                    here.append(d)
                    if len(here) == len(self.owners[s]):
                        phase_of[s] = 0
                        sync_start[s] = t
                        push(heap, (t, seq, 1, s))
                        seq += 1
                    break  # every owner resumes when the collective ends
                if code == _ASYNC:
                    s = op[1]
                    here = arrived.setdefault(s, [])
                    here.append(d)
                    if len(here) == len(self.owners[s]):
                        async_done[s] = -1.0
                        phase_of[s] = 0
                        sync_start[s] = t
                        push(heap, (t, seq, 1, s))
                        seq += 1
                    k += 1
                    continue
                if code == _WAIT:
                    s = op[1]
                    at = async_done.get(s, -1.0)
                    if at < 0:
                        cid_waiters.setdefault(s, []).append(d)
                        break
                    k += 1
                    if at > t:  # (woken at ``at``: never later than now)
                        events[d].append(Event(t, at, "sync", op[2]))
                    continue
                if code == _PUSH:
                    _, key, label, dur, rids, owners = op
                    start, end = _occupy(free_at, rids, t, dur)
                    for r in rids:
                        link_events[r].append(Event(start, end, "push", label))
                    got = pushed.setdefault(key, [0, 0.0])
                    got[0] += 1
                    got[1] = max(got[1], end)
                    if got[0] == owners:
                        ready[key] = got[1]
                        for w in pull_waiters.pop(key, []):
                            push(heap, (got[1], seq, 0, w))
                            seq += 1
                    k += 1
                    continue
                if code == _PULL:
                    _, key, label, dur, back = op
                    if key[1] < 0:
                        k += 1
                        continue
                    if key not in ready:
                        pull_waiters.setdefault(key, []).append(d)
                        waits_since[d] = min(waits_since.get(d, t), t)
                        break
                    since = waits_since.pop(d, t)
                    # the global weights travel back on the host's links from when the shard holds them
                    start, arrive = _occupy(free_at, back, ready[key], dur)
                    for r in back:
                        link_events[r].append(Event(start, arrive, "pull", label))
                    end = max(t, arrive)
                    k += 1
                    if end > since:
                        events[d].append(Event(since, end, "sync", label))
                        sync[d] += end - since
                    if end > t:
                        push(heap, (end, seq, 0, d))
                        seq += 1
                        break
                    continue
                # _STEP
                end = t + self.optimizer_s[d]
                events[d].append(Event(t, end, "optimizer", op[2]))
                if self.step_memory[d] > 0:
                    curves[d].append((t, memory[d] + self.step_memory[d]))
                    curves[d].append((end, memory[d]))
                busy[d] += end - t
                k += 1
                push(heap, (end, seq, 0, d))
                seq += 1
                break
            pc[d] = k

        stuck = [self.names[d] for d in range(n) if pc[d] < len(ops_of[d])]
        if stuck:
            validate(self.schedule, self.plan)  # raises with the grid
            raise ScheduleError(f"simulation stalled with {', '.join(stuck[:4])} unfinished")
        return self._result(finish, last_backward, events, curves, busy, sync, max_in_flight)

    def _result(self, finish: list[float], last_backward: float, events: list[list[Event]],
                curves: list[list[tuple[float, float]]], busy: list[float], sync: list[float],
                max_in_flight: list[int]) -> SimResult:
        plan = self.plan
        total_s = max(finish, default=0.0)
        iteration_s = total_s / self.iterations
        timeline = Timeline(
            devices={name: events[d] for d, name in enumerate(self.names)},
            links={name: evs for name, evs in zip(self.res.names, self.res.events, strict=True) if evs},
            memory={name: curves[d] for d, name in enumerate(self.names)},
            source="simulated",
            meta={"model": plan.model, "cluster": plan.cluster.name, "schedule": plan.schedule, "sync": plan.sync,
                  "iteration_s": iteration_s, "iterations": self.iterations},
        )
        capacity = {dev.name: dev.memory_bytes for dev in plan.cluster.devices}
        stats = {}
        for d, name in enumerate(self.names):
            v, j = self.where[d]
            stats[name] = DeviceStats(
                device=name, vw=v, stage=j, iteration_s=iteration_s, busy_s=busy[d] / self.iterations,
                sync_s=sync[d] / self.iterations,
                bubble_s=max(0.0, iteration_s - (busy[d] + sync[d]) / self.iterations),
                peak_memory_bytes=max(b for _, b in curves[d]),
                capacity_bytes=capacity[name], max_in_flight=max_in_flight[d],
            )
        samples_per_s = plan.global_batch / iteration_s if iteration_s > 0 else 0.0
        if plan.sync != "bsp" and iteration_s > 0:
            # VWs that run ahead finish their iterations sooner: each VW's own pace counts
            samples_per_s = 0.0
            for v, vw in enumerate(plan.virtual_workers):
                end = max(finish[d] for d in range(len(self.names)) if self.where[d][0] == v)
                samples_per_s += vw.mini_batch * self.iterations / end if end > 0 else 0.0
            iteration_s = plan.global_batch / samples_per_s
        return SimResult(
            timeline=timeline, iteration_s=iteration_s, pipeline_s=last_backward / self.iterations,
            samples_per_s=samples_per_s,
            devices=stats, closed_form_iteration_s=plan.prediction.iteration_s,
        )


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


def run_simulate_command(plan_path: str, trace: str | None, gantt: str | None, as_json: bool) -> int:
    """``hetrain simulate plan.json [--trace out.json] [--gantt out.png] [--json]``.

    Prints the summary (or the metrics as JSON), writes the Chrome trace and the
    Gantt picture if asked. Returns the exit status: 0, or 1 with the reason on
    stderr.
    """
    try:
        plan = load_plan(plan_path)
        result = simulate(plan)
    except (PlanError, ScheduleError, ValueError) as e:
        print(f"hetrain simulate: {e}", file=sys.stderr)
        return 1
    written = []
    try:
        if trace:
            result.timeline.to_chrome_trace(trace)
            written.append(f"trace: {trace} (open in https://ui.perfetto.dev)")
        if gantt:
            result.timeline.save_gantt(gantt, title=f"{plan.model} on {plan.cluster.name}: {plan.schedule}, "
                                       f"iteration {format_time(result.iteration_s)}")
            written.append(f"gantt: {gantt}")
    except OSError as e:
        print(f"hetrain simulate: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.summary())
        for line in written:
            print(line)
    return 0


def with_simulated_prediction(draft: Plan) -> Plan:
    """``draft`` with every predicted figure taken from one replay (a hand-built plan has no closed form,
    ``planner.baselines``):
    the iteration; its pipeline (to the last backward) and the rest after it, as the optimizer step
    (the longest, at most the rest) and sync; each VW's pipeline (to its last backward); each
    device's peak memory."""
    sim = simulate(draft)
    events = sim.timeline.devices
    rest = max(0.0, sim.iteration_s - sim.pipeline_s)
    optimizer_s = min(rest, max((e.end_s - e.start_s for evs in events.values() for e in evs
                                 if e.kind == "optimizer"), default=0.0))
    vws = tuple(replace(vw, predicted_pipeline_s=max(
        (e.end_s for d in vw.devices for e in events.get(d, ()) if e.kind == "backward"), default=0.0))
        for vw in draft.virtual_workers)
    memory = tuple(DeviceMemory(d.device, d.peak_memory_bytes, d.capacity_bytes) for d in sim.devices.values())
    pred = Prediction(iteration_s=sim.iteration_s, samples_per_s=sim.samples_per_s, pipeline_s=sim.pipeline_s,
                      sync_s=rest - optimizer_s, optimizer_s=optimizer_s,
                      memory=memory, simulated_iteration_s=sim.iteration_s)
    return replace(draft, virtual_workers=vws, prediction=pred)

"""The planner: a pure function of (cluster, profile, options) to a Plan.

Search, per candidate formation (formation.py):

1. score each VW shape against mini-batch size (vw.VWEvaluator.estimate_time);
2. split the global batch over VWs by water-filling: give samples one at a time
   to the VW that would finish soonest with one more, which minimises the
   slowest VW's time for monotone costs, so no VW waits at the sync;
3. refine each VW at its mini-batch: exact micro-batch size, count and partition;
4. add synchronisation (sync.py) and the optimizer step.

The formations are ranked by the objective (throughput, or time to accuracy
with a critical batch size), and the best few are re-ranked by a scoring
function when the caller hands one in (``hetrain.plan`` hands in the
simulator; the planner imports no simulator).

Within a time budget (``PlannerOptions.time_budget_s``, ``hetrain plan --time-budget``)::

    screen every formation (fast partitions) ─► search the best refine_top_k exactly, then the others
        whose optimistic score beats the best found, within EXTRA_SEARCH_SHARE of the budget
        ─► simulate the best candidates, one at a time, while the next one's estimated cost
           (the dearest simulation so far per unit of plan size) fits in what is left: the best, its
           pipelines reversed, each of the two under the other schedules of 1F1B, 1F1B-eager and GPipe where
           they fit memory (schedule auto), the rest
        ─► the robust draws and the sync-mode choice, where their simulations fit too

Screening always runs, and the exact search of at least the best screened candidate (no plan
without them); the first simulation runs whenever any budget is left, so the budget is
exceeded by at most one simulation's misestimate. Where the search spent the budget before the
first simulation, the chosen plan (the closed forms' best) is simulated all the same: a plan the
simulator has not checked is not a plan (``_simulated_past_budget``; only ``simulate_top_k=0`` or
no scoring function leave it unchecked). Where the budget cuts the simulations
short, which candidates were simulated depends on the machine's speed, and so may the plan.
The plan records what was done in ``options["planner_report"]`` (``format_planner_report``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from hetrain.cluster import Cluster, tp_cluster, tp_groups_of_node
from hetrain.cost import (
    MEMORY_MARGIN_FRACTION,
    estimate_device_memory,
    estimate_iteration_overhead,
    estimate_layer_times,
    estimate_optimizer_step_memory,
    estimate_optimizer_time,
    estimate_samples_to_accuracy_factor,
    estimate_shard_gather_time,
    estimate_stage_memory,
    estimate_weight_memory,
    in_flight,
    loss_memory_per_sample,
    runtime_footprint,
    tensor_budget,
    tp_rank_profile,
)
from hetrain.errors import InputError
from hetrain.plan import (
    MAX_TP,
    OPTIMIZERS,
    SCHEDULES,
    DeviceMemory,
    Optimizer,
    Plan,
    Prediction,
    Schedule,
    Stage,
    VirtualWorker,
)
from hetrain.planner.budget import PlannerReport, TimeBudget
from hetrain.planner.formation import Formation, build_formations
from hetrain.planner.partition import PartitionResult, partition, priced_as
from hetrain.planner.robust import DRAWS, SEED, has_spread, rank_robust
from hetrain.planner.shards import lighten_segments, reprice, segment_row, size_shards
from hetrain.planner.sharing import estimate_pipeline_traffic, estimate_shared_pipeline_times
from hetrain.planner.stage_cost import StageTableCache
from hetrain.planner.sync import Scorer, choose_sync_mode, estimate_mode_sync_time, estimate_sync_predictions
from hetrain.planner.vw import VWEvaluator, vw_shape
from hetrain.profile import ModelProfile
from hetrain.sync_layout import SHARD_MODES, SyncOptions, check_mode_options, group_segments, modes_for
from hetrain.sync_mode import MODES, SYNC_MODES, SyncModeName, sync_mode
from hetrain.units import format_bytes

INF = float("inf")

#: seconds ``hetrain plan`` may spend by default (issue 21: 4096 devices planned in about 10 s)
DEFAULT_TIME_BUDGET_S = 10.0
#: with ``simulate_top_k=None``: simulate at least this many of the best candidates where the budget allows
#: (the planner's fixed top 3 before the budget), and at most this many
SIMULATE_AT_LEAST = 3
SIMULATE_AT_MOST = 50
#: with ``simulate_top_k=None``, past SIMULATE_AT_LEAST: stop once the next candidate, at the smallest
#: simulated / closed-form ratio seen less this fraction, could not beat the best simulated plan
PLAUSIBLE_FRACTION = 0.05
#: the key of ``Plan.options`` that says what the planner did (``PlannerReport``)
REPORT_KEY = "planner_report"
#: the key of ``Plan.options`` with each TP degree's best predicted iteration (``tp_degrees``)
TP_KEY = "tp_choice"
#: the TP degree the planner goes up to by default: the devices of a DGX-class node
DEFAULT_MAX_TP = 8


class PlannerError(InputError):
    """No plan satisfies the request; the message says why, with the numbers."""


class NotBetter(PlannerError):
    """No candidate of a search could beat, even optimistically, a plan found already (``TimeBudget.must_beat``)."""


@dataclass(frozen=True)
class PlannerOptions:
    """What the planner may choose and what it optimises.

    Attributes:
        strategy: ``auto`` searches all formations; ``dp`` / ``pp`` force a family.
        schedule: ``gpipe``, ``1f1b``, or ``auto`` (both tried).
        sync: the sync mode recorded in the plan and costed (``planner.sync.estimate_mode_sync_time``); ``auto``:
            plan for ``bsp``, then take the mode with the soonest predicted time to accuracy for those VWs
            (``planner.sync.choose_sync_mode``, discounted by ``staleness_penalty``).
        sync_options: the mode's parameters (staleness, period, aggregate, placement, buckets...), recorded in
            the plan (``Plan.sync_options``).
        staleness_penalty: with ``sync="auto"``, the extra samples to accuracy per iteration of mean staleness.
        optimizer: sets optimizer-state memory and step time.
        objective: ``throughput`` or ``time-to-accuracy``.
        critical_batch: the critical batch size B_crit (for time-to-accuracy).
        target_samples: samples to reach the target at small batch (E_min).
        global_batch_choices: with time-to-accuracy, other global batches to try.
        micro_batch_sizes: micro-batch sizes to try (default powers of two).
        allow_recompute: let stages recompute activations to fit memory.
        max_caps: bottleneck caps tried per partition before sampling.
        order_budget: DP cells allowed for trying every device order of a VW.
        exhaustive_orders: try every device order of a VW when it has at most this many.
        exhaustive_devices: clusters this small also try every set partition.
        refine_top_k: search this many best screened candidates exactly.
        simulate_top_k: re-rank at most this many best candidates (and the best one's reversed pipelines, and
            under schedule ``auto`` the two under the other schedules where they fit memory) by the scoring
            function, where one is given (0: off); None: as many as ``time_budget_s`` allows, at least
            SIMULATE_AT_LEAST where it allows, at most SIMULATE_AT_MOST, and none past the first that the closed
            form says cannot win (PLAUSIBLE_FRACTION).
        time_budget_s: seconds the planning may take: screening and the exact search always run, then
            simulations while the next one's estimated cost fits, and the chosen plan's simulation whatever is
            left (module docstring); None: no limit.
        robust_draws: where the profile has spreads, score those candidates on this many profiles drawn within
            them too, and prefer the best worst case among the plans within the fastest's spread
            (``planner.robust``; 0: off).
        robust_seed: the seed of those draws (the same seed, the same plan).
        max_tp: the largest TP degree a stage may run at (1: no tensor parallelism); the planner plans at every
            power of two up to it that some node's devices of one type can form, where the profile has TP rules,
            and keeps the best (``tp_degrees``).
        tp: plan every stage at this TP degree (``hetrain plan --tp K``, as ``strategy`` forces a family).
        shard: ``"auto"``: also plan with the optimizer state sharded among each segment's owners (ZeRO-1, then
            ZeRO-2 where ZeRO-1 does not fit), where the plan without could be memory-bound (it does not fit, or
            it pipelines or recomputes), then shard each segment at the lightest mode its owners fit where that
            is not slower, and keep the best (``plan_shards``); a shard mode: plan with it for every shared
            segment (``SyncOptions.shard``); None: as ``sync_options`` says.
    """

    strategy: Literal["auto", "dp", "pp", "hybrid"] = "auto"
    schedule: Literal["auto", "gpipe", "1f1b", "1f1b-eager"] = "auto"
    sync: SyncModeName | Literal["auto"] = "bsp"
    sync_options: SyncOptions = field(default_factory=SyncOptions)
    staleness_penalty: float = 0.0
    optimizer: Optimizer = "adam"
    objective: Literal["throughput", "time-to-accuracy"] = "throughput"
    critical_batch: float | None = None
    target_samples: float = 1e6
    global_batch_choices: tuple[int, ...] = ()
    micro_batch_sizes: tuple[int, ...] | None = None
    allow_recompute: bool = True
    max_caps: int = 24
    order_budget: float = 2e6
    exhaustive_orders: int = 120
    exhaustive_devices: int = 6
    refine_top_k: int = 3
    simulate_top_k: int | None = None
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S
    robust_draws: int = DRAWS
    robust_seed: int = SEED
    leave_out: bool = True  # also plan without the slowest NIC's or the weakest node, keep it if 10% faster
    max_tp: int = DEFAULT_MAX_TP
    tp: int | None = None
    shard: str | None = None

    def __post_init__(self) -> None:
        if self.shard is not None and self.shard not in ("auto", *SHARD_MODES):
            raise ValueError(f"shard must be auto or one of {', '.join(SHARD_MODES)}, got {self.shard!r}")
        if self.strategy not in ("auto", "dp", "pp", "hybrid"):
            raise ValueError(f"strategy must be auto, dp, pp or hybrid, got {self.strategy!r}")
        if self.schedule not in ("auto", *SCHEDULES):
            raise ValueError(f"schedule must be auto or one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.sync not in SYNC_MODES and self.sync != "auto":
            raise ValueError(f"sync must be auto or one of {SYNC_MODES}, got {self.sync!r}")
        if not isinstance(self.sync_options, SyncOptions):
            raise ValueError(f"sync_options must be a SyncOptions, got {type(self.sync_options).__name__}")
        check_mode_options(self.sync, self.sync_options)
        if not self.staleness_penalty >= 0:
            raise ValueError(f"staleness_penalty must be >= 0, got {self.staleness_penalty}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.objective not in ("throughput", "time-to-accuracy"):
            raise ValueError(f"objective must be throughput or time-to-accuracy, got {self.objective!r}")
        if self.objective == "time-to-accuracy" and not (self.critical_batch and self.critical_batch > 0):
            raise ValueError("objective time-to-accuracy needs a positive critical_batch (--critical-batch)")
        if self.simulate_top_k is not None and self.simulate_top_k < 0:
            raise ValueError(f"simulate_top_k must be >= 0 or None, got {self.simulate_top_k}")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s >= 0):
            raise ValueError(f"time_budget_s must be a finite number of seconds >= 0 or None, got {self.time_budget_s}")
        if self.robust_draws < 0:
            raise ValueError(f"robust_draws must be >= 0, got {self.robust_draws}")
        for key, k in (("max_tp", self.max_tp), ("tp", self.tp)):
            if k is not None and (k < 1 or k & (k - 1) or k > MAX_TP):
                raise ValueError(f"{key} must be a power of two in [1, {MAX_TP}], got {k}")
        if self.micro_batch_sizes is not None and any(b < 1 for b in self.micro_batch_sizes):
            raise ValueError(f"micro-batch sizes must be >= 1, got {list(self.micro_batch_sizes)}")


@dataclass
class Candidate:
    """One scored formation: its VWs' partitions, batch split and predicted times."""

    formation: Formation
    schedule: str
    global_batch: int
    parts: list[PartitionResult]
    mini_batches: list[int]
    pipeline_s: float
    sync_s: float
    optimizer_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def iteration_s(self) -> float:
        return self.pipeline_s + self.sync_s + self.optimizer_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.iteration_s

    def score(self, opts: PlannerOptions) -> float:
        """Lower is better: seconds per sample, or predicted time to accuracy."""
        if opts.objective == "time-to-accuracy":
            assert opts.critical_batch is not None
            factor = estimate_samples_to_accuracy_factor(self.global_batch, opts.critical_batch)
            return opts.target_samples * factor / self.samples_per_s
        return 1.0 / self.samples_per_s


def _split_batch(times: Sequence[Any], global_batch: int) -> list[int] | None:
    """Water-filling: mini-batches summing to ``global_batch`` minimising the slowest VW.

    ``times[v](B)`` is VW v's time for mini-batch B (non-decreasing in B). Every
    VW gets at least one sample. Optimal for monotone costs: each step gives a
    sample to the VW whose time after taking it is smallest (the first VW among
    equals); None where that time is not finite.

    VWs handed the same function (one object: alike VWs, ``_evaluate``) are served as one group, level by level:
    at the smallest next time T, every VW whose next time is T takes each sample that keeps it at T, in VW order,
    which is what the one-sample-at-a-time heap gives (a VW served at T pushes its next time, T again or later,
    and among equal times the lower VW goes first); only the last level, where the samples run out, is served VW
    by VW. At 4096 devices, 1024 VWs of a few shapes and 16384 samples: a few dozen levels instead of 15,360 heap
    steps per candidate (``tests/test_planner.py`` compares it with that heap on random step functions).
    """
    k = len(times)
    if global_batch < k:
        return None
    if any(not math.isfinite(t(1)) for t in times):
        return None
    groups: dict[int, list[int]] = {}
    for v, t in enumerate(times):
        groups.setdefault(id(t), []).append(v)
    members = list(groups.values())  # each in VW order
    fns = [times[m[0]] for m in members]
    level = [1] * len(members)  # the samples each VW of a group has
    left = global_batch - k
    while left > 0:
        nexts = [fns[g](level[g] + 1) for g in range(len(members))]
        now = min(nexts)
        if not math.isfinite(now):
            return None
        at = [g for g in range(len(members)) if nexts[g] == now]
        takes = {}
        for g in at:  # each of its VWs takes every sample that keeps it at ``now``
            c = 1
            while c < left and fns[g](level[g] + c + 1) == now:
                c += 1
            takes[g] = c
        demand = sum(takes[g] * len(members[g]) for g in at)
        if demand <= left:
            for g in at:
                level[g] += takes[g]
            left -= demand
            continue
        alloc = _spread(members, level, k)
        for v, h in sorted((v, g) for g in at for v in members[g]):  # the last level: VW by VW, lowest first
            got = min(takes[h], left)
            alloc[v] += got
            left -= got
            if left == 0:
                break
        return alloc
    return _spread(members, level, k)


def _spread(members: Sequence[Sequence[int]], level: Sequence[int], k: int) -> list[int]:
    """Per VW, its group's samples."""
    alloc = [0] * k
    for g, m in enumerate(members):
        for v in m:
            alloc[v] = level[g]
    return alloc


def _reduce_copy(opts: PlannerOptions, vws: int) -> float:
    """The bf16 gradient copies per gradient byte each stage of a formation of ``vws`` VWs holds at the end
    of its iteration (``SyncOptions.reduce_copy``): none with one VW, whose gradients no other replica shares."""
    return opts.sync_options.reduce_copy if vws > 1 else 0.0


def _shares(opts: PlannerOptions, vws: int) -> tuple[float, float]:
    """The (optimizer state, gradients) shares each stage of a formation of ``vws`` VWs keeps where the plan
    shards them (``SyncOptions.shard``), as the search prices memory: an even share, 1 / ``vws`` (every VW
    holds each layer once). The plan's own shards are uneven (``_shard_weights``), and its memory is counted
    with them (``_to_plan``)."""
    shard = opts.sync_options.shard
    if shard == "none" or vws < 2:
        return (1.0, 1.0)
    return (1.0 / vws, 1.0 / vws if shard == "optimizer+gradients" else 1.0)


def shard_gather_s(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Sequence[tuple[int, int, int]]],
                   shard: str) -> dict[int, float]:
    """Per device, the seconds after its optimizer step in which the owners of its sharded segments hand each
    other their updated shards (an all-gather: half a ring all-reduce's bytes on the same links; the gradients'
    reduce-scatter is the other half, priced with the buckets at ``SyncOptions.reduce_wire``)."""
    out: dict[int, float] = {}
    if shard == "none":
        return out
    for first, end, owners in group_segments(profile.num_layers, layouts):
        if len(owners) < 2:
            continue
        t = estimate_shard_gather_time(cluster, list(owners), sum(x.param_bytes for x in profile.layers[first:end]))
        for d in owners:
            out[d] = out.get(d, 0.0) + t
    return out


def _evaluate(cluster: Cluster, profile: ModelProfile, formation: Formation, schedule: str, global_batch: int,
              opts: PlannerOptions, evaluators: dict[tuple[object, ...], VWEvaluator], cache: StageTableCache,
              exact: bool = True) -> Candidate | None:
    groups = formation.vws
    # a VW's stages hold bf16 copies of their gradients where other VWs share them (reduce_dtype bf16): one
    # evaluator per VW shape for formations of one VW, another for those of many
    copies = _reduce_copy(opts, len(groups))
    shares = _shares(opts, len(groups))
    shapes = [vw_shape(cluster, g) for g in groups]
    sigs = [(sig, schedule, copies, shares) for sig, _ in shapes]
    for sig, (_, canon) in zip(sigs, shapes, strict=True):
        if sig not in evaluators:
            evaluators[sig] = VWEvaluator(
                cluster, profile, list(canon), schedule, opts.optimizer, opts.allow_recompute,
                opts.order_budget, opts.max_caps, opts.micro_batch_sizes, cache, opts.exhaustive_orders,
                opts.sync_options.transfers == "blocking", reduce_copy=copies, shares=shares)
    if global_batch < len(groups):
        return None
    # Guess each VW's share by peak compute, to size the coarse partitions' micro-batch count.
    speed = [sum(cluster.devices[d].peak_flops(profile.precision) for d in g) for g in groups]
    total_speed = sum(speed)
    # alike VWs (one shape, one reference micro-batch count) share one function, so ``_split_batch`` serves them as
    # one group; its figures are its own (a table per shape alone gave whichever VW asked first its m_ref)
    fns: dict[tuple[object, ...], Any] = {}

    def time_fn(v: int) -> Any:
        sig = sigs[v]
        ev = evaluators[sig]
        m_ref = max(1, round(global_batch * speed[v] / total_speed))
        if (sig, m_ref) in fns:
            return fns[(sig, m_ref)]
        table: dict[int, float] = {}

        def t(mini_batch: int) -> float:
            if mini_batch not in table:
                table[mini_batch] = ev.estimate_time(mini_batch, m_ref)
            return table[mini_batch]
        fns[(sig, m_ref)] = t
        return t

    split = _split_batch([time_fn(v) for v in range(len(groups))], global_batch)
    if split is None:
        return None
    parts: list[PartitionResult] = []
    places: dict[int, tuple[PartitionResult, tuple[int, ...]]] = {}  # id(r) -> r, its devices' canonical positions
    for v in range(len(groups)):
        ev = evaluators[sigs[v]]
        r = ev.refine(split[v], fast=not exact)
        if r is None:
            return None
        # map canonical positions back to this VW's devices (the VWs of one evaluator and mini-batch share ``r``)
        if id(r) not in places:
            pos = {d.index: q for q, d in enumerate(ev.devices)}
            places[id(r)] = (r, tuple(pos[d.index] for d in r.devices))
        canon = shapes[v][1]
        parts.append(replace(r, devices=tuple(canon[q] for q in places[id(r)][1])))
    return _eager_if_faster(cluster, profile, _assemble(cluster, profile, formation, schedule, global_batch, parts,
                                                        split, opts), opts)


def _eager_if_faster(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions) -> Candidate:
    """Under schedule ``auto``, ``c`` (planned for 1F1B) under 1F1B-eager where every stage fits that and its
    closed form is faster, priced by that form; else ``c``. Eager's one more micro-batch in flight on every stage
    but the last lets each cycle through the last stage turn once per micro-batch more (``cost.estimate_1f1b_period``):
    where a transfer sets 1F1B's period, eager's is shorter, and only there is the candidate priced twice."""
    if opts.schedule != "auto" or c.schedule != "1f1b" or opts.sync_options.transfers == "blocking":
        return c
    if all(r.max_s <= max(r.stage_s) for r in c.parts):  # every period at its slowest stage: eager's is no shorter
        return c
    # a pipeline no shorter under eager's form leaves the candidate's time as it is: no memory check, no sync
    eager_s = estimate_shared_pipeline_times(cluster, [priced_as(r, "1f1b-eager") for r in c.parts], "1f1b-eager")
    if max(eager_s) >= c.pipeline_s:
        return c
    eager = _as_schedule(cluster, profile, c, opts, "1f1b-eager")
    return eager if eager is not None and eager.score(opts) < c.score(opts) else c


def _assemble(cluster: Cluster, profile: ModelProfile, formation: Formation, schedule: str, global_batch: int,
              parts: list[PartitionResult], split: list[int], opts: PlannerOptions) -> Candidate:
    """The candidate of these VW partitions and batch split: its optimizer step and sync added."""
    blocking = opts.sync_options.transfers == "blocking"
    vw_pipeline_s = estimate_shared_pipeline_times(cluster, parts, schedule, blocking)  # NICs shared by all VWs
    pipeline_s = max(vw_pipeline_s)
    layouts = [[(d.index, r.cuts[j], r.cuts[j + 1]) for j, d in enumerate(r.devices)] for r in parts]
    state_share = _shares(opts, len(parts))[0]
    gather = shard_gather_s(cluster, profile, layouts, opts.sync_options.shard if len(parts) > 1 else "none")
    # a step's seconds depend on the device's type and memory bandwidth and the stage's layers alone: once per
    # kind of stage (4096 devices run a few dozen), the same sums
    step: dict[tuple[str, float, int, int], float] = {}

    def step_s(d: int, k: int, l: int) -> float:
        dev = cluster.devices[d]
        key = (dev.type_name, dev.memory_bandwidth_bytes_per_s, k, l)
        if key not in step:
            step[key] = estimate_optimizer_time(state_share * sum(profile.layers[i].param_bytes for i in range(k, l)),
                                                profile.bytes_per_element, dev, opts.optimizer, profile) \
                + estimate_iteration_overhead(profile, dev)
        return step[key]
    optimizer_s = max(step_s(d, k, l) + gather.get(d, 0.0) for layout in layouts for d, k, l in layout)
    # what each device's last backward micro-batch can hide of its BSP gradient buckets
    hide = {d.index: r.backward_s[j] for r in parts for j, d in enumerate(r.devices)}
    traffic = estimate_pipeline_traffic(cluster, parts, vw_pipeline_s, schedule, blocking)
    sync_s = estimate_mode_sync_time(cluster, profile, layouts, opts.sync, opts.sync_options,
                                     pipeline_s + optimizer_s, hide, traffic)
    c = Candidate(formation, schedule, global_batch, parts, split, pipeline_s, sync_s, optimizer_s)
    c.extra["layouts"] = layouts
    c.extra["hide"] = hide
    c.extra["traffic"] = traffic
    return c


def reversed_orders(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions) -> Candidate | None:
    """``c`` with each pipeline over devices of more than one type run in the reverse device order, partitioned
    anew at the same micro-batch size and count; None where no VW has such a pipeline, or one does not fit.

    The closed forms price a pipeline and its reverse alike (``sum + (m - 1) * max`` is symmetric in stage
    order), and the search keeps the first of equals; warm-up, cool-down, transfers and the memory of 1F1B's
    early stages are not symmetric, so the scoring function is handed both (slow first and fast first).
    """
    parts: list[PartitionResult] = []
    done: dict[tuple[object, ...], PartitionResult | None] = {}  # VWs alike in figures and links: one partition
    planned = "1f1b" if opts.schedule == "auto" else c.schedule  # what the search partitions for (_search)
    for r in c.parts:
        if len(r.devices) < 2 or len({d.type_name for d in r.devices}) < 2:
            parts.append(r)
            continue
        devices = r.devices[::-1]
        idx = [d.index for d in devices]
        key = (r.b, r.m, tuple((d.type_name, d.peak_fp32_flops, d.peak_fp16_flops, d.memory_bytes,
                                d.memory_bandwidth_bytes_per_s) for d in devices),
               tuple((float(cluster.bandwidth_bytes_per_s[a, b]), float(cluster.latency_s[a, b]))
                     for a, b in itertools.pairwise(idx)))
        if key not in done:
            done[key] = partition(cluster, profile, devices, r.b, r.m, planned, opts.optimizer,
                                  opts.allow_recompute, opts.max_caps,
                                  reduce_copy=_reduce_copy(opts, len(c.parts)), shares=_shares(opts, len(c.parts)))
        flipped = done[key]
        if flipped is None:
            return None
        parts.append(replace(flipped, devices=devices))
    if all(a is b for a, b in zip(parts, c.parts, strict=True)):
        return None
    return _eager_if_faster(cluster, profile, _assemble(cluster, profile, c.formation, planned, c.global_batch, parts,
                                                        c.mini_batches, opts), opts)


def _to_plan(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions,
             predictions: bool = True) -> Plan:
    """``c`` as a plan; ``predictions``: with every sync mode's closed form (``_sync_predictions``), which the
    planner adds only to the plan a planning returns (``_with_sync_predictions``)."""
    shares = _shares(opts, len(c.parts))
    vws = []
    memory = []
    for r, mini in zip(c.parts, c.mini_batches, strict=True):
        p = len(r.devices)
        stages = []
        for j, d in enumerate(r.devices):
            k, l = r.cuts[j], r.cuts[j + 1]
            mem = estimate_stage_memory(profile, k, l, r.recompute[j], r.b, in_flight(c.schedule, r.m, p, j),
                                        opts.optimizer, reduce_copy=_reduce_copy(opts, len(c.parts)),
                                        state_share=shares[0], grad_share=shares[1], micro_batches=r.m)
            stages.append(Stage(d.name, k, l, r.recompute[j], r.forward_s[j], r.backward_s[j], mem))
            memory.append(DeviceMemory(d.name, estimate_device_memory(profile, d, mem), d.memory_bytes))
        vws.append(VirtualWorker(tuple(stages), mini, r.m, r.pipeline_s))
    tta = None
    if opts.critical_batch:
        tta = opts.target_samples * estimate_samples_to_accuracy_factor(c.global_batch, opts.critical_batch) \
            / c.samples_per_s
    prediction = Prediction(
        iteration_s=c.iteration_s, samples_per_s=c.samples_per_s, pipeline_s=c.pipeline_s, sync_s=c.sync_s,
        optimizer_s=c.optimizer_s, memory=tuple(memory), time_to_accuracy_s=tta,
    )
    schedule = cast(Schedule, c.schedule)
    options: dict[str, Any] = {"objective": opts.objective, "strategy": opts.strategy}
    if predictions:
        options.update(_sync_predictions(cluster, profile, c, opts))
    if opts.critical_batch:
        options["critical_batch"] = opts.critical_batch
    plan = Plan(
        model=profile.name, global_batch=c.global_batch, schedule=schedule,
        sync=opts.sync if opts.sync != "auto" else "bsp", optimizer=opts.optimizer,
        virtual_workers=tuple(vws), prediction=prediction,
        strategy=c.formation.strategy, formation=c.formation.name, cluster=cluster, profile=profile,
        options=options, sync_options=opts.sync_options,
    )
    return _with_shards(plan) if opts.sync_options.shard != "none" and len(c.parts) > 1 else plan


def _sync_predictions(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions) -> dict[str, Any]:
    """``{"sync_predictions": ...}``: every mode's closed form for ``c``'s VWs, so a user can compare them
    (docs/sync.md); its own mode's is the candidate's, priced by ``_assemble`` with the same arguments. Empty
    where ``c`` has no layouts."""
    layouts = c.extra.get("layouts")
    if layouts is None:
        return {}
    return {"sync_predictions": estimate_sync_predictions(
        cluster, profile, layouts, opts.sync_options, c.pipeline_s + c.optimizer_s, c.global_batch,
        c.extra.get("hide"), c.extra.get("traffic"), known={opts.sync: c.sync_s})}


def _with_sync_predictions(cluster: Cluster, profile: ModelProfile, p: Plan, c: Candidate,
                           opts: PlannerOptions) -> Plan:
    """``p``, made from ``c`` without them (``_to_plan``), with every mode's closed form where ``_to_plan`` puts
    them: a table per simulated candidate (at 4096 devices half a second each) for the one a planning returns."""
    head = {key: p.options[key] for key in ("objective", "strategy")}
    return p.with_options({**head, **_sync_predictions(cluster, profile, c, opts), **p.options})


def _with_shards(plan: Plan) -> Plan:
    """``plan`` with its shards sized and each stage's memory counted at its own shares (``shards.size_shards``)."""
    sized = size_shards(plan)
    if sized is None:
        raise PlannerError(f"the plan's stages fit with even shards of their state in the search, but not with the "
                           f"shards of its segments' owners ({plan.sync_options.shard}); plan with --shard none")
    return sized


def _explain_no_fit(cluster: Cluster, profile: ModelProfile, opts: PlannerOptions) -> str:
    """Smallest memory the model needs vs the largest any arrangement offers."""
    weights = estimate_weight_memory(profile.param_bytes, profile.bytes_per_element, opts.optimizer,
                                     grad_bytes_per_element=profile.grad_bytes_per_element)
    # one sample, every layer recomputed: each layer keeps only its input
    acts = profile.input_bytes_per_sample + sum(x.output_bytes_per_sample for x in profile.layers[:-1])
    step = estimate_optimizer_step_memory(profile.param_bytes, profile.bytes_per_element, opts.optimizer)
    need = weights + max(acts + sum(loss_memory_per_sample(profile)), step)
    mems = sorted((tensor_budget(profile, d) for d in cluster.devices), reverse=True)  # footprint, margin out
    if mems[0] <= 0:  # not even the runtime fits: a negative "offer" would say nothing
        return _explain_no_room(cluster, profile, need)
    offer = sum(max(0.0, m) for m in mems[: profile.num_layers])  # a device with no room offers nothing
    biggest_layer = max(profile.layers, key=lambda x: x.param_bytes)
    big, bpe = biggest_layer.param_bytes, profile.bytes_per_element
    grad_bpe = profile.grad_bytes_per_element
    layer_need = (estimate_weight_memory(big, bpe, opts.optimizer, grad_bytes_per_element=grad_bpe)
                  + estimate_optimizer_step_memory(big, bpe, opts.optimizer))
    return (
        f"{profile.name} fits no arrangement of cluster {cluster.name!r}: it needs at least "
        f"{format_bytes(need)} (parameters, gradients and {opts.optimizer} state of "
        f"{format_bytes(profile.param_bytes)} of weights, plus one sample's activations with full "
        f"recomputation); the largest any arrangement offers is {format_bytes(offer)} "
        f"({min(profile.num_layers, len(mems))} devices, at most one stage per layer). Its largest layer "
        f"{biggest_layer.name!r} alone needs {format_bytes(layer_need)}; the largest device has "
        f"{format_bytes(mems[0])} for tensors (its memory less the runtime's footprint and a "
        f"{MEMORY_MARGIN_FRACTION:.0%} margin).{_copies_hint(profile, opts)}{_gpipe_hint(opts)}"
        f"{_data_parallel_need(cluster, profile, opts)} Add devices, use a "
        f"smaller model{'' if opts.optimizer == 'sgd' else ', or --optimizer sgd'}."
    )


def _data_parallel_need(cluster: Cluster, profile: ModelProfile, opts: PlannerOptions) -> str:
    """With ``--strategy dp``: a sentence with what pure data parallelism needs on each device (the whole model's
    parameters, gradients and optimizer state, and one sample's activations with every layer recomputed), what
    it would need with ZeRO-2 over every device, and which devices fall short of the former, by type."""
    if opts.strategy != "dp":
        return ""
    layers, n = profile.num_layers, cluster.num_devices
    recompute = tuple(range(layers)) if opts.allow_recompute else ()

    def need(share: float) -> float:  # one stage of every layer, one sample in flight, a ``share`` of its state
        return estimate_stage_memory(profile, 0, layers, recompute, 1, 1, opts.optimizer,
                                     reduce_copy=_reduce_copy(opts, n), state_share=share, grad_share=share)
    whole, zero2 = need(1.0), need(1.0 / n)
    short: dict[str, list[float]] = {}  # device type -> each short device's tensor budget
    for d in cluster.devices:
        if (room := tensor_budget(profile, d)) < whole:
            short.setdefault(d.type_name, []).append(room)
    devices = ", ".join(f"{len(rooms)} x {t} ({format_bytes(max(0.0, max(rooms)))} for tensors)"
                        for t, rooms in short.items())
    return (f" Pure data parallelism (--strategy dp) holds the whole model on each device: it needs at least "
            f"{format_bytes(whole)} per device ({format_bytes(profile.param_bytes)} of weights with their gradients "
            f"and {opts.optimizer} state, and one sample's activations{' recomputed' if recompute else ''}); "
            f"with the state and gradients sharded over all {n} devices (ZeRO-2, --shard optimizer+gradients), "
            f"at least {format_bytes(zero2)}. Short of {format_bytes(whole)}: {devices or 'none'}.")


def _gpipe_hint(opts: PlannerOptions) -> str:
    """Under GPipe a stage holds every micro-batch of its VW's mini-batch at once, which the one-sample bound
    above does not show: a sentence saying so, with the schedules that hold fewer."""
    if opts.schedule != "gpipe":
        return ""
    return (" Under --schedule gpipe each stage holds the activations of all its VW's micro-batches at once "
            "(its whole share of the global batch, whatever the micro-batch size); 1F1B holds at most one per "
            "later stage, plus one: try --schedule 1f1b (or auto), or a smaller --global-batch.")


def _explain_no_room(cluster: Cluster, profile: ModelProfile, need: float) -> str:
    """Every device's memory is less than its runtime's reserve (CUDA context, communication buffers) and
    the margin: say so, with the figures, instead of a negative capacity."""
    device = max(cluster.devices, key=lambda d: tensor_budget(profile, d))
    reserved = runtime_footprint(profile, device).fixed_bytes
    same = all(d.memory_bytes == device.memory_bytes for d in cluster.devices)
    whose = "each device's" if same else f"the largest device's ({device.name})"
    return (
        f"{profile.name} fits no arrangement of cluster {cluster.name!r}: it needs at least {format_bytes(need)}, "
        f"and no device has memory left for it: {whose} {format_bytes(device.memory_bytes)} is less than the "
        f"{format_bytes(reserved)} reserved for the CUDA context and runtime (plus a "
        f"{MEMORY_MARGIN_FRACTION:.0%} margin kept free). Check the devices' memory in the cluster file "
        f"(e.g. memory = \"16GB\")."
    )


def _copies_hint(profile: ModelProfile, opts: PlannerOptions) -> str:
    """Where bf16 gradient copies raise what a replicated stage needs at its step: a sentence saying so."""
    copies = opts.sync_options.reduce_copy
    step = estimate_optimizer_step_memory(profile.param_bytes, profile.bytes_per_element, opts.optimizer)
    if copies * profile.param_bytes <= step:
        return ""
    return (f" With reduce_dtype {opts.sync_options.reduce_dtype}, a stage that other VWs share also holds "
            f"16-bit copies of its gradients at the step ({format_bytes(copies * profile.param_bytes)} for the "
            f"whole model); reduce_dtype fp32 needs none.")


def _no_arrangement(strategy: str, num_layers: int, num_devices: int) -> str:
    """Why ``strategy`` has no formation of ``num_devices`` devices for ``num_layers`` layers."""
    return (f"strategy {strategy!r} has no arrangement for {num_layers} layers on {num_devices} devices: every stage "
            f"needs at least one layer" + (", so a pure pipeline can use at most one device per layer"
                                           if strategy == "pp" else ""))


def _check_batch_fills_vws(cluster: Cluster, formations: Sequence[Formation], global_batch: int,
                           opts: PlannerOptions) -> None:
    """Refuse a global batch smaller than the fewest VWs of any formation: every VW needs a sample."""
    fewest = min(len(f.vws) for f in formations)
    if global_batch < fewest:
        raise PlannerError(
            f"global batch {global_batch} is smaller than the {fewest} virtual workers of the "
            f"{opts.strategy} strategy on {cluster.num_devices} devices: every VW needs at least one sample. "
            f"Use --global-batch >= {fewest}" + ("" if opts.strategy != "dp" else ", or --strategy auto/pp")
        )


def search(cluster: Cluster, profile: ModelProfile, global_batch: int, opts: PlannerOptions) -> list[Candidate]:
    """Every feasible candidate, best first by the objective (closed forms only)."""
    return _search(cluster, profile, global_batch, opts)[0]


def _search(cluster: Cluster, profile: ModelProfile, global_batch: int, opts: PlannerOptions,
            budget: TimeBudget | None = None) -> tuple[list[Candidate], int, int]:
    """``search``'s candidates, and how many were screened and how many searched exactly: the best
    ``refine_top_k``, or fewer where ``budget`` is spent (never fewer than one)."""
    if global_batch < 1:
        raise PlannerError(f"global batch must be >= 1, got {global_batch}")
    formations = build_formations(cluster, profile.num_layers, opts.strategy, profile.precision,
                                  opts.exhaustive_devices)
    if not formations:
        raise PlannerError(_no_arrangement(opts.strategy, profile.num_layers, cluster.num_devices))
    _check_batch_fills_vws(cluster, formations, global_batch, opts)
    # 1F1B holds min(m, p - j) <= m micro-batches per stage, so under "auto" the search partitions for 1F1B and
    # prices each candidate by the better of 1F1B's and 1F1B-eager's forms where eager fits (_eager_if_faster:
    # each transfer in its cycle, cost.estimate_1f1b_period); the simulator replays the best under the other
    # schedules too (_simulate_best).
    schedules = ("1f1b",) if opts.schedule == "auto" else (opts.schedule,)
    batches = sorted({global_batch, *opts.global_batch_choices}) if opts.objective == "time-to-accuracy" \
        else [global_batch]
    evaluators: dict[tuple[object, ...], VWEvaluator] = {}
    cache = StageTableCache()  # stage tables shared by every VW shape of this search

    def rank(cs: list[Candidate]) -> list[Candidate]:
        return sorted(cs, key=lambda c: (c.score(opts), c.schedule != "1f1b", len(c.formation.vws)))

    # Screen every (formation, schedule, batch) with fast partitions, then search
    # the most promising ones exactly (all orders, all bottleneck caps).
    screened: list[Candidate] = []
    for f in formations:
        for sched in schedules:
            for g in batches:
                c = _evaluate(cluster, profile, f, sched, g, opts, evaluators, cache, exact=False)
                if c is not None:
                    screened.append(c)
    if not screened:
        raise PlannerError(_explain_no_fit(cluster, profile, opts))
    screened = rank(screened)
    whole: dict[tuple[int, int], float] = {}  # (device, micro-batch size) -> the whole model's seconds on it
    if budget is not None and budget.must_beat is not None:
        bound = min(_optimistic_score(profile, c, opts, whole) for c in screened)
        if bound >= budget.must_beat:
            raise NotBetter(f"no candidate could beat {budget.must_beat:.4g} (at best {bound:.4g})")
    found: list[Candidate] = []
    refined: set[int] = set()  # positions in screened

    took: list[float] = []  # seconds of each exact search

    def refine(k: int) -> None:
        start = time.perf_counter()
        found.append(_searched(cluster, profile, screened[k], opts, evaluators, cache))
        took.append(time.perf_counter() - start)
        refined.add(k)

    for k in range(min(len(screened), max(1, opts.refine_top_k))):
        if found and budget is not None and budget.left_s() <= 0:
            break
        refine(k)
    # A screening partition is an upper bound (two device orders, full recomputation wherever memory asks for
    # any): a candidate ranked below the top k can still beat them all once searched (pipetorch.toml, gpt2-small,
    # gradients all-reduced in bf16: spread-2 screened at 0.99 s, 0.43 s searched, past the top 3's best 0.63 s).
    # Search the others whose optimistic score (stages balanced by speed; no transfer, sync or recomputation)
    # beats the best found, most promising first, each only where the dearest exact search so far still fits in
    # the first EXTRA_SEARCH_SHARE of the time budget.
    best = min(c.score(opts) for c in found)
    hopeful = sorted((score, k) for k in range(len(screened)) if k not in refined
                     if (score := _optimistic_score(profile, screened[k], opts, whole)) < best)
    for score, k in hopeful:
        if budget is not None and budget.budget_s is not None and \
                budget.elapsed_s() + max(took) > EXTRA_SEARCH_SHARE * budget.budget_s:
            break
        if score < min(c.score(opts) for c in found):
            refine(k)
    return rank(found) + [c for k, c in enumerate(screened) if k not in refined], len(screened), len(found)


def _searched(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions,
              evaluators: dict[tuple[object, ...], VWEvaluator], cache: StageTableCache) -> Candidate:
    """The screened candidate ``c`` searched exactly (all orders, all bottleneck caps), or ``c`` where that
    is no better. One screened under 1F1B-eager's form is searched for both forms' cuts: 1F1B's, priced under
    the better of the two, can beat eager's own (cloud-mixed, wsp, every node: eager's search ends A100 first,
    1.27 s replayed; 1F1B's puts the T4s first, 1.09 s)."""
    best = c
    both = opts.schedule == "auto" and c.schedule == "1f1b-eager"
    for sched in ("1f1b", c.schedule) if both else (c.schedule,):
        exact = _evaluate(cluster, profile, c.formation, sched, c.global_batch, opts, evaluators, cache, exact=True)
        if exact is not None and exact.score(opts) <= best.score(opts):
            best = exact
    return best


#: the share of the time budget the exact search of candidates past ``refine_top_k`` may use (the rest is the
#: simulator's)
EXTRA_SEARCH_SHARE = 0.5


def _optimistic_score(profile: ModelProfile, c: Candidate, opts: PlannerOptions,
                      whole_s: dict[tuple[int, int], float] | None = None) -> float:
    """A score no search of ``c``'s formation, schedule and micro-batches can beat (nearly: layer times are
    taken to scale alike across device types), plus the optimizer step: each VW's pipeline ``sum + (m - 1) max``
    with its slowest stage no faster than a micro-batch spread over its devices in proportion to their speed,
    and the stages' sum no less than the whole model on its fastest device; no transfer, recomputation or sync.
    ``whole_s``: (device index, micro-batch size) -> a forward and backward of the whole model there, kept
    across calls (4096 devices recur in every candidate of a search)."""
    memo = whole_s if whole_s is not None else {}
    pipeline = 0.0
    for r in c.parts:
        whole = []
        for d in r.devices:
            if (d.index, r.b) not in memo:
                f, g = estimate_layer_times(profile, d, r.b)
                memo[(d.index, r.b)] = float(f.sum() + g.sum())
            whole.append(memo[(d.index, r.b)])
        spread = 1.0 / sum(1.0 / t for t in whole)  # every device busy on its share of one micro-batch
        pipeline = max(pipeline, min(whole) + (r.m - 1) * spread)
    optimistic = replace(c, pipeline_s=pipeline, sync_s=0.0)
    return optimistic.score(opts)


def plan(cluster: Cluster, profile: ModelProfile, global_batch: int, options: PlannerOptions | None = None,
         score: Scorer | None = None, **kwargs: Any) -> Plan:
    """Plan a hybrid pipeline + data parallel run of ``profile`` on ``cluster``.

    Args:
        cluster: the devices and links.
        profile: the model's per-layer costs.
        global_batch: samples per iteration over all virtual workers.
        options: a PlannerOptions; or pass its fields as keyword arguments.
        score: a plan's iteration seconds by a finer model (``hetrain.plan`` passes the simulator's);
            None ranks by the closed forms only.

    Returns:
        The best Plan by the objective: by ``score`` among the closed form's best candidates that were
        simulated within ``time_budget_s`` (at most ``simulate_top_k``) where a scorer is given, and simulated
        itself whatever the budget left (unless ``simulate_top_k=0``). Its ``options["planner_report"]`` says
        what was done (``planner.budget.PlannerReport``).

    Raises:
        PlannerError: no arrangement fits, or the batch is too small; the message has the numbers.

    Example:
        >>> import hetrain
        >>> c = hetrain.load_cluster("examples/clusters/hetpipe.toml")            # doctest: +SKIP
        >>> p = hetrain.plan(c, hetrain.build_profile("gpt2-medium"), 512)        # doctest: +SKIP
        >>> print(p.summary())                                                     # doctest: +SKIP
    """
    opts = options if options is not None else PlannerOptions(**kwargs)
    if options is not None and kwargs:
        opts = replace(options, **kwargs)
    if opts.shard == "auto":
        return plan_shards(cluster, profile, global_batch, opts, score)
    opts = _shard_fixed(opts)
    degrees = tp_degrees(cluster, profile, opts)
    if degrees == [1]:
        return _plan_degree(cluster, profile, global_batch, opts, score, TimeBudget(opts.time_budget_s))
    start = time.perf_counter()
    found: list[tuple[int, Plan]] = []
    errors: list[tuple[int, PlannerError]] = []
    pruned: list[tuple[int, PlannerError]] = []
    skipped: list[int] = []
    seconds_per_device: float | None = None  # the first degree planned: its seconds per device of its cluster
    for n, k in enumerate(degrees):  # TP 1 half the budget, each other degree an equal share of what is left
        left = None if opts.time_budget_s is None else opts.time_budget_s - (time.perf_counter() - start)
        count = sum(len(tp_groups_of_node(node, k)) for node in cluster.nodes)
        if found and left is not None and seconds_per_device is not None and seconds_per_device * count > left:
            skipped.append(k)  # its screening and exact search, which always run, would not fit what is left
            continue
        if opts.strategy == "pp" and count > profile.num_layers:  # known without building the groups' cluster
            errors.append((k, PlannerError(_no_arrangement("pp", profile.num_layers, count))))  # (seconds at 4096)
            continue
        groups = tp_cluster(cluster, k)
        share = TimeBudget(None if left is None else max(0.0, left) / (2 if n == 0 else len(degrees) - n))  # TP 1: half
        if found:  # a degree none of whose candidates could beat the best so far stops after screening
            share.must_beat = min(_candidate_score(opts, p) for _, p in found)
        try:
            began = time.perf_counter()
            p = _plan_degree(groups, tp_rank_profile(profile, k), global_batch, opts, score, share)
            if seconds_per_device is None:
                seconds_per_device = (time.perf_counter() - began) / groups.num_devices
        except NotBetter as e:
            pruned.append((k, e))
            continue
        except PlannerError as e:
            errors.append((k, e))
            continue
        found.append((k, as_tp_plan(p, cluster, profile)))
    if not found:
        raise errors[0][1] if len(errors) == 1 else PlannerError(
            "; ".join(f"at TP {k}: {e}" for k, e in errors))
    return _chosen_degree(_simulate_degrees(found, opts, score, start), errors, pruned, skipped, opts)


def _chosen_degree(found: list[tuple[int, Plan]], errors: list[tuple[int, PlannerError]],
                   pruned: list[tuple[int, PlannerError]], skipped: list[int], opts: PlannerOptions) -> Plan:
    """The best degree's plan, recording each degree's outcome (``TP_KEY``) and every planning's counts."""
    best_k, best = _best_degree(found, opts)
    choice: dict[str, dict[str, Any]] = {
        str(k): {"iteration_s": p.prediction.iteration_s, "simulated_iteration_s": p.prediction.simulated_iteration_s}
        for k, p in found}
    choice.update({str(k): {"error": str(e)} for k, e in errors})
    choice.update({str(k): {"pruned": str(e)} for k, e in pruned})
    choice.update({str(k): {"skipped": "its search would not fit the time budget left"} for k in skipped})
    reports = [PlannerReport.from_dict(p.options[REPORT_KEY]) for _, p in found]
    total = replace(reports[0], simulations=sum(r.simulations for r in reports), past_budget_s=_past_budget_s(best),
                    **{key: sum(getattr(r, key) for r in reports) for key in ("screened", "searched", "simulated")})
    return best.with_options({**best.options, TP_KEY: {"chosen": best_k, "degrees": choice},
                              REPORT_KEY: total.to_dict()})


def _shard_fixed(opts: PlannerOptions) -> PlannerOptions:
    """``opts`` with a forced shard mode (``opts.shard``) moved into its sync options, and TP off where state is
    sharded (the runtime shards whole tensors: no TP stage with a sharded segment), unless TP is forced."""
    if opts.shard is not None:
        opts = replace(opts, shard=None, sync_options=replace(opts.sync_options, shard=opts.shard))
    if opts.sync_options.shard != "none" and (opts.tp or 1) == 1:
        opts = replace(opts, max_tp=1)
    return opts


#: the synchronous mode, the one that runs TP stages and sharded state
_SYNCHRONOUS = next(m.name for m in MODES if m.synchronous)


def _may_run_bsp(opts: PlannerOptions) -> bool:
    """Whether the plan may be synchronous: its mode is, or the planner picks it (``auto``)."""
    return opts.sync == "auto" or sync_mode(opts.sync).synchronous


#: the key of ``Plan.options`` that says what ``plan_shards`` planned with each shard mode
SHARD_KEY = "shard_choice"


def plan_shards(cluster: Cluster, profile: ModelProfile, global_batch: int, opts: PlannerOptions,
                score: Scorer | None) -> Plan:
    """``plan`` without sharding, then, where that plan could be memory-bound (none fits, or it pipelines or
    recomputes, which memory may have forced), with the optimizer state sharded (ZeRO-1), and with the
    gradients too (ZeRO-2) where ZeRO-1 does not fit; the sharded plan then with each segment at the lightest
    mode its owners fit, where that is not slower (``_per_segment``); the best by the simulator where it
    simulated every mode's plan, else by the closed forms, and then simulated (under a budget each mode's planning
    leaves its simulation past the budget to this one: ``LeftToCaller``). The budget is shared: half to the plan
    without, the rest to the others in turn. Where a plan without sharding was found, a sharded planning whose
    search (its screening and exact search always run, as long as the plan without took besides its simulations)
    would not fit what is left of the budget is skipped, and said so (``options["shard_choice"]["modes"]``), as a
    TP degree is, unless memory shaped that plan (``_memory_shaped``): at 4096 devices a second search costs 4 to
    17 s, past any budget left. A larger ``--time-budget`` plans it.
    Sharding is bsp's (``SyncOptions.shard``) and whole tensors' (no TP stage), so other modes, or a forced
    TP degree, plan without."""
    base = replace(opts, shard=None, sync_options=replace(opts.sync_options, shard="none"))
    if not _may_run_bsp(opts) or (opts.tp or 1) > 1:
        return plan(cluster, profile, global_batch, base, score)
    start = time.perf_counter()

    def left(share: float) -> float | None:
        if opts.time_budget_s is None:
            return None
        return max(0.0, (opts.time_budget_s - (time.perf_counter() - start)) * share)

    found: list[tuple[str, Plan]] = []
    choice: dict[str, dict[str, Any]] = {}
    simulated_s = [0.0]  # the seconds the scoring function took in the planning without sharding
    # under a budget, each shard mode's planning leaves its chosen plan's simulation past the budget to this one,
    # which simulates only the plan it chooses
    inner: Scorer | None = score
    counted: Scorer | None = None if score is None else _counted(score, simulated_s)
    if score is not None and opts.time_budget_s is not None:
        inner, counted = LeftToCaller(score), LeftToCaller(_counted(score, simulated_s))
    try:
        found.append(("none", plan(cluster, profile, global_batch, replace(base, time_budget_s=left(0.5)), counted)))
    except PlannerError as e:
        choice["none"] = {"error": str(e)}
        first_error: PlannerError | None = e
    else:
        first_error = None
        unsharded = found[0][1]
        if not any(len(vw.stages) > 1 or any(s.recompute for s in vw.stages) for vw in unsharded.virtual_workers):
            _, unsharded = _chosen_mode(opts, found, score)  # simulated where its planning left that to this one
            return unsharded.with_options({
                **unsharded.options, REPORT_KEY: _total_report([unsharded], opts, unsharded).to_dict(), SHARD_KEY: {
                    "chosen": "none", "modes": {"none": _shard_row(unsharded)},
                    "note": "every VW is one stage without recompute: sharding would only add its all-gather"}})
    # what the planning without sharding took besides its simulations: its screening, exact search and plan, which
    # a sharded planning repeats on the same formations whatever its budget (at 4096 devices, 4 to 17 s)
    searched_s = time.perf_counter() - start - simulated_s[0]
    for n, mode in enumerate(SHARD_MODES[1:]):
        if n > 0 and any(m != "none" for m, _ in found):
            break  # ZeRO-2 only where ZeRO-1 does not fit
        if found and opts.time_budget_s is not None and (room := left(1.0)) is not None and room < searched_s \
                and not _memory_shaped(cluster, profile, opts, found[0][1]):
            choice[mode] = {"skipped": f"its search (about {searched_s:.1f} s, as the plan without sharding took "
                                       f"besides its simulations) would not fit the time budget left "
                                       f"({room:.1f} s), and memory shaped no part of the plan without it"}
            break  # a plan was found, memory did not shape it: the budget decides
        sharded = replace(base, sync=_SYNCHRONOUS, max_tp=1,
                          sync_options=replace(opts.sync_options, shard=mode), time_budget_s=left(1.0 / (2 - n)))
        try:
            found.append((mode, plan(cluster, profile, global_batch, sharded, inner)))
        except PlannerError as e:
            choice[mode] = {"error": str(e)}
    if not found:
        assert first_error is not None
        raise first_error
    records: dict[str, dict[str, Any]] = {}
    for k, (mode, p) in enumerate(found):  # the sharded planning's plan, each segment at its lightest mode
        if mode != "none":
            p, records[mode] = _per_segment(opts, p, score, left(1.0))
            found[k] = (mode, p)
    chosen, best = _chosen_mode(opts, found, score)
    choice.update({m: {**_shard_row(p), **({"per_segment": records[m]["per_segment"]}
                                          if "per_segment" in records.get(m, {}) else {})} for m, p in found})
    segments = {"segments": records[chosen]["segments"]} if chosen in records else {}
    return best.with_options({**best.options, SHARD_KEY: {"chosen": chosen, "modes": choice, **segments},
                              REPORT_KEY: _total_report([p for _, p in found], opts, best).to_dict()})


def _chosen_mode(opts: PlannerOptions, found: list[tuple[str, Plan]], score: Scorer | None) -> tuple[str, Plan]:
    """The best of the shard modes' plans: by the simulator where it simulated every one, else by the closed forms;
    simulated where it was not (``_simulated_at_last``), and put back in ``found`` so."""
    simulated = _all_simulated(p for _, p in found)
    k, (chosen, best) = min(enumerate(found), key=lambda kmp: _rank_key(opts, kmp[1][1], simulated))
    if score is not None and best.prediction.simulated_iteration_s is None and opts.simulate_top_k != 0:
        best = _simulated_at_last(best, score)
        found[k] = (chosen, best)
    return chosen, best


def _simulated_at_last(p: Plan, score: Scorer) -> Plan:
    """``p``, the plan ``plan_shards`` chose by the closed forms once the budget was spent, simulated (its own
    planning left that to it: ``LeftToCaller``), with the call and its seconds in its planner report."""
    start = time.perf_counter()
    seconds = score(p)
    report = PlannerReport.from_dict(p.options[REPORT_KEY])
    report = replace(report, simulated=report.simulated + 1, simulations=report.simulations + 1,
                     past_budget_s=(report.past_budget_s or 0.0) + time.perf_counter() - start)
    p = replace(p, prediction=replace(p.prediction, simulated_iteration_s=seconds))
    return p.with_options({**p.options, REPORT_KEY: report.to_dict()})


def _memory_shaped(cluster: Cluster, profile: ModelProfile, opts: PlannerOptions, unsharded: Plan) -> bool:
    """Whether memory may have shaped ``unsharded``, the plan without sharding: it recomputes a layer, or some
    device could not hold the whole model (its weights, gradients and optimizer state, one sample's activations
    kept) and so a pipeline may have been forced. Where neither holds, sharding can only trade its all-gather for
    a smaller optimizer step, and a sharded planning past the budget is not worth its search (at 4096 devices x
    26 layers the ZeRO-1 plan was the same arrangement, 0.2% slower); where memory shaped it, sharding can make a
    shallower pipeline fit (1024 devices x 200 layers: 1.39 s against 1.90 s per iteration) and is planned
    whatever the budget."""
    if any(s.recompute for vw in unsharded.virtual_workers for s in vw.stages):
        return True
    whole = estimate_stage_memory(profile, 0, profile.num_layers, (), 1, 1, opts.optimizer,
                                  reduce_copy=opts.sync_options.reduce_copy)
    return any(tensor_budget(profile, d) < whole for d in cluster.devices)


def _counted(score: Scorer, seconds: list[float]) -> Scorer:
    """``score``, adding the seconds each call takes to ``seconds[0]``."""
    def counted(p: Plan) -> float:
        began = time.perf_counter()
        try:
            return score(p)
        finally:
            seconds[0] += time.perf_counter() - began
    return counted


def _per_segment(opts: PlannerOptions, p: Plan, score: Scorer | None,
                 left_s: float | None) -> tuple[Plan, dict[str, Any]]:
    """``p``, a sharded planning's plan, with each segment at the lightest shard mode under which its owners fit
    (``shards.lighten_segments``: sharding costs an all-gather on the critical path and a larger optimizer step
    where an owner steps more than its share), where that plan is not slower by the objective (``_rank_key``):
    by the simulator where ``p`` was simulated (one simulation more), else by both plans' closed forms at their own
    shards (``shards.reprice``); none of it once the budget is spent (``left_s``). And the record: ``segments``,
    each segment's mode in the plan returned and why; ``per_segment``, the two plans' times and whether the
    per-segment one was kept."""
    if left_s is not None and left_s <= 0:  # each lighter mode sized over the whole plan (4096 x 200: 7 s), then a
        # simulation or two closed forms
        untried = "lighter modes not tried: the time budget was spent"
        return p, {"segments": [segment_row(k, seg, untried) for k, seg in enumerate(p.segments())],
                   "per_segment": {"kept": False}}
    lighter, rows = lighten_segments(p)
    if lighter.layout.segment_shards == p.layout.segment_shards:
        return p, {"segments": rows}
    simulate = score is not None and p.prediction.simulated_iteration_s is not None
    refined = reprice(lighter)
    uniform = p if simulate else reprice(p)  # closed forms compared alike: each at its own shards
    if simulate:
        assert score is not None
        refined = replace(refined, prediction=replace(refined.prediction, simulated_iteration_s=score(refined)))
        p, refined = _one_more_simulation(p), _one_more_simulation(refined)
    kept = _rank_key(opts, refined, simulate) <= _rank_key(opts, uniform, simulate)
    times = {"kept": kept, "iteration_s": refined.prediction.iteration_s,
             "simulated_iteration_s": refined.prediction.simulated_iteration_s,
             "uniform_iteration_s": uniform.prediction.iteration_s,
             "uniform_simulated_iteration_s": p.prediction.simulated_iteration_s}
    if kept:
        return refined, {"segments": rows, "per_segment": times}
    return p, {"segments": _kept_uniform(rows, p, "the plan with per-segment modes was slower"), "per_segment": times}


def _kept_uniform(rows: list[dict[str, Any]], p: Plan, why: str) -> list[dict[str, Any]]:
    """``lighten_segments``' rows as ``p`` keeps its segments: a segment whose owners would fit a lighter mode
    says so, and why it was not taken."""
    modes = p.layout.segment_shards
    return [row if row["shard"] == modes[row["segment"]] else
            {**row, "shard": modes[row["segment"]], "why": f"{row['why']}, but kept {modes[row['segment']]}: {why}"}
            for row in rows]


def _one_more_simulation(p: Plan) -> Plan:
    """``p`` with one more call of the scoring function in its planner report."""
    report = PlannerReport.from_dict(p.options[REPORT_KEY])
    return p.with_options({**p.options, REPORT_KEY: replace(report, simulations=report.simulations + 1).to_dict()})


def _total_report(plans: Sequence[Plan], opts: PlannerOptions, chosen: Plan) -> PlannerReport:
    """What the planner did over several plannings that shared one budget: their counts added up, the
    last's reason to stop, the whole budget, and the ``chosen`` plan's simulation past it."""
    reports = [PlannerReport.from_dict(p.options[REPORT_KEY]) for p in plans]
    return replace(reports[-1], time_budget_s=opts.time_budget_s, past_budget_s=_past_budget_s(chosen),
                   **{key: sum(getattr(r, key) for r in reports)
                      for key in ("screened", "searched", "simulated", "simulations")})


def _past_budget_s(p: Plan) -> float | None:
    """The seconds ``p``'s own planning simulated it past its budget (``PlannerReport.past_budget_s``)."""
    return PlannerReport.from_dict(p.options[REPORT_KEY]).past_budget_s


def _shard_row(p: Plan) -> dict[str, Any]:
    return {"iteration_s": p.prediction.iteration_s, "simulated_iteration_s": p.prediction.simulated_iteration_s,
            "stages": max(len(vw.stages) for vw in p.virtual_workers), "vws": len(p.virtual_workers)}


def _simulate_degrees(found: list[tuple[int, Plan]], opts: PlannerOptions, score: Scorer | None,
                      start: float) -> list[tuple[int, Plan]]:
    """Each degree's plan simulated (where a scorer is given) while the budget that began at ``start`` lasts, so
    that the degrees are compared alike (``_best_degree``: among the simulated where any is)."""
    if score is None or opts.simulate_top_k == 0:
        return found

    def simulated(p: Plan) -> Plan:
        if p.prediction.simulated_iteration_s is not None:
            return p
        return replace(p, prediction=replace(p.prediction, simulated_iteration_s=score(p)))

    out = list(found)
    for n, (k, p) in enumerate(out):
        if opts.time_budget_s is None or time.perf_counter() - start < opts.time_budget_s:
            out[n] = (k, simulated(p))
    return out


def _best_degree(found: list[tuple[int, Plan]], opts: PlannerOptions) -> tuple[int, Plan]:
    """The best of each degree's plan: by the simulator where it simulated every one, else by the closed forms (a
    degree's plan left unsimulated past the budget for the caller, ``LeftToCaller``, would otherwise lose to any
    degree simulated within it)."""
    simulated = _all_simulated(p for _, p in found)
    return min(found, key=lambda kp: _rank_key(opts, kp[1], simulated))


def tp_degrees(cluster: Cluster, profile: ModelProfile, opts: PlannerOptions) -> list[int]:
    """The TP degrees to plan at: ``opts.tp`` alone where given; else 1 and every power of two up to
    ``opts.max_tp`` that some node's devices of one type can form, where the profile has TP rules."""
    if opts.tp is not None:
        if opts.tp > 1 and not _may_run_bsp(opts):
            raise PlannerError(f"--tp {opts.tp}: sync mode {opts.sync} does not run TP stages yet; use --sync bsp")
        if opts.tp > 1 and not profile.has_tp:
            raise PlannerError(f"--tp {opts.tp}: model {profile.name} has no layer with a TP rule (its profile's "
                               f"layers have no 'tp' split); plan it with --tp 1")
        if opts.tp > 1 and not tp_groups_possible(cluster, opts.tp):
            raise PlannerError(f"--tp {opts.tp}: no node of cluster {cluster.name} has {opts.tp} devices of one type")
        return [opts.tp]
    if not profile.has_tp or not _may_run_bsp(opts):  # the runtime runs TP stages under bsp only
        return [1]
    return [1] + [k for k in (2, 4, 8, 16) if k <= opts.max_tp and tp_groups_possible(cluster, k, every=not
                                                                                       opts.leave_out)]


def tp_groups_possible(cluster: Cluster, k: int, every: bool = False) -> bool:
    """Whether some node of ``cluster`` has ``k`` devices of one type (a TP group of ``k``); with ``every``, whether
    every device falls in such a group (``--use-every-device``: no device left out)."""
    if every:
        return all(len(tp_groups_of_node(n, k)) * k == len(n.devices) for n in cluster.nodes)
    return any(tp_groups_of_node(n, k) for n in cluster.nodes)


def as_tp_plan(p: Plan, cluster: Cluster, profile: ModelProfile) -> Plan:
    """A plan made on ``tp_cluster(cluster, k)`` and ``tp_rank_profile(profile, k)`` as a plan of ``cluster`` and
    ``profile``: each stage on its group's devices (``Stage.tp_group``), each device's memory entry repeated for
    the group's other devices (they hold the same)."""
    if p.profile is profile:
        return p
    groups = {d.name: d.tp_group for d in p.cluster.devices}
    vws = tuple(replace(vw, stages=tuple(replace(s, tp_group=groups[s.device]) for s in vw.stages))
                for vw in p.virtual_workers)
    memory = tuple(replace(m, device=d) for m in p.prediction.memory for d in groups.get(m.device) or (m.device,))
    return replace(p, cluster=cluster, profile=profile, virtual_workers=vws,
                   prediction=replace(p.prediction, memory=memory))


def _candidate_score(opts: PlannerOptions, p: Plan) -> float:
    """``Candidate.score`` of a plan: the closed form's objective (what ``_search`` ranks by)."""
    if opts.objective == "time-to-accuracy" and p.prediction.time_to_accuracy_s:
        return p.prediction.time_to_accuracy_s
    return p.prediction.iteration_s / p.global_batch


def _rank_key(opts: PlannerOptions, p: Plan, simulated: bool) -> float:
    """What the objective ranks plans by: time to accuracy where asked and known, else the iteration time per
    sample (``simulated``: the simulator's, which every plan compared has; else the closed form's)."""
    if opts.objective == "time-to-accuracy" and p.prediction.time_to_accuracy_s:
        return p.prediction.time_to_accuracy_s
    return (_iteration_s(p) if simulated else p.prediction.iteration_s) / p.global_batch


def _plan_degree(cluster: Cluster, profile: ModelProfile, global_batch: int, opts: PlannerOptions,
                 score: Scorer | None, budget: TimeBudget) -> Plan:
    """``plan`` at one TP degree: on the whole cluster, and without the nodes worth leaving out."""
    best = _plan_within(cluster, profile, global_batch, opts, score, budget)
    if not opts.leave_out or opts.strategy != "auto" or opts.objective != "throughput":
        return best  # a family asked for is planned on every device; time to accuracy may change the batch
    reports = [PlannerReport.from_dict(best.options[REPORT_KEY])]
    for drop in leave_out_candidates(cluster, profile):
        if budget.budget_s is not None and budget.left_s() <= 0:
            break  # the budget is the whole planning's: what is left of it, or nothing
        try:
            alt = _plan_within(cluster_without(cluster, drop), profile, global_batch, opts, score, budget)
        except PlannerError:
            continue
        reports.append(PlannerReport.from_dict(alt.options[REPORT_KEY]))
        alt_s, best_s = _alike(alt, best)
        if alt_s < (1 - LEAVE_OUT_GAIN) * best_s:
            best = replace(alt, cluster=cluster, options={**alt.options, "left_out": sorted(drop)})
    # every planning's candidates together, the whole cluster's and those without nodes; the budget's calls
    total = replace(reports[0], simulations=budget.simulations, past_budget_s=_past_budget_s(best),
                    **{k: sum(getattr(r, k) for r in reports) for k in ("screened", "searched", "simulated")})
    return best.with_options({**best.options, REPORT_KEY: total.to_dict()})


# a plan that leaves nodes out must be this much faster than the best on every device: a device left idle is
# one the user has paid for, and a gain inside the cost model's error is no reason to leave it
LEAVE_OUT_GAIN = 0.10


def _iteration_s(p: Plan) -> float:
    return p.prediction.simulated_iteration_s or p.prediction.iteration_s


def _all_simulated(plans: Iterable[Plan]) -> bool:
    """Whether the simulator replayed every one of ``plans``: only then are they compared by it, else all by their
    closed forms (a planning whose scorer is ``LeftToCaller`` may return its plan unsimulated past the budget)."""
    return all(p.prediction.simulated_iteration_s is not None for p in plans)


def _alike(a: Plan, b: Plan) -> tuple[float, float]:
    """Both plans' iteration seconds, compared alike (``_all_simulated``)."""
    if _all_simulated((a, b)):
        return _iteration_s(a), _iteration_s(b)
    return a.prediction.iteration_s, b.prediction.iteration_s


def leave_out_candidates(cluster: Cluster, profile: ModelProfile) -> list[frozenset[str]]:
    """Sets of nodes worth planning without (at most two, so planning takes at most twice as long again): the
    node(s) of the slowest NIC where NICs differ (one slow network link can hold every pipeline that crosses
    it, and every all-reduce), and the node of least compute where nodes differ in it. Never every node."""
    nodes = cluster.nodes
    if len(nodes) < 2:
        return []
    out: list[frozenset[str]] = []
    nic = {n.name: n.nic.bandwidth_bytes_per_s for n in nodes}
    if min(nic.values()) < max(nic.values()):
        out.append(frozenset(name for name, b in nic.items() if b == min(nic.values())))
    compute = {n.name: sum(d.peak_flops(profile.precision) for d in n.devices) for n in nodes}
    if min(compute.values()) < max(compute.values()):
        weakest = frozenset({min(compute, key=lambda name: compute[name])})
        if weakest not in out:
            out.append(weakest)
    return [drop for drop in out if len(drop) < len(nodes)]


def cluster_without(cluster: Cluster, drop: frozenset[str]) -> Cluster:
    """``cluster`` without the nodes named in ``drop``: the rest keep their names, devices, links and overrides
    (device indices renumbered), so a plan on it names the same devices as on the whole cluster."""
    nodes, index = [], 0
    for node in cluster.nodes:
        if node.name in drop:
            continue
        devices = []
        for d in node.devices:
            devices.append(replace(d, index=index))
            index += 1
        nodes.append(replace(node, devices=tuple(devices)))
    links = tuple(nl for nl in cluster.node_links if not set(nl.nodes) & drop)
    return Cluster(cluster.name, tuple(nodes), links)


def _plan_within(cluster: Cluster, profile: ModelProfile, global_batch: int, opts: PlannerOptions,
                 score: Scorer | None, budget: TimeBudget) -> Plan:
    if opts.sync == "auto" and profile.tp_degree > 1:  # the runtime runs TP stages under bsp only (runtime.tp)
        opts = replace(opts, sync="bsp")
    if opts.sync == "auto":  # plan for BSP, then pick the mode by predicted time to accuracy (docs/sync.md)
        base = _plan_within(cluster, profile, global_batch, replace(opts, sync="bsp"), score, budget)
        # every mode of the chosen plan simulated, where they fit; else the closed forms choose
        modes = len(modes_for(opts.sync_options))
        by_simulation = score is not None and opts.simulate_top_k != 0 and budget.fits([base] * modes)
        chosen = choose_sync_mode(base, opts.staleness_penalty, opts.target_samples, opts.critical_batch,
                                  budget.timed(score) if by_simulation and score is not None else None)
        report = PlannerReport.from_dict(base.options[REPORT_KEY])
        if chosen.prediction.simulated_iteration_s is None and base.prediction.simulated_iteration_s is not None:
            # the closed forms chose the mode: the chosen plan simulated all the same (bsp's is the base's)
            assert score is not None
            if chosen.sync == base.sync:
                chosen = replace(chosen, prediction=replace(
                    chosen.prediction, simulated_iteration_s=base.prediction.simulated_iteration_s))
            else:
                chosen, mode_s = _simulated_past_budget(chosen, score, budget)
                if mode_s is not None:
                    report = replace(report, past_budget_s=(report.past_budget_s or 0.0) + mode_s)
        report = replace(report, simulations=budget.simulations)
        return chosen.with_options({**chosen.options, REPORT_KEY: report.to_dict()})
    found, screened, searched = _search(cluster, profile, global_batch, opts, budget)
    plans, stopped_by, made_from = _simulate_best(cluster, profile, found, opts, score, budget)
    simulated, past_s = len(plans), None
    if plans and score is not None:
        plans = _rank_simulated(plans, opts, budget.timed(score), budget)
        plans[0] = _with_sync_predictions(cluster, profile, plans[0], made_from[id(plans[0].virtual_workers)], opts)
    else:  # the closed forms' best; simulated all the same where the budget stopped the simulations before it
        plans = [_to_plan(cluster, profile, found[0], opts)]
        if score is not None and stopped_by == "time budget":
            plans[0], past_s = _simulated_past_budget(plans[0], score, budget)
            simulated = 0 if past_s is None else 1
    report = PlannerReport(screened, searched, simulated, budget.simulations, stopped_by, opts.time_budget_s,
                           past_s)
    return plans[0].with_options({**plans[0].options, REPORT_KEY: report.to_dict()})


class LeftToCaller:
    """A scoring function whose simulation of a planning's chosen plan past the budget is left to the caller
    (``_simulated_past_budget``): ``plan_shards`` plans each shard mode in turn and, once the budget is spent,
    simulates only the plan it chooses among theirs by the closed forms (``_simulated_at_last``), not each
    mode's (at 4096 devices x 200 layers one simulation takes 20 s)."""

    def __init__(self, score: Scorer) -> None:
        self.score = score

    def __call__(self, p: Plan) -> float:
        return self.score(p)


def _simulated_past_budget(p: Plan, score: Scorer, budget: TimeBudget) -> tuple[Plan, float | None]:
    """``p``, the chosen plan, simulated though the budget stopped the simulations before it (a plan the simulator
    has not checked is not a plan: its closed form can be off by 2x at 4096 devices); and the seconds it took
    (``PlannerReport.past_budget_s``). Counted among the budget's simulations. ``p`` as it is, and None, where
    ``score`` leaves that simulation to the caller (``LeftToCaller``)."""
    if isinstance(score, LeftToCaller):
        return p, None
    start = budget.clock()
    seconds = budget.timed(score)(p)
    return replace(p, prediction=replace(p.prediction, simulated_iteration_s=seconds)), budget.clock() - start


def _simulate_best(cluster: Cluster, profile: ModelProfile, found: list[Candidate], opts: PlannerOptions,
                   score: Scorer | None, budget: TimeBudget) -> tuple[list[Plan], str, dict[int, Candidate]]:
    """The best candidates as plans, each with its simulated iteration time, as many as ``opts`` and the budget
    allow, in the closed form's order (the best one's reversed pipelines last); why no more were simulated; and
    the candidate each was made from, by the id of its ``virtual_workers`` (which ranking them keeps), so that
    the one chosen gets its sync predictions (``_with_sync_predictions``; none of them has them).

    They are simulated best first, the reverse of the best second (only the scoring function tells it from
    the best); with ``simulate_top_k=None``, past SIMULATE_AT_LEAST, only while the next candidate could beat
    the best simulated one by the closed form scaled by the smallest simulated / closed-form ratio seen.
    """
    if score is None:
        return [], "no scoring function", {}
    cap = SIMULATE_AT_MOST if opts.simulate_top_k is None else opts.simulate_top_k
    if cap == 0:
        return [], "simulate_top_k", {}
    if budget.left_s() <= 0:  # spent by the search: not even the best one's reverse is partitioned
        return [], "time budget", {}
    head: list[Candidate] = found[:cap]
    flipped = reversed_orders(cluster, profile, head[0], opts)
    # the best and its reverse, then each of them under the other schedules of AUTO_VARIANTS where every stage
    # still fits (schedule auto), each priced by its own closed form, then the rest: a simulation tells them apart
    bases = [c for c in (head[0], flipped) if c is not None]
    replays = [v for schedule in AUTO_VARIANTS for c in bases if schedule != c.schedule
               and (v := _as_schedule(cluster, profile, c, opts, schedule)) is not None] \
        if opts.schedule == "auto" else []
    candidates = [*head, *bases[1:], *replays]
    order = [0, *range(len(head), len(candidates)), *range(1, len(head))]
    timed = budget.timed(score)
    done: dict[int, Plan] = {}
    best = INF  # the best simulated objective
    ratio = INF  # the smallest simulated / closed-form iteration time seen
    stopped_by = "all candidates" if cap >= len(found) else "simulate_top_k"
    for q in order:
        c = candidates[q]
        looked = sum(1 for e in done if e < len(head))  # simulated of the closed form's best, the reverse not
        if opts.simulate_top_k is None and q < len(head) and looked >= SIMULATE_AT_LEAST \
                and _objective(opts, c.global_batch, c.iteration_s * ratio * (1 - PLAUSIBLE_FRACTION)) >= best:
            stopped_by = "closed form"
            break
        p = _to_plan(cluster, profile, c, opts, predictions=False)
        if not budget.fits([p]):
            stopped_by = "time budget"
            break
        t = timed(p)
        done[q] = replace(p, prediction=replace(p.prediction, simulated_iteration_s=t))
        best = min(best, _objective(opts, c.global_batch, t))
        ratio = min(ratio, t / c.iteration_s)
    return [done[q] for q in sorted(done)], stopped_by, {id(p.virtual_workers): candidates[q] for q, p in done.items()}


#: the schedules ``--schedule auto`` replays its best candidates under (each but the candidate's own), in this
#: order (a tie keeps the first simulated: the candidate, then these, each holding more activations than the one
#: before)
AUTO_VARIANTS = ("1f1b", "1f1b-eager", "gpipe")


def _as_schedule(cluster: Cluster, profile: ModelProfile, c: Candidate, opts: PlannerOptions,
                 schedule: str) -> Candidate | None:
    """``c`` (partitioned for 1F1B, run under 1F1B or 1F1B-eager) under ``schedule`` on the same partitions,
    recompute sets and micro-batches, priced by that schedule's closed form, where it holds other activations
    somewhere and every stage still fits its device's tensor budget; else None.

    The search plans for 1F1B, which holds the fewest activations, and prices each candidate by the better of
    1F1B's and 1F1B-eager's forms (``_eager_if_faster``; their transfers in their cycles,
    ``cost.estimate_1f1b_period``). A simulation tells them apart better: 1F1B's steady state alternates one
    forward and one backward, so a stage waits for the gradient of a micro-batch it sent out one round trip
    earlier, and every transfer and every difference between stages' speeds lands on that round trip;
    1F1B-eager holds one micro-batch more for slack, GPipe's forwards and backwards each flow one way. On
    ``examples/clusters/pipetorch.toml`` (gpt2-small, batch 16) the chosen spread-2 plan simulates to 148.9 ms
    under 1F1B, 140.0 under 1F1B-eager and 143.4 under GPipe.
    """
    if c.schedule not in ("1f1b", "1f1b-eager") or schedule == c.schedule:
        return None
    copies = _reduce_copy(opts, len(c.parts))
    state_share, grad_share = _shares(opts, len(c.parts))
    other = False
    for r in c.parts:
        p = len(r.devices)
        for j, d in enumerate(r.devices):
            n = in_flight(schedule, r.m, p, j)
            other = other or n != in_flight(c.schedule, r.m, p, j)
            need = estimate_stage_memory(profile, r.cuts[j], r.cuts[j + 1], r.recompute[j], r.b, n,
                                         opts.optimizer, reduce_copy=copies, state_share=state_share,
                                         grad_share=grad_share, micro_batches=r.m)
            if need > tensor_budget(profile, d):
                return None
    if not other:
        return None
    blocking = opts.sync_options.transfers == "blocking"
    parts = [priced_as(r, schedule, blocking) for r in c.parts]
    return _assemble(cluster, profile, c.formation, schedule, c.global_batch, parts, c.mini_batches, opts)


def _objective(opts: PlannerOptions, global_batch: int, iteration_s: float) -> float:
    """Lower is better: seconds per sample, or (time to accuracy) that times the samples-to-accuracy factor."""
    if opts.objective == "time-to-accuracy" and opts.critical_batch:
        return iteration_s * estimate_samples_to_accuracy_factor(global_batch, opts.critical_batch) / global_batch
    return iteration_s / global_batch


def candidate_plans(cluster: Cluster, profile: ModelProfile, global_batch: int, count: int,
                    options: PlannerOptions | None = None, **kwargs: Any) -> list[Plan]:
    """The ``count`` best candidates of the search as plans, best first by the closed forms (none simulated).

    For benchmarks that simulate them all, to see how often the planner's choice is beaten
    (benchmarks/planner_scale.py).
    """
    opts = options if options is not None else PlannerOptions(**kwargs)
    if options is not None and kwargs:
        opts = replace(options, **kwargs)
    return [_to_plan(cluster, profile, c, opts) for c in search(cluster, profile, global_batch, opts)[:count]]


def _rank_simulated(plans: list[Plan], opts: PlannerOptions, score: Callable[[Plan], float],
                    budget: TimeBudget) -> list[Plan]:
    """``plans`` (simulated) ordered by their simulated objective, then the robust choice first, its draws
    simulated for as many of the best as fit in the budget (the draws of none where not even two fit)."""
    def objective(p: Plan, t: float) -> float:
        return _objective(opts, p.global_batch, t)

    def key(p: Plan) -> float:
        assert p.prediction.simulated_iteration_s is not None
        return objective(p, p.prediction.simulated_iteration_s)
    ranked = sorted(plans, key=key)
    if len(ranked) < 2:
        return ranked
    draws = opts.robust_draws if has_spread(ranked[0].profile) else 0
    count = len(ranked)
    while draws and count >= 2 and not budget.fits([p for p in ranked[:count] for _ in range(draws)]):
        count -= 1
    if count < 2:
        draws, count = 0, len(ranked)
    return rank_robust(ranked[:count], objective, score, draws, opts.robust_seed)[0] + ranked[count:]

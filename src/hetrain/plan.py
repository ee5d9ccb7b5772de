"""A Plan: every decision the planner made, and what it predicts. Plan is data.

A plan is a JSON file a person can read and edit (docs/plan.md). It embeds the
cluster and the profile it was made for, so the simulator and the runtime need
nothing else. Picture of a plan with two virtual workers (VWs)::

    VW0  mini-batch 96, 4 x 24   fast:0 [0..12) ──► fast:1 [12..24)
    VW1  mini-batch 32, 2 x 16   old:0  [0..8)  ──► old:1  [8..24)
    sync bsp: segment [0..8) among fast:0, old:0; [8..12) among fast:0, old:1; ...

Example:
    >>> plan = load_plan("plan.json")           # doctest: +SKIP
    >>> print(plan.summary())                   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from hetrain.cluster import Cluster, ClusterError, parse_cluster
from hetrain.device_groups import describe_devices
from hetrain.errors import InputError
from hetrain.fields import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICRO_BATCHES,
    check_int,
    load_json_object,
    optional_number,
    path_of,
    require_int,
    require_list,
    require_mapping,
    require_number,
    require_object,
    require_str,
    show,
)
from hetrain.profile import OPTIMIZER_NAMES, ModelProfile, ProfileError, parse_profile
from hetrain.sync_layout import (
    Segment,
    SyncLayout,
    SyncLayoutError,
    SyncOptions,
    build_sync_layout,
    check_mode_options,
    check_sync_section,
)
from hetrain.sync_mode import SYNC_MODES, SyncMode, SyncModeName, sync_mode
from hetrain.units import format_bytes, format_time

Schedule = Literal["gpipe", "1f1b", "1f1b-eager"]
Optimizer = Literal["sgd", "momentum", "adam"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "1f1b-eager")
OPTIMIZERS: tuple[str, ...] = OPTIMIZER_NAMES  # profile.OPTIMIZER_NAMES: one vocabulary
#: 2: the ``"sync"`` section holds the mode, its typed options and the sync layout (was the mode's name);
#: 3: a stage may run on a TP group (``"tp_group"``). A version 2 plan reads as it is (every stage on one device).
#: 5: a segment's parameter server is sharded (``ps_shards``, sync option ``placement = "sharded"``, the new
#: default; was one ``ps_host``). A version 2-4 plan reads as it was laid out (``_sync_section_as_v5``).
FORMAT_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)
#: the largest TP degree a stage may have (the devices of one node; DGX-class nodes hold 8, a few 16)
MAX_TP = 16


class PlanError(InputError):
    """A plan that is inconsistent with itself, its cluster or its profile."""


# The keys of each object of plan.json: what ``to_dict`` writes (every format_version wrote these), and
# all that ``parse_plan`` reads. A key not here is refused rather than ignored, so that a hand edit with a
# slip (``"recomput"``) is not silently dropped. ``options`` is the planner's free-form record: not checked.
PLAN_KEYS = frozenset({"format_version", "model", "global_batch", "schedule", "sync", "optimizer", "strategy",
                       "formation", "options", "prediction", "virtual_workers", "cluster", "profile"})
VIRTUAL_WORKER_KEYS = frozenset({"mini_batch", "micro_batches", "predicted_pipeline_s", "stages"})
STAGE_KEYS = frozenset({"device", "tp_group", "layers", "recompute", "predicted_forward_s", "predicted_backward_s",
                        "predicted_memory_bytes"})
PREDICTION_KEYS = frozenset({"iteration_s", "samples_per_s", "pipeline_s", "sync_s", "optimizer_s",
                             "simulated_iteration_s", "time_to_accuracy_s", "memory"})
DEVICE_MEMORY_KEYS = frozenset({"device", "peak_bytes", "capacity_bytes"})
SYNC_SECTION_KEYS = frozenset({"mode", "options", "segments", "shard_weights", "segment_shards"})


def check_known_keys(data: Mapping[str, Any], known: frozenset[str] | set[str], where: str, what: str) -> None:
    """Refuse a key of ``data`` (the object at field path ``where``) that is not in ``known``: one line naming
    the place, the key, its value and the nearest known key.

    Example:
        >>> check_known_keys({"recomput": [1]}, STAGE_KEYS, "virtual_workers[0].stages[1]", "a stage")
        Traceback (most recent call last):
        ...
        hetrain.plan.PlanError: virtual_workers[0].stages[1]: unknown key 'recomput' (= [1]); did you mean ...
    """
    extra = [k for k in data if k not in known]
    if not extra:
        return
    key = extra[0]
    near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6) or \
        [k for k in sorted(known) if k.startswith(str(key))][:1]  # "peak" -> "peak_bytes"
    hint = f"; did you mean {near[0]!r}?" if near else ""
    also = f"; also unknown: {', '.join(map(repr, extra[1:4]))}{', ...' if len(extra) > 4 else ''}" \
        if len(extra) > 1 else ""
    raise PlanError(f"{where or 'the top level'}: unknown key {key!r} (= {show(data[key])}){hint}{also} "
                    f"({what} has {', '.join(sorted(known))})")


@dataclass(frozen=True)
class Stage:
    """Layers ``[first_layer, end_layer)`` on one device or on a TP group, with their recompute set.

    ``tp_group``: empty for a stage on ``device`` alone; else the k devices (k a power of two >= 2, all of one
    type in one node, ``device`` first) that split each layer's matrices (tensor parallelism of degree k).
    ``device`` leads the group: the schedule's actions are named by it, and every device of the group runs them.
    The ``predicted_*`` figures are per micro-batch of the VW's micro-batch size, per device of the group.
    """

    device: str
    first_layer: int
    end_layer: int
    recompute: tuple[int, ...] = ()
    predicted_forward_s: float = 0.0
    predicted_backward_s: float = 0.0
    predicted_memory_bytes: float = 0.0
    tp_group: tuple[str, ...] = ()

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device that runs the stage: its TP group, or its one device."""
        return self.tp_group or (self.device,)

    @property
    def tp(self) -> int:
        """The stage's tensor-parallel degree (1: one device)."""
        return len(self.tp_group) or 1

    def to_dict(self) -> dict[str, Any]:
        group = {"tp_group": list(self.tp_group)} if self.tp_group else {}
        return {
            "device": self.device,
            **group,
            "layers": [self.first_layer, self.end_layer],
            "recompute": list(self.recompute),
            "predicted_forward_s": self.predicted_forward_s,
            "predicted_backward_s": self.predicted_backward_s,
            "predicted_memory_bytes": self.predicted_memory_bytes,
        }


@dataclass(frozen=True)
class VirtualWorker:
    """An ordered list of stages on distinct devices that holds the whole model.

    It processes ``mini_batch`` samples per iteration as ``micro_batches``
    micro-batches, sized as evenly as possible (``micro_batch_sizes``).
    """

    stages: tuple[Stage, ...]
    mini_batch: int
    micro_batches: int
    predicted_pipeline_s: float = 0.0

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch (the one costs are predicted for)."""
        return -(-self.mini_batch // self.micro_batches)

    @property
    def micro_batch_sizes(self) -> list[int]:
        """Sizes of micro-batches 0..m-1: ``mini_batch`` split as evenly as possible."""
        q, r = divmod(self.mini_batch, self.micro_batches)
        return [q + 1 if i < r else q for i in range(self.micro_batches)]

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mini_batch": self.mini_batch,
            "micro_batches": self.micro_batches,
            "predicted_pipeline_s": self.predicted_pipeline_s,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak memory of one device against its capacity."""

    device: str
    peak_bytes: float
    capacity_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "peak_bytes": self.peak_bytes, "capacity_bytes": self.capacity_bytes}


@dataclass(frozen=True)
class Prediction:
    """What the cost model (and, where run, the simulator) predicts for one iteration."""

    iteration_s: float
    samples_per_s: float
    pipeline_s: float
    sync_s: float
    optimizer_s: float
    memory: tuple[DeviceMemory, ...] = ()
    simulated_iteration_s: float | None = None
    time_to_accuracy_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration_s": self.iteration_s,
            "samples_per_s": self.samples_per_s,
            "pipeline_s": self.pipeline_s,
            "sync_s": self.sync_s,
            "optimizer_s": self.optimizer_s,
            "simulated_iteration_s": self.simulated_iteration_s,
            "time_to_accuracy_s": self.time_to_accuracy_s,
            "memory": [m.to_dict() for m in self.memory],
        }


@dataclass(frozen=True)
class Plan:
    """Every decision of the planner, and its prediction.

    Attributes:
        model: the profile's model name.
        global_batch: samples per iteration over all VWs.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"1f1b-eager"`` (``hetrain.schedule.generate``).
        sync: the sync mode among VWs, by name (as plan.json stores it); ``sync_mode`` has its rules.
        sync_options: the mode's parameters (staleness, period, bucket sizes, all-reduce algorithm...).
        layout: every sync decision (segments, buckets and their algorithms, parameter-server hosts), made
            from the stages and ``sync_options`` when the plan is built (``sync_layout.build_sync_layout``);
            the schedule, the simulator and the runtime read it.
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"`` (sets optimizer-state memory).
        virtual_workers: the VWs, each a pipeline over its devices.
        prediction: the predicted iteration time, throughput and memory.
        strategy: ``"dp"``, ``"pp"`` or ``"hybrid"``: the family the plan belongs to.
        formation: how the VWs were formed (``"node"``, ``"spread"``, ``"contiguous"``...).
        cluster: the cluster the plan is for.
        profile: the model profile the plan is for.
        options: what the planner recorded: objective, strategy, critical batch, every mode's prediction
            (``sync_predictions``), the mode comparison (``sync_choice``).
    """

    model: str
    global_batch: int
    schedule: Schedule
    sync: SyncModeName
    optimizer: Optimizer
    virtual_workers: tuple[VirtualWorker, ...]
    prediction: Prediction
    strategy: str
    formation: str
    cluster: Cluster = field(repr=False)
    profile: ModelProfile = field(repr=False)
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    sync_options: SyncOptions = field(default_factory=SyncOptions)
    #: with ``sync_options.shard``: device -> what sizes its shards of the segments it owns (the bytes its stage
    #: leaves free, or its speed: ``sync_options.shard_by``); plan.json's ``sync.shard_weights``
    shard_weights: Mapping[str, float] = field(default_factory=dict)
    #: per segment (``layout.segments``' order), what its owners shard, where the planner chose it per segment
    #: (``planner.shards``): the most of them is ``sync_options.shard``; empty: every shared segment shards as
    #: ``sync_options.shard`` says. plan.json's ``sync.segment_shards``
    segment_shards: tuple[str, ...] = ()
    layout: SyncLayout = field(init=False, repr=False, compare=False)
    #: the sync mode's rules (``hetrain.sync_mode``), looked up from ``sync`` when the plan is built
    sync_mode: SyncMode = field(init=False, repr=False, compare=False)
    #: device -> (VW index, stage index) of the stage it runs (``stage_of``), made once: the planner asks it of
    #: every device, thousands of them, for each per-segment shard mode it tries (``planner.shards``)
    _stage_index: Mapping[str, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_plan(self)
        object.__setattr__(self, "sync_mode", sync_mode(self.sync))
        object.__setattr__(self, "_stage_index", {d: (v, j) for v, vw in enumerate(self.virtual_workers)
                                                  for j, s in enumerate(vw.stages) for d in s.devices})
        stages = [[(s.device, s.first_layer, s.end_layer) for s in vw.stages] for vw in self.virtual_workers]
        layout = build_sync_layout(self.cluster, self.profile, stages, self.sync, self.sync_options,
                                   self.layer_tp_degrees() if self.max_tp > 1 else None, self.shard_weights,
                                   self.segment_shards)
        object.__setattr__(self, "layout", layout)

    # --- derived views -----------------------------------------------------

    @property
    def precision(self) -> str:
        """The precision of compute the plan was made for and runs in: its profile's (``hetrain.amp``)."""
        return self.profile.precision

    @property
    def devices_used(self) -> list[str]:
        """Every device that runs a stage, TP groups' devices included, in stage order."""
        return [d for vw in self.virtual_workers for s in vw.stages for d in s.devices]

    @property
    def max_tp(self) -> int:
        """The largest TP degree of any stage (1: no stage splits its layers)."""
        return max(s.tp for vw in self.virtual_workers for s in vw.stages)

    def layer_tp_degrees(self) -> list[int]:
        """Per layer, the TP degree it runs at (every VW runs it at the same: ``validate_plan``)."""
        return [s.tp for s in self.virtual_workers[0].stages for _ in s.layers]

    def stage_on(self, device: str) -> Stage:
        """The stage ``device`` runs (as the stage's device or a member of its TP group)."""
        v, j = self.stage_of(device)
        return self.virtual_workers[v].stages[j]

    @property
    def unused_devices(self) -> list[str]:
        used = set(self.devices_used)
        return [d.name for d in self.cluster.devices if d.name not in used]

    def segments(self) -> tuple[Segment, ...]:
        """Layers grouped by the set of devices that hold them (``layout.segments``).

        Under data parallelism across VWs that partition the model differently,
        each segment's gradients are reduced among exactly its owners.
        """
        return self.layout.segments

    def shard_shares(self, device: str, share: float | None = None) -> tuple[float, float]:
        """(optimizer state, gradients): the shares of its stage's state and gradients ``device`` keeps between
        iterations, over the stage's parameter bytes (1, 1 where nothing is sharded; ``Segment.shard_of``). Each
        segment counts at its own mode: its state where sharded, its gradients too under ZeRO-2.

        ``share``: the share of each sharded segment of its stage it would keep in place of its own (what the
        planner weighs shards by: ``planner.shards.shard_weights``)."""
        if self.sync_options.shard == "none":
            return (1.0, 1.0)
        v, j = self.stage_of(device)
        stage = self.virtual_workers[v].stages[j]
        total = state = grad = 0.0
        for seg, size in self._segment_bytes(stage.first_layer, stage.end_layer):
            mine = 1.0
            if seg.sharded and seg.owner_position(stage.device) is not None:
                mine = seg.shard_of(stage.device) if share is None else share
            total += size
            state += size * mine
            grad += size * (mine if seg.shard == "optimizer+gradients" else 1.0)
        return (state / total, grad / total) if total > 0 else (1.0, 1.0)

    def _segment_bytes(self, first: int, end: int) -> tuple[tuple[Segment, float], ...]:
        """Each segment over layers ``[first, end)`` with its parameter bytes among them, kept per range: a plan's
        thousands of stages have a few dozen ranges (``shard_shares``)."""
        found: dict[tuple[int, int], tuple[tuple[Segment, float], ...]] = \
            self.__dict__.setdefault("_segment_bytes_cache", {})
        if (first, end) not in found:
            layers = self.profile.layers
            found[(first, end)] = tuple(
                (seg, float(sum(x.param_bytes for x in layers[max(seg.first_layer, first):min(seg.end_layer, end)])))
                for seg in self.layout.segments_over(first, end))
        return found[(first, end)]

    def with_sync(self, mode: str | None = None, options: SyncOptions | None = None) -> Plan:
        """This plan under another sync mode or options: the layout is made anew, the prediction kept
        (``planner.sync.repredict_sync`` re-predicts it). The per-segment shard modes stay where the options
        shard as they did; under another ``shard`` option every shared segment shards as it says."""
        options = options or self.sync_options
        segment_shards = self.segment_shards if options.shard == self.sync_options.shard else ()
        return replace(self, sync=mode or self.sync, sync_options=options,  # type: ignore[arg-type]
                       segment_shards=segment_shards)

    def stage_of(self, device: str) -> tuple[int, int]:
        """(VW index, stage index) of the stage ``device`` runs (its device, or a member of its TP group)."""
        found = self._stage_index.get(device)
        if found is None:
            raise PlanError(f"device {device} holds no stage in this plan")
        return found

    # --- (de)serialisation ---------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "global_batch": self.global_batch,
            "schedule": self.schedule,
            "sync": {**self.layout.to_dict(),
                     **({"shard_weights": dict(self.shard_weights)} if self.sync_options.shard != "none" else {}),
                     **({"segment_shards": list(self.segment_shards)} if self.segment_shards else {})},
            "optimizer": self.optimizer,
            "strategy": self.strategy,
            "formation": self.formation,
            "options": dict(self.options),
            "prediction": self.prediction.to_dict(),
            "virtual_workers": [vw.to_dict() for vw in self.virtual_workers],
            "cluster": self.cluster.to_dict(),
            "profile": self.profile.to_dict(),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Plan:
        return parse_plan(data)

    def save(self, path: str | Path) -> None:
        """Write plan.json atomically (temporary file, then rename)."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(p)

    def _shard_lines(self) -> list[str]:
        """The summary's lines on sharding: each device's share, each segment's mode where they differ, and
        what the planner compared (``options["shard_choice"]``, ``planner.search.plan_shards``)."""
        lines = []
        if self.sync_options.shard != "none":
            shares = ", ".join(f"{d} {self.shard_shares(d)[0]:.0%}" for d in self.devices_used)
            how = f"per segment, at most {self.sync_options.shard}" if self.layout.mixed_shards \
                else self.sync_options.shard
            lines.append(f"  sharded ({how}, by {self.sync_options.shard_by}): each device keeps this share of its "
                         f"stage's optimizer state: {shares}")
        shard_choice = self.options.get("shard_choice")
        if not isinstance(shard_choice, Mapping):
            shard_choice = {}
        if self.layout.mixed_shards:  # each shared segment's mode, and why where the planner said
            why = {tuple(r["layers"]): r.get("why") for r in shard_choice.get("segments", ())
                   if isinstance(r, Mapping) and isinstance(r.get("layers"), list)}
            lines.append("  shard per segment: " + "; ".join(
                f"[{seg.first_layer}, {seg.end_layer}) {seg.shard}"
                + (f" ({reason})" if (reason := why.get((seg.first_layer, seg.end_layer))) else "")
                for seg in self.layout.segments if seg.shared))
        if isinstance(shard_choice.get("modes"), Mapping):
            rows = []
            for mode, row in shard_choice["modes"].items():
                t = row.get("simulated_iteration_s") or row.get("iteration_s") if isinstance(row, Mapping) else None
                skipped = isinstance(row, Mapping) and "skipped" in row
                rows.append(f"shard {mode}: {format_time(t)}" if t else
                            f"shard {mode}: not planned (the time budget)" if skipped else f"shard {mode}: no plan")
            lines.append(f"  planned with {'; '.join(rows)}; chose shard {shard_choice.get('chosen')}")
        return lines

    def with_options(self, options: Mapping[str, Any]) -> Plan:
        """This plan with ``options`` instead of its own, not validated or laid out again: nothing ``__post_init__``
        checks or derives reads the options. ``dataclasses.replace`` would do both again, 40 ms per call on a
        4096-device plan, and the planner records what it did in the options a dozen times per plan."""
        other = copy.copy(self)
        object.__setattr__(other, "options", dict(options))
        return other

    def summary(self) -> str:
        """A readable table: VWs, stages, batch split, prediction and memory."""
        pr = self.prediction
        lines = [
            f"plan for {self.model} on {self.cluster.name}: {self.strategy} ({self.formation}), "
            f"{len(self.virtual_workers)} VW(s), schedule {self.schedule}, sync {self.sync}, "
            f"global batch {self.global_batch}, precision {self.precision}",
        ]
        mem = {m.device: m for m in pr.memory}
        for v, vw in enumerate(self.virtual_workers):
            lines.append(
                f"  VW{v}: mini-batch {vw.mini_batch} = {vw.micro_batches} micro-batches of <= "
                f"{vw.micro_batch_size}, pipeline {format_time(vw.predicted_pipeline_s)}"
            )
            for j, s in enumerate(vw.stages):
                m = mem.get(s.device)
                mem_text = "?"
                if m:  # the device's predicted peak (its runtime footprint in), and what it leaves free
                    free = m.capacity_bytes - m.peak_bytes
                    mem_text = (f"{format_bytes(m.peak_bytes)} / {format_bytes(m.capacity_bytes)}, margin "
                                f"{format_bytes(free)} ({free / m.capacity_bytes:.0%})" if m.capacity_bytes > 0
                                else f"{format_bytes(m.peak_bytes)} / 0 B")
                rc = f" recompute {len(s.recompute)} layer(s)" if s.recompute else ""
                where = s.device if s.tp == 1 else f"{s.device} TP{s.tp}"
                lines.append(
                    f"    stage {j}  {where:<12} layers [{s.first_layer:>3}, {s.end_layer:>3})"
                    f"  F {format_time(s.predicted_forward_s):>9}  B {format_time(s.predicted_backward_s):>9}"
                    f"  mem {mem_text}{rc}"
                )
        groups = [s for vw in self.virtual_workers for s in vw.stages if s.tp > 1]
        if groups:
            lines.append("  TP groups: " + "; ".join(f"{s.device} = {s.tp_group[0]} .. {s.tp_group[-1]} ({s.tp})"
                                                     for s in groups[:8])
                         + (f"; ... {len(groups) - 8} more" if len(groups) > 8 else ""))
        if unused := self.unused_devices:  # by node and type: a plan on 4096 devices may leave a thousand unused
            lines.append(f"  unused: {len(unused)} device{'s' if len(unused) > 1 else ''} — "
                         f"{describe_devices(self.cluster, unused)}")
        tp_choice = self.options.get("tp_choice")
        if isinstance(tp_choice, Mapping) and isinstance(tp_choice.get("degrees"), Mapping):
            rows = []
            for k, row in tp_choice["degrees"].items():
                t = row.get("simulated_iteration_s") or row.get("iteration_s") if isinstance(row, Mapping) else None
                pruned = isinstance(row, Mapping) and "pruned" in row
                skipped = isinstance(row, Mapping) and "skipped" in row
                rows.append(f"TP {k}: {format_time(t)}" if t else f"TP {k}: cannot beat it" if pruned
                            else f"TP {k}: not planned within the time budget" if skipped else f"TP {k}: no plan")
            lines.append(f"  planned at {'; '.join(rows)}; chose TP {tp_choice.get('chosen')}")
        lines += self._shard_lines()
        learned = self.options.get("time_model")
        if isinstance(learned, Mapping) and learned.get("types"):
            lines.append(f"  layer times for {', '.join(map(str, learned['types']))} from the learned model "
                         f"({learned.get('file')})")
        sim = ""
        if pr.simulated_iteration_s:
            sim = (f"; simulated {format_time(pr.simulated_iteration_s)}, "
                   f"{self.global_batch / pr.simulated_iteration_s:.1f} samples/s")
        lines.append(
            f"  predicted iteration {format_time(pr.iteration_s)} (pipeline {format_time(pr.pipeline_s)}"
            f" + sync {format_time(pr.sync_s)} + optimizer {format_time(pr.optimizer_s)}), "
            f"{pr.samples_per_s:.1f} samples/s{sim}"
        )
        return "\n".join(lines)


#: the field of each ``--metrics-out`` row that names the plan trained (``plan_fingerprint``)
PLAN_FINGERPRINT_KEY = "plan_fingerprint"


def plan_fingerprint(plan: Plan) -> str:
    """A short hash of what a run of ``plan`` executes: model, precision, batches, stages (devices, layers,
    recompute sets), schedule, sync mode and options, optimizer.

    Predictions, the profile's times and the planner's ``options`` are left out, so a plan re-predicted
    (``hetrain plan --from``) or re-planned with a calibrated profile into the same stages keeps it; any
    change to what runs changes it. The runtime stamps it on every metrics row (``runtime.report.metrics``) and
    ``hetrain calibrate`` refuses metrics of another plan. (``elastic.plan_digest`` hashes the whole plan.)

    Example:
        >>> plan_fingerprint(load_plan("plan.json"))          # doctest: +SKIP
        '3f9c0a51be27d410'
    """
    what = {
        "model": plan.model, "precision": plan.precision, "global_batch": plan.global_batch,
        "schedule": plan.schedule, "sync": plan.sync, "sync_options": plan.sync_options.to_dict(),
        "optimizer": plan.optimizer,
        "virtual_workers": [[vw.mini_batch, vw.micro_batches,
                             [[s.device, s.first_layer, s.end_layer, list(s.recompute)]
                              + ([list(s.tp_group)] if s.tp_group else []) for s in vw.stages]]
                            for vw in plan.virtual_workers],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def validate_plan(plan: Plan) -> None:
    """Check a plan against itself, its cluster and its profile.

    Every VW covers all layers with contiguous stages on distinct devices that
    exist; no device is in two stages; the mini-batches add up to the global
    batch; recompute sets lie inside their stage; no stage's predicted memory
    exceeds its device's.
    """
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, got {plan.schedule!r}")
    if plan.sync not in SYNC_MODES:
        raise PlanError(f"sync mode must be one of {SYNC_MODES}, got {plan.sync!r}")
    if plan.optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer must be one of {OPTIMIZERS}, got {plan.optimizer!r}")
    if not plan.virtual_workers:
        raise PlanError("a plan needs at least one virtual worker")
    names = {d.name for d in plan.cluster.devices}
    seen: set[str] = set()
    L = plan.profile.num_layers
    for v, vw in enumerate(plan.virtual_workers):
        if vw.mini_batch < 1 or vw.micro_batches < 1:
            raise PlanError(f"VW{v}: mini_batch {vw.mini_batch} and micro_batches {vw.micro_batches} must be >= 1")
        if vw.micro_batches > vw.mini_batch:
            raise PlanError(f"VW{v}: {vw.micro_batches} micro-batches for a mini-batch of {vw.mini_batch}")
        expect = 0
        for j, s in enumerate(vw.stages):
            for d in s.devices:
                if d not in names:
                    raise PlanError(f"VW{v} stage {j}: device {d!r} is not in cluster {plan.cluster.name!r}")
            _check_tp_group(plan.cluster, s, f"VW{v} stage {j}")
            for d in s.devices:
                if d in seen:
                    raise PlanError(f"VW{v} stage {j}: device {d} already holds another stage")
                seen.add(d)
            if s.first_layer != expect or s.end_layer <= s.first_layer:
                raise PlanError(
                    f"VW{v} stage {j}: layers [{s.first_layer}, {s.end_layer}) do not continue from layer {expect}"
                )
            bad = [i for i in s.recompute if not s.first_layer <= i < s.end_layer]
            if bad:
                raise PlanError(f"VW{v} stage {j}: recompute layers {bad} are outside [{s.first_layer}, {s.end_layer})")
            expect = s.end_layer
        if expect != L:
            raise PlanError(f"VW{v}: stages cover layers [0, {expect}) but the model has {L} layers")
    _check_tp_degrees(plan)
    total = sum(vw.mini_batch for vw in plan.virtual_workers)
    if total != plan.global_batch:
        raise PlanError(f"mini-batches add up to {total}, global batch is {plan.global_batch}")
    misplaced = sorted(set(plan.options) & set(SyncOptions().to_dict()))
    if misplaced:
        raise PlanError(f"plan options {misplaced[0]!r} is a sync option: it belongs in sync.options "
                        f"(Plan.sync_options; `hetrain plan --from PLAN --sync-option {misplaced[0]}=...`)")
    _check_memory(plan)


def _check_tp_group(cluster: Cluster, s: Stage, where: str) -> None:
    """A TP group is k >= 2 distinct devices, k a power of two, of one type in one node, led by the stage's device."""
    if not s.tp_group:
        return
    k = len(s.tp_group)
    if k < 2 or k & (k - 1) or k > MAX_TP:
        raise PlanError(f"{where}: tp_group has {k} device(s); a TP group has 2, 4, 8 or 16 (a power of two "
                        f"<= MAX_TP {MAX_TP})")
    if s.tp_group[0] != s.device:
        raise PlanError(f"{where}: tp_group {list(s.tp_group)} must start with the stage's device {s.device!r}")
    if len(set(s.tp_group)) != k:
        raise PlanError(f"{where}: tp_group {list(s.tp_group)} names a device twice")
    devs = [cluster.device(d) for d in s.tp_group]
    nodes = sorted({d.node for d in devs})
    if len(nodes) > 1:
        raise PlanError(f"{where}: tp_group {list(s.tp_group)} spans nodes {', '.join(nodes)}; a TP group lies "
                        f"in one node (its collectives run on the node's own link)")
    types = sorted({d.type_name for d in devs})
    if len(types) > 1:
        raise PlanError(f"{where}: tp_group {list(s.tp_group)} mixes device types {', '.join(types)}; a TP group "
                        f"is of one type (its ranks wait for each other at every collective)")


def _check_tp_degrees(plan: Plan) -> None:
    """Every layer runs at one TP degree in every VW: each TP rank then reduces its shard's gradients with the
    same shard of the other VWs, exactly (``runtime.sync``). A plan where they differ is refused."""
    if len(plan.virtual_workers) < 2 or plan.max_tp == 1:
        return
    degree: dict[int, tuple[int, int]] = {}
    for v, vw in enumerate(plan.virtual_workers):
        for s in vw.stages:
            for i in s.layers:
                k0, v0 = degree.setdefault(i, (s.tp, v))
                if k0 != s.tp:
                    raise PlanError(f"layer {i} runs at TP degree {k0} in VW{v0} and {s.tp} in VW{v}; every VW "
                                    f"must split a layer alike (its gradients are reduced shard by shard)")


def _check_memory(plan: Plan) -> None:
    """Refuse a stage whose predicted peak memory (the stage's, or the prediction's for its device) exceeds
    its device's memory: "stage 0 on n1:0 needs 9.1 GB, the device has 8.0 GB"."""
    capacity = {d.name: d.memory_bytes for d in plan.cluster.devices}
    peak = {m.device: m.peak_bytes for m in plan.prediction.memory}
    for v, vw in enumerate(plan.virtual_workers):
        for j, s in enumerate(vw.stages):
            need = max(s.predicted_memory_bytes, peak.get(s.device, 0.0))
            if need > capacity[s.device]:
                raise PlanError(f"VW{v} stage {j} on {s.device} needs {format_bytes(need)}, the device has "
                                f"{format_bytes(capacity[s.device])}")


def _stage_from(raw: Any, where: str) -> Stage:
    """One stage of plan.json; ``where`` is its field path (``virtual_workers[1].stages[0]``)."""
    raw = require_mapping(raw, where, PlanError)
    check_known_keys(raw, STAGE_KEYS, where, "a stage")
    layers = require_list(raw, "layers", where, PlanError)
    if len(layers) != 2:
        raise PlanError(f"{path_of(where, 'layers')}: expected [first, end], got {show(layers)}")
    first = check_int(layers[0], f"{where}.layers[0]", PlanError, least=0, most=MAX_LAYERS, limit_name="MAX_LAYERS")
    end = check_int(layers[1], f"{where}.layers[1]", PlanError, least=0, most=MAX_LAYERS, limit_name="MAX_LAYERS")
    recompute = require_list(raw, "recompute", where, PlanError, default=[], most=MAX_LAYERS, what="layers")
    group = require_list(raw, "tp_group", where, PlanError, default=[], most=MAX_TP, what="devices")
    for k, d in enumerate(group):
        if not isinstance(d, str) or not d.strip():
            raise PlanError(f"{where}.tp_group[{k}]: expected a device name, got {show(d)}")
    tp_group = tuple(group)
    return Stage(
        device=require_str(raw, "device", where, PlanError), first_layer=first, end_layer=end, tp_group=tp_group,
        recompute=tuple(check_int(i, f"{where}.recompute[{k}]", PlanError, least=0) for k, i in enumerate(recompute)),
        predicted_forward_s=require_number(raw, "predicted_forward_s", where, PlanError, 0.0, least=0),
        predicted_backward_s=require_number(raw, "predicted_backward_s", where, PlanError, 0.0, least=0),
        predicted_memory_bytes=require_number(raw, "predicted_memory_bytes", where, PlanError, 0.0, least=0),
    )


def _virtual_worker_from(raw: Any, where: str) -> VirtualWorker:
    """One virtual worker of plan.json; ``where`` is its field path (``virtual_workers[1]``)."""
    raw = require_mapping(raw, where, PlanError)
    check_known_keys(raw, VIRTUAL_WORKER_KEYS, where, "a virtual worker")
    stages = require_list(raw, "stages", where, PlanError, least=1, most=MAX_DEVICES, what="stages")
    return VirtualWorker(
        tuple(_stage_from(s, f"{where}.stages[{j}]") for j, s in enumerate(stages)),
        mini_batch=require_int(raw, "mini_batch", where, PlanError, least=1, most=MAX_GLOBAL_BATCH,
                               limit_name="MAX_GLOBAL_BATCH"),
        micro_batches=require_int(raw, "micro_batches", where, PlanError, least=1, most=MAX_MICRO_BATCHES,
                                  limit_name="MAX_MICRO_BATCHES"),
        predicted_pipeline_s=require_number(raw, "predicted_pipeline_s", where, PlanError, 0.0, least=0),
    )


def _prediction_from(raw: Any) -> Prediction:
    """The ``prediction`` object of plan.json (every figure optional, each a number where given)."""
    where = "prediction"
    raw = require_mapping(raw, where, PlanError)
    check_known_keys(raw, PREDICTION_KEYS, where, "the prediction")
    memory = []
    for k, m in enumerate(require_list(raw, "memory", where, PlanError, default=[], most=MAX_DEVICES)):
        at = f"{where}.memory[{k}]"
        m = require_mapping(m, at, PlanError)
        check_known_keys(m, DEVICE_MEMORY_KEYS, at, "a memory entry")
        memory.append(DeviceMemory(require_str(m, "device", at, PlanError),
                                   require_number(m, "peak_bytes", at, PlanError, least=0),
                                   require_number(m, "capacity_bytes", at, PlanError, least=0)))
    return Prediction(
        iteration_s=require_number(raw, "iteration_s", where, PlanError, 0.0, least=0),
        samples_per_s=require_number(raw, "samples_per_s", where, PlanError, 0.0, least=0),
        pipeline_s=require_number(raw, "pipeline_s", where, PlanError, 0.0, least=0),
        sync_s=require_number(raw, "sync_s", where, PlanError, 0.0, least=0),
        optimizer_s=require_number(raw, "optimizer_s", where, PlanError, 0.0, least=0),
        memory=tuple(memory),
        simulated_iteration_s=optional_number(raw, "simulated_iteration_s", where, PlanError, least=0),
        time_to_accuracy_s=optional_number(raw, "time_to_accuracy_s", where, PlanError, least=0),
    )


def _shard_weights_from(raw: Any, cluster: Cluster) -> dict[str, float]:
    """``sync.shard_weights``: device name -> a finite weight >= 0."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"sync.shard_weights: expected an object of device -> weight, got {type(raw).__name__}")
    names = {d.name for d in cluster.devices}
    out: dict[str, float] = {}
    for name, value in raw.items():
        if name not in names:
            raise PlanError(f"sync.shard_weights.{name}: no such device in the plan's cluster")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise PlanError(f"sync.shard_weights.{name}: expected a finite number >= 0, got {value!r:.40}")
        out[name] = float(value)
    return out


def _segment_shards_from(raw: Any) -> tuple[str, ...]:
    """``sync.segment_shards``: a list of shard modes, one per segment (checked against the segments by
    ``sync_layout.check_segment_shards`` when the plan is laid out)."""
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise PlanError(f"sync.segment_shards: expected a list of shard modes, one per segment, got {show(raw)}")
    return tuple(raw)


def upgrade_plan_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """A format_version 1 plan dict as version 2: its mode and the sync options it kept among its ``options``
    move into the ``"sync"`` section (whose layout ``parse_plan(check_layout=False)`` then makes anew).
    Any other dict is returned as it is."""
    if not isinstance(data, Mapping) or data.get("format_version") != 1:
        return dict(data) if isinstance(data, Mapping) else data
    options = dict(data["options"]) if isinstance(data.get("options"), Mapping) else {}
    names = set(SyncOptions().to_dict())
    sync = {"mode": data.get("sync", "bsp"), "options": {k: options.pop(k) for k in list(options) if k in names},
            "segments": []}
    return {**data, "format_version": FORMAT_VERSION, "sync": sync, "options": options}


def _sync_section_as_v5(sync: Mapping[str, Any]) -> dict[str, Any]:
    """A format_version 2-4 ``"sync"`` section as version 5 has it, laid out as it was made.

    Those versions kept each segment's parameter server on one owner (``"ps_host": DEV``), placed by the
    ``placement`` option, whose default was ``"local"``: a row's ``ps_host`` reads as one shard
    ``"ps_shards": [{"host": DEV, "fraction": 1.0}]``, and options without ``placement`` get ``"local"``. The
    plan then runs as before; ``hetrain plan --from PLAN --sync-option placement=sharded -o NEW`` re-plans it
    with sharded servers.
    """
    out = dict(sync)
    options = out.get("options", {})
    if isinstance(options, Mapping) and "placement" not in options:
        out["options"] = {**options, "placement": "local"}
    rows = out.get("segments")
    if isinstance(rows, list):
        out["segments"] = [_one_ps_shard(row) for row in rows]
    return out


def _one_ps_shard(row: Any) -> Any:
    """A format_version 2-4 segment row with ``"ps_host": DEV`` as ``"ps_shards": [{"host": DEV, "fraction": 1.0}]``."""
    if not isinstance(row, Mapping) or "ps_host" not in row:
        return row
    shard = {"host": row["ps_host"], "fraction": 1.0}
    return {**{k: v for k, v in row.items() if k != "ps_host"}, "ps_shards": [shard]}


def parse_plan(data: Mapping[str, Any], check_layout: bool = True) -> Plan:
    """Build a Plan from its JSON dict, validating it.

    With ``check_layout`` its ``"sync"`` section must be the one its stages and options give
    (``sync_layout.check_sync_section``); without, the section's segments are ignored and made anew
    (``hetrain plan --from``, which re-predicts a plan).

    Raises:
        PlanError: naming the field path (``virtual_workers[1].stages[0].layers``) and the value.
    """
    data = require_mapping(data, "plan", PlanError)
    version = require_int(data, "format_version", "", PlanError)
    if version == 1:
        raise PlanError("format_version: 1 predates the plan's sync section (format_version 2): "
                        "upgrade it with `hetrain plan --from PLAN -o NEW`, which re-predicts it")
    if version not in READABLE_VERSIONS:
        raise PlanError(f"format_version: {version} is not supported (this hetrain reads "
                        f"{', '.join(map(str, READABLE_VERSIONS))})")
    check_known_keys(data, PLAN_KEYS, "", "a plan")
    sync = require_object(data, "sync", "", PlanError)
    if version < 5:
        sync = _sync_section_as_v5(sync)
    check_known_keys(sync, SYNC_SECTION_KEYS, "sync", "the sync section")
    try:
        cluster = parse_cluster(require_object(data, "cluster", "", PlanError))
    except ClusterError as e:
        raise PlanError(f"cluster: {e}") from None
    try:
        profile = parse_profile(require_object(data, "profile", "", PlanError))
    except ProfileError as e:
        raise PlanError(f"profile: {e}") from None
    raw_vws = require_list(data, "virtual_workers", "", PlanError, least=1, most=MAX_DEVICES,
                           what="virtual workers")
    vws = [_virtual_worker_from(raw, f"virtual_workers[{v}]") for v, raw in enumerate(raw_vws)]
    try:
        sync_options = SyncOptions.from_mapping(require_object(sync, "options", "sync", PlanError, {}),
                                                "sync.options")
        check_mode_options(str(sync.get("mode", "bsp")), sync_options, "sync.options")
    except SyncLayoutError as e:
        raise PlanError(str(e)) from None
    plan = Plan(
        model=require_str(data, "model", "", PlanError, profile.name),
        global_batch=require_int(data, "global_batch", "", PlanError, least=1, most=MAX_GLOBAL_BATCH,
                                 limit_name="MAX_GLOBAL_BATCH"),
        schedule=data.get("schedule", "1f1b"),
        sync=require_str(sync, "mode", "sync", PlanError, "bsp"),  # type: ignore[arg-type]  # checked by Plan
        optimizer=data.get("optimizer", "adam"),
        virtual_workers=tuple(vws),
        prediction=_prediction_from(data.get("prediction", {})),
        strategy=require_str(data, "strategy", "", PlanError, "hybrid"),
        formation=require_str(data, "formation", "", PlanError, "manual"),
        cluster=cluster,
        profile=profile,
        options=dict(require_object(data, "options", "", PlanError, {})),
        sync_options=sync_options,
        shard_weights=_shard_weights_from(sync.get("shard_weights", {}), cluster),
        segment_shards=_segment_shards_from(sync.get("segment_shards", [])),
    )
    if check_layout:
        try:
            check_sync_section(sync, plan.layout)
        except SyncLayoutError as e:
            raise PlanError(str(e)) from None
        # a segment row's keys are those the layout writes for it (which differ by mode: ps_host, buckets...)
        for k, (row, want) in enumerate(zip(sync["segments"], plan.layout.to_dict()["segments"], strict=True)):
            check_known_keys(row, frozenset(want), f"sync.segments[{k}]", "this plan's segment")
    return plan


def load_plan(path: str | Path, check_layout: bool = True, upgrade: bool = False) -> Plan:
    """Read and validate plan.json; PlanError names the file, the field and the value.

    ``upgrade`` reads a format_version 1 plan too (``upgrade_plan_data``); ``check_layout`` as ``parse_plan``.
    """
    p = Path(path)
    data = load_json_object(p, PlanError, "plan")
    try:
        return parse_plan(upgrade_plan_data(data) if upgrade else data, check_layout)
    except PlanError as e:
        raise PlanError(f"{p}: {e}") from None

"""Re-plan on drift: a device that stays slower (or faster) than its plan predicted, and whether to switch.

The runtime (``runtime.lifecycle.drift_watch``) times each device's forward and backward actions every step
and shares the figures; every rank then feeds the same figures to the same ``DriftDetector``
and, when it fires, makes the same ``decide_drift`` call, so every rank reaches the same
decision and the same plan by itself::

    step s, device d:  ratio = measured compute s / the plan's predicted compute s     (d's stages)
                       factor = ratio / baseline ratio  (the median of its first --drift-window ratios
                                after warm-up: the cost model's own error on d is not drift)
    sustained:         factor >= 1 + threshold (or <= 1 / (1 + threshold)) for window steps in a row,
                       no decision in the last cooldown steps
    slowdown of d:     the median factor over those window steps
    re-plan:           d becomes a device type of its own, "<type>@<d>", whose layer times, action and
                       iteration overheads and optimizer rate are d's times the slowdown (``slowed_plan``);
                       the planner re-plans the slowed cluster with the plan's own options (``elastic.replan``)
    switch when:       (current_s - new_s) x remaining steps x (measured / predicted step s)  >  switch cost s
                       current_s: the current plan under the slowdown, new_s: the new plan, both simulated;
                       switch cost: checkpoint + restart + warm-up seconds (``SwitchCost``)

Everything here is pure (no torch) and deterministic.

Example:
    >>> det = DriftDetector({"n0:0": 0.01, "n0:1": 0.01}, DriftOptions(window_steps=3, warmup_steps=0))
    >>> for s in range(1, 4):
    ...     _ = det.observe(s, {"n0:0": 0.01, "n0:1": 0.01})   # baseline
    >>> [det.observe(s, {"n0:0": 0.01, "n0:1": 0.03}) is not None for s in range(4, 7)]
    [False, False, True]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hetrain.cluster import Cluster, Node
from hetrain.cost import estimate_layer_time, runtime_footprint
from hetrain.elastic import (
    REPLAN_KEY,
    ReplanError,
    Replanned,
    WorldChange,
    plan_digest,
    predicted_samples_per_s,
    replan_on_cluster,
)
from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.simulator import simulate

#: ``options["replan"]["kind"]`` of a plan re-made on drift (a world change's plan has no ``kind``)
DRIFT_KIND = "drift"
#: seconds torchrun takes to stop the workers, meet again and start them, beyond the job's own start-up
RESTART_OVERHEAD_S = 5.0
#: bytes/s a checkpoint is assumed to be written at before one has been timed in this attempt
CHECKPOINT_BYTES_PER_S = 100e6


class DriftError(InputError):
    """Drift options out of range; the message names the option and its value."""


@dataclass(frozen=True)
class DriftOptions:
    """When drift counts as sustained, and how often a plan may change.

    Attributes:
        threshold: a device counts as drifted in a step when it runs ``1 + threshold`` times slower than its
            baseline (or ``1 + threshold`` times faster: a device that recovered).
        window_steps: steps in a row a device must stay drifted; also the steps of its baseline.
        cooldown_steps: no decision (switch or skip) within this many steps of the last one, or of the
            step a drift plan took over.
        warmup_steps: the first steps of an attempt, left out of the baseline (their times include start-up).
        share_every: ranks all-gather their figures once per this many steps.
        force: a drill (tests, rehearsals): at step ``force[0]`` act as if the devices of ``force[1]`` ran that
            many times slower, and switch whatever the gain. None: no drill.
    """

    threshold: float = 0.3
    window_steps: int = 20
    cooldown_steps: int = 100
    warmup_steps: int = 3
    share_every: int = 5
    force: tuple[int, tuple[tuple[str, float], ...]] | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise DriftError(f"drift threshold must be a number > 0, got {self.threshold}")
        for name in ("window_steps", "share_every"):
            if getattr(self, name) < 1:
                raise DriftError(f"drift option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("cooldown_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise DriftError(f"drift option {name} must be >= 0, got {getattr(self, name)}")
        if self.force is not None:
            step, factors = self.force
            if step < 1 or not factors or any(not (math.isfinite(f) and f > 0) for _, f in factors):
                raise DriftError(f"forced drift must be at a step >= 1 with factors > 0, got step {step}, "
                                 f"{format_factors(factors) or 'no devices'}")

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "window_steps": self.window_steps,
                "cooldown_steps": self.cooldown_steps, "warmup_steps": self.warmup_steps}


@dataclass(frozen=True)
class Drift:
    """A sustained drift the detector saw.

    Attributes:
        step: the step it was seen at (the last of the window).
        factors: the drifted devices' slowdowns (median factor over the window; < 1: faster).
        window: every device's median factor over the window, for the log.
        forced: True for a drill (``DriftOptions.force``).
    """

    step: int
    factors: Mapping[str, float]
    window: Mapping[str, float]
    forced: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "factors": dict(self.factors), "window": dict(self.window),
                "forced": self.forced}


def predicted_compute_s(plan: Plan) -> dict[str, float]:
    """Each used device's predicted compute seconds per step: its stage's forward and backward per micro-batch
    (``Stage.predicted_*``, recomputation included) times its VW's micro-batches."""
    return {s.device: vw.micro_batches * (s.predicted_forward_s + s.predicted_backward_s)
            for vw in plan.virtual_workers for s in vw.stages}


@dataclass
class _Track:
    """One device's figures in the detector."""

    baseline: list[float] = field(default_factory=list)  # ratios measured / predicted, first window_steps steps
    recent: deque[float] = field(default_factory=deque)  # factors of the last window_steps steps
    run: int = 0  # steps in a row beyond the threshold

    def reference(self) -> float:
        return statistics.median(self.baseline)


class DriftDetector:
    """Sustained drift of each device's compute time from the plan's prediction (module docstring).

    Args:
        predicted_s: each used device's predicted compute seconds per step (``predicted_compute_s``).
        options: threshold, window, cooldown.
        last_decision_step: the step of the last decision, or of the step a drift plan took over
            (the cooldown counts from it); None: none yet.

    A device with a predicted time of 0 (no work) is not watched.
    """

    def __init__(self, predicted_s: Mapping[str, float], options: DriftOptions,
                 last_decision_step: int | None = None) -> None:
        self.options = options
        self.predicted_s = {d: s for d, s in predicted_s.items() if s > 0}
        self.tracks = {d: _Track(recent=deque(maxlen=options.window_steps)) for d in self.predicted_s}
        self.last_decision_step = last_decision_step
        self.seen = 0  # steps observed

    def forced(self, step: int) -> Drift | None:
        """The drill's drift at its step (``DriftOptions.force``), else None."""
        force = self.options.force
        if force is None or step != force[0]:
            return None
        return Drift(step, dict(force[1]), dict(force[1]), forced=True)

    def in_cooldown(self, step: int) -> bool:
        last = self.last_decision_step
        return last is not None and step - last < self.options.cooldown_steps

    def decided(self, step: int) -> None:
        """A decision was taken at ``step`` (a switch or a skip): the cooldown starts; windows start over."""
        self.last_decision_step = step
        for t in self.tracks.values():
            t.recent.clear()
            t.run = 0

    def observe(self, step: int, measured_s: Mapping[str, float]) -> Drift | None:
        """Take one step's measured compute seconds of each device; return the drift when it is sustained.

        A step a device lacks (or measured at 0) leaves its figures as they are.
        """
        o = self.options
        self.seen += 1
        if self.seen <= o.warmup_steps:
            return None
        hi, lo = 1.0 + o.threshold, 1.0 / (1.0 + o.threshold)
        for d, t in self.tracks.items():
            s = measured_s.get(d, 0.0)
            if not s > 0:
                continue
            ratio = s / self.predicted_s[d]
            if len(t.baseline) < o.window_steps:
                t.baseline.append(ratio)
                continue
            factor = ratio / t.reference()
            t.recent.append(factor)
            t.run = t.run + 1 if (factor >= hi or factor <= lo) else 0
        drifted = {d: statistics.median(t.recent) for d, t in self.tracks.items() if t.run >= o.window_steps}
        if not drifted or self.in_cooldown(step):
            return None
        window = {d: statistics.median(t.recent) for d, t in self.tracks.items() if t.recent}
        return Drift(step, drifted, window)


# --- the slowed plan: a per-device slowdown as the planner sees it -----------------------------------------

def base_type(type_name: str) -> str:
    """``"cpu@n0:1"`` -> ``"cpu"``: the device type a slowed type was made from."""
    return type_name.partition("@")[0]


def _micro_batch_grid(profile: ModelProfile, plan: Plan) -> list[int]:
    """Where a slowed type's layer times are written: every micro-batch size the profile measured, the powers
    of two up to the global batch, the global batch, and the plan's own micro-batch sizes. Between them the
    cost model interpolates, as for any measured type (a roofline time, ``max(flops, bytes)``, is piecewise
    linear in the micro-batch: exact at the grid, close between)."""
    n = plan.global_batch
    sizes = {n, *(2 ** k for k in range(n.bit_length()) if 2 ** k <= n)}
    sizes.update(b for vw in plan.virtual_workers for b in vw.micro_batch_sizes)
    for layer in profile.layers:
        for _, ms in layer.measured:
            sizes.update(m.micro_batch for m in ms)
    return sorted(sizes)


def _slowed_layer(layer: LayerProfile, new_type: str, ms: tuple[Measurement, ...]) -> LayerProfile:
    kept = tuple((t, m) for t, m in layer.measured if t != new_type)
    return replace(layer, measured=(*kept, (new_type, ms)))


def _per_type(entries: tuple[tuple[str, float], ...], old: str, new: str, factor: float) -> tuple[tuple[str, float],
                                                                                                   ...]:
    kept = tuple((t, s) for t, s in entries if t != new)
    found = [s for t, s in entries if t == old]
    return (*kept, (new, found[0] * factor)) if found else kept


def slowed_plan(plan: Plan, factors: Mapping[str, float]) -> Plan:
    """``plan`` with each device of ``factors`` made that many times slower, as the planner and simulator see it.

    The device gets a type of its own, ``"<type>@<device>"``: its layer times (at the micro-batch sizes
    of ``_micro_batch_grid``) are the device's estimated times
    (``cost.estimate_layer_time``) times the factor; its action and iteration overheads and its
    optimizer rate likewise; its memory footprint is copied. Its memory and peak figures stay, so
    what fits where does not change. A device already slowed is slowed again from its slowed
    times, so factors compound. Deterministic: the same plan and factors give the same plan.

    Raises:
        ReplanError: a device of ``factors`` the plan's cluster lacks.
    """
    cluster, profile = plan.cluster, plan.profile
    known = {d.name: d for d in cluster.devices}
    missing = sorted(set(factors) - set(known))
    if missing:
        raise ReplanError(f"drift on {', '.join(missing)}: not a device of the plan's cluster {cluster.name!r}")
    grid = _micro_batch_grid(profile, plan)
    layers = list(profile.layers)
    renamed: dict[str, str] = {}
    for name in sorted(factors):
        dev, f = known[name], float(factors[name])
        new_type = f"{base_type(dev.type_name)}@{name}"
        for i in range(len(layers)):
            times = [estimate_layer_time(profile, i, dev, b) for b in grid]
            ms = tuple(Measurement(b, fw * f, bw * f, source="scaled") for b, (fw, bw) in zip(grid, times, strict=True))
            layers[i] = _slowed_layer(layers[i], new_type, ms)
        rates = [(t, r) for t, r in profile.optimizer_step_s_per_byte if t == dev.type_name]
        opt = tuple((t, r) for t, r in profile.optimizer_step_s_per_byte if t != new_type)
        if rates:
            opt += ((new_type, tuple((n, v * f) for n, v in rates[0][1])),)
        fp = runtime_footprint(profile, dev)  # measured, else the catalog's for the device's own type
        foot = tuple(e for e in profile.memory_footprint if e[0] != new_type)
        foot += ((new_type, fp.fixed_bytes, fp.allocator_fraction),)
        profile = replace(profile, layers=tuple(layers),
                          action_overhead_s=_per_type(profile.action_overhead_s, dev.type_name, new_type, f),
                          iteration_overhead_s=_per_type(profile.iteration_overhead_s, dev.type_name, new_type, f),
                          action_overhead_spread_s=_per_type(profile.action_overhead_spread_s, dev.type_name,
                                                             new_type, f),
                          optimizer_step_s_per_byte=opt, memory_footprint=foot)
        renamed[name] = new_type
    nodes = tuple(Node(n.name, tuple(replace(d, type_name=renamed.get(d.name, d.type_name)) for d in n.devices),
                       n.intra_link, n.nic) for n in cluster.nodes)
    return replace(plan, cluster=Cluster(cluster.name, nodes, cluster.node_links), profile=profile)


# --- the decision -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SwitchCost:
    """Seconds a switch of plans costs, each part measured in this attempt where it could be.

    Attributes:
        checkpoint_s: writing a checkpoint (the slowest rank's last write; else the model's weights and
            optimizer state at ``CHECKPOINT_BYTES_PER_S``).
        startup_s: this attempt's start-up, from the process's start to its first step (the slowest rank).
        warmup_s: the first steps' time beyond the steady step time.
        restart_s: torchrun's part: stopping the workers, a rendezvous round (``RESTART_OVERHEAD_S``).
    """

    checkpoint_s: float
    startup_s: float
    warmup_s: float
    restart_s: float = RESTART_OVERHEAD_S

    @property
    def total_s(self) -> float:
        return self.checkpoint_s + self.startup_s + self.warmup_s + self.restart_s

    def to_dict(self) -> dict[str, float]:
        return {"checkpoint_s": self.checkpoint_s, "startup_s": self.startup_s, "warmup_s": self.warmup_s,
                "restart_s": self.restart_s, "total_s": self.total_s}


@dataclass(frozen=True)
class DriftDecision:
    """What to do about a drift, with its figures.

    Attributes:
        switch: whether to checkpoint and switch to ``replanned``.
        reason: one line, with the figures.
        figures: current and new predicted iteration seconds under the drift, the remaining steps, the
            predicted gain and the switch cost, in seconds of this run (measured / predicted step time).
        replanned: the new plan (None when re-planning failed or gave the plan back).
    """

    switch: bool
    reason: str
    figures: Mapping[str, Any]
    replanned: Replanned | None = None


def drift_factors_of(plan: Plan) -> dict[str, float]:
    """The slowdowns a drift plan was made with (compounded over drift re-plans), by device; {} for another plan."""
    record = plan.options.get(REPLAN_KEY)
    if isinstance(record, Mapping) and record.get("kind") == DRIFT_KIND:
        return {str(d): float(f) for d, f in dict(record.get("slowdown", {})).items()}
    return {}


def base_digest_of(plan: Plan) -> str:
    """The digest of the plan a job was started with (plan.json): a drift plan records it, any other plan is it."""
    record = plan.options.get(REPLAN_KEY)
    if isinstance(record, Mapping) and record.get("kind") == DRIFT_KIND and record.get("base_digest"):
        return str(record["base_digest"])
    return plan_digest(plan)


def decide_drift(plan: Plan, drift: Drift, step: int, steps: int, measured_step_s: float,
                 cost: SwitchCost) -> DriftDecision:
    """Re-plan ``plan`` for the slowdowns of ``drift`` and say whether switching pays (module docstring).

    Args:
        plan: the plan running now.
        drift: what the detector saw.
        step: the step done (training would resume from it).
        steps: the step count the run goes to.
        measured_step_s: the median measured step seconds over the drift's window.
        cost: the switch's cost.

    Returns:
        The decision; ``replanned.plan.options["replan"]`` records the drift (``kind: "drift"``, the
        slowdown compounded with the plan's own, the base plan's digest, the figures).
    """
    slowed = slowed_plan(plan, drift.factors)
    current_s = simulate(slowed).iteration_s
    figures: dict[str, Any] = {"step": step, "factors": dict(drift.factors), "current_s": current_s,
                               "remaining_steps": steps - step, "measured_step_s": measured_step_s,
                               "switch_cost": cost.to_dict(), "forced": drift.forced}
    try:
        replanned = replan_on_cluster(slowed, slowed.cluster, WorldChange((), ()), step)
    except ReplanError as e:
        return DriftDecision(False, f"re-planning failed: {e}", figures)
    new_s = simulate(replanned.plan).iteration_s
    scale = measured_step_s / current_s if current_s > 0 and measured_step_s > 0 else 1.0
    gain_s = (current_s - new_s) * (steps - step) * scale
    figures.update(new_s=new_s, scale=scale, gain_s=gain_s)
    total = {**drift_factors_of(plan)}
    for d, f in drift.factors.items():
        total[d] = total.get(d, 1.0) * f
    record = {"kind": DRIFT_KIND, "from_step": step, "slowdown": total, "drift": drift.to_dict(),
              "base_digest": base_digest_of(plan), "previous_digest": plan_digest(plan),
              "previous_devices": plan.devices_used, "previous_samples_per_s": predicted_samples_per_s(plan),
              "previous_iteration_s_under_drift": current_s, "predicted_gain_s": gain_s,
              "switch_cost_s": cost.total_s, "lost": [], "added": [], "assumed_links": []}
    new = replanned.plan.with_options({**replanned.plan.options, REPLAN_KEY: record})
    done = Replanned(new, WorldChange((), ()), plan_digest(new))
    same = _shape(new) == _shape(plan)
    what = ", ".join(f"{d} x{f:.2f}" for d, f in sorted(drift.factors.items()))
    line = (f"{what}: current plan {current_s:.4g} s/step under the drift, re-planned {new_s:.4g} s/step "
            f"(predicted; measured/predicted {scale:.3g}), gain {gain_s:.1f} s over {steps - step} steps, "
            f"switch cost {cost.total_s:.1f} s")
    if drift.forced:
        return DriftDecision(True, f"forced: {line}", figures, done)
    if same:
        return DriftDecision(False, f"the re-plan is the current plan: {line}", figures, done)
    if gain_s <= cost.total_s:
        return DriftDecision(False, f"not worth it: {line}", figures, done)
    return DriftDecision(True, line, figures, done)


def _shape(plan: Plan) -> list[Any]:
    """What a plan runs: its stages (device, layers, recompute set) and batch split, per VW; schedule; sync."""
    return [plan.schedule, plan.sync, [(vw.mini_batch, vw.micro_batches,
                                        [(s.device, s.first_layer, s.end_layer, s.recompute) for s in vw.stages])
                                       for vw in plan.virtual_workers]]


def format_factors(factors: Sequence[tuple[str, float]]) -> str:
    """``(("n0:1", 3.0), ("n1:0", 2.5))`` -> ``"n0:1=3,n1:0=2.5"``: ``--force-drift``'s spelling."""
    return ",".join(f"{d}={f:g}" for d, f in factors)


def parse_force(text: str, name: str | None = None) -> tuple[int, tuple[tuple[str, float], ...]]:
    """``"40:n0:1=3"`` (or ``"40:n0:1=3,n1:0=2"``) -> ``(40, (("n0:1", 3.0),))``: ``--force-drift``'s value,
    checked: a step >= 1, each device once, each factor a finite number > 0.

    Args:
        text: the value.
        name: how errors name it (``TrainConfig.name_of``: ``--force-drift 40:n0:1=3`` or
            ``train.toml: force_drift = "40:n0:1=3"``); default ``--force-drift TEXT``.

    Raises:
        DriftError: one line naming the value and what is wrong with it.

    Example:
        >>> parse_force("40:n0:1=3,n1:0=2.5")
        (40, (('n0:1', 3.0), ('n1:0', 2.5)))
    """
    name = name or f"--force-drift {text}"
    head, sep, rest = text.partition(":")
    try:
        step = int(head)
        pairs = []
        for part in rest.split(","):
            dev, eq, value = part.rpartition("=")
            if not sep or not eq or not dev.strip():
                raise ValueError(part)
            pairs.append((dev.strip(), float(value)))
    except ValueError:
        raise DriftError(f"{name}: expected STEP:DEVICE=FACTOR[,DEVICE=FACTOR...], e.g. 40:n0:1=3") from None
    if step < 1:
        raise DriftError(f"{name}: the step must be >= 1 (the drill acts after a step is done), got {step}")
    bad = [(d, f) for d, f in pairs if not (math.isfinite(f) and f > 0)]
    if bad:
        raise DriftError(f"{name}: a factor must be a number > 0 (how many times slower: 3, or 0.5 for twice "
                         f"as fast), got {bad[0][0]}={bad[0][1]:g}")
    devices = [d for d, _ in pairs]
    twice = sorted({d for d in devices if devices.count(d) > 1})
    if twice:
        raise DriftError(f"{name}: device {twice[0]} is given twice; give each device once")
    return step, tuple(sorted(pairs))


def check_force_devices(force: tuple[int, tuple[tuple[str, float], ...]], cluster: Cluster, name: str,
                        plan_path: str) -> None:
    """Refuse a drill on a device that is not in ``cluster`` (the cluster plan.json embeds).

    Raises:
        DriftError: naming the value, the device, the plan file and the devices there are.
    """
    known = [d.name for d in cluster.devices]
    missing = [d for d, _ in force[1] if d not in known]
    if missing:
        listed = ", ".join(known[:8]) + (f" ... ({len(known)} in all)" if len(known) > 8 else "")
        raise DriftError(f"{name}: {missing[0]} is not a device of {plan_path}'s cluster {cluster.name!r} "
                         f"(its devices: {listed})")

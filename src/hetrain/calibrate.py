"""Calibrate the cost model's overhead per action from a real run of a plan (``hetrain calibrate``).

Layer times are profiled back to back, one layer at a time. When the runtime runs a
stage, each forward and backward of a micro-batch also costs what the profile never
sees: posting and completing its messages, their copies, the executor's own work,
the device getting going again after a wait. That cost is paid per action, so it
grows with the number of micro-batches: on the demo's emulated cluster the simulator
ran ahead of the measurement by 8% with 4 micro-batches per pipeline and by 47% with
32 (benchmarks/RESULTS.md, "Prediction error against the micro-batch size"), about
4 ms per action on the critical path at every size of that run. How much it is
changes from run to run there, from 0 to 4 ms, with the host.

Calibration measures it once per cluster and runtime: train any plan for a few steps
(one with many micro-batches per stage pins the figure best), then find the overhead
``o`` at which the simulator's iteration of that plan equals the measured one::

    simulate(plan with action_overhead_s = o).iteration_s == measured iteration   (bisection on o)

The simulated iteration grows with ``o`` (every forward and backward takes ``o``
longer), so the answer is unique. The run's steps are not all alike: the overheads that
its lower and upper quartile step would imply, ``o(Q1)`` and ``o(Q3)``, give the
overhead's spread from step to step, ``(o(Q3) - o(Q1)) / 1.349`` (a standard deviation,
from the interquartile range of a normal). The planner draws the overhead within it
(``planner.robust``): a plan of many small micro-batches pays it more often than one of
few large ones, so it is the more exposed to it. ``o`` is written into the profile for every device
type of the plan's cluster (``ModelProfile.action_overhead_s``); the planner and the
simulator then charge it to each forward and backward. One figure serves all types:
the work it stands for is the host's, and one run cannot tell the types apart.

Example::

    hetrain train --plan calib.json --steps 8 --metrics-out calib.jsonl ...
    hetrain calibrate calib.json calib.jsonl --warmup 3 -o profile-calibrated.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

from hetrain.errors import InputError
from hetrain.fields import check_number, read_text, show
from hetrain.plan import PLAN_FINGERPRINT_KEY, Plan, PlanError, load_plan, plan_fingerprint
from hetrain.profile import ModelProfile, ProfileError
from hetrain.units import format_time


class CalibrationError(InputError):
    """The run cannot calibrate the model: unreadable metrics, no timed steps, no positive measured time."""


@dataclass(frozen=True)
class Calibration:
    """What ``fit_action_overhead`` found.

    Attributes:
        overhead_s: seconds per forward and per backward action (0 when the run was not slower
            than the prediction without overhead).
        measured_s: the measured iteration.
        simulated_before_s: the simulated iteration with the profile's overhead set to 0.
        simulated_after_s: the simulated iteration with ``overhead_s``.
        spread_s: how far the overhead moves from step to step (a standard deviation, from the
            overheads the steps' quartiles imply); 0 without steps to tell (fewer than 4).
    """

    overhead_s: float
    measured_s: float
    simulated_before_s: float
    simulated_after_s: float
    spread_s: float = 0.0

    def summary(self) -> str:
        spread = f", +- {format_time(self.spread_s)} from step to step" if self.spread_s > 0 else ""
        return (f"measured iteration {format_time(self.measured_s)}; simulated {format_time(self.simulated_before_s)} "
                f"without overhead ({100 * (self.simulated_before_s / self.measured_s - 1):+.1f}%), "
                f"{format_time(self.simulated_after_s)} with {format_time(self.overhead_s)} per forward and backward "
                f"({100 * (self.simulated_after_s / self.measured_s - 1):+.1f}%){spread}")


def with_action_overhead(profile: ModelProfile, overhead_s: float, type_names: list[str],
                         spread_s: float | None = None) -> ModelProfile:
    """``profile`` with ``action_overhead_s`` set to ``overhead_s`` for each of ``type_names`` (others kept), and
    its ``action_overhead_spread_s`` to ``spread_s`` where given (0: none known)."""
    kept = tuple((t, s) for t, s in profile.action_overhead_s if t not in type_names)
    out = replace(profile, action_overhead_s=kept + tuple((t, overhead_s) for t in type_names))
    if spread_s is None:
        return out
    kept = tuple((t, s) for t, s in profile.action_overhead_spread_s if t not in type_names)
    return replace(out, action_overhead_spread_s=kept + (tuple((t, spread_s) for t in type_names) if spread_s > 0
                                                         else ()))


def _simulated(plan: Plan, overhead_s: float) -> float:
    from hetrain.simulator import simulate

    profile = with_action_overhead(plan.profile, overhead_s, plan.cluster.type_names)
    return float(simulate(replace(plan, profile=profile)).iteration_s)


#: the fewest timed steps whose quartiles say anything of the overhead's spread
MIN_STEPS_FOR_SPREAD = 4
#: interquartile range / standard deviation of a normal distribution
IQR_PER_SD = 1.349


def fit_action_overhead(plan: Plan, measured_s: float, tolerance_s: float = 1e-6,
                        steps_s: Sequence[float] = ()) -> Calibration:
    """The overhead per action at which ``plan``'s simulated iteration equals ``measured_s`` (bisection), and,
    from the timed steps ``steps_s`` (``measured_step_times_s``; at least ``MIN_STEPS_FOR_SPREAD``), its spread.

    Raises:
        CalibrationError: ``measured_s`` (or a step) is not a positive finite time.
    """
    for t in (measured_s, *steps_s):
        if not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"the measured iteration must be a positive number of seconds, got {t!r}")
    before = _simulated(plan, 0.0)
    spread = 0.0
    if len(steps_s) >= MIN_STEPS_FOR_SPREAD:
        q1, _, q3 = statistics.quantiles(steps_s, n=4)
        spread = (_bisect(plan, q3, before, tolerance_s) - _bisect(plan, q1, before, tolerance_s)) / IQR_PER_SD
    o = _bisect(plan, measured_s, before, tolerance_s)
    return Calibration(o, measured_s, before, _simulated(plan, o) if o > 0 else before, spread)


def _bisect(plan: Plan, measured_s: float, before_s: float, tolerance_s: float) -> float:
    """The overhead at which ``plan`` simulates to ``measured_s``; 0 where it is no slower than ``before_s``, the
    simulation without overhead."""
    if before_s >= measured_s:
        return 0.0
    # Each device runs at least two actions, so an overhead of the whole measured iteration is too much.
    lo, hi = 0.0, measured_s
    while hi - lo > tolerance_s:
        mid = (lo + hi) / 2
        if _simulated(plan, mid) < measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def measured_iteration_s(metrics_path: str | Path, warmup: int) -> float:
    """Mean ``step_time_s`` of a ``--metrics-out`` file's steps after the first ``warmup``."""
    timed = measured_step_times_s(metrics_path, warmup)
    return sum(timed) / len(timed)


def read_step_rows(metrics_path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """The step rows of a ``--metrics-out`` file (those with ``step_time_s``), each with its line number."""
    path = Path(metrics_path)
    lines = read_text(path, CalibrationError, "metrics file").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}:{n}: not a JSON line: {e}") from None
        except RecursionError:
            raise CalibrationError(f"{path}:{n}: nested too deeply to be a metrics line") from None
        if isinstance(row, dict) and "step_time_s" in row:
            rows.append((n, row))
    return rows


def measured_step_times_s(metrics_path: str | Path, warmup: int,
                          rows: Sequence[tuple[int, Mapping[str, Any]]] | None = None) -> list[float]:
    """Every ``step_time_s`` of a ``--metrics-out`` file after the first ``warmup``, in order (of ``rows``, its
    ``read_step_rows``, where the caller has them)."""
    path = Path(metrics_path)
    if warmup < 0:
        raise CalibrationError(f"warmup must be >= 0 steps, got {warmup}")
    steps = [check_number(row["step_time_s"], f"{path}:{n}: step_time_s", CalibrationError, least=0)
             for n, row in (read_step_rows(path) if rows is None else rows)]
    if len(steps) <= warmup:
        raise CalibrationError(f"{path} has {len(steps)} step(s), none after the {warmup} warm-up step(s); "
                               "train more steps or lower --warmup")
    return steps[warmup:]


def check_metrics_of_plan(plan: Plan, plan_path: str | Path, metrics_path: str | Path,
                          rows: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
    """Refuse metrics recorded training another plan than ``plan``: one line naming both files.

    A row that records ``plan_fingerprint`` (``runtime.report.metrics``) must carry ``plan``'s. A row of an older
    run, without it, is checked against what every step row records: its samples per step
    (``samples_per_s * step_time_s``, the global batch) and the sync actions that ended the step on the
    reporting device (those of one of the plan's devices).

    Raises:
        CalibrationError: naming the metrics line, both files and what differs.
    """
    fingerprint = plan_fingerprint(plan)
    first, endings = _sync_endings(plan)
    other = f"was recorded training another plan than {plan_path}"
    for n, row in rows:
        at = f"{metrics_path}:{n}"
        if PLAN_FINGERPRINT_KEY in row:
            if row[PLAN_FINGERPRINT_KEY] != fingerprint:
                raise CalibrationError(f"{at} {other} (plan fingerprint {show(row[PLAN_FINGERPRINT_KEY])}, "
                                       f"{plan_path}'s is {fingerprint!r}); calibrate with the plan that was trained")
            continue
        rate, step_s = row.get("samples_per_s"), row.get("step_time_s")
        if _is_number(rate) and _is_number(step_s) and rate > 0 and step_s > 0:
            samples = rate * step_s  # the runtime writes samples_per_s = global batch / step_time_s
            if abs(samples - plan.global_batch) > 1e-6 * plan.global_batch:
                raise CalibrationError(f"{at} {other}: its steps are of {samples:.6g} samples, the plan's global "
                                       f"batch is {plan.global_batch}; calibrate with the plan that was trained")
        actions = row.get("sync_actions")
        if isinstance(actions, list) and tuple(map(str, actions)) not in endings:  # (older runs: no field)
            raise CalibrationError(f"{at} {other}: its steps end with sync actions {show(actions)}, which no "
                                   f"device of the plan's ends a step with under {plan.sync} (one ends with "
                                   f"{show(list(first))}); calibrate with the plan that was trained")


def _is_number(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _sync_endings(plan: Plan) -> tuple[tuple[str, ...], set[tuple[str, ...]]]:
    """The sync actions that end a step of ``plan``, as the metrics write them: the first device's of the first
    step, and every device's of every kind of step of the mode (bsp, wsp: the same each step; the others over the
    mode's cycle: periods, DASO's warm-up, pending merges and cool-down, whatever period DASO adapts to)."""
    from hetrain.schedule import SyncState, build_sync_actions

    owned = plan.layout.owned_segments_by_device()
    devices = plan.devices_used
    opts = plan.sync_options
    states: list[tuple[SyncState | None, int | None]] = [(None, None)]
    if not plan.sync_mode.same_every_iteration:
        every = plan.sync_mode.period(opts)
        after = every * ((opts.warmup + every) // every) - 1  # the first global sync at or after DASO's warm-up
        iterations = {0, 1, max(0, opts.warmup - 1), opts.warmup, opts.warmup + 1, every - 1, after, after + 1}
        states += [(SyncState(i, opts.period, pending), steps) for i in sorted(iterations)
                   for pending in (False, True) for steps in (None, i + 1)]  # i + 1: the step is in the cool-down
    endings = [tuple(str(a) for a in build_sync_actions(plan, d, state, steps, owned))
               for state, steps in states for d in devices]
    return endings[0], set(endings)


def run_calibrate_command(plan_path: str, metrics_path: str, warmup: int, output: str | None) -> int:
    """``hetrain calibrate PLAN METRICS [--warmup N] [-o PROFILE]``: print the fit, write the profile; exit status:
    0, 2 for a plan or metrics file that cannot be used (bad input), 1 for a profile that cannot be written."""
    try:
        plan = load_plan(plan_path)
        rows = read_step_rows(metrics_path)
        check_metrics_of_plan(plan, plan_path, metrics_path, rows)
        steps = measured_step_times_s(metrics_path, warmup, rows)
        found = fit_action_overhead(plan, sum(steps) / len(steps), steps_s=steps)
    except (PlanError, ProfileError, CalibrationError, ValueError) as e:
        print(f"hetrain calibrate: error: {e}", file=sys.stderr)
        return 2
    print(found.summary())
    if output:
        profile = with_action_overhead(plan.profile, found.overhead_s, plan.cluster.type_names, found.spread_s)
        try:
            profile.save(output)
        except OSError as e:
            print(f"hetrain calibrate: error: cannot write {output}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {output}: action_overhead_s {format_time(found.overhead_s)} for "
              f"{', '.join(plan.cluster.type_names)}")
    return 0

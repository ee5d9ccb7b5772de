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
longer), so the answer is unique. ``o`` is written into the profile for every device
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
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from hetrain.errors import InputError
from hetrain.fields import check_number, read_text
from hetrain.plan import Plan, PlanError, load_plan
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
    """

    overhead_s: float
    measured_s: float
    simulated_before_s: float
    simulated_after_s: float

    def summary(self) -> str:
        return (f"measured iteration {format_time(self.measured_s)}; simulated {format_time(self.simulated_before_s)} "
                f"without overhead ({100 * (self.simulated_before_s / self.measured_s - 1):+.1f}%), "
                f"{format_time(self.simulated_after_s)} with {format_time(self.overhead_s)} per forward and backward "
                f"({100 * (self.simulated_after_s / self.measured_s - 1):+.1f}%)")


def with_action_overhead(profile: ModelProfile, overhead_s: float, type_names: list[str]) -> ModelProfile:
    """``profile`` with ``action_overhead_s`` set to ``overhead_s`` for each of ``type_names`` (others kept)."""
    kept = tuple((t, s) for t, s in profile.action_overhead_s if t not in type_names)
    return replace(profile, action_overhead_s=kept + tuple((t, overhead_s) for t in type_names))


def _simulated(plan: Plan, overhead_s: float) -> float:
    from hetrain.simulator import simulate

    profile = with_action_overhead(plan.profile, overhead_s, plan.cluster.type_names)
    return float(simulate(replace(plan, profile=profile)).iteration_s)


def fit_action_overhead(plan: Plan, measured_s: float, tolerance_s: float = 1e-6) -> Calibration:
    """The overhead per action at which ``plan``'s simulated iteration equals ``measured_s`` (bisection).

    Raises:
        CalibrationError: ``measured_s`` is not a positive finite time.
    """
    if not (math.isfinite(measured_s) and measured_s > 0):
        raise CalibrationError(f"the measured iteration must be a positive number of seconds, got {measured_s!r}")
    before = _simulated(plan, 0.0)
    if before >= measured_s:
        return Calibration(0.0, measured_s, before, before)
    # Each device runs at least two actions, so an overhead of the whole measured iteration is too much.
    lo, hi = 0.0, measured_s
    while hi - lo > tolerance_s:
        mid = (lo + hi) / 2
        if _simulated(plan, mid) < measured_s:
            lo = mid
        else:
            hi = mid
    o = (lo + hi) / 2
    return Calibration(o, measured_s, before, _simulated(plan, o))


def measured_iteration_s(metrics_path: str | Path, warmup: int) -> float:
    """Mean ``step_time_s`` of a ``--metrics-out`` file's steps after the first ``warmup``."""
    path = Path(metrics_path)
    if warmup < 0:
        raise CalibrationError(f"warmup must be >= 0 steps, got {warmup}")
    lines = read_text(path, CalibrationError, "metrics file").splitlines()
    steps = []
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
            steps.append(check_number(row["step_time_s"], f"{path}:{n}: step_time_s", CalibrationError, least=0))
    if len(steps) <= warmup:
        raise CalibrationError(f"{path} has {len(steps)} step(s), none after the {warmup} warm-up step(s); "
                               "train more steps or lower --warmup")
    timed = steps[warmup:]
    return sum(timed) / len(timed)


def run_calibrate_command(plan_path: str, metrics_path: str, warmup: int, output: str | None) -> int:
    """``hetrain calibrate PLAN METRICS [--warmup N] [-o PROFILE]``: print the fit, write the profile; exit status."""
    try:
        plan = load_plan(plan_path)
        measured = measured_iteration_s(metrics_path, warmup)
        found = fit_action_overhead(plan, measured)
    except (PlanError, ProfileError, CalibrationError, ValueError) as e:
        print(f"hetrain calibrate: error: {e}", file=sys.stderr)
        return 1
    print(found.summary())
    if output:
        profile = with_action_overhead(plan.profile, found.overhead_s, plan.cluster.type_names)
        try:
            profile.save(output)
        except OSError as e:
            print(f"hetrain calibrate: error: cannot write {output}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {output}: action_overhead_s {format_time(found.overhead_s)} for "
              f"{', '.join(plan.cluster.type_names)}")
    return 0

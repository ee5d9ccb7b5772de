"""The ``hetrain simulate`` command."""

from __future__ import annotations

import json
import sys

from hetrain.plan import PlanError, load_plan
from hetrain.schedule import ScheduleError
from hetrain.simulator.replay import simulate
from hetrain.units import format_time


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

"""``hetrain simulate``: replay a plan's iteration, action by action; its summary, and the files asked for.

    hetrain simulate plan.json [--trace out.json] [--gantt out.png] [--timeline out.json] [--json]

The plan is read once and replayed once; the trace, the Gantt chart and the timeline are that replay's.
"""

from __future__ import annotations

import argparse
import json

from hetrain.fields import check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain simulate``'s options."""
    parser.add_argument("plan")
    parser.add_argument("--trace", help="write a Chrome trace JSON (Perfetto, chrome://tracing)")
    parser.add_argument("--gantt", help="write a Gantt chart PNG")
    parser.add_argument("--timeline", help="write the predicted timeline JSON (for hetrain compare)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Print the replay's summary (or its metrics as JSON) and write the trace, Gantt chart and timeline asked for.

    Raises:
        PlanError, ScheduleError: a plan that cannot be read or replayed, named before any file is written.
        OSError: a file that cannot be written.
    """
    from hetrain.plan import load_plan
    from hetrain.simulator import simulate
    from hetrain.units import format_time

    for flag, path in (("--trace", args.trace), ("--gantt", args.gantt), ("--timeline", args.timeline)):
        if path:
            check_output_path(path, flag)
    plan = load_plan(args.plan)
    result = simulate(plan)
    written = []
    if args.trace:
        result.timeline.to_chrome_trace(args.trace)
        written.append(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.gantt:
        result.timeline.save_gantt(args.gantt, title=f"{plan.model} on {plan.cluster.name}: {plan.schedule}, "
                                   f"iteration {format_time(result.iteration_s)}")
        written.append(f"gantt: {args.gantt}")
    if args.timeline:
        result.timeline.save(args.timeline)
        n = result.timeline.iterations
        written.append(f"timeline: {args.timeline}"
                       + (f" ({n} simulated iterations; hetrain compare divides by them)" if n > 1 else ""))
    if args.json:  # stdout is the metrics alone
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.summary())
        for line in written:
            print(line)
    return 0

"""``hetrain calibrate``: the cost model's overhead per action, fitted to a trained plan's metrics.

    hetrain calibrate plan.json metrics.jsonl [--warmup N] [-o profile.json]
"""

from __future__ import annotations

import argparse

from hetrain.arguments import int_between
from hetrain.fields import MAX_STEPS, check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain calibrate``'s options."""
    parser.add_argument("plan", help="the plan that was trained (plan.json)")
    parser.add_argument("metrics", help="its training metrics (hetrain train --metrics-out FILE)")
    parser.add_argument("--warmup", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=3,
                        help="first steps left out (default 3)")
    parser.add_argument("-o", "--output", help="write the plan's profile with the fitted overhead here")


def run(args: argparse.Namespace) -> int:
    """Fit and print; write the profile where asked (``calibrate.run_calibrate_command``)."""
    from hetrain.calibrate import run_calibrate_command

    if args.output:
        check_output_path(args.output, "-o")
    return run_calibrate_command(args.plan, args.metrics, args.warmup, args.output)

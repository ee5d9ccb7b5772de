"""``hetrain compare``: a predicted timeline against a measured one, per device and action kind, per iteration.

    hetrain compare predicted.json measured.json [--gantt both.png]
"""

from __future__ import annotations

import argparse

from hetrain.fields import check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain compare``'s options."""
    parser.add_argument("predicted", help="the predicted timeline JSON (hetrain simulate PLAN --timeline FILE)")
    parser.add_argument("measured", help="the runtime's measured timeline JSON (hetrain train --timeline-out)")
    parser.add_argument("--gantt", help="write both timelines as one PNG, predicted above measured")


def run(args: argparse.Namespace) -> int:
    """Print the comparison; write both timelines as one picture where asked."""
    from hetrain.timeline import compare, load_comparison, save_side_by_side

    if args.gantt:
        check_output_path(args.gantt, "--gantt")
    predicted, measured = load_comparison(args.predicted, args.measured)
    print(compare(predicted, measured))
    if args.gantt:
        save_side_by_side(predicted, measured, args.gantt)
        print(f"Gantt charts written to {args.gantt}")
    return 0

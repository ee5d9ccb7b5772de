"""``hetrain fit-time-model``: the learned layer-time model, fitted on measured profiles (scikit-learn).

    hetrain fit-time-model --profiles P1.json P2.json ... [-o time_model.json]
"""

from __future__ import annotations

import argparse

from hetrain.fields import check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain fit-time-model``'s options."""
    parser.add_argument("--profiles", nargs="+", required=True, metavar="PROFILE",
                        help="profile JSON files with measured layer times on device types the catalog knows")
    parser.add_argument("-o", "--output", default="time_model.json")


def run(args: argparse.Namespace) -> int:
    """Fit, save, say what it was trained on (``profiler.learned.run_fit_command``)."""
    check_output_path(args.output, "-o")
    from hetrain.profiler.learned import run_fit_command

    return run_fit_command(args.profiles, args.output)

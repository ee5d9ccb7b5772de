"""``hetrain demo``: the main job end to end on an emulated heterogeneous cluster (``hetrain.demo``)."""

from __future__ import annotations

import argparse

from hetrain.arguments import int_between
from hetrain.fields import MAX_GLOBAL_BATCH, MAX_STEPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain demo``'s options."""
    parser.add_argument("--model", default="gpt-tiny", help="reference model (default gpt-tiny)")
    parser.add_argument("--global-batch", type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"), default=32,
                        help="samples per iteration (default 32)")
    parser.add_argument("--steps", type=int_between(1, MAX_STEPS, "MAX_STEPS"), default=20,
                        help="training steps per plan (default 20)")
    parser.add_argument("--warmup", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=5,
                        help="first steps left out of samples/s (default 5)")
    parser.add_argument("--cluster", default=None, help="cluster file (default: the embedded 2-node cluster)")
    parser.add_argument("--out", default="out/demo", help="report and run files (default out/demo)")
    parser.add_argument("--plan-only", action="store_true", help="plan and simulate only: no emulation, no root")


def run(args: argparse.Namespace) -> int:
    """Run the demo (``demo.run_demo``): emulated where this host can, else planning only."""
    from hetrain.demo import run_demo

    return run_demo(args)

"""``hetrain models``: the reference models, with their layers, parameters and precision."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain models`` takes no options."""


def run(args: argparse.Namespace) -> int:
    """Print one line per reference model."""
    from hetrain.models.analytic import MODEL_NAMES, build_profile
    from hetrain.units import format_bytes

    print(f"{'model':<14} {'layers':>6} {'parameters':>12} {'precision':>9}")
    for name in MODEL_NAMES:
        p = build_profile(name)
        print(f"{name:<14} {p.num_layers:>6} {format_bytes(p.param_bytes):>12} {p.precision:>9}")
    return 0

"""What the emulated benchmarks share before they start: their step options checked, and root."""

from __future__ import annotations

import argparse


def ready_to_emulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Check ``--warmup`` against ``--steps`` (a usage error names them); whether this host can emulate.

    Prints ``skipped: <why>`` and returns False where it cannot (not root, no namespaces...).
    """
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must leave at least one timed step of --steps {args.steps}, got {args.warmup}")
    return can_emulate()


def can_emulate() -> bool:
    """Whether this host can emulate; prints ``skipped: <why>`` where it cannot (not root, no namespaces...)."""
    from hetrain.emulate import EmulationError
    from hetrain.emulate.emulator import check_permissions

    try:
        check_permissions("up")
    except EmulationError as e:
        print(f"skipped: {e}")
        return False
    return True

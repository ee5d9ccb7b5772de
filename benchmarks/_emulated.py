"""What the emulated benchmarks share: their step options checked and root before they start; their ending."""

from __future__ import annotations

import argparse
import sys

from _results import write_section


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


def finish(args: argparse.Namespace, failed: list[str], script: str, title: str, table: str, notes: str) -> int:
    """Print ``notes`` and what failed; write ``table`` and ``notes`` as RESULTS.md's section ``title`` (the
    command: ``script`` and this run's arguments) unless ``args.no_write`` or something failed; the exit status."""
    print(notes)
    if failed:
        print(f"failed: {', '.join(failed)} (their logs are under {args.out})")
    if not args.no_write and not failed:
        command = f"sudo -E .venv/bin/python benchmarks/{script} " + " ".join(sys.argv[1:])
        write_section(title, command.strip(), table, notes)
    return 1 if failed else 0

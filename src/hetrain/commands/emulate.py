"""``hetrain emulate run | up | down | status``: a heterogeneous cluster emulated on this host, a job run on it.

The subcommands and their options are ``hetrain.emulate.cli``'s (``python -m hetrain.emulate`` is the same
command).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain emulate``'s subcommands and their options (``emulate.cli.add_emulate_arguments``)."""
    from hetrain.emulate.cli import add_emulate_arguments

    add_emulate_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand given (``emulate.cli.run_emulate_args``)."""
    from hetrain.emulate.cli import run_emulate_args

    return run_emulate_args(args)

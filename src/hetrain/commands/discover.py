"""``hetrain discover``: under torchrun, measure devices and links and write them as a cluster file.

    torchrun --nproc-per-node N --no-python hetrain discover -o cluster.toml

(``python -m hetrain.profiler.network ...`` is the same command.)
"""

from __future__ import annotations

import argparse

from hetrain.arguments import int_between, number_at_least
from hetrain.fields import MAX_REPEATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain discover``'s options."""
    from hetrain.profiler.network import DEFAULT_SIZES, parse_message_sizes
    from hetrain.units import parse_bytes

    parser.add_argument("-o", "--output", default="cluster.toml", help="cluster file to write (default cluster.toml)")
    parser.add_argument("--sizes", type=parse_message_sizes, default=list(DEFAULT_SIZES),
                        help="message sizes: '4KB,1MB,16MB' or a x4 range '4KB..64MB' (the default)")
    parser.add_argument("--timeout", type=number_at_least(0.0, inclusive=False), default=60.0, dest="timeout_s",
                        help="seconds any one wait may take before the rank waited for is reported (default 60)")
    parser.add_argument("--repeats", type=int_between(1, MAX_REPEATS, "MAX_REPEATS"), default=5,
                        help="timed round trips per message size (default 5)")
    parser.add_argument("--allreduce-bytes", type=parse_bytes, default=None,
                        help="size of the all-reduce compared with the cost model (default: the largest message)")


def run(args: argparse.Namespace) -> int:
    """Measure on every rank; rank 0 writes the file and prints the summary (``network.run_discover_command``)."""
    from hetrain.profiler.network import run_discover_command

    allreduce = int(args.allreduce_bytes) if args.allreduce_bytes else None
    return run_discover_command(args.output, args.sizes, args.timeout_s, args.repeats, allreduce)

"""``hetrain fit-time-model``: the learned layer-time model, fitted on measured profiles (scikit-learn).

    hetrain fit-time-model --profiles P1.json P2.json ... [--cluster C.toml] [--device-spec SPEC ...]
                           [-o time_model.json]
"""

from __future__ import annotations

import argparse

from hetrain.fields import check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain fit-time-model``'s options."""
    parser.add_argument("--profiles", nargs="+", required=True, metavar="PROFILE",
                        help="profile JSON files with measured layer times; every measured device type whose "
                             "figures are known (catalog, --cluster, --device-spec, the profile) is learned from")
    parser.add_argument("--cluster", action="append", default=[], metavar="CLUSTER",
                        help="a cluster file whose device types' figures (custom types' tflops, tflops_fp16, "
                             "memory_bandwidth) the model may learn with; repeatable")
    parser.add_argument("--device-spec", action="append", default=[], metavar="SPEC",
                        help="one device type's figures as a cluster file writes a device, e.g. "
                             "'{ type = \"P40\", tflops = 12, tflops_fp16 = 12, memory = \"24GB\", "
                             "memory_bandwidth = \"346GB/s\" }'; repeatable")
    parser.add_argument("-o", "--output", default="time_model.json")


def run(args: argparse.Namespace) -> int:
    """Fit, save, say which types it learned from and which it left out (``profiler.learned.run_fit_command``)."""
    check_output_path(args.output, "-o")
    from hetrain.profiler.learned import run_fit_command

    return run_fit_command(args.profiles, args.output, args.cluster, args.device_spec)

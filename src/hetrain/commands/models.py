"""``hetrain models``: the reference models, with their layers, parameters and precision; or the models named
(reference names, or ``hf:DIR``: a transformers config.json, read as JSON and never built).

    hetrain models                      # every reference model
    hetrain models llama2-7b hf:DIR     # those named
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain models``' one option: the models to list (default: every reference model)."""
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="reference model names or hf:DIR (a transformers config.json); default: every reference "
                        "model")


def run(args: argparse.Namespace) -> int:
    """Print one line per model: its layers, its parameters' bytes (fp32) and its precision."""
    from hetrain.errors import InputError
    from hetrain.models.analytic import MODEL_NAMES, UnknownModelError, build_profile
    from hetrain.models.hf_analytic import build_hf_profile, is_hf_spec
    from hetrain.units import format_bytes

    names = args.models or list(MODEL_NAMES)
    profiles = []
    for name in names:  # all read before a line is printed: a bad name is the one line of output
        try:
            profiles.append(build_hf_profile(name) if is_hf_spec(name) else build_profile(name))
        except UnknownModelError as e:  # a KeyError: said in one line as bad input
            raise InputError(str(e)) from None
    width = max(14, *(len(name) for name in names))
    print(f"{'model':<{width}} {'layers':>6} {'parameters':>12} {'precision':>9}")
    for name, p in zip(names, profiles, strict=True):
        print(f"{name:<{width}} {p.num_layers:>6} {format_bytes(p.param_bytes):>12} {p.precision:>9}")
    return 0

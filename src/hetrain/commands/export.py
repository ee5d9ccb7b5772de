"""``hetrain export``: a checkpoint's weights as a Hugging Face model directory (hf:DIR models) or one
safetensors file.

    hetrain export --checkpoint D --to-hf OUT [--step N] [--model hf:DIR]  (or --to-safetensors FILE)
"""

from __future__ import annotations

import argparse

from hetrain.arguments import int_between
from hetrain.errors import InputError
from hetrain.fields import MAX_STEPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain export``'s options."""
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="the --checkpoint-dir hetrain train wrote")
    to = parser.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-hf", metavar="OUT", help="write a transformers model directory (a model trained from "
                    "--model hf:DIR): model.safetensors, config.json, tokenizer files")
    to.add_argument("--to-safetensors", metavar="FILE", help="write every layer's tensors, named layers.{k}.<name>, "
                    "as one safetensors file (any model)")
    parser.add_argument("--step", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=None,
                        help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--model", metavar="hf:DIR", help="the model's directory (default: the plan's model, as the "
                        "checkpoint records it)")
    parser.add_argument("--plan", metavar="PLAN", help="the plan it was trained with, to read its model from")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT or an existing FILE")


def run(args: argparse.Namespace) -> int:
    """Export the step asked for (or the newest complete one) and say what was written."""
    from hetrain.runtime.state.export import export_hf, export_safetensors
    from hetrain.units import format_bytes

    if args.to_hf is not None:
        done = export_hf(args.checkpoint, args.to_hf, step=args.step, model=args.model, plan=args.plan,
                         force=args.force)
    else:
        for flag in ("model", "plan"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag} applies to --to-hf only; --to-safetensors writes hetrain's own names")
        done = export_safetensors(args.checkpoint, args.to_safetensors, step=args.step, force=args.force)
    print(f"hetrain export: step {done.step} of {done.model or 'the checkpoint'} -> {done.path} "
          f"({done.tensors} tensors, {format_bytes(done.weight_bytes)})")
    return 0

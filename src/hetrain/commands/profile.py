"""``hetrain profile``: measure a model's layers on this device and write the profile.

    hetrain profile --model NAME|MODULE:FUNCTION|hf:DIR [--data SPEC] [--seq-len T] [--micro-batch 1,2,4,8] [-o P]
    torchrun --nproc-per-node K -m hetrain profile --model NAME --tp K [...]     (the layers also on a TP group of K)
"""

from __future__ import annotations

import argparse

from hetrain.arguments import int_between, micro_batch_sizes, module_names
from hetrain.errors import InputError
from hetrain.fields import MAX_REPEATS, MAX_SEQ_LEN, check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain profile``'s options."""
    parser.add_argument("--model", required=True, help="a reference model, or MODULE:FUNCTION / "
                        "path/to/file.py:FUNCTION returning your own (docs/own-model.md)")
    parser.add_argument("--data", default=None, help="MODULE:FUNCTION returning a torch Dataset of (input, target), "
                        "tokens:FILE.bin / text:FILE, or jsonl:FILE / parquet:FILE / dataset:DIR: the input to "
                        "profile on (needed for your own model)")
    parser.add_argument("--split-points", type=module_names, default=(), metavar="NAME,...",
                        help="cut a traced model (hf:DIR, or your own module) where these modules begin, in forward "
                        "order (default: before each repeated block, and after the last); recorded in the profile, "
                        "hetrain train cuts alike (docs/own-model.md)")
    parser.add_argument("--seq-len", type=int_between(1, MAX_SEQ_LEN, "MAX_SEQ_LEN"), default=None, metavar="T",
                        help="tokens per sample of a token model or token data (default: a gpt model's seq_len; an "
                        "hf:DIR model needs it); recorded in the profile, hetrain train runs at it")
    parser.add_argument("--micro-batch", type=micro_batch_sizes, default=[1, 2, 4, 8])
    parser.add_argument("-o", "--output", default="profile.json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int_between(1, MAX_REPEATS, "MAX_REPEATS"), default=5)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    parser.add_argument("--tp", type=int_between(1, 16, "a TP group's devices"), default=1, metavar="K",
                        help="under torchrun with K ranks on this node: also time each layer that has a TP rule on a "
                        "rank of a TP group of the K devices (the profile's measured_tp; docs/profile.md); without it "
                        "the planner estimates those times")


def run(args: argparse.Namespace) -> int:
    """Resolve the model and its input (a model or data set that cannot be used is refused first), measure,
    write the profile (``profiler.layers.run_profile_command``)."""
    check_output_path(args.output, "-o")
    from hetrain.models.spec import is_user_spec
    from hetrain.models.user import resolve_model
    from hetrain.profiler.layers import profile_inputs, run_profile_command

    if args.model.endswith(".py") and not is_user_spec(args.model):
        raise InputError(f"--model {args.model}: a Python file needs the function that returns the model: "
                         f"--model {args.model}:FUNCTION (docs/own-model.md)")
    source = resolve_model(args.model, split_points=args.split_points)
    inputs = profile_inputs(source, args.data, seq_len=args.seq_len)
    if args.tp > 1:
        from hetrain.runtime.tp_measure import profile_with_tp

        return profile_with_tp(source, args, inputs)
    return run_profile_command(source, args.micro_batch, args.output, device=args.device,
                               repeats=args.repeats, precision=args.precision, data=args.data, inputs=inputs)

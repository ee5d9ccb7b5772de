"""The ``hetrain`` command.

    hetrain plan --cluster C.toml --model gpt2-medium --global-batch 512 [-o plan.json] [--json]
    hetrain simulate plan.json [--trace out.json] [--gantt out.png] [--timeline out.json] [--json]
    torchrun ... -m hetrain train --plan plan.json --model NAME [--steps N] [--checkpoint-dir D]
    torchrun ... -m hetrain baseline ddp|pipelining --model NAME [--global-batch B] [--steps N]
    hetrain compare predicted.json measured.json [--gantt both.png]
    hetrain calibrate plan.json metrics.jsonl [--warmup N] [-o profile.json]
    hetrain profile --model NAME|MODULE:FUNCTION|hf:DIR [--data SPEC] [--seq-len T] [--micro-batch 1,2,4,8] [-o P]
    hetrain fit-time-model --profiles P1.json P2.json ... [--cluster C.toml] [--device-spec SPEC] [-o M.json]
    torchrun --nproc-per-node N --no-python hetrain discover -o cluster.toml
    hetrain export --checkpoint D --to-hf OUT [--step N] [--model hf:DIR]  (or --to-safetensors FILE)
    hetrain emulate run CLUSTER.toml -- COMMAND...  (also up, down, status)
    hetrain models | hetrain demo

One table, ``COMMANDS``, names every command, the module that defines it and its line in ``hetrain --help``.
A command's module has ``add_arguments(parser)`` and ``run(args) -> int``::

    argv ──► COMMANDS[argv[0]] ──► import its module ──► add_arguments(its subparser) ──► run(args)

Only the chosen command's module is imported and only its subparser gets options: ``hetrain --help``
imports none (and no torch), the planning commands never import torch. This module imports nothing of
hetrain's but its errors, so that ``python -m hetrain.runtime.command`` and ``python -m
hetrain.profiler.network`` hand their arguments here too.

Exit status, whatever the command: 0 done; 2 bad input (an ``InputError``: a file, a field, an argument;
argparse's own errors too); 1 a failure while running (a ``RunError``, a file that cannot be written).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hetrain.errors import InputError, RunError


@dataclass(frozen=True)
class Command:
    """One ``hetrain`` command.

    Attributes:
        module: the module that defines it: ``add_arguments(parser)`` and ``run(args) -> int``; imported only
            to run it or to print its own ``--help``.
        help: its line in ``hetrain --help``.
        description: the paragraph ``hetrain NAME --help`` prints under its usage (None: none).
    """

    module: str
    help: str
    description: str | None = None


#: every command, in the order ``hetrain --help`` lists them
COMMANDS: dict[str, Command] = {
    "plan": Command("hetrain.commands.plan", "plan a hybrid pipeline + data parallel run"),
    "simulate": Command("hetrain.commands.simulate", "simulate a plan's iteration, action by action"),
    "models": Command("hetrain.commands.models", "list the reference models"),
    "profile": Command("hetrain.commands.profile", "measure a model's layers on this device"),
    "fit-time-model": Command("hetrain.commands.fit_time_model", "fit the learned layer-time model on measured "
                              "profiles (needs scikit-learn)"),
    "discover": Command("hetrain.commands.discover", "under torchrun: measure devices and links, write a cluster "
                        "file", "Measure the cluster under torchrun and write it as a cluster file (``hetrain "
                        "discover``)."),
    "train": Command("hetrain.runtime.command", "under torchrun: train a model with a plan (torchrun ... -m hetrain "
                     "train --plan P)", "Train a reference model with a plan."),
    "baseline": Command("hetrain.baselines", "under torchrun: train a reference model with torch's DDP or "
                        "pipelining, as a baseline for a plan (torchrun ... -m hetrain baseline ddp)",
                        "Train a reference model with torch's DDP or pipelining."),
    "compare": Command("hetrain.commands.compare", "predicted vs measured timeline: error per device and action "
                       "kind, per iteration (each side's totals divided by the iterations it holds)"),
    "calibrate": Command("hetrain.commands.calibrate", "fit the cost model's overhead per action to a trained "
                         "plan's metrics"),
    "export": Command("hetrain.commands.export", "a checkpoint's weights as a Hugging Face model directory "
                      "(hf:DIR models) or one safetensors file"),
    "emulate": Command("hetrain.commands.emulate", "emulate a heterogeneous cluster on this host and run a job "
                       "on it"),
    "demo": Command("hetrain.commands.demo", "the main job end to end on an emulated heterogeneous cluster (root)"),
}


def build_parser(chosen: str | None = None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The ``hetrain`` parser, every command listed with its help; only ``chosen``'s subparser has its options
    (its module imported). Returns the parser and that subparser (None where none is chosen)."""
    parser = argparse.ArgumentParser(prog="hetrain", description=__doc__.split("\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    picked = None
    for name, command in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=command.help, add_help=False)  # listed; its options are its module's
            continue
        picked = sub.add_parser(name, help=command.help, description=command.description)
        importlib.import_module(command.module).add_arguments(picked)
    return parser, picked


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by its command's parser (argparse exits on its own errors, and after ``--help``)."""
    name = argv[0] if argv and argv[0] in COMMANDS else None
    parser, sub = build_parser(name)
    if sub is None:  # no command, an unknown one, or --help: argparse says so and exits
        parser.parse_args(argv)
        parser.error("give the command first: hetrain COMMAND [options]")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hetrain`` command; returns the exit status.

    Bad input (``InputError``: a file, a field, an argument) is one line on stderr and status 2;
    a failure while running (``RunError``, or a file that cannot be written) one line and status 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv else "command"
    try:
        args = _parse(argv)
        code: int = importlib.import_module(COMMANDS[args.command].module).run(args)
        return code
    except (InputError, ValueError) as e:  # ValueError: the checks that predate InputError
        print(f"hetrain {name}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"hetrain {name}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away (``hetrain plan ... | head``): stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the interpreter's final flush does not fail again
        return 1
    except OSError as e:
        print(f"hetrain {name}: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hetrain {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

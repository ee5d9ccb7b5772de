"""The ``train`` command: a model (reference or your own), a data set and a plan, on every rank of a torchrun job.

    torchrun --nproc-per-node 4 -m hetrain.runtime.command --plan plan.json --model gpt-tiny --steps 100 \
        --checkpoint-dir ckpt --checkpoint-every 50 --metrics-out metrics.jsonl --timeline-out measured.json

``hetrain train`` takes the same options (``add_arguments``, ``run``), on the
command line or in a TOML file, ``--config train.toml`` (``runtime.config_file``).
Restarted by ``torchrun --max-restarts N``, a job resumes from the newest complete
checkpoint in ``--checkpoint-dir`` by itself, under the plan it is given then; when the
world it restarts on is not that plan's (a node left or joined, ``torchrun --nnodes MIN:MAX``),
``--replan auto`` re-plans it first (``runtime.lifecycle.restart``, docs/elastic.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from hetrain.amp import check_precision
from hetrain.arguments import int_between, number_at_least
from hetrain.data.datasets import DatasetSplit
from hetrain.data.seq_len import check_sample_length, refuse_seq_len, train_seq_len
from hetrain.data.user import build_model_datasets, check_batch_fits
from hetrain.distributed.device import choose_device
from hetrain.drift import DriftOptions, check_force_devices, parse_force
from hetrain.errors import InputError, RunError
from hetrain.fields import MAX_SEQ_LEN, MAX_STEPS
from hetrain.models.layers import param_bytes
from hetrain.models.spec import is_user_spec
from hetrain.models.user import ModelSource, resolve_model
from hetrain.plan import Plan, PlanError, load_plan
from hetrain.profile import PRECISIONS
from hetrain.runtime.config_file import named_value, parse_with_config
from hetrain.runtime.lifecycle.drift_watch import SWITCH_EXIT_STATUS, DriftSwitch
from hetrain.runtime.lifecycle.restart import REPLAN_MODES
from hetrain.runtime.step.clip import check_clip
from hetrain.runtime.step.loss_scale import check_fp16
from hetrain.runtime.step.lr_schedule import LR_SCHEDULES, LrSchedule
from hetrain.runtime.trainer import DEFAULT_TIMEOUT_S, Trainer, build_optimizer_fn, default_lr


def _model_config(items: Sequence[str]) -> dict[str, Any]:
    """``["n_blocks=2", "hidden=64"]`` -> ``{"n_blocks": 2, "hidden": 64}`` (values read as JSON when they parse)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"model settings are KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _describe(schedule: LrSchedule, clip_grad_norm: float | None) -> str:
    """``"lr 0.001 cosine to 1e-05, warm-up 100, clip 1"``: the start-up line's part on the optimizer's driving."""
    text = f"lr {schedule.lr:g}"
    if schedule.schedule != "constant":
        text += f" {schedule.schedule} to {schedule.min_lr:g}"
    if schedule.warmup_steps:
        text += f", warm-up {schedule.warmup_steps}"
    return text + (f", clip {clip_grad_norm:g}" if clip_grad_norm is not None else "")


def _print_outcome(trainer: Trainer, start: int, history: list[dict[str, Any]]) -> None:
    """The reporting rank's last lines: steps, loss, median samples/s, validation loss; an unused rank's note."""
    if trainer.is_reporting and history:
        rates = [r["samples_per_s"] for r in history[1:]] or [history[0]["samples_per_s"]]
        print(f"hetrain train: steps {start} -> {trainer.step}, loss {history[0]['loss']:.4f} -> "
              f"{history[-1]['loss']:.4f}, {sorted(rates)[len(rates) // 2]:.1f} samples/s (median)", flush=True)
        if trainer.val_history:
            print(f"hetrain train: validation loss {trainer.val_history[0]['val_loss']:.4f} -> "
                  f"{trainer.val_history[-1]['val_loss']:.4f}", flush=True)
    elif not trainer.role.used:
        print(f"hetrain train: rank {trainer.rank} ({trainer.role.device}) is unused by the plan; idle", flush=True)


def build_train_datasets(plan: Plan, model: ModelSource, data: str | None, data_seed: int = 0, *,
                         seq_len: int | None = None, val_data: str | None = None,
                         tokenizer: str | None = None) -> tuple[str, DatasetSplit]:
    """``build_model_datasets`` at the sequence length the plan's profile was measured at (``hetrain.data.seq_len``).

    Raises:
        SpecError: a ``seq_len`` (``--seq-len``) that differs from the profile's, one for a run with no sequence
            length, or a user's data set for a token model whose samples are of another length.
    """
    refuse_seq_len(model, data, seq_len)
    measured_at = plan.profile.seq_len
    t = train_seq_len(measured_at, seq_len)
    split = build_model_datasets(model, data, data_seed, seq_len=t, val_data=val_data, tokenizer=tokenizer)
    if data is not None and is_user_spec(data):
        check_sample_length(model, data, split[1].train, t, from_profile=measured_at is not None)
    return split


def check_layers_of_plan(plan_path: str | Path | Plan, plan: Plan, model: str, first: int,
                         layers: Sequence[nn.Module]) -> None:
    """Refuse layers whose parameters are not what the plan's profile counted (a model of other settings:
    ``--set hidden=256`` on a plan of 128, another ``hf:DIR``): the plan's memory and time are those of
    another model. Parameter bytes per layer, as the profiler and the analytic profiles count them.

    Raises:
        PlanError: naming the plan, the first such layer and both sizes.
    """
    for k, layer in enumerate(layers, start=first):
        have = param_bytes(layer)
        want = plan.profile.layers[k].param_bytes
        if abs(have - want) > 1e-3 * max(want, 1.0):
            where = plan_path if isinstance(plan_path, (str, Path)) else "the plan"
            raise PlanError(f"{where} was made for another model: layer {k} ({plan.profile.layers[k].name}) of "
                            f"its profile ({plan.profile.name}) has {int(want):,} bytes of parameters, model "
                            f"{model}'s has {int(have):,}; profile and plan this model (hetrain profile, "
                            "hetrain plan) and train with that plan")


def run_train_command(plan_path: str | Path | Plan, model: str | ModelSource,
                      data: str | tuple[str, DatasetSplit] | None = None, steps: int = 100,
                      checkpoint_dir: str | Path | None = None, timeline_out: str | Path | None = None,
                      metrics_out: str | Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                      checkpoint_every: int = 0, lr: float | None = None,
                      weight_decay: float = 0.0, seed: int = 0, data_seed: int = 0, progress: bool | None = None,
                      tensorboard_dir: str | Path | None = None, log_every: int = 10,
                      model_config: dict[str, Any] | None = None, eval_every: int = 0,
                      eval_batches: int = 8, lr_schedule: str = "constant", warmup_steps: int = 0,
                      min_lr: float = 0.0, clip_grad_norm: float | None = None, replan: str = "auto",
                      drift: DriftOptions | None = None) -> int:
    """``hetrain train``: train a reference model with a plan, on every rank of a torchrun job.

    The plan runs as it is: its sync mode, sync options and optimizer (module docstring).

    Args:
        plan_path: plan.json, or the Plan read from it.
        model: a reference model name (``hetrain.models.registry``), ``MODULE:FUNCTION`` returning the
            user's own (``hetrain.models.user``), or the ``ModelSource`` of either; its layer count must
            be the plan's.
        data: a data set name (``hetrain.data.registry``; default: the real one that fits the model),
            ``tokens:FILE.bin`` or ``text:FILE`` (``hetrain.data.tokens``, windows of the plan's profile's
            seq_len, else the GPT's),
            ``MODULE:FUNCTION`` returning the user's own (``hetrain.data.user``; a user's model needs
            it), or ``build_model_datasets``' ``(name, datasets)``.
        steps: the step count to reach (a resumed run goes on from its checkpoint).
        checkpoint_dir: where checkpoints go and are resumed from.
        timeline_out: the measured Timeline of the last step (JSON).
        metrics_out: per-step metrics (JSONL).
        timeout_s: the longest any distributed wait may take.
        checkpoint_every: steps between checkpoints (0: only at the end).
        lr: the peak learning rate (default by optimizer: 0.05 SGD, 1e-3 AdamW).
        weight_decay: weight decay.
        seed: the model's seed (per-layer seeds derive from it).
        data_seed: the seed of the order of the data.
        progress: progress bar (None: when stdout is a terminal).
        tensorboard_dir: TensorBoard scalars, if tensorboard is installed.
        log_every: steps whose losses are reduced (and logged) together.
        model_config: overrides of the model preset's fields.
        eval_every: validation loss on the data set's held-out part every this many steps (0: never).
        eval_batches: global-batch-sized validation batches per evaluation.
        lr_schedule: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr`` at step ``steps``.
        warmup_steps: linear warm-up from 0 to ``lr`` over this many steps.
        min_lr: the learning rate the decay ends at.
        clip_grad_norm: clip gradients to this global norm over the whole model (``bsp`` plans only).
        replan: ``auto``: re-plan a world that is not the plan's (``runtime.lifecycle.restart``) and watch for drift
            (``runtime.lifecycle.drift_watch``); ``world``: the changed world only; ``off``: refuse a changed world.
        drift: the drift watch's options (``replan="auto"`` with a ``checkpoint_dir`` only); None: no watch.

    Returns:
        The exit status: 0; ``SWITCH_EXIT_STATUS`` (75) after a drift switch's checkpoint and plan are
        written (run it again, as torchrun's ``--max-restarts`` does, to go on under the new plan); 1 after
        an error printed to stderr.
    """
    trainer: Trainer | None = None
    config = dict(model_config or {})
    try:
        plan = plan_path if isinstance(plan_path, Plan) else load_plan(plan_path)
        source = (resolve_model(model, split_points=plan.profile.split_points, **config) if isinstance(model, str)
                  else model)
        n = source.num_layers
        if n != plan.profile.num_layers:
            raise PlanError(f"model {source.name!r} has {n} layers but the plan ({plan.model}) has "
                            f"{plan.profile.num_layers}")
        data_name, (train_set, val_set) = (data if isinstance(data, tuple)
                                           else build_train_datasets(plan, source, data, data_seed))
        if eval_every and val_set is None:
            raise InputError(f"--eval-every needs a validation set; --data {data_name} returned only a training "
                             "set (return a (train, validation) pair)")
        opt_name = plan.optimizer
        check_clip(plan, clip_grad_norm)
        schedule = LrSchedule(default_lr(opt_name) if lr is None else lr, lr_schedule,  # type: ignore[arg-type]
                              warmup_steps, min_lr)

        def layers_fn(first: int, end: int) -> list[nn.Module]:
            built = source.build_layers(first, end, seed=seed)
            check_layers_of_plan(plan_path, plan, source.name, first, built)
            return built

        trainer = Trainer(layers_fn, plan, build_optimizer_fn(opt_name, lr, weight_decay=weight_decay),
                          source.loss_fn, timeout_s=timeout_s, checkpoint_dir=checkpoint_dir,
                          checkpoint_every=checkpoint_every, metrics_out=metrics_out, timeline_out=timeline_out,
                          progress=progress, tensorboard_dir=tensorboard_dir, log_every=log_every,
                          lr_schedule=schedule, clip_grad_norm=clip_grad_norm, tied=source.tied, replan=replan,
                          drift=drift)
        plan = trainer.plan  # re-made when the world changed
        if trainer.is_reporting:
            resumed = f", resuming at step {trainer.step}" if trainer.step else ""
            print(f"hetrain train: {source.name} on {data_name}, {len(plan.devices_used)} device(s) of {trainer.world} "
                  f"rank(s), {len(plan.virtual_workers)} VW(s), {plan.schedule}, global batch {plan.global_batch}, "
                  f"{opt_name} {_describe(schedule, clip_grad_norm)}{resumed}", flush=True)
        start = trainer.step
        if start and start >= steps:  # every rank resumed at the same step, so every rank stops here
            if trainer.is_reporting:
                print(f"hetrain train: nothing to train: checkpoint step {start} in {checkpoint_dir} is already at "
                      f"or past --steps {steps} (the step count to reach); give --steps above {start} to train on",
                      flush=True)
        else:
            history = trainer.fit(train_set, steps, seed=data_seed, val_data=val_set, eval_every=eval_every,
                                  eval_batches=eval_batches)
            _print_outcome(trainer, start, history)
    except DriftSwitch as e:
        print(f"hetrain train: {e}", flush=True)
        if trainer is not None:
            trainer.close()
        return SWITCH_EXIT_STATUS
    except (RunError, InputError, ValueError, TypeError, OSError) as e:
        print(f"hetrain train: error: {e}", file=sys.stderr, flush=True)
        if trainer is not None:
            trainer.close()
        return 1
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` command's options (for ``hetrain train`` and ``python -m hetrain.runtime.trainer``)."""
    parser.add_argument("--config", default=None, metavar="train.toml",
                        help="read options from this TOML file (keys: the long option names); the command line "
                             "overrides it")
    parser.add_argument("--plan", required=True, help="plan.json")
    parser.add_argument("--model", required=True, help="reference model name (hetrain.models.registry), or "
                        "MODULE:FUNCTION / path/to/file.py:FUNCTION returning your own (docs/own-model.md)")
    parser.add_argument("--data", default=None, help="data set: shakespeare, digits, synthetic (default: fits model), "
                        "tokens:FILE.bin (uint16 token ids), text:FILE (an hf:DIR model's tokenizer.json, --tokenizer, "
                        "or bytes), jsonl:FILE / parquet:FILE / dataset:DIR (a text or input_ids column), "
                        "or MODULE:FUNCTION returning a torch Dataset of (input, target) or of dicts with input_ids "
                        "(needed for your own model)")
    parser.add_argument("--val-data", default=None, metavar="tokens:FILE|text:FILE",
                        help="validation tokens for --data tokens:/text: (default: its last 10%%)")
    parser.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                        help="tokenize --data text:FILE (or a text column) with this tokenizers file (default: an "
                        "hf:DIR model's tokenizer.json, else bytes, vocab 256)")
    parser.add_argument("--seq-len", type=int_between(1, MAX_SEQ_LEN, "MAX_SEQ_LEN"), default=None, metavar="T",
                        help="tokens per sample of token data (default: the length the plan's profile was measured "
                             "at, which it must equal; else the reference GPT's seq_len; needed for your own model)")
    steps = int_between(0, MAX_STEPS, "MAX_STEPS")
    parser.add_argument("--steps", type=steps, default=100, help="step count to reach (default 100)")
    parser.add_argument("--checkpoint-dir", default=None, help="write checkpoints here; resume from the newest")
    parser.add_argument("--checkpoint-every", type=steps, default=0, help="steps between checkpoints (0: at the end)")
    parser.add_argument("--timeline-out", default=None, help="measured timeline of the last step (JSON)")
    parser.add_argument("--metrics-out", default=None, help="per-step metrics (JSONL)")
    parser.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars (if tensorboard is installed)")
    parser.add_argument("--log-every", type=int_between(1, MAX_STEPS, "MAX_STEPS"), default=10,
                        help="steps whose losses are summed over the ranks together (default 10)")
    parser.add_argument("--timeout-s", type=number_at_least(0.0, inclusive=False), default=DEFAULT_TIMEOUT_S,
                        help=f"longest distributed wait, seconds (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--lr", type=number_at_least(0.0, inclusive=False), default=None,
                        help="peak learning rate, reached after the warm-up (default 0.05 SGD, 1e-3 AdamW)")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="after the warm-up: constant, or cosine / linear decay to --min-lr at the last step "
                             "(default constant)")
    parser.add_argument("--warmup-steps", type=steps, default=0, metavar="N",
                        help="linear warm-up from 0 to --lr over the first N steps (default 0)")
    parser.add_argument("--min-lr", type=number_at_least(0.0), default=0.0,
                        help="learning rate the decay ends at, <= --lr (default 0)")
    parser.add_argument("--clip-grad-norm", type=number_at_least(0.0, inclusive=False), default=None, metavar="X",
                        help="clip gradients to global norm X over the whole model before each step; bsp plans "
                             "only (other sync modes step on gradients not summed across VWs: refused)")
    parser.add_argument("--weight-decay", type=number_at_least(0.0), default=0.0)
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="must be the plan's precision (hetrain plan --precision), which is what runs; "
                             "a different one is refused (re-plan)")
    parser.add_argument("--replan", choices=REPLAN_MODES, default="auto",
                        help="auto: a restart whose devices are not the plan's (a node left or joined) re-plans "
                             "with the plan's cluster, profile and options, and resumes from the newest checkpoint "
                             "under the new plan (written to CHECKPOINT_DIR/plans/); with --checkpoint-dir it also "
                             "watches for a device that drifts and switches plans when that pays (exit status 75, "
                             "for torchrun to restart); world: the changed world only, no drift watch; off: refuse "
                             "a changed world (default auto; docs/elastic.md)")
    parser.add_argument("--drift-threshold", type=number_at_least(0.0, inclusive=False), default=0.3, metavar="X",
                        help="a device drifts when its compute runs 1+X times slower (or faster) than its baseline "
                             "(default 0.3)")
    parser.add_argument("--drift-window", type=int_between(1, MAX_STEPS, "MAX_STEPS"), default=20, metavar="N",
                        help="steps in a row a device must drift before a re-plan is considered; also its "
                             "baseline's steps (default 20)")
    parser.add_argument("--replan-cooldown", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=100,
                        metavar="N", help="no drift decision within N steps of the last one (default 100)")
    parser.add_argument("--force-drift", default=None, metavar="STEP:DEVICE=FACTOR",
                        help="a drill: at STEP act as if DEVICE ran FACTOR times slower and switch plans whatever "
                             "the gain (e.g. 40:n0:1=3)")
    parser.add_argument("--seed", type=int, default=0, help="model seed (per-layer seeds derive from it)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the data order")
    parser.add_argument("--set", dest="model_config", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the model preset, e.g. --set n_blocks=2")
    bar = parser.add_mutually_exclusive_group()
    parser.add_argument("--eval-every", type=steps, default=0, metavar="N",
                        help="validation loss on the held-out data every N steps, logged as val_loss (0: never)")
    parser.add_argument("--eval-batches", type=int_between(1, MAX_STEPS, "MAX_STEPS"), default=8, metavar="K",
                        help="global-batch-sized validation batches per evaluation (default 8)")
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _check_output_paths(args: argparse.Namespace) -> None:
    """Refuse an output file that is a directory, and a checkpoint directory that is a file. (Only what is
    wrong on every host: the reporting rank writes the files, perhaps on another host than this one.)"""
    for flag, path in (("--metrics-out", args.metrics_out), ("--timeline-out", args.timeline_out)):
        if path and Path(path).is_dir():
            raise InputError(f"{flag} {path!r}: is a directory; give a file name")
    if args.checkpoint_dir and Path(args.checkpoint_dir).exists() and not Path(args.checkpoint_dir).is_dir():
        raise InputError(f"--checkpoint-dir {args.checkpoint_dir!r}: is a file; give a directory")


def check_plan_precision(plan: Plan, precision: str | None, plan_path: str) -> None:
    """Refuse a ``--precision`` other than the plan's, fp16 under a sync mode other than bsp, and fp16 on a CPU.

    Raises:
        InputError: naming the plan file and both precisions.
    """
    if precision is not None and precision != plan.precision:
        raise InputError(f"--precision {precision}: {plan_path} was planned for {plan.precision} (its memory and "
                         f"time predictions hold for that); re-plan with hetrain plan --precision {precision}")
    check_fp16(plan, plan_path)
    check_precision(plan.precision, choose_device(int(os.environ.get("LOCAL_RANK", "0")))[1].type, plan_path)


def _check_options_with_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse clipping the plan's sync mode cannot do, and a ``--min-lr`` above the learning rate; each error
    names the option as given: its flag, or the config file and key (``config_file.named_value``)."""
    try:
        check_clip(plan, args.clip_grad_norm)
    except InputError as e:
        raise InputError(f"{named_value(args, 'clip_grad_norm', '--clip-grad-norm')}: {e}") from None
    lr = default_lr(plan.optimizer) if args.lr is None else args.lr
    if args.min_lr > lr:
        peak = f"{plan.optimizer}'s default {lr:g}" if args.lr is None else named_value(args, "lr", "--lr")
        raise InputError(f"{named_value(args, 'min_lr', '--min-lr')}: the minimum learning rate, where the decay "
                         f"ends, must be at most the learning rate ({peak})")
    LrSchedule(lr, args.lr_schedule, args.warmup_steps, args.min_lr)


def _check_force_drift(args: argparse.Namespace, plan: Plan) -> tuple[int, tuple[tuple[str, float], ...]] | None:
    """``--force-drift``'s value parsed and checked against plan.json's own cluster, and what a drill needs
    (``--replan auto``, a ``--checkpoint-dir``): before any process group, re-plan or file. Errors name the
    value as given (``config_file.named_value``) and only the conditions that fail."""
    if not args.force_drift:
        return None
    named = named_value(args, "force_drift", "--force-drift")
    force = parse_force(args.force_drift, named)
    check_force_devices(force, plan.cluster, named, args.plan)
    missing = ([] if args.replan == "auto" else [f"--replan auto (got {args.replan})"]) + \
              ([] if args.checkpoint_dir else ["a --checkpoint-dir (got none)"])
    if missing:
        raise InputError(f"{named}: a drift switch needs {' and '.join(missing)}")
    return force


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The command table's hook (``hetrain.cli``): ``argv`` over the options of ``--config train.toml``, if given."""
    return parse_with_config(parser, argv)


def run(args: argparse.Namespace) -> int:
    """Run the ``train`` command from parsed ``add_arguments`` options.

    Bad arguments and a plan file that cannot be read are refused here, before any process group,
    with status 2; ``run_train_command`` returns 1 for what fails after. A rank that fails with its
    process group up leaves at once (``_leave_at_once``).
    """
    code = _run(args)
    if code != 0 and dist.is_initialized():
        _leave_at_once(code)
    return code


def _leave_at_once(code: int) -> None:
    """A process group with a dead or stuck peer cannot be torn down cleanly: its transport threads may abort
    the interpreter at exit ("terminate called without an active exception"). The error is printed; leave
    at once with it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    try:
        config = _model_config(args.model_config)
        _check_output_paths(args)
        plan = load_plan(args.plan)
        check_plan_precision(plan, args.precision, args.plan)
        _check_options_with_plan(args, plan)
        force = _check_force_drift(args, plan)
        # a model or data set that cannot be used: refused here; a traced model cut where its profile was
        model = resolve_model(args.model, split_points=plan.profile.split_points, **config)
        data = build_train_datasets(plan, model, args.data, args.data_seed, seq_len=args.seq_len,
                                    val_data=args.val_data, tokenizer=args.tokenizer)
        check_batch_fits(data[0], data[1], plan.global_batch, args.eval_batches if args.eval_every else 0)
        if args.tokenizer and args.checkpoint_dir:  # exported with the model (export --to-hf)
            from hetrain.runtime.state.export import save_tokenizer

            save_tokenizer(args.checkpoint_dir, args.tokenizer)
        drift = None
        if args.replan == "auto" and args.checkpoint_dir:
            drift = DriftOptions(args.drift_threshold, args.drift_window, args.replan_cooldown, force=force)
    except (InputError, ValueError) as e:
        print(f"hetrain train: error: {e}", file=sys.stderr)
        return 2
    return run_train_command(plan, model, data, args.steps, args.checkpoint_dir, args.timeline_out,
                             args.metrics_out, args.timeout_s, checkpoint_every=args.checkpoint_every,
                             lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                             data_seed=args.data_seed, progress=args.progress, tensorboard_dir=args.tensorboard_dir,
                             log_every=args.log_every, model_config=config, eval_every=args.eval_every,
                             eval_batches=args.eval_batches, lr_schedule=args.lr_schedule,
                             warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                             clip_grad_norm=args.clip_grad_norm, replan=args.replan, drift=drift)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.runtime.command --plan plan.json --model NAME ...`` (under torchrun): ``hetrain train``
    (the one command line, ``hetrain.cli``)."""
    from hetrain.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

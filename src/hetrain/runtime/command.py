"""The ``train`` command: a model (reference or your own), a data set and a plan, on every rank of a torchrun job.

    torchrun --nproc-per-node 4 -m hetrain train --plan plan.json --model gpt-tiny --steps 100 \
        --checkpoint-dir ckpt --checkpoint-every 50 --metrics-out metrics.jsonl --timeline-out measured.json

Its options are ``TrainConfig``'s (``runtime.config``), on the command line or in a TOML file
(``--config train.toml``); ``add_arguments`` and ``run`` are the command table's entry, and
``run_train(plan, model, config)`` is the same run from Python. Restarted by ``torchrun --max-restarts N``,
a job resumes from the newest intact checkpoint in ``--checkpoint-dir`` by itself, under the plan it is
given then; when the world it restarts on is not that plan's (a node left or joined, ``torchrun --nnodes
MIN:MAX``), ``--replan auto`` re-plans it first (``runtime.lifecycle.restart``, docs/elastic.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from hetrain.amp import check_precision
from hetrain.data.datasets import DatasetSplit
from hetrain.data.seq_len import check_sample_length, refuse_seq_len, train_seq_len
from hetrain.data.user import build_model_datasets, check_batch_fits
from hetrain.distributed.device import choose_device
from hetrain.drift import check_force_devices, parse_force
from hetrain.errors import InputError, RunError
from hetrain.models.layers import param_bytes
from hetrain.models.spec import is_user_spec
from hetrain.models.user import ModelSource, resolve_model
from hetrain.plan import Plan, PlanError, load_plan
from hetrain.runtime.config import TrainConfig, add_train_options, train_config_from_args
from hetrain.runtime.lifecycle.drift_watch import SWITCH_EXIT_STATUS, DriftSwitch
from hetrain.runtime.step.clip import check_clip
from hetrain.runtime.step.loss_scale import check_fp16
from hetrain.runtime.step.lr_schedule import LrSchedule
from hetrain.runtime.trainer import Trainer, default_lr


def _describe(schedule: LrSchedule | None, clip_grad_norm: float | None) -> str:
    """``"lr 0.001 cosine to 1e-05, warm-up 100, clip 1"``: the start-up line's part on the optimizer's driving."""
    if schedule is None:
        return "at its own learning rate"
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


def build_train_datasets(plan: Plan, model: ModelSource, config: TrainConfig) -> tuple[str, DatasetSplit]:
    """``build_model_datasets`` at the sequence length the plan's profile was measured at (``hetrain.data.seq_len``).

    Raises:
        SpecError: a ``seq_len`` (``--seq-len``) that differs from the profile's, one for a run with no sequence
            length, or a user's data set for a token model whose samples are of another length.
    """
    d = config.data
    data, seq_len = d.data, d.seq_len
    refuse_seq_len(model, data, seq_len)
    measured_at = plan.profile.seq_len
    t = train_seq_len(measured_at, seq_len)
    split = build_model_datasets(model, data, config.data_seed, seq_len=t, val_data=d.val_data,
                                 tokenizer=d.tokenizer)
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


def checked_model(model: ModelSource, plan: Plan, plan_path: str | Path | None) -> ModelSource:
    """``model``, whose layers are refused where their parameters are not what the plan's profile counted
    (``check_layers_of_plan``), each as it is built."""
    def build(first: int, end: int, seed: int) -> list[nn.Module]:
        built = model.build_layers(first, end, seed=seed)
        check_layers_of_plan(plan_path if plan_path is not None else plan, plan, model.name, first, built)
        return built

    return replace(model, _build=build)


def run_train(plan: Plan, model: ModelSource, config: TrainConfig | None = None, *,
              data: tuple[str, DatasetSplit] | None = None, plan_path: str | Path | None = None) -> int:
    """Train ``model`` with ``plan`` on every rank of a torchrun job, as ``config`` says; the exit status.

    The plan runs as it is: its sync mode, sync options and optimizer (``config.optim`` drives the optimizer:
    learning rate, schedule, weight decay, clipping).

    Args:
        plan: the plan (``load_plan``).
        model: the model (``resolve_model``); its layer count must be the plan's.
        config: the run's options (``runtime.config``); its ``plan`` and ``model`` names are not read.
        data: ``build_train_datasets``' ``(name, datasets)``; None: ``config.data.data``'s, built here.
        plan_path: the plan's file, for messages.

    Returns:
        0; ``SWITCH_EXIT_STATUS`` (75) after a drift switch's checkpoint and plan are written (run it again, as
        torchrun's ``--max-restarts`` does, to go on under the new plan); 1 after an error printed to stderr.
    """
    config = TrainConfig() if config is None else config
    trainer: Trainer | None = None
    try:
        if model.num_layers != plan.profile.num_layers:
            raise PlanError(f"model {model.name!r} has {model.num_layers} layers but the plan ({plan.model}) has "
                            f"{plan.profile.num_layers}")
        data_name, (train_set, val_set) = data if data is not None else build_train_datasets(plan, model, config)
        if config.data.eval_every and val_set is None:
            raise InputError(f"--eval-every needs a validation set; --data {data_name} returned only a training "
                             "set (return a (train, validation) pair)")
        trainer = Trainer(checked_model(model, plan, plan_path), plan, config)
        plan = trainer.plan  # re-made when the world changed
        if trainer.is_reporting:
            resumed = f", resuming at step {trainer.step}" if trainer.step else ""
            print(f"hetrain train: {model.name} on {data_name}, {len(plan.devices_used)} device(s) of {trainer.world} "
                  f"rank(s), {len(plan.virtual_workers)} VW(s), {plan.schedule}, global batch {plan.global_batch}, "
                  f"{plan.optimizer} {_describe(trainer.lr_schedule, config.optim.clip_grad_norm)}{resumed}",
                  flush=True)
        start, steps = trainer.step, config.steps
        if start and start >= steps:  # every rank resumed at the same step, so every rank stops here
            if trainer.is_reporting:
                print(f"hetrain train: nothing to train: checkpoint step {start} in "
                      f"{config.checkpoint.checkpoint_dir} is already at or past --steps {steps} (the step count to "
                      f"reach); give --steps above {start} to train on", flush=True)
        else:
            history = trainer.fit(train_set, steps, seed=config.data_seed, val_data=val_set,
                                  eval_every=config.data.eval_every, eval_batches=config.data.eval_batches)
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
    """The ``train`` command's options: ``--config`` and ``TrainConfig``'s (``runtime.config``)."""
    add_train_options(parser)


def _check_output_paths(config: TrainConfig) -> None:
    """Refuse an output file that is a directory, and a checkpoint directory that is a file. (Only what is
    wrong on every host: the reporting rank writes the files, perhaps on another host than this one.)"""
    log = config.logging
    for key, path in (("metrics_out", log.metrics_out), ("timeline_out", log.timeline_out)):
        if path and Path(path).is_dir():
            raise InputError(f"{config.name_of(key, path)}: is a directory; give a file name")
    ckpt = config.checkpoint.checkpoint_dir
    if ckpt and Path(ckpt).exists() and not Path(ckpt).is_dir():
        raise InputError(f"{config.name_of('checkpoint_dir', ckpt)}: is a file; give a directory")


def check_plan_precision(plan: Plan, precision: str | None, plan_path: str) -> None:
    """Refuse a ``--precision`` other than the plan's, fp16 under a sync mode other than bsp, and fp16 on a CPU.

    Raises:
        InputError: naming the plan file and both precisions.
    """
    if precision is not None and precision != plan.precision:
        raise InputError(f"--precision {precision}: {plan_path} was planned for {plan.precision} (its memory and "
                         f"time predictions hold for that); re-plan with hetrain plan --precision {precision}")
    if plan.profile.mixed_precision != "autocast":
        raise InputError(f"{plan_path}: its profile's mixed_precision is {plan.profile.mixed_precision!r} (another "
                         f"runtime's 16-bit weights and gradients, hetrain.imports); hetrain's runtime trains with "
                         f"'autocast' only: re-plan from a profile of this model")
    check_fp16(plan, plan_path)
    check_precision(plan.precision, choose_device(int(os.environ.get("LOCAL_RANK", "0")))[1].type, plan_path)


def _check_options_with_plan(config: TrainConfig, plan: Plan) -> None:
    """Refuse clipping the plan's sync mode cannot do, and a ``--min-lr`` above the learning rate; each error
    names the option as given: its flag, or the config file and key (``TrainConfig.name_of``)."""
    o = config.optim
    try:
        check_clip(plan, o.clip_grad_norm)
    except InputError as e:
        raise InputError(f"{config.name_of('clip_grad_norm', o.clip_grad_norm)}: {e}") from None
    lr = default_lr(plan.optimizer) if o.lr is None else o.lr
    if o.min_lr > lr:
        peak = f"{plan.optimizer}'s default {lr:g}" if o.lr is None else config.name_of("lr", o.lr)
        raise InputError(f"{config.name_of('min_lr', o.min_lr)}: the minimum learning rate, where the decay "
                         f"ends, must be at most the learning rate ({peak})")
    LrSchedule(lr, o.lr_schedule, o.warmup_steps, o.min_lr)  # type: ignore[arg-type]


def _check_force_drift(config: TrainConfig, plan: Plan) -> None:
    """``--force-drift``'s value parsed and checked against plan.json's own cluster, and what a drill needs
    (``--replan auto``, a ``--checkpoint-dir``): before any process group, re-plan or file. Errors name the
    value as given (``TrainConfig.name_of``) and only the conditions that fail."""
    e = config.elastic
    if not e.force_drift:
        return
    named = config.name_of("force_drift", e.force_drift)
    force = parse_force(e.force_drift, named)
    check_force_devices(force, plan.cluster, named, str(config.plan))
    missing = ([] if e.replan == "auto" else [f"--replan auto (got {e.replan})"]) + \
              ([] if config.checkpoint.checkpoint_dir else ["a --checkpoint-dir (got none)"])
    if missing:
        raise InputError(f"{named}: a drift switch needs {' and '.join(missing)}")


def run(args: argparse.Namespace) -> int:
    """Run the ``train`` command from parsed ``add_arguments`` options.

    Bad arguments and a plan file that cannot be read are refused here, before any process group,
    with status 2; ``run_train`` returns 1 for what fails after. A rank that fails with its process group up
    leaves at once (``_leave_at_once``).
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
        config = train_config_from_args(args)
        _check_output_paths(config)
        plan_path = str(config.plan)
        plan = load_plan(plan_path)
        check_plan_precision(plan, config.precision.precision, plan_path)
        _check_options_with_plan(config, plan)
        _check_force_drift(config, plan)
        # a model or data set that cannot be used: refused here; a traced model cut where its profile was
        model = resolve_model(str(config.model), split_points=plan.profile.split_points, **config.model_settings())
        data = build_train_datasets(plan, model, config)
        check_batch_fits(data[0], data[1], plan.global_batch,
                         config.data.eval_batches if config.data.eval_every else 0)
        if config.data.tokenizer and config.checkpoint.checkpoint_dir:  # exported with the model (export --to-hf)
            from hetrain.runtime.state.export import save_tokenizer

            save_tokenizer(config.checkpoint.checkpoint_dir, config.data.tokenizer)
    except (InputError, ValueError) as e:
        print(f"hetrain train: error: {e}", file=sys.stderr)
        return 2
    return run_train(plan, model, config, data=data, plan_path=plan_path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.runtime.command --plan plan.json --model NAME ...`` (under torchrun): ``hetrain train``
    (the one command line, ``hetrain.cli``)."""
    from hetrain.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

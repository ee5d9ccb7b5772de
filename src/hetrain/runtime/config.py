"""``TrainConfig``: everything ``hetrain train`` and the ``Trainer`` take besides the plan and the model, as one tree.

    TrainConfig
      ├─ plan, model, steps, seed, model_config (--set), timeout_s
      ├─ data        DataConfig        --data --val-data --tokenizer --seq-len --data-seed --eval-every --eval-batches
      ├─ optim       OptimConfig       --lr --lr-schedule --warmup-steps --min-lr --weight-decay --clip-grad-norm
      ├─ precision   PrecisionConfig   --precision
      ├─ checkpoint  CheckpointConfig  --checkpoint-dir --checkpoint-every
      ├─ logging     LoggingConfig     --metrics-out --timeline-out --tensorboard-dir --log-every --progress
      └─ elastic     ElasticConfig     --replan --drift-threshold --drift-window --replan-cooldown --force-drift

Each field is written once (``hetrain.options``): its flag, its key in ``--config train.toml`` and its
help (the docstring beneath it) come from it, and every section checks its values when it is built, so a
value refused on the command line is refused in the file and in Python, naming the value. The file's keys
are the flags' names, flat (``lr = 3e-4``, ``lr-schedule = "cosine"``, ``set = ["n_blocks=2"]``); the
command line overrides the file, and ``--set`` adds to the file's list.

    config = TrainConfig(plan="plan.json", model="gpt-tiny", steps=200,
                         optim=OptimConfig(lr=3e-4, lr_schedule="cosine", warmup_steps=20))

Importing this module imports no torch: ``hetrain train --help`` and the baselines read it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from typing import Any

from hetrain.arguments import int_between, number_at_least
from hetrain.drift import DriftOptions, parse_force
from hetrain.errors import InputError
from hetrain.fields import MAX_SEQ_LEN, MAX_STEPS
from hetrain.options import add_options, build_options, check_section, given_options, leaves, load_options_file, option
from hetrain.profile import PRECISIONS
from hetrain.runtime.step.lr_schedule import LR_SCHEDULES

#: the longest any distributed wait may take by default, seconds
DEFAULT_TIMEOUT_S = 300.0
#: ``--replan``: ``auto`` re-plans a changed world when the plan records how it was made, and watches for drift
#: (``runtime.lifecycle.drift_watch``); ``world``: the changed world only; ``off`` refuses a changed world
REPLAN_MODES: tuple[str, ...] = ("auto", "world", "off")

_STEPS = int_between(0, MAX_STEPS, "MAX_STEPS")
_POSITIVE_STEPS = int_between(1, MAX_STEPS, "MAX_STEPS")
_POSITIVE = number_at_least(0.0, inclusive=False)
_NON_NEGATIVE = number_at_least(0.0)


def _model_setting(text: str) -> str:
    """``KEY=VALUE``, checked."""
    key, sep, _ = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"model settings are KEY=VALUE, got {text!r}")
    return text


@dataclass(frozen=True)
class DataConfig:
    """What the model is trained and evaluated on."""

    data: str | None = option(None)
    """data set: shakespeare, digits, synthetic (default: fits model), tokens:FILE.bin (uint16 token ids), text:FILE
    (an hf:DIR model's tokenizer.json, --tokenizer, or bytes), jsonl:FILE / parquet:FILE / dataset:DIR (a text or
    input_ids column), or MODULE:FUNCTION returning a torch Dataset of (input, target) or of dicts with input_ids
    (needed for your own model)"""
    val_data: str | None = option(None, metavar="tokens:FILE|text:FILE")
    """validation tokens for --data tokens:/text: (default: its last 10%)"""
    tokenizer: str | None = option(None, metavar="tokenizer.json")
    """tokenize --data text:FILE (or a text column) with this tokenizers file (default: an hf:DIR model's
    tokenizer.json, else bytes, vocab 256)"""
    seq_len: int | None = option(None, type=int_between(1, MAX_SEQ_LEN, "MAX_SEQ_LEN"), metavar="T")
    """tokens per sample of token data (default: the length the plan's profile was measured at, which it must
    equal; else the reference GPT's seq_len; needed for your own model)"""
    eval_every: int = option(0, type=_STEPS, metavar="N")
    """validation loss on the held-out data every N steps, logged as val_loss (0: never)"""
    eval_batches: int = option(8, type=_POSITIVE_STEPS, metavar="K")
    """global-batch-sized validation batches per evaluation (default 8)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class OptimConfig:
    """How the plan's optimizer is driven: learning rate and its schedule, weight decay, clipping."""

    lr: float | None = option(None, type=_POSITIVE)
    """peak learning rate, reached after the warm-up (default 0.05 SGD, 1e-3 AdamW)"""
    lr_schedule: str = option("constant", choices=LR_SCHEDULES)
    """after the warm-up: constant, or cosine / linear decay to --min-lr at the last step (default constant)"""
    warmup_steps: int = option(0, type=_STEPS, metavar="N")
    """linear warm-up from 0 to --lr over the first N steps (default 0)"""
    min_lr: float = option(0.0, type=_NON_NEGATIVE)
    """learning rate the decay ends at, <= --lr (default 0)"""
    clip_grad_norm: float | None = option(None, type=_POSITIVE, metavar="X")
    """clip gradients to global norm X over the whole model before each step; sync modes that step on a global
    sum only (others step on gradients not summed across VWs: refused)"""
    weight_decay: float = option(0.0, type=_NON_NEGATIVE)
    """weight decay (default 0)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class PrecisionConfig:
    """The precision the plan trains in: stated here only to be checked against the plan."""

    precision: str | None = option(None, choices=PRECISIONS)
    """must be the plan's precision (hetrain plan --precision), which is what runs; a different one is refused
    (re-plan)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and how often; a run resumes from the newest intact one there."""

    checkpoint_dir: str | None = option(None)
    """write checkpoints here; resume from the newest intact one"""
    checkpoint_every: int = option(0, type=_STEPS)
    """steps between checkpoints (0: at the end)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class LoggingConfig:
    """What a run reports, and where."""

    metrics_out: str | None = option(None)
    """per-step metrics (JSONL)"""
    timeline_out: str | None = option(None)
    """measured timeline of the last step (JSON)"""
    tensorboard_dir: str | None = option(None)
    """TensorBoard scalars (if tensorboard is installed)"""
    log_every: int = option(10, type=_POSITIVE_STEPS)
    """steps whose losses are summed over the ranks together (default 10)"""
    progress: bool | None = option(None, switch=True)
    """progress bar on or off (default: when stdout is a terminal)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class ElasticConfig:
    """A restart on a changed world, and the drift watch (docs/elastic.md)."""

    replan: str = option("auto", choices=REPLAN_MODES)
    """auto: a restart whose devices are not the plan's (a node left or joined) re-plans with the plan's cluster,
    profile and options, and resumes from the newest checkpoint under the new plan (written to
    CHECKPOINT_DIR/plans/); with --checkpoint-dir it also watches for a device that drifts and switches plans when
    that pays (exit status 75, for torchrun to restart); world: the changed world only, no drift watch; off: refuse
    a changed world (default auto; docs/elastic.md)"""
    drift_threshold: float = option(0.3, type=_POSITIVE, metavar="X")
    """a device drifts when its compute runs 1+X times slower (or faster) than its baseline (default 0.3)"""
    drift_window: int = option(20, type=_POSITIVE_STEPS, metavar="N")
    """steps in a row a device must drift before a re-plan is considered; also its baseline's steps (default 20)"""
    replan_cooldown: int = option(100, type=_STEPS, metavar="N")
    """no drift decision within N steps of the last one (default 100)"""
    force_drift: str | None = option(None, metavar="STEP:DEVICE=FACTOR")
    """a drill: at STEP act as if DEVICE ran FACTOR times slower and switch plans whatever the gain
    (e.g. 40:n0:1=3)"""

    def __post_init__(self) -> None:
        check_section(self)


@dataclass(frozen=True)
class RunOptions:
    """What every run of a reference model takes, hetrain's or a torch baseline's: seeds, model settings, waits."""

    seed: int = option(0, type=int)
    """model seed (per-layer seeds derive from it)"""
    data_seed: int = option(0, type=int)
    """seed of the data order"""
    model_config: tuple[str, ...] = option((), flag="--set", type=_model_setting, metavar="KEY=VALUE", repeat=True)
    """override a field of the model preset, e.g. --set n_blocks=2"""
    timeout_s: float = option(DEFAULT_TIMEOUT_S, type=_POSITIVE)
    """longest distributed wait, seconds (default 300)"""
    named: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """how an error names each value the user gave: ``--min-lr 1.0`` or ``train.toml: min_lr = 1.0``"""

    def __post_init__(self) -> None:
        check_section(self)

    def name_of(self, key: str, value: Any) -> str:
        """How an error names an option's value: where it was given (``named``), else its flag and value."""
        flag = next(leaf.flag for leaf in leaves(self.__class__) if leaf.key == key)
        return self.named.get(key) or f"{flag} {value}"

    def model_settings(self) -> dict[str, Any]:
        """``--set`` as overrides: ``("n_blocks=2", "act=gelu")`` -> ``{"n_blocks": 2, "act": "gelu"}``
        (values read as JSON where they parse)."""
        out: dict[str, Any] = {}
        for item in self.model_config:
            key, _, value = item.partition("=")
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
        return out


@dataclass(frozen=True)
class TrainConfig(RunOptions):
    """Everything a training run takes besides the plan's own decisions; one field per option (module docstring).

    ``plan`` and ``model`` name files and models for the command; the Python API takes the Plan and the model
    themselves (``Trainer(model, plan, config)``, ``run_train(plan, model, config)``) and leaves them None.
    """

    plan: str | None = option(None)
    """plan.json"""
    model: str | None = option(None)
    """reference model name (hetrain.models.registry), or MODULE:FUNCTION / path/to/file.py:FUNCTION returning your
    own (docs/own-model.md)"""
    steps: int = option(100, type=_STEPS)
    """step count to reach (default 100); a decaying learning rate ends there"""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    def drift_options(self) -> DriftOptions | None:
        """The drift watch's options: under ``--replan auto`` with a ``--checkpoint-dir`` only; else None.

        Raises:
            InputError: a ``--force-drift`` that does not parse, naming it as given.
        """
        e = self.elastic
        if e.replan != "auto" or not self.checkpoint.checkpoint_dir:
            return None
        force = parse_force(e.force_drift, self.name_of("force_drift", e.force_drift)) if e.force_drift else None
        return DriftOptions(e.drift_threshold, e.drift_window, e.replan_cooldown, force=force)


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """``hetrain train``'s flags: ``--config`` and one per ``TrainConfig`` option."""
    parser.add_argument("--config", default=None, metavar="train.toml",
                        help="read options from this TOML file (keys: the long option names); the command line "
                             "overrides it")
    add_options(parser, TrainConfig)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``add_train_options`` flags over ``--config FILE``'s values, if given.

    Raises:
        ConfigFileError: see ``hetrain.options.load_options_file``.
        InputError: ``--plan`` or ``--model`` given nowhere.
    """
    given = given_options(args, TrainConfig)
    if getattr(args, "config", None):
        given = given.over(load_options_file(args.config, TrainConfig, "hetrain train"))
    missing = [f"--{k}" for k in ("plan", "model") if given.values.get(k) is None]
    if missing:
        where = f" or in --config {args.config}" if getattr(args, "config", None) else ""
        raise InputError(f"the following arguments are required: {', '.join(missing)} (on the command line{where})")
    try:
        config: TrainConfig = build_options(TrainConfig, given)
    except ValueError as e:  # checked already, value by value; a section's own check of two values
        raise InputError(str(e)) from None
    return replace(config, named=dict(given.named))

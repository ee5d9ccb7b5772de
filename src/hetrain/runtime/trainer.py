"""Train with a Plan under torchrun: the Trainer API (the ``train`` command is in ``command``).

Every rank of the job runs the same program::

    torchrun --nproc-per-node 4 -m hetrain.runtime.command --plan plan.json --model gpt-tiny --steps 100

or, with a model of one's own as a list of layers::

    trainer = Trainer(lambda first, end: my_layers(first, end), plan,
                      lambda params: torch.optim.AdamW(params, lr=1e-3), my_mean_loss)
    history = trainer.fit(dataset, steps=100)        # dataset.take(indices) -> (inputs, targets)

What one step does on a rank (its Role in the plan), and where each part lives::

    _step(s) -> StepRecord
      global batch (same on every rank, from the data seed) ─ this VW's micro-batches     step.batches
      this iteration's Actions (the sync state, DASO's k, as the simulator has them)     step.actions
      learning rate of the step, the same on every rank (a pure function of the step)   step.lr_schedule
      Executor.run(actions): F/B, SEND/RECV, ALLREDUCE, sync-mode actions, STEP         step.executor
        at STEP, before the optimizer: tied gradients, fp16 unscaling, clipping         step.hooks
      the sync mode's waves, DASO's loss                                                sync.modes, sync.daso
    _after_step(record)
      metrics row; losses of log_every steps summed over the used ranks in one call     step.record, step.losses
      checkpoint every N steps (collective over the job; unused ranks join when told)   state.stage_state, idle
      evaluation every M steps; the drift watch                           step.evaluate, lifecycle.drift_watch

Start-up (``job.build_job``): each rank reports its device ``<node>:<LOCAL_RANK>``
and the reports are all-gathered and matched to the plan (``roles``); every rank
creates the same process groups in the same order; each used rank builds only
its own layers (per-layer seeds). The Trainer then resumes from the newest
intact checkpoint, if any (found once for every rank at start-up, ``state.resume``),
so ``torchrun --max-restarts N`` resumes by itself.
A rank whose device the plan leaves unused takes part in nothing after that (it
waits, idle, only to join checkpoint writes, which are collective over the job).

The Trainer keeps ``fit`` and the step loop; each concern of a step lives in the module named beside it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.amp import check_precision
from hetrain.distributed.device import choose_device
from hetrain.distributed.work import PeerError, first_line, is_connection_loss
from hetrain.errors import HetrainError, RunError
from hetrain.models.user import ModelSource, describe_error
from hetrain.plan import Plan, plan_fingerprint
from hetrain.profile import OPTIMIZER_NAMES, canonical_optimizer
from hetrain.runtime.config import OptimConfig, TrainConfig
from hetrain.runtime.lifecycle.drift_watch import DriftMonitor, DriftSwitch, drift_row, leave_together
from hetrain.runtime.lifecycle.host_memory import tune_host_allocator
from hetrain.runtime.lifecycle.idle import JobEvents
from hetrain.runtime.lifecycle.job import (
    LayersFn,
    OptimizerFn,
    StageParts,
    build_job,
    init_distributed,
)
from hetrain.runtime.lifecycle.restart import ReplanPolicy, plan_path
from hetrain.runtime.lifecycle.roles import Role
from hetrain.runtime.report.metrics import MetricsLog, merge_timeline
from hetrain.runtime.state.stage_state import checkpoint_meta, restore_stage, resume_together, save_stage
from hetrain.runtime.step.actions import StepActions
from hetrain.runtime.step.batches import MicroBatches, global_batches
from hetrain.runtime.step.clip import GradClip, check_clip
from hetrain.runtime.step.evaluate import evaluate_stage
from hetrain.runtime.step.executor import LayerFailure, StageModule
from hetrain.runtime.step.hooks import PreStepHooks, build_pre_step_hooks
from hetrain.runtime.step.loss_scale import LossScaling, check_fp16
from hetrain.runtime.step.losses import EarlySum, LossSums
from hetrain.runtime.step.lr_schedule import LrSchedule
from hetrain.runtime.step.record import StepRecord
from hetrain.runtime.step.tied import check_tied
from hetrain.runtime.sync.allreduce import GradientSync
from hetrain.runtime.sync.daso import DasoAdaptation
from hetrain.runtime.sync.modes import ModeSync
from hetrain.runtime.sync.shard import check_shard
from hetrain.runtime.tp import TPError, check_tp, full_state
from hetrain.schedule import ActionKind
from hetrain.timeline import Timeline


def default_lr(name: str) -> float:
    """The default learning rate of an optimizer by the plan's name: 1e-3 for Adam(W), 0.05 for SGD."""
    return 1e-3 if canonical_optimizer(name) == "adam" else 0.05


def build_optimizer_fn(name: str, lr: float | None = None, momentum: float = 0.9,
                       weight_decay: float = 0.0) -> OptimizerFn:
    """An optimizer factory by the plan's name (``profile.OPTIMIZER_NAMES``): ``sgd``, ``momentum`` (SGD with
    momentum) or ``adam`` (``torch.optim.AdamW``; ``adamw`` is read as ``adam``).

    Default learning rates (``default_lr``): 0.05 for SGD, 1e-3 for Adam.
    """
    key = canonical_optimizer(name)
    rate = default_lr(name) if lr is None else lr

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if key == "adam":
            return torch.optim.AdamW(params, lr=rate, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=rate, momentum=momentum if key == "momentum" else 0.0,
                               weight_decay=weight_decay)

    return make


def _model_layers(model: ModelSource, seed: int, first: int, end: int) -> list[nn.Module]:
    """Layers ``[first, end)`` of ``model`` from ``seed`` (``Trainer``'s ``layers_fn``)."""
    return model.build_layers(first, end, seed=seed)


class Trainer:
    """Runs a Plan's share of training on this rank. Create it on every rank of the job, with the same arguments.

    Args:
        model: the model (``resolve_model``, or ``ModelSource.of_layers`` for a function building layers
            ``[first, end)``); each layer is initialised from its own seed (``config.seed``), so any plan starts
            from the same weights; its loss function and tied weights come with it.
        plan: the plan; its devices are matched to ranks by node and local rank.
        config: the run's options (``runtime.config.TrainConfig``): the ones the Trainer reads are
            ``timeout_s``, ``seed``, ``optim`` (the plan's optimizer at ``lr``, with ``weight_decay``, the
            learning-rate schedule of each step, and ``clip_grad_norm``: clipping by the global norm over the
            whole model, where the sync mode steps on a global sum), ``checkpoint`` (the newest intact
            checkpoint in ``checkpoint_dir`` is resumed from), ``logging`` (metrics rows, timeline, TensorBoard,
            progress bar, ``log_every``: the losses of this many steps summed over the ranks in one all-reduce
            while training goes on) and ``elastic`` (``replan``: a world whose devices are not the plan's is
            re-planned and ``self.plan`` is then the new plan; under ``auto`` with a checkpoint directory, the
            drift watch: ``fit`` checkpoints and raises ``DriftSwitch`` on every rank when switching plans pays;
            docs/elastic.md). ``plan``, ``model`` and ``data`` are the command's, not read here.
        optimizer_fn: ``optimizer_fn(params)`` -> an optimizer over this rank's parameters, for an optimizer the
            plan does not name (its memory is then not the plan's prediction); it keeps its own learning rate
            where ``config.optim`` is left at its defaults. None: the plan's optimizer.
        record_timeline: record the last step's Timeline even without ``timeline_out`` (``self.timeline``).

    Example:
        >>> model = resolve_model("gpt-tiny")                                             # doctest: +SKIP
        >>> trainer = Trainer(model, plan, TrainConfig(optim=OptimConfig(lr=3e-4)))       # doctest: +SKIP
        >>> trainer.fit(build_datasets("shakespeare", "gpt-tiny").train, steps=10)      # doctest: +SKIP
    """

    def __init__(self, model: ModelSource, plan: Plan, config: TrainConfig | None = None, *,
                 optimizer_fn: OptimizerFn | None = None,
                 record_timeline: bool = False) -> None:
        config = TrainConfig() if config is None else config
        self.config = config
        o, log = config.optim, config.logging
        started_s = time.perf_counter()
        check_clip(plan, o.clip_grad_norm)  # before any process group: every rank refuses alike
        check_tied(plan, model.tied)
        check_shard(plan, model.tied)
        check_tp(plan, model.tied)
        check_fp16(plan)
        check_precision(plan.precision, choose_device(int(os.environ.get("LOCAL_RANK", "0")))[1].type)
        own_rate = optimizer_fn is not None and o == OptimConfig()  # a given optimizer at its own rate throughout
        if optimizer_fn is None:
            optimizer_fn = build_optimizer_fn(plan.optimizer, o.lr, weight_decay=o.weight_decay)
        self.lr_schedule = None if own_rate else LrSchedule(default_lr(plan.optimizer) if o.lr is None else o.lr,
                                                            o.lr_schedule, o.warmup_steps,  # type: ignore[arg-type]
                                                            o.min_lr, total_steps=config.steps or None)
        # the host allocator keeps freed pages for the next step (lifecycle.host_memory)
        self.host_allocator = tune_host_allocator()
        self.log_every = log.log_every
        self.plan = plan
        self.timeout_s = config.timeout_s
        ckpt_dir = config.checkpoint.checkpoint_dir
        self.checkpoint_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.checkpoint_every = config.checkpoint.checkpoint_every
        self.metrics_out = log.metrics_out
        self.timeline_out = log.timeline_out
        self.progress = log.progress
        self.tensorboard_dir = log.tensorboard_dir
        self.record_timeline = record_timeline or log.timeline_out is not None
        self.timeline: Timeline | None = None
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[dict[str, Any]] = []  # validation-loss records of fit (reporting rank)
        self._loss_fn = model.loss_fn
        self._eval_set: list[Any] = []  # fixed validation batches (fit's val_data)
        self._eval_every = 0

        layers_fn: LayersFn = functools.partial(_model_layers, model, config.seed)
        # collective (lifecycle.job)
        self.job = build_job(plan, layers_fn, optimizer_fn, model.loss_fn, config.timeout_s, model.tied,
                             ReplanPolicy(config.elastic.replan, self.checkpoint_dir), self.checkpoint_dir)
        plan = self.plan = self.job.plan  # re-made when the world changed (runtime.lifecycle.restart)
        job = self.job
        self.rank, self.world, self.device, self.reported = job.rank, job.world, job.device, job.reported
        self.role: Role = job.role
        self.rank_of, self.actions, self.health, self.used_ranks = job.rank_of, job.actions, job.health, job.used_ranks
        self.report_rank = job.report_rank
        self.work_group = job.groups.work
        parts = job.stage
        self.module: StageModule | None = None if parts is None else parts.module
        self.optimizer: torch.optim.Optimizer | None = None if parts is None else parts.optimizer
        self.sync: GradientSync | None = None if parts is None else parts.sync
        self.modes: ModeSync | None = None if parts is None else parts.modes
        hooks = PreStepHooks()
        if parts is not None:  # tied gradients, fp16's unscaling, clipping: in their order (runtime.step.hooks)
            hooks = build_pre_step_hooks(plan, self.role.device, tied=parts.tied, sync=parts.sync,
                                         executor=parts.executor, group=self.work_group, ranks=len(self.used_ranks),
                                         wait=job.wait, on=self.device, clip_grad_norm=o.clip_grad_norm,
                                         tp_member=self.role.tp_rank)
            parts.executor.before_step = hooks.as_hook()
        self.clip: GradClip | None = hooks.clip
        self.loss_scaling: LossScaling | None = hooks.loss_scaling  # fp16 only
        # DASO's adaptive k (runtime.sync.daso); this rank's Actions of each iteration (runtime.step.actions)
        self._daso = (DasoAdaptation(plan.sync_options.period, self.work_group, len(self.used_ranks), job.wait)
                      if plan.sync_mode.adaptive else None)
        self._step_actions = StepActions(plan, self.role.lead, self._daso)  # a TP group runs its lead's Actions
        self._fit: _Fit | None = None  # the loop's state during fit
        self._events = JobEvents(job, self.checkpoint_dir)
        self._micro_batches = MicroBatches(self.role, plan.global_batch)
        self._restore()
        self._drift: DriftMonitor | None = None  # the drift watch (runtime.lifecycle.drift_watch), on used ranks
        drift = config.drift_options()  # None unless --replan auto with a checkpoint directory
        if drift is not None and parts is not None:
            device_of = {r: d for d, r in self.rank_of.items()}
            self._drift = DriftMonitor(plan, self.role.device, [device_of[r] for r in self.used_ranks],
                                       self.work_group, job.wait, drift, started_s, self.step)

    # --- public --------------------------------------------------------------------

    @property
    def is_reporting(self) -> bool:
        """Whether this rank writes metrics, the timeline and the progress bar (the lowest used rank)."""
        return self.rank == self.report_rank

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage, with global names ``layers.{k}.…`` (empty on an unused rank); a TP stage's split
        tensors whole (collective over its TP group: every member calls it)."""
        return {} if self.module is None else full_state(self.module.state_dict())

    def fit(self, data: Any, steps: int, *, seed: int = 0, val_data: Any = None, eval_every: int = 0,
            eval_batches: int = 8) -> list[dict[str, Any]]:
        """Train until ``steps`` steps are done (counting those before a resume).

        Args:
            data: a dataset (``len`` and ``take(indices) -> (inputs, targets)``), from which
                global batches are drawn by ``iter_batches(data, plan.global_batch, seed)``;
                or an iterable of global batches ``(inputs, targets)``, the same on every rank,
                from step 0 (batches before the resumed step are skipped).
            steps: the step count to reach.
            seed: the data seed (datasets only).
            val_data: a held-out dataset (``len`` and ``take``) for the validation loss.
            eval_every: evaluate before the first step, every ``eval_every`` steps and after the
                last (0: never). VW 0 runs ``eval_batches`` fixed batches of ``plan.global_batch``
                samples (``data.datasets.eval_batches``) forward through its pipeline
                (``runtime.step.evaluate``); the reporting rank logs ``{"step", "val_loss", "elapsed_s",
                "eval_s", "val_samples"}`` (also in ``val_history``). Evaluation time is left out of
                every ``elapsed_s``; the wait for all ranks to finish the step before it is not.
            eval_batches: batches per evaluation.

        Returns:
            Per-step metrics of this call (``step``, ``loss``, ``samples_per_s``, ``step_time_s``, ``lr``;
            ``grad_norm`` when clipping), the same on every used rank; empty on an unused rank.

        Raises:
            PeerError: a peer died, or did not answer within ``timeout_s``; names it and the action.
        """
        if eval_every < 0 or (eval_every and val_data is None):
            raise ValueError(f"eval_every={eval_every} needs eval_every >= 0 and, when > 0, val_data")
        if eval_every and self.plan.max_tp > 1:
            raise TPError(f"evaluation (eval_every={eval_every}) does not run TP stages yet (the plan's largest TP "
                          f"degree is {self.plan.max_tp}); train without it, or plan with --max-tp 1")
        self._eval_every = eval_every
        if eval_every:
            from hetrain.data.datasets import eval_batches as fixed_batches

            self._eval_set = fixed_batches(val_data, self.plan.global_batch, eval_batches)
        if not self.role.used:
            try:
                self.step = self._events.idle(self.step)
            except DriftSwitch as e:  # the used ranks switch plans (runtime.lifecycle.drift_watch)
                leave_together(self.health, e.step, self.timeout_s)
                raise
            self._events.leave()
            return []
        start_step = self.step
        log = (MetricsLog(self.metrics_out, self.tensorboard_dir, self.progress, steps, start_step,
                          plan_fingerprint=plan_fingerprint(self.plan))
               if self.is_reporting else None)
        out: list[dict[str, Any]] = []
        try:
            self._train(global_batches(data, self.plan.global_batch, seed, self.step), steps, log, out)
        except DriftSwitch as e:  # every rank leaves alike, on purpose: nothing to tell the others
            leave_together(self.health, e.step, self.timeout_s)
            raise
        except Exception as e:
            # the user's model, loss or data: one line naming the step and the layer; hetrain's own errors as they are
            failure = e if isinstance(e, HetrainError) and not isinstance(e, LayerFailure) else \
                self._peer_failure(e) or RunError(self._describe_failure(e))
            self.health.post_error(str(failure))
            self.health.linger(min(self.timeout_s, 3 * self.health.period_s + 2))
            if failure is e:
                raise
            raise failure from e.cause if isinstance(e, LayerFailure) else e
        finally:
            if log is not None:
                log.close()
        self._events.post({"kind": "done"})
        self._events.leave()
        return out

    def _peer_failure(self, e: BaseException) -> PeerError | None:
        """A PeerError naming the peer that failed, when ``e`` is a broken connection (posting to a peer that
        died raises at once, before any wait could name it); None for any other error."""
        if not is_connection_loss(e):
            return None
        culprit = self.health.failed_peer(min(self.timeout_s, 3 * self.health.period_s + 2))
        if culprit is None:
            return None
        return PeerError(f"step {self.step} on {self.health.name(self.rank)}: {culprit}\n  cause: {first_line(e)}")

    def _describe_failure(self, e: BaseException) -> str:
        """What failed during step ``self.step`` (counted from 0, as the peers name it) on this rank, in one
        line: the layer of the model (by its profile's name) or the loss function that raised, and the first
        line of what it raised."""
        here = f"step {self.step} on {self.health.name(self.rank)}"
        if isinstance(e, LayerFailure):
            return f"{here}: {e.where(None if e.layer is None else self.plan.profile.layers[e.layer].name)}"
        return f"{here}: {describe_error(e)}"

    @property
    def sync_stats(self) -> dict[str, int]:
        """Sync-mode counters: ``max_lead_waves`` (how many waves this rank ran ahead of the slowest owner
        of its segments, at most; ``wsp`` / ``hybrid-ps``), ``lead_checks``, ``waves``, ``period`` (DASO's k now)."""
        if self.modes is None:
            return {}
        return {"max_lead_waves": self.modes.max_lead_waves, "lead_checks": self.modes.lead_checks,
                "waves": self.modes.wave, "period": self.daso_period}

    def close(self) -> None:
        """Stop the heartbeat and any parameter-server threads. The process group is left as it is."""
        if self.modes is not None:
            self.modes.close()
        if self.sync is not None:
            self.sync.close()
        self.health.stop()

    # --- the loop --------------------------------------------------------------------

    def _train(self, batches: Iterator[Any], steps: int, log: MetricsLog | None, out: list[dict[str, Any]]) -> None:
        """Each step, then what follows it; at the end, the last losses and the sync mode's waves in flight."""
        sums = LossSums(self.work_group, len(self.used_ranks), self.job.wait)  # reduced in batches, asynchronously
        now = time.perf_counter()
        fit = self._fit = _Fit(batches, steps, log, out, sums, now, now)
        self._step_actions.start(self.step)
        if self._eval_every:
            fit.excluded_s += self._evaluate(0.0)
            fit.last_s = time.perf_counter()
        while self.step < steps:
            self._after_step(self._step(self.step))
        if self._drift is not None:
            self._drift.flush(self.step)
        self._log_losses(sums.drain())
        if self.modes is not None:
            self.modes.finish(f"the end of training (step {self.step})")

    def _step(self, s: int) -> StepRecord:
        """Step ``s`` (0-based) on this rank: its micro-batches through its Actions; what it produced."""
        fit, parts = self._run, self._parts
        recorded = self.record_timeline and s == fit.steps - 1
        inputs, targets = self._micro_batches(self._next_batch(s), s)
        if recorded:
            self._line_up(s)
        it = self._step_actions.next(fit.steps)
        lr = self._set_lr(fit.steps)
        # where the losses are summed right after this step (a batch of log_every, or the last step of fit),
        # start that sum as soon as the step's forwards are over: it runs during the backward and the
        # gradient all-reduces instead of after them (the end of fit then waits for nothing more)
        early = EarlySum(fit.sums, s + 1) if s + 1 == fit.steps or fit.sums.waiting + 1 >= self.log_every else None
        parts.executor.on_losses = early
        wire0 = parts.sync.wire_bytes
        loss = parts.executor.run(it.actions, s, inputs, targets)
        if self.modes is not None and any(a.kind is ActionKind.PULL for a in it.actions):
            self.modes.end_wave()
        if self._daso is not None:
            self._daso.after_step(it.actions, loss)
        if recorded and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_end = time.perf_counter()
        if recorded:
            self._merge_timeline(parts.recorder.stop(), s, t_end - fit.last_s)
        self.step += 1
        step_s, fit.last_s = t_end - fit.last_s, t_end
        scaling = self.loss_scaling
        return StepRecord(
            step=s + 1, loss=loss, lr=lr, step_time_s=step_s, elapsed_s=t_end - fit.began_s - fit.excluded_s,
            samples_per_s=self.plan.global_batch / step_s if step_s > 0 else 0.0, sync_actions=it.sync_actions,
            allreduce_bytes=parts.sync.wire_bytes - wire0, compute_s=parts.executor.compute_s, early=early,
            clipping=self.clip is not None, grad_norm=None if self.clip is None else self.clip.norm,
            loss_scale=None if scaling is None else scaling.scaler.scale,
            step_skipped=None if scaling is None else scaling.skipped_last,
            daso_period=None if self._daso is None else it.period)

    def _after_step(self, record: StepRecord) -> None:
        """What follows a step, each when due: its metrics row (logged once its loss is summed over the ranks), a
        checkpoint, an evaluation, the drift watch."""
        fit = self._run
        if record.early is not None and record.early.read is not None:  # its loss is being summed already
            record.early.row.update(record.metrics())
            self._log_losses(record.early.read)
        else:
            fit.sums.add({"step": record.step, "loss": None, **record.metrics()}, record.loss)
        checkpoint = self._checkpoint_due(fit.steps)
        evaluate = bool(self._eval_every) and (self.step % self._eval_every == 0 or self.step == fit.steps)
        if fit.sums.waiting >= self.log_every or checkpoint or evaluate or self.step == fit.steps:
            self._log_losses(fit.sums.flush())
        if checkpoint:
            self._log_losses(fit.sums.drain())
            self._save(fit.out[-1]["loss"] if fit.out else None)
        if evaluate:  # after every rank has finished this step (its losses are summed): evaluate, untimed
            self._log_losses(fit.sums.drain())
            fit.excluded_s += self._evaluate(record.elapsed_s)
            fit.last_s = time.perf_counter()
        if self._drift is not None:
            self._watch_drift(record, checkpoint)

    @property
    def _run(self) -> _Fit:
        """The loop's state (during ``fit`` only)."""
        assert self._fit is not None
        return self._fit

    @property
    def _parts(self) -> StageParts:
        """This rank's stage and the machinery around it (a used rank's only)."""
        assert self.job.stage is not None
        return self.job.stage

    def _next_batch(self, s: int) -> Any:
        try:
            return next(self._run.batches)
        except StopIteration:
            raise ValueError(f"the data ran out at step {s} of {self._run.steps}") from None

    def _line_up(self, s: int) -> None:
        """Before the recorded step (``fit``'s last, the Timeline's): the used ranks start it together, and the
        recorder runs; its time counts from here."""
        self.job.wait(dist.all_reduce(torch.zeros(1, device=self.device), group=self.work_group, async_op=True),
                      f"lining up for the recorded step {s}")
        self._parts.recorder.start()
        self._run.last_s = time.perf_counter()

    def _watch_drift(self, record: StepRecord, saved: bool) -> None:
        """Record this step's compute time; every ``share_every`` steps share the figures and, on a sustained
        drift, decide (the same on every rank) and log it; switch when that pays (``runtime.lifecycle.drift_watch``)."""
        mon, fit = self._drift, self._run
        assert mon is not None
        mon.after_step(self.step, record.compute_s, record.step_time_s)
        if self.step >= fit.steps:
            return
        drift = mon.detector.forced(self.step)
        if drift is None and mon.due():
            drift = mon.observe(mon.share(self.step))
        if drift is None:
            return
        self._log_drift(drift_row(self.step, "trigger", drift, None))
        decision = mon.decide(drift, self.step, fit.steps)
        self._log_drift(drift_row(self.step, "switch" if decision.switch else "skip", drift, decision))
        if not decision.switch or decision.replanned is None:
            return
        mon.flush(self.step)
        self._log_losses(fit.sums.flush())
        self._log_losses(fit.sums.drain())
        if not saved:
            self._save(fit.out[-1]["loss"] if fit.out else None)
        assert self.checkpoint_dir is not None
        path = plan_path(self.checkpoint_dir, self.step)
        if self.is_reporting:
            path.parent.mkdir(parents=True, exist_ok=True)
            decision.replanned.plan.save(path)
        self._events.post({"kind": "switch", "step": self.step})
        raise DriftSwitch(f"switching plans at step {self.step} (drift: {decision.reason}); checkpoint written, "
                          f"the new plan is {path} (plan {decision.replanned.digest}): restart to take it",
                          self.step, str(path))

    def _log_drift(self, row: dict[str, Any]) -> None:
        """A drift decision: a metrics row and one printed line, on the reporting rank."""
        if not self.is_reporting:
            return
        log = self._run.log
        if log is not None:
            log.log(row)
        print(f"hetrain: drift {row['drift']} at step {row['step']}: "
              + (row.get("reason") or ", ".join(f"{d} x{f:.2f}" for d, f in row["factors"].items())), flush=True)

    def _log_losses(self, rows: list[dict[str, Any]]) -> None:
        """Steps whose summed loss has been read: into ``fit``'s rows, the history and the metrics log."""
        fit = self._run
        for row in rows:
            if isinstance(row.get("grad_norm"), torch.Tensor):
                row["grad_norm"] = float(row["grad_norm"])
            fit.out.append(row)
            self.history.append(row)
            if fit.log is not None:
                fit.log.log(row)

    def _set_lr(self, steps: int) -> float:
        """Set every parameter group to the schedule's rate of the coming step (``self.step + 1``); return it."""
        assert self.optimizer is not None
        if self.lr_schedule is None:
            return float(self.optimizer.param_groups[0]["lr"])
        lr = self.lr_schedule.at(self.step + 1, steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _evaluate(self, elapsed_s: float) -> float:
        """Validation loss of VW 0's weights now (``runtime.step.evaluate``); returns the seconds it took."""
        t0 = time.perf_counter()
        mine = evaluate_stage(self.role, self.module, self._loss_fn, self._eval_set, self.work_group, self.health,
                              self.device, self.timeout_s, self.plan.precision)
        buf = torch.tensor([0.0 if mine is None else mine], dtype=torch.float64)
        if len(self.used_ranks) > 1:  # only VW 0's last stage adds its figure
            self.job.wait(dist.all_reduce(buf, group=self.work_group, async_op=True),
                          f"the validation loss at step {self.step}")
        took = time.perf_counter() - t0
        row = {"step": self.step, "val_loss": float(buf[0]), "elapsed_s": elapsed_s, "eval_s": took,
               "val_samples": sum(len(y) for _, y in self._eval_set)}
        self.val_history.append(row)
        if self._run.log is not None:
            self._run.log.log(row)
        return took

    def _merge_timeline(self, part: dict[str, Any], step: int, iteration_s: float) -> None:
        """Gather the recorded step's events on the reporting rank, which merges them into ``self.timeline``."""
        parts: list[Any] | None = [None] * len(self.used_ranks) if self.is_reporting else None
        try:
            dist.gather_object(part, parts, dst=self.report_rank, group=self.work_group)
        except RuntimeError as e:
            raise self.health.peer_error(f"gathering the timeline of step {step} on "
                                         f"{self.health.name(self.report_rank)} failed or timed out "
                                         f"({self.timeout_s:g} s)", self.used_ranks, e) from None
        if not self.is_reporting:
            return
        assert parts is not None
        meta = {"model": self.plan.model, "schedule": self.plan.schedule, "step": step,
                "global_batch": self.plan.global_batch, "iteration_s": iteration_s,
                "samples_per_s": self.plan.global_batch / iteration_s if iteration_s > 0 else 0.0,
                "devices": {r: d for r, d in enumerate(self.reported)}}
        order = {d: k for k, d in enumerate(self.plan.devices_used)}
        parts.sort(key=lambda p: order.get(p["device"], len(order)))
        self.timeline = merge_timeline(parts, self.plan.cluster, meta)
        if self.timeline_out is not None:
            Path(self.timeline_out).parent.mkdir(parents=True, exist_ok=True)
            self.timeline.save(self.timeline_out)

    # --- checkpoints (runtime.state.stage_state) ---------------------------------------------

    def _checkpoint_due(self, steps: int) -> bool:
        if self.checkpoint_dir is None:
            return False
        return self.step == steps or (self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0)

    def _save(self, loss: float | None) -> None:
        """Write this rank's share of the checkpoint of ``self.step``; unused ranks are told to join."""
        assert self.module is not None and self.optimizer is not None and self.checkpoint_dir is not None
        meta = checkpoint_meta(self.plan, self.step, loss)
        mode_tensors = ({} if self.modes is None else  # parameter-server shards (runtime.sync.modes)
                        self.modes.checkpoint_state(self.module, f"the checkpoint of step {self.step}"))
        self._save_sync_state(meta)
        t0 = time.perf_counter()
        self._events.post({"kind": "checkpoint", "step": self.step, "meta": meta})
        save_stage(self.checkpoint_dir, self.step, self.module, self.optimizer, self.plan, self.role.device,
                   mode_tensors, meta, self.timeout_s)
        if self._drift is not None:  # the switch's cost counts it (runtime.lifecycle.drift_watch)
            self._drift.checkpoint_s = time.perf_counter() - t0

    def _restore(self) -> None:
        """Resume from the job's checkpoint (``Job.resume``: the newest intact one), if any: the stage, its optimizer,
        the sync mode's state;
        with every other rank (``resume_together``: a rank that cannot, or that could not build its stage, is
        named by the others). Without a checkpoint directory the ranks only pass the start together."""
        resuming = self.checkpoint_dir is not None
        resume_together(self.health, self.rank, self.world, self.timeout_s,
                        self._restore_own if resuming else lambda: None, resuming)

    def _restore_own(self) -> None:
        """This rank's share of ``_restore``."""
        assert self.checkpoint_dir is not None
        resume = self.job.resume
        if resume is None:  # no checkpoint yet
            return
        if self.module is None or self.optimizer is None:  # unused rank: only the step
            self.step = resume.step
            return
        restored = restore_stage(self.checkpoint_dir, self.module, self.optimizer, self.role.device,
                                 self.plan.optimizer, resume.step)
        if restored is None:
            return
        self.step = int(restored.meta.get("step", restored.step))
        if self.modes is not None:  # the parameter-server shards' global weights (runtime.sync.modes)
            self.modes.restore_state(self.module, self.checkpoint_dir, restored.step)
        self._load_sync_state(restored.meta)

    # --- the sync mode's and fp16's state in checkpoints ---------------------------------

    @property
    def daso_period(self) -> int:
        """DASO's current k (iterations between global averages; ``runtime.sync.daso``); the plan's period under
        another mode."""
        return self._daso.period if self._daso is not None else self.plan.sync_options.period

    def _save_sync_state(self, meta: dict[str, Any]) -> None:
        if self._daso is not None:
            meta["daso"] = self._daso.state_dict()
        if self.loss_scaling is not None:  # the same on every rank: the overflow verdict is global
            meta["loss_scaler"] = self.loss_scaling.scaler.state_dict()

    def _load_sync_state(self, meta: dict[str, Any]) -> None:
        if self._daso is not None and isinstance(meta.get("daso"), dict):
            self._daso.load_state_dict(meta["daso"])
        if self.loss_scaling is not None and isinstance(meta.get("loss_scaler"), dict):
            self.loss_scaling.scaler.load_state_dict(meta["loss_scaler"])
            self.loss_scaling.set_scale()


@dataclass
class _Fit:
    """One ``fit`` call's loop state, carried from step to step (``Trainer._train``).

    Attributes:
        batches: the global batches, from the resumed step.
        steps: the step count to reach.
        log: the metrics log (the reporting rank's), or None.
        out: the rows ``fit`` returns.
        sums: the steps' losses being summed over the ranks.
        began_s: when the loop began (``perf_counter``).
        last_s: when the last step, evaluation, or line-up for the recorded step ended: the next step's time
            counts from there.
        excluded_s: seconds spent evaluating, left out of ``elapsed_s``.
    """

    batches: Iterator[Any]
    steps: int
    log: MetricsLog | None
    out: list[dict[str, Any]]
    sums: LossSums
    began_s: float
    last_s: float
    excluded_s: float = 0.0


__all__ = ["OPTIMIZER_NAMES", "LayersFn", "LrSchedule", "OptimizerFn", "Trainer",
           "build_optimizer_fn", "default_lr", "init_distributed"]

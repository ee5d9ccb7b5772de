"""Train with a Plan under torchrun: the Trainer API (the ``train`` command is in ``command``).

Every rank of the job runs the same program::

    torchrun --nproc-per-node 4 -m hetrain.runtime.command --plan plan.json --model gpt-tiny --steps 100

or, with a model of one's own as a list of layers::

    trainer = Trainer(lambda first, end: my_layers(first, end), plan,
                      lambda params: torch.optim.AdamW(params, lr=1e-3), my_mean_loss)
    history = trainer.fit(dataset, steps=100)        # dataset.take(indices) -> (inputs, targets)

What one step does on a rank (its Role in the plan), and where each part lives::

    global batch (same on every rank, from the data seed)               batches
      └─ shard_batch: this VW's mini-batch ─ split_batch: micro-batches i = 0..m-1
    Executor.run(actions of this iteration)  F/B, SEND/RECV, ALLREDUCE, STEP   executor
    losses: every log_every steps, summed over the used ranks by one all-reduce, asynchronously   losses
    learning rate of the step, the same on every rank (a pure function of the step)      lr_schedule
    at STEP, bsp: gradients clipped by the global norm (one all-reduce of one number)    clip
    checkpoint every N steps (collective over the job; unused ranks join when told)   stage_state, idle

Start-up (``job.build_job``): each rank reports its device ``<node>:<LOCAL_RANK>``
and the reports are all-gathered and matched to the plan (``roles``); every rank
creates the same process groups in the same order; each used rank builds only
its own layers (per-layer seeds). The Trainer then resumes from the newest
complete checkpoint, if any, so ``torchrun --max-restarts N`` resumes by itself.
A rank whose device the plan leaves unused takes part in nothing after that (it
waits, idle, only to join checkpoint writes, which are collective over the job).

The Trainer keeps ``fit`` and the step loop, and the per-iteration sync state
(which sync actions an iteration runs, DASO's adaptive period) in one block.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.amp import LossScaler, check_precision
from hetrain.distributed.device import choose_device
from hetrain.errors import HetrainError, RunError
from hetrain.models.user import ModelSource, describe_error
from hetrain.plan import Plan, plan_fingerprint
from hetrain.profile import OPTIMIZER_NAMES, canonical_optimizer
from hetrain.runtime.config import OptimConfig, TrainConfig
from hetrain.runtime.lifecycle.drift_watch import DriftMonitor, DriftSwitch, drift_row, leave_together
from hetrain.runtime.lifecycle.host_memory import tune_host_allocator
from hetrain.runtime.lifecycle.idle import JobEvents
from hetrain.runtime.lifecycle.job import LayersFn, OptimizerFn, build_job, init_distributed
from hetrain.runtime.lifecycle.restart import ReplanPolicy, plan_path
from hetrain.runtime.lifecycle.roles import Role
from hetrain.runtime.report.metrics import MetricsLog, merge_timeline
from hetrain.runtime.state.stage_state import checkpoint_meta, latest_step, restore_stage, resume_together, save_stage
from hetrain.runtime.step.batches import MicroBatches, global_batches
from hetrain.runtime.step.clip import GradClip, check_clip
from hetrain.runtime.step.evaluate import evaluate_stage
from hetrain.runtime.step.executor import LayerFailure, StageModule
from hetrain.runtime.step.loss_scale import LossScaling, check_fp16
from hetrain.runtime.step.losses import LossSums
from hetrain.runtime.step.lr_schedule import LrSchedule
from hetrain.runtime.step.tied import chain_hooks, check_tied
from hetrain.runtime.sync.allreduce import GradientSync
from hetrain.runtime.sync.modes import DasoRate, ModeSync
from hetrain.schedule import (
    Action,
    ActionKind,
    SyncState,
    advance_sync_state,
    build_schedule,
    build_sync_actions,
    initial_sync_state,
    validate,
)
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
            whole model, where the sync mode steps on a global sum), ``checkpoint`` (the newest complete
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
        o, log, ckpt = config.optim, config.logging, config.checkpoint
        loss_fn, tied = model.loss_fn, model.tied
        layers_fn: LayersFn = functools.partial(_model_layers, model, config.seed)
        own_rate = optimizer_fn is not None and o == OptimConfig()  # a given optimizer at its own rate throughout
        if optimizer_fn is None:
            optimizer_fn = build_optimizer_fn(plan.optimizer, o.lr, weight_decay=o.weight_decay)
        lr_schedule = None if own_rate else LrSchedule(default_lr(plan.optimizer) if o.lr is None else o.lr,
                                                       o.lr_schedule, o.warmup_steps, o.min_lr,  # type: ignore[arg-type]
                                                       total_steps=config.steps or None)
        timeout_s, clip_grad_norm, replan, drift = config.timeout_s, o.clip_grad_norm, config.elastic.replan, \
            config.drift_options()
        checkpoint_dir, checkpoint_every = ckpt.checkpoint_dir, ckpt.checkpoint_every
        metrics_out, timeline_out, progress = log.metrics_out, log.timeline_out, log.progress
        tensorboard_dir, log_every = log.tensorboard_dir, log.log_every
        started_s = time.perf_counter()
        check_clip(plan, clip_grad_norm)  # before any process group: every rank refuses alike
        check_tied(plan, tied)
        check_fp16(plan)
        check_precision(plan.precision, choose_device(int(os.environ.get("LOCAL_RANK", "0")))[1].type)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        # the host allocator keeps freed pages for the next step (lifecycle.host_memory)
        self.host_allocator = tune_host_allocator()
        self.log_every = log_every
        self.plan = plan
        self.timeout_s = timeout_s
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.metrics_out = metrics_out
        self.timeline_out = timeline_out
        self.progress = progress
        self.tensorboard_dir = tensorboard_dir
        self.record_timeline = record_timeline or timeline_out is not None
        self.timeline: Timeline | None = None
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[dict[str, Any]] = []  # validation-loss records of fit (reporting rank)
        self._loss_fn = loss_fn
        self._eval_set: list[Any] = []  # fixed validation batches (fit's val_data)
        self._eval_every = 0

        self.job = build_job(plan, layers_fn, optimizer_fn, loss_fn, timeout_s, tied,  # collective: lifecycle.job
                             ReplanPolicy(replan, self.checkpoint_dir))
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
        self.lr_schedule = lr_schedule
        self.clip: GradClip | None = None
        self.loss_scaling: LossScaling | None = None  # fp16 only
        if parts is not None and plan.precision == "fp16":
            self.loss_scaling = LossScaling(LossScaler(), parts.sync, self.work_group, len(self.used_ranks),
                                            job.wait, self.device, parts.executor)
            parts.executor.before_step = chain_hooks(parts.executor.before_step, self.loss_scaling)
        if parts is not None and clip_grad_norm is not None:
            self.clip = GradClip(clip_grad_norm, plan, self.role.device, parts.sync, self.work_group,
                                 len(self.used_ranks), job.wait, self.device,
                                 duplicates=parts.tied.duplicates if parts.tied is not None else ())
            # ties summed first, then fp16's gradients unscaled (a skipped step is not clipped)
            parts.executor.before_step = chain_hooks(parts.executor.before_step, self.clip)
        self._init_sync_state()
        self._events = JobEvents(job, self.checkpoint_dir)
        self._micro_batches = MicroBatches(self.role, plan.global_batch)
        self._restore()
        self._drift: DriftMonitor | None = None  # the drift watch (runtime.lifecycle.drift_watch), on used ranks
        if drift is not None and replan == "auto" and self.checkpoint_dir is not None and parts is not None:
            device_of = {r: d for d, r in self.rank_of.items()}
            self._drift = DriftMonitor(plan, self.role.device, [device_of[r] for r in self.used_ranks],
                                       self.work_group, job.wait, drift, started_s, self.step)

    # --- public --------------------------------------------------------------------

    @property
    def is_reporting(self) -> bool:
        """Whether this rank writes metrics, the timeline and the progress bar (the lowest used rank)."""
        return self.rank == self.report_rank

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage, with global names ``layers.{k}.…`` (empty on an unused rank)."""
        return {} if self.module is None else self.module.state_dict()

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
                RunError(self._describe_failure(e))
            self.health.post_error(str(failure))
            self.health.linger(min(self.timeout_s, 3 * self.health.period_s + 2))
            if failure is e:
                raise
            raise failure from e.cause if isinstance(e, LayerFailure) else e
        finally:
            if log is not None:
                log.close()
        self._events.post({"kind": "done"})
        return out

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
                "waves": self.modes.wave, "period": self._daso_rate.period}

    def close(self) -> None:
        """Stop the heartbeat and any parameter-server threads. The process group is left as it is."""
        if self.modes is not None:
            self.modes.close()
        if self.sync is not None:
            self.sync.close()
        self.health.stop()

    # --- the loop --------------------------------------------------------------------

    def _train(self, batches: Iterator[Any], steps: int, log: MetricsLog | None, out: list[dict[str, Any]]) -> None:
        parts = self.job.stage
        assert parts is not None
        N = self.plan.global_batch
        # the sync mode's state at this step (a resumed run starts with no DASO average in flight)
        self.sync_state = SyncState(self.step, self._daso_rate.period, False)
        sums = LossSums(self.work_group, len(self.used_ranks), self.job.wait)  # reduced in batches, asynchronously
        t_begin = t_prev = time.perf_counter()
        excluded = 0.0  # seconds spent evaluating: left out of elapsed_s
        if self._eval_every:
            excluded += self._evaluate(log, 0.0)
            t_prev = time.perf_counter()
        while self.step < steps:
            s = self.step
            record = self.record_timeline and s == steps - 1
            try:
                batch = next(batches)
            except StopIteration:
                raise ValueError(f"the data ran out at step {s} of {steps}") from None
            inputs, targets = self._micro_batches(batch, s)
            if record:
                self.job.wait(dist.all_reduce(torch.zeros(1, device=self.device), group=self.work_group,
                                              async_op=True), f"lining up for the recorded step {s}")
                parts.recorder.start()
                t_prev = time.perf_counter()
            actions, sync_actions = self._actions_for(steps)
            lr = self._set_lr(steps)
            row: dict[str, Any] = {"step": s + 1, "loss": None}
            # where the losses are summed right after this step (a batch of log_every, or the last step of fit),
            # start that sum as soon as the step's forwards are over: it runs during the backward and the
            # gradient all-reduces instead of after them (the end of fit then waits for nothing more)
            read: list[list[dict[str, Any]]] = []  # the rows that early flush read, logged after the step
            early = s + 1 == steps or sums.waiting + 1 >= self.log_every
            parts.executor.on_losses = functools.partial(_sum_now, sums, row, read) if early else None
            wire0 = self.sync.wire_bytes if self.sync is not None else 0
            loss = parts.executor.run(actions, s, inputs, targets)
            if self.modes is not None and any(a.kind is ActionKind.PULL for a in actions):
                self.modes.end_wave()
            if self.plan.sync == "daso":
                self._adapt_daso_period(actions, loss)
            if record and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t_end = time.perf_counter()
            if record:
                self._merge_timeline(parts.recorder.stop(), s, t_end - t_prev)
            self.step += 1
            step_time = t_end - t_prev
            t_prev = t_end
            row.update({
                "samples_per_s": N / step_time if step_time > 0 else 0.0,
                "step_time_s": step_time, "elapsed_s": (elapsed := t_end - t_begin - excluded),
                "sync_actions": sync_actions, "lr": lr,
                # what this rank handed to its gradient all-reduces, in the plan's reduce_dtype
                "allreduce_bytes": (self.sync.wire_bytes - wire0) if self.sync is not None else 0})
            if self.clip is not None:
                row["grad_norm"] = self.clip.norm  # a tensor until the row is logged (no device sync here)
            if self.loss_scaling is not None:
                row["loss_scale"] = self.loss_scaling.scaler.scale  # the scale after this step
                row["step_skipped"] = self.loss_scaling.skipped_last
            if self.plan.sync == "daso":
                row["daso_period"] = self.sync_state.period  # the k this step's actions were built with
            if read:  # its loss is being summed already (on_losses)
                self._log_losses(read[0], log, out)
            else:
                sums.add(row, loss)
            checkpoint = self._checkpoint_due(steps)
            evaluate = bool(self._eval_every) and (self.step % self._eval_every == 0 or self.step == steps)
            if sums.waiting >= self.log_every or checkpoint or evaluate or self.step == steps:
                self._log_losses(sums.flush(), log, out)
            if checkpoint:
                self._log_losses(sums.drain(), log, out)
                self._save(out[-1]["loss"] if out else None)
            if evaluate:  # after every rank has finished this step (its losses are summed): evaluate, untimed
                self._log_losses(sums.drain(), log, out)
                excluded += self._evaluate(log, elapsed)
                t_prev = time.perf_counter()
            if self._drift is not None:
                self._watch_drift(parts.executor.compute_s, step_time, steps, log, out, sums, checkpoint)
        if self._drift is not None:
            self._drift.flush(self.step)
        self._log_losses(sums.drain(), log, out)
        if self.modes is not None:
            self.modes.finish(f"the end of training (step {self.step})")

    def _watch_drift(self, compute_s: float, step_s: float, steps: int, log: MetricsLog | None,
                     out: list[dict[str, Any]], sums: LossSums, saved: bool) -> None:
        """Record this step's compute time; every ``share_every`` steps share the figures and, on a sustained
        drift, decide (the same on every rank) and log it; switch when that pays (``runtime.lifecycle.drift_watch``)."""
        mon = self._drift
        assert mon is not None
        mon.after_step(self.step, compute_s, step_s)
        if self.step >= steps:
            return
        drift = mon.detector.forced(self.step)
        if drift is None and mon.due():
            drift = mon.observe(mon.share(self.step))
        if drift is None:
            return
        self._log_drift(drift_row(self.step, "trigger", drift, None), log)
        decision = mon.decide(drift, self.step, steps)
        self._log_drift(drift_row(self.step, "switch" if decision.switch else "skip", drift, decision), log)
        if not decision.switch or decision.replanned is None:
            return
        mon.flush(self.step)
        self._log_losses(sums.flush(), log, out)
        self._log_losses(sums.drain(), log, out)
        if not saved:
            self._save(out[-1]["loss"] if out else None)
        assert self.checkpoint_dir is not None
        path = plan_path(self.checkpoint_dir, self.step)
        if self.is_reporting:
            path.parent.mkdir(parents=True, exist_ok=True)
            decision.replanned.plan.save(path)
        self._events.post({"kind": "switch", "step": self.step})
        raise DriftSwitch(f"switching plans at step {self.step} (drift: {decision.reason}); checkpoint written, "
                          f"the new plan is {path} (plan {decision.replanned.digest}): restart to take it",
                          self.step, str(path))

    def _log_drift(self, row: dict[str, Any], log: MetricsLog | None) -> None:
        """A drift decision: a metrics row and one printed line, on the reporting rank."""
        if not self.is_reporting:
            return
        if log is not None:
            log.log(row)
        print(f"hetrain: drift {row['drift']} at step {row['step']}: "
              + (row.get("reason") or ", ".join(f"{d} x{f:.2f}" for d, f in row["factors"].items())), flush=True)

    def _log_losses(self, rows: list[dict[str, Any]], log: MetricsLog | None, out: list[dict[str, Any]]) -> None:
        """Steps whose summed loss has been read: into ``out``, the history and the metrics log."""
        for row in rows:
            if isinstance(row.get("grad_norm"), torch.Tensor):
                row["grad_norm"] = float(row["grad_norm"])
            out.append(row)
            self.history.append(row)
            if log is not None:
                log.log(row)

    def _set_lr(self, steps: int) -> float:
        """Set every parameter group to the schedule's rate of the coming step (``self.step + 1``); return it."""
        assert self.optimizer is not None
        if self.lr_schedule is None:
            return float(self.optimizer.param_groups[0]["lr"])
        lr = self.lr_schedule.at(self.step + 1, steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _evaluate(self, log: MetricsLog | None, elapsed_s: float) -> float:
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
        if log is not None:
            log.log(row)
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
        mode_tensors = ({} if self.modes is None else  # parameter-server shards; DASO's k (runtime.sync.modes)
                        self.modes.checkpoint_state(self.module, f"the checkpoint of step {self.step}"))
        self._save_sync_state(meta)
        t0 = time.perf_counter()
        self._events.post({"kind": "checkpoint", "step": self.step, "meta": meta})
        save_stage(self.checkpoint_dir, self.step, self.module, self.optimizer, self.plan, self.role.device,
                   mode_tensors, meta, self.timeout_s)
        if self._drift is not None:  # the switch's cost counts it (runtime.lifecycle.drift_watch)
            self._drift.checkpoint_s = time.perf_counter() - t0

    def _restore(self) -> None:
        """Resume from the newest complete checkpoint, if any: the stage, its optimizer, the sync mode's state;
        with every other rank (``resume_together``: a rank that cannot, or that could not build its stage, is
        named by the others). Without a checkpoint directory the ranks only pass the start together."""
        resuming = self.checkpoint_dir is not None
        resume_together(self.health, self.rank, self.world, self.timeout_s,
                        self._restore_own if resuming else lambda: None, resuming)

    def _restore_own(self) -> None:
        """This rank's share of ``_restore``."""
        assert self.checkpoint_dir is not None
        if self.module is None or self.optimizer is None:  # unused rank: only the step
            step = latest_step(self.checkpoint_dir)
            self.step = self.step if step is None else step
            return
        restored = restore_stage(self.checkpoint_dir, self.module, self.optimizer, self.role.device,
                                 self.plan.optimizer)
        if restored is None:
            return
        self.step = int(restored.meta.get("step", restored.step))
        if self.modes is not None:  # the parameter-server shards' global weights, DASO's k (runtime.sync.modes)
            self.modes.restore_state(self.module, self.checkpoint_dir, restored.step)
        self._load_sync_state(restored.meta)

    # === per-iteration sync state ===================================================
    # Which sync actions each iteration runs: ``schedule.advance_sync_state`` moves the state on after
    # every step, as the simulator does; DASO's adaptive period k is put into it before each step.
    # Checkpoints carry k through ``_save_sync_state`` / ``_load_sync_state``.

    def _init_sync_state(self) -> None:
        self._schedules: dict[tuple[str, ...], list[Action]] = {}  # this device's actions, by its sync actions
        self._daso_rate = DasoRate(self.plan.sync_options.period)  # DASO's k, adapted when the loss plateaus
        self._daso_loss: tuple[Any, torch.Tensor] | None = None  # (work, buffer) of the loss posted with an average
        self.sync_state = initial_sync_state(self.plan)

    def _actions_for(self, steps: int) -> tuple[list[Action], list[str]]:
        """This device's Actions of the iteration of ``sync_state`` (the plan's schedule for it, validated once
        per kind) and its sync actions' text, for the metrics; then the state is advanced."""
        state = replace(self.sync_state, period=self._daso_rate.period)
        if self.plan.sync == "bsp" and self._schedules:  # the same actions every iteration: built once
            ((key, actions),) = self._schedules.items()
            self.sync_state = advance_sync_state(self.plan, state, steps)
            return actions, list(key)
        tail = build_sync_actions(self.plan, self.role.device, state, steps)
        key = tuple(str(a) for a in tail)
        if key not in self._schedules:
            schedule = build_schedule(self.plan, state, steps)
            validate(schedule, self.plan)
            self._schedules[key] = schedule[self.role.device]
        self.sync_state = advance_sync_state(self.plan, state, steps)
        return self._schedules[key], list(key)

    def _adapt_daso_period(self, actions: Sequence[Action], loss: torch.Tensor) -> None:
        """DASO's adaptive global sync rate (Coquelin et al. 2022, Sec. 3.3): the global loss travels with
        each non-blocking average and is read when it is merged; when it has not improved by 1% over the last
        two merges, k is halved (syncing more often near a plateau). Every used rank sees the same losses, so
        all choose the same k."""
        if self._daso_loss is not None and any(a.kind is ActionKind.AVERAGE_MERGE for a in actions):
            work, buf = self._daso_loss
            self._daso_loss = None
            if work is not None:
                self._wait_collective(work, "the loss sent with DASO's global average")
            self._daso_rate.observe(float(buf))  # modes.DasoRate: k for the iterations that follow
        if any(a.kind is ActionKind.AVERAGE_START for a in actions):
            buf = loss.detach().clone()
            work = (dist.all_reduce(buf, group=self.work_group, async_op=True) if len(self.used_ranks) > 1 else None)
            self._daso_loss = (work, buf)

    def _wait_collective(self, work: Any, what: str) -> None:
        self.job.wait(work, what)

    @property
    def daso_period(self) -> int:
        """DASO's current k (iterations between global averages)."""
        return self._daso_rate.period

    def _save_sync_state(self, meta: dict[str, Any]) -> None:
        if self.plan.sync == "daso":
            meta["daso"] = self._daso_rate.state_dict()
        if self.loss_scaling is not None:  # the same on every rank: the overflow verdict is global
            meta["loss_scaler"] = self.loss_scaling.scaler.state_dict()

    def _load_sync_state(self, meta: dict[str, Any]) -> None:
        if self.plan.sync == "daso" and isinstance(meta.get("daso"), dict):
            self._daso_rate.load_state_dict(meta["daso"])
        if self.loss_scaling is not None and isinstance(meta.get("loss_scaler"), dict):
            self.loss_scaling.scaler.load_state_dict(meta["loss_scaler"])
            self.loss_scaling.set_scale()

    # === end of the per-iteration sync state ==========================================


def _sum_now(sums: LossSums, row: dict[str, Any], read: list[list[dict[str, Any]]], loss_sum: torch.Tensor) -> None:
    """A step's losses, known once its forwards are over: start summing them over the ranks now, with the
    steps waiting before it (``LossSums.flush``); the rows of the batch before go into ``read``."""
    sums.add(row, loss_sum)
    read.append(sums.flush())


__all__ = ["OPTIMIZER_NAMES", "LayersFn", "LrSchedule", "OptimizerFn", "Trainer",
           "build_optimizer_fn", "default_lr", "init_distributed"]

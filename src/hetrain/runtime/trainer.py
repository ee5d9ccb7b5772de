"""Train with a Plan under torchrun: the Trainer API (the ``train`` command is in ``command``).

Every rank of the job runs the same program::

    torchrun --nproc-per-node 4 -m hetrain.runtime.command --plan plan.json --model gpt-tiny --steps 100

or, with a model of one's own as a list of layers::

    trainer = Trainer(lambda first, end: my_layers(first, end), plan,
                      lambda params: torch.optim.AdamW(params, lr=1e-3), my_mean_loss)
    history = trainer.fit(dataset, steps=100)        # dataset.take(indices) -> (inputs, targets)

What one step does on a rank (its Role in the plan)::

    global batch (same on every rank, from the data seed)
      └─ shard_batch: this VW's mini-batch ─ split_batch: micro-batches i = 0..m-1
    Executor.run(build_schedule(plan)[device])       F/B, SEND/RECV, ALLREDUCE, STEP
    losses: every log_every steps, summed over the used ranks by one all-reduce, asynchronously
    checkpoint every N steps (collective over the job; unused ranks join when told)

Start-up: each rank reports its device ``<node>:<LOCAL_RANK>`` and the reports
are all-gathered and matched to the plan (``roles``); every rank creates the
same process groups in the same order; each used rank builds only its own
layers (per-layer seeds) and resumes from the newest complete checkpoint, if
any, so ``torchrun --max-restarts N`` resumes by itself. A rank whose device
the plan leaves unused takes part in nothing after that (it waits, idle, only
to join checkpoint writes, which are collective over the job).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hetrain.data.sharding import batch_length, shard_batch, split_batch
from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.device import DeviceError, choose_device
from hetrain.distributed.health import Health, PeerError, beat_counter
from hetrain.distributed.store import attempt_store
from hetrain.plan import Plan
from hetrain.runtime.evaluate import evaluate_stage
from hetrain.runtime.executor import Executor, LossFn, StageModule
from hetrain.runtime.metrics import MetricsLog, Recorder, merge_timeline
from hetrain.runtime.modes import DasoRate, ModeSync, build_mode_groups
from hetrain.runtime.p2p import Transport
from hetrain.runtime.roles import Role, RoleError, build_roles, local_device_name
from hetrain.runtime.sync import GradientSync, build_segment_groups
from hetrain.schedule import Action, ActionKind, build_schedule, build_sync_actions, validate
from hetrain.timeline import Timeline

LayersFn = Callable[[int, int], Sequence[nn.Module]]
OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZER_NAMES = ("sgd", "momentum", "adamw")
DEFAULT_TIMEOUT_S = 300.0
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, int, torch.device]:
    """Join the job's default process group if not done yet: NCCL with CUDA, else Gloo.

    Under torchrun (``RANK`` set) every rank joins; without it, a world of one
    process. The device is ``cuda:LOCAL_RANK`` with NCCL, else the CPU
    (``HETRAIN_DEVICE``: see ``hetrain.distributed.device``).

    Returns:
        (rank, world size, local rank, device)
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend, _ = choose_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            store = attempt_store(timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    rank = dist.get_rank()
    if "LOCAL_RANK" not in os.environ:
        local_rank = rank
    on_cuda = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    return rank, dist.get_world_size(), local_rank, device


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def build_optimizer_fn(name: str, lr: float | None = None, momentum: float = 0.9,
                       weight_decay: float = 0.0) -> OptimizerFn:
    """An optimizer factory by name: ``sgd``, ``momentum`` (SGD with momentum) or ``adamw`` (``adam`` too).

    Default learning rates: 0.05 for SGD, 1e-3 for AdamW.
    """
    key = "adamw" if name == "adam" else name
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}")

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if key == "adamw":
            return torch.optim.AdamW(params, lr=1e-3 if lr is None else lr, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=0.05 if lr is None else lr, momentum=momentum if key == "momentum" else 0.0,
                               weight_decay=weight_decay)

    return make


class _Losses(NamedTuple):
    """Per-step losses being summed over the used ranks: the steps' rows, the buffer, the pending work."""

    rows: list[dict[str, Any]]
    buf: torch.Tensor
    work: Any


class Trainer:
    """Runs a Plan's share of training on this rank. Create it on every rank of the job, with the same arguments.

    Args:
        layers_fn: ``layers_fn(first, end)`` builds layers ``[first, end)`` of the model (each
            layer initialised from its own seed, so any plan starts from the same weights).
        plan: the plan; its devices are matched to ranks by node and local rank.
        optimizer_fn: ``optimizer_fn(params)`` -> an optimizer over this rank's parameters.
        loss_fn: ``loss_fn(output, target)``: the mean loss of a micro-batch.
        timeout_s: the longest any distributed wait may take.
        checkpoint_dir: where checkpoints go; the newest complete one is resumed from.
        checkpoint_every: steps between checkpoints (0: only at the end of ``fit``).
        metrics_out: JSONL file of per-step metrics (written by the reporting rank).
        timeline_out: file for the measured Timeline of ``fit``'s last step.
        progress: progress bar on the reporting rank: True, False, or None (when stdout is a terminal).
        tensorboard_dir: TensorBoard scalars, when tensorboard is installed.
        record_timeline: record the last step's Timeline even without ``timeline_out`` (``self.timeline``).
        log_every: the losses of this many steps are summed over the ranks in one all-reduce, which
            runs while training goes on; metrics lines and the progress bar follow in batches.

    Example:
        >>> trainer = Trainer(functools.partial(build_layers, "gpt-tiny", seed=0), plan,   # doctest: +SKIP
        ...                   build_optimizer_fn("adamw"), loss_fn("gpt-tiny"))
        >>> trainer.fit(build_datasets("shakespeare", "gpt-tiny").train, steps=10)      # doctest: +SKIP
    """

    def __init__(self, layers_fn: LayersFn, plan: Plan, optimizer_fn: OptimizerFn, loss_fn: LossFn, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, metrics_out: str | Path | None = None,
                 timeline_out: str | Path | None = None, progress: bool | None = None,
                 tensorboard_dir: str | Path | None = None, record_timeline: bool = False,
                 log_every: int = 10) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
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

        try:
            self.rank, self.world, local_rank, self.device = init_distributed(timeout_s)
        except DeviceError:
            raise
        except RuntimeError as e:
            raise RoleError(f"rank {os.environ.get('RANK', 0)} could not join the job within {timeout_s:g} s "
                            f"(MASTER_ADDR {os.environ.get('MASTER_ADDR')}, MASTER_PORT "
                            f"{os.environ.get('MASTER_PORT')}): {_first_line(e)}") from None
        reported: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(reported, local_device_name(self.rank, local_rank))
        except RuntimeError as e:
            raise RoleError(f"rank {self.rank}: the {self.world} ranks did not all report their device within "
                            f"{timeout_s:g} s (a rank failed or never started): {_first_line(e)}") from None
        self.reported: list[str] = [str(d) for d in reported]
        roles = build_roles(plan, self.reported)
        self.role: Role = roles[self.rank]
        self.rank_of = {r.device: r.rank for r in roles}
        self.actions = build_schedule(plan)
        validate(self.actions, plan)

        self.health = Health(self.rank, self.reported)
        self.health.start()
        self.used_ranks = sorted(self.rank_of[d] for d in plan.devices_used)
        self.report_rank = self.used_ranks[0]
        timeout = timedelta(seconds=timeout_s)
        # every rank creates every group, in this order (new_group is collective over the job)
        forward_group = dist.new_group(self.used_ranks, timeout=timeout)
        # NCCL runs all operations of a pair of ranks in a group on one stream, so activations and
        # gradients get a group each (or a send could queue behind a receive); Gloo needs one
        backward_group = (dist.new_group(self.used_ranks, timeout=timeout) if self.device.type == "cuda"
                          else forward_group)
        self.work_group = dist.new_group(self.used_ranks, timeout=timeout)
        segment_groups = build_segment_groups(plan, self.rank_of, timeout_s)
        mode_groups = build_mode_groups(plan, self.rank_of, timeout_s)
        self.modes: ModeSync | None = None
        self._schedules: dict[tuple[str, ...], list[Action]] = {}  # this device's actions, by its sync actions
        self._daso_pending = False  # a DASO average was started last iteration: merge it in this one
        self._daso_rate = DasoRate(plan.sync_options.period)  # DASO's k, adapted when the loss plateaus
        self._daso_period = self._daso_rate.period
        self._daso_loss: tuple[Any, torch.Tensor] | None = None  # (work, buffer) of the loss posted with an average

        self.module: StageModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if self.role.used:
            stage = self.role.stage
            assert stage is not None
            layers = list(layers_fn(stage.first_layer, stage.end_layer))
            if len(layers) != stage.end_layer - stage.first_layer:
                raise ValueError(f"layers_fn({stage.first_layer}, {stage.end_layer}) returned {len(layers)} layers, "
                                 f"expected {stage.end_layer - stage.first_layer}")
            self.module = StageModule(layers, stage.first_layer, stage.recompute).to(self.device)
            self.optimizer = optimizer_fn(list(self.module.parameters()))
            by_index = {k: self.module[k] for k in stage.layers}
            self.sync = GradientSync(plan, by_index, segment_groups, self.rank_of, self.health, timeout_s)
            self.transport = Transport(self.health, forward_group, backward_group, self.device, timeout_s)
            self.recorder = Recorder(self.role.device, self.device if self.device.type == "cuda" else None)
            if plan.sync != "bsp":
                self.modes = ModeSync(plan, self.role.device, self.sync, segment_groups, mode_groups, self.rank_of,
                                      self.health, timeout_s)
            self.executor = Executor(self.role, self.module, loss_fn, self.transport, self.sync, self.optimizer,
                                     self.health, self.recorder, self.device, self.modes)
        self._events = 0  # store events posted to (or read by) unused ranks
        self._slices: list[tuple[int, int]] = []  # micro-batch i of this VW = global batch [lo, hi)
        if self.role.vw is not None:
            bounds = list(itertools.accumulate(self.role.micro_batch_sizes,
                                               initial=sum(self.role.mini_batch_sizes[:self.role.vw])))
            self._slices = list(itertools.pairwise(bounds))
        self._restore()

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
                (``runtime.evaluate``); the reporting rank logs ``{"step", "val_loss", "elapsed_s",
                "eval_s", "val_samples"}`` (also in ``val_history``). Evaluation time is left out of
                every ``elapsed_s``; the wait for all ranks to finish the step before it is not.
            eval_batches: batches per evaluation.

        Returns:
            Per-step metrics of this call (``step``, ``loss``, ``samples_per_s``, ``step_time_s``),
            the same on every used rank; empty on an unused rank.

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
            self._idle()
            return []
        start_step = self.step
        log = (MetricsLog(self.metrics_out, self.tensorboard_dir, self.progress, steps, start_step)
               if self.is_reporting else None)
        out: list[dict[str, Any]] = []
        try:
            self._train(self._batches(data, seed), steps, log, out)
        except Exception as e:
            self.health.post_error(str(e))
            self.health.linger(min(self.timeout_s, 3 * self.health.period_s + 2))
            raise
        finally:
            if log is not None:
                log.close()
        self._post_event({"kind": "done"})
        return out

    @property
    def sync_stats(self) -> dict[str, int]:
        """Sync-mode counters: ``max_lead_waves`` (how many waves this rank ran ahead of the slowest owner
        of its segments, at most; ``wsp`` / ``hybrid-ps``), ``lead_checks``, ``waves``, ``period`` (DASO's k now)."""
        if self.modes is None:
            return {}
        return {"max_lead_waves": self.modes.max_lead_waves, "lead_checks": self.modes.lead_checks,
                "waves": self.modes.wave, "period": self._daso_period}

    def close(self) -> None:
        """Stop the heartbeat and any parameter-server threads. The process group is left as it is."""
        if self.modes is not None:
            self.modes.close()
        if self.role.used:
            self.sync.close()
        self.health.stop()

    def _actions_for(self, iteration: int, steps: int) -> list[Action]:
        """This device's Actions of ``iteration``: the plan's schedule for that iteration, validated once per kind."""
        if self.plan.sync == "bsp":
            return self.actions[self.role.device]
        merge = self._daso_pending
        period = self._daso_period if self.plan.sync == "daso" else None
        tail = build_sync_actions(self.plan, self.role.device, iteration, steps, period, merge)
        key = tuple(str(a) for a in tail)
        if key not in self._schedules:
            schedule = build_schedule(self.plan, iteration, steps, period, merge)
            validate(schedule, self.plan)
            self._schedules[key] = schedule[self.role.device]
        self._daso_pending = any(a.kind is ActionKind.AVERAGE_START for a in tail)
        return self._schedules[key]

    # --- the loop --------------------------------------------------------------------

    def _train(self, batches: Iterator[Any], steps: int, log: MetricsLog | None, out: list[dict[str, Any]]) -> None:
        assert self.module is not None
        N = self.plan.global_batch
        self._daso_pending = False
        waiting: list[tuple[dict[str, Any], torch.Tensor]] = []  # steps whose loss is not reduced yet
        in_flight: _Losses | None = None  # reduced asynchronously, read at the next flush
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
                self._wait_collective(dist.all_reduce(torch.zeros(1, device=self.device), group=self.work_group,
                                                      async_op=True), f"lining up for the recorded step {s}")
                self.recorder.start()
                t_prev = time.perf_counter()
            actions = self._actions_for(s, steps)
            loss = self.executor.run(actions, s, inputs, targets)
            if self.modes is not None and any(a.kind is ActionKind.PULL for a in actions):
                self.modes.end_wave()
            if self.plan.sync == "daso":
                self._adapt_daso_period(actions, loss)
            if record and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t_end = time.perf_counter()
            if record:
                self._merge_timeline(self.recorder.stop(), s, t_end - t_prev)
            self.step += 1
            step_time = t_end - t_prev
            t_prev = t_end
            row = {"step": self.step, "loss": None, "samples_per_s": N / step_time if step_time > 0 else 0.0,
                   "step_time_s": step_time, "elapsed_s": (elapsed := t_end - t_begin - excluded)}
            waiting.append((row, loss.detach()))
            checkpoint = self._checkpoint_due(steps)
            evaluate = bool(self._eval_every) and (self.step % self._eval_every == 0 or self.step == steps)
            if len(waiting) >= self.log_every or checkpoint or evaluate or self.step == steps:
                if in_flight is not None:
                    self._finish_metrics(in_flight, log, out)
                in_flight = self._reduce_losses(waiting)
                waiting = []
            if checkpoint:
                assert in_flight is not None
                self._finish_metrics(in_flight, log, out)
                in_flight = None
                self._save(out[-1]["loss"] if out else None)
            if evaluate:  # after every rank has finished this step (its losses are summed): evaluate, untimed
                if in_flight is not None:
                    self._finish_metrics(in_flight, log, out)
                    in_flight = None
                excluded += self._evaluate(log, elapsed)
                t_prev = time.perf_counter()
        if in_flight is not None:
            self._finish_metrics(in_flight, log, out)
        if self.modes is not None:
            self.modes.finish(f"the end of training (step {self.step})")

    def _evaluate(self, log: MetricsLog | None, elapsed_s: float) -> float:
        """Validation loss of VW 0's weights now (``runtime.evaluate``); returns the seconds it took."""
        t0 = time.perf_counter()
        mine = evaluate_stage(self.role, self.module, self._loss_fn, self._eval_set, self.work_group, self.health,
                              self.device, self.timeout_s)
        buf = torch.tensor([0.0 if mine is None else mine], dtype=torch.float64)
        if len(self.used_ranks) > 1:  # only VW 0's last stage adds its figure
            self._wait_collective(dist.all_reduce(buf, group=self.work_group, async_op=True),
                                  f"the validation loss at step {self.step}")
        took = time.perf_counter() - t0
        row = {"step": self.step, "val_loss": float(buf[0]), "elapsed_s": elapsed_s, "eval_s": took,
               "val_samples": sum(len(y) for _, y in self._eval_set)}
        self.val_history.append(row)
        if log is not None:
            log.log(row)
        return took

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
            self._daso_period = self._daso_rate.observe(float(buf))  # modes.DasoRate
        if any(a.kind is ActionKind.AVERAGE_START for a in actions):
            buf = loss.detach().clone()
            work = (dist.all_reduce(buf, group=self.work_group, async_op=True) if len(self.used_ranks) > 1 else None)
            self._daso_loss = (work, buf)

    @property
    def daso_period(self) -> int:
        """DASO's current k (iterations between global averages)."""
        return self._daso_period

    def _reduce_losses(self, waiting: list[tuple[dict[str, Any], torch.Tensor]]) -> _Losses:
        """Start summing the steps' losses over the used ranks (only last stages hold a part of each)."""
        buf = torch.stack([loss for _, loss in waiting])  # (steps,)
        work = (dist.all_reduce(buf, group=self.work_group, async_op=True) if len(self.used_ranks) > 1 else None)
        return _Losses([row for row, _ in waiting], buf, work)

    def _finish_metrics(self, losses: _Losses, log: MetricsLog | None, out: list[dict[str, Any]]) -> None:
        if losses.work is not None:
            self._wait_collective(losses.work, f"the losses of steps {losses.rows[0]['step']}.."
                                               f"{losses.rows[-1]['step']}")
        for row, value in zip(losses.rows, losses.buf.tolist(), strict=True):
            row["loss"] = float(value)
            out.append(row)
            self.history.append(row)
            if log is not None:
                log.log(row)

    def _wait_collective(self, work: Any, what: str) -> None:
        self.health.wait(work, what, self.used_ranks, self.timeout_s)

    # --- data ------------------------------------------------------------------------

    def _batches(self, data: Any, seed: int) -> Iterator[Any]:
        if hasattr(data, "take") and hasattr(data, "__len__"):
            from hetrain.data.datasets import iter_batches

            stream: Iterable[Any] = iter_batches(data, self.plan.global_batch, seed)
        else:
            stream = data
        return itertools.islice(iter(stream), self.step, None)

    def _micro_batches(self, batch: Any, step: int) -> tuple[list[Any] | None, list[Any] | None]:
        """This VW's micro-batches of a global batch: inputs for the first stage, targets for the last.

        VW ``v`` takes its contiguous share of the global batch (``data.sharding``), cut into
        its micro-batches in order: micro-batch ``i`` is one slice of the global batch.
        """
        if not (self.role.is_first or self.role.is_last):
            return None, None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"step {step}: a global batch must be a pair (inputs, targets), got {type(batch).__name__}")
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):  # the common case, without the general code
            if len(x) != self.plan.global_batch or len(y) != self.plan.global_batch:
                raise ValueError(f"step {step}: a global batch of {len(x)} inputs and {len(y)} targets; the plan's "
                                 f"global batch is {self.plan.global_batch}")
            return ([x[lo:hi] for lo, hi in self._slices] if self.role.is_first else None,
                    [y[lo:hi] for lo, hi in self._slices] if self.role.is_last else None)
        batch = (x, y)
        n = batch_length(batch)
        if n != self.plan.global_batch:
            raise ValueError(f"step {step}: a global batch of {n} samples; the plan's global batch is "
                             f"{self.plan.global_batch}")
        assert self.role.vw is not None
        micro = split_batch(shard_batch(batch, self.role.mini_batch_sizes, self.role.vw), self.role.micro_batch_sizes)
        return ([m[0] for m in micro] if self.role.is_first else None,
                [m[1] for m in micro] if self.role.is_last else None)

    # --- timeline --------------------------------------------------------------------

    def _merge_timeline(self, part: dict[str, Any], step: int, iteration_s: float) -> None:
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

    # --- checkpoints -----------------------------------------------------------------

    def _checkpoint_due(self, steps: int) -> bool:
        if self.checkpoint_dir is None:
            return False
        return self.step == steps or (self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0)

    def _owned_names(self) -> set[str]:
        """The names this rank writes: those of layers whose segment's first owner is this rank's device."""
        assert self.module is not None
        first_owner = {}
        for seg in self.plan.segments():
            for k in range(seg.first_layer, seg.end_layer):
                first_owner[k] = seg.owners[0]
        out = set()
        for name in self.module.state_dict():
            m = _LAYER_RE.match(name)
            if m and first_owner.get(int(m.group(1))) == self.role.device:
                out.add(name)
        return out

    def _optimizer_state(self) -> dict[str, dict[str, Any]]:
        assert self.module is not None and self.optimizer is not None
        name_of = {id(p): n for n, p in self.module.named_parameters()}
        return {name_of[id(p)]: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                for p, st in self.optimizer.state.items() if id(p) in name_of}

    def _meta(self, loss: float | None) -> dict[str, Any]:
        return {"step": self.step, "loss": loss, "model": self.plan.model, "global_batch": self.plan.global_batch,
                "samples_seen": self.step * self.plan.global_batch, "devices": self.plan.devices_used}

    def _save(self, loss: float | None) -> None:
        from hetrain.runtime.checkpoint import save_checkpoint

        assert self.module is not None and self.checkpoint_dir is not None
        meta = self._meta(loss)
        owned = self._owned_names()
        mode_tensors = ({} if self.modes is None else  # parameter-server shards; DASO's k (runtime.modes)
                        self.modes.checkpoint_state(self.module, f"the checkpoint of step {self.step}"))
        if self.plan.sync == "daso":
            meta["daso"] = self._daso_rate.state_dict()
        self._post_event({"kind": "checkpoint", "step": self.step, "meta": meta})
        tensors = {n: t.detach().cpu() for n, t in self.module.state_dict().items()}
        save_checkpoint(self.checkpoint_dir, self.step, {**tensors, **mode_tensors}, self._optimizer_state(), meta,
                        owned_names=owned | set(mode_tensors), timeout_s=self.timeout_s)

    def _restore(self) -> None:
        if self.checkpoint_dir is None:
            return
        from hetrain.runtime.checkpoint import latest_checkpoint, load_checkpoint

        found = latest_checkpoint(self.checkpoint_dir)
        if found is None:
            return
        step, _ = found
        if self.module is None or self.optimizer is None:
            self.step = step
            return
        names = list(self.module.state_dict())
        tensors, optimizer_state, meta = load_checkpoint(self.checkpoint_dir, names, step)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"checkpoint step {step} in {self.checkpoint_dir} lacks {len(missing)} tensor(s) of "
                             f"{self.role.device}'s stage, e.g. {missing[:3]}")
        self.module.load_state_dict({n: tensors[n] for n in names})
        for name, p in self.module.named_parameters():
            if name in optimizer_state:
                self.optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v)
                                           for k, v in optimizer_state[name].items()}
        self.step = int(meta.get("step", step))
        if self.modes is not None:  # the parameter-server shards' global weights, DASO's k (runtime.modes)
            self.modes.restore_state(self.module, self.checkpoint_dir, step)
        if self.plan.sync == "daso" and isinstance(meta.get("daso"), dict):
            self._daso_rate.load_state_dict(meta["daso"])
            self._daso_period = self._daso_rate.period

    # --- unused ranks ----------------------------------------------------------------

    def _post_event(self, event: dict[str, Any]) -> None:
        """Tell unused ranks what to join (checkpoint writes) or that training is done."""
        if not self.is_reporting or len(self.used_ranks) == self.world or self.checkpoint_dir is None:
            return
        if self.health.store is not None:
            Barrier(self.health.store, self.rank, self.world, self.timeout_s).arrive(f"event/{self._events}",
                                                                                     json.dumps(event))
        self._events += 1

    def _idle(self) -> None:
        """An unused rank: nothing to do, except joining checkpoint writes (collective over the job).

        It waits for the reporting rank's news as long as that rank beats, and stops when it has
        been silent for ``timeout_s`` or a rank posts an error.
        """
        if self.checkpoint_dir is None or self.health.store is None:
            return
        from hetrain.runtime.checkpoint import save_checkpoint

        store = self.health.store
        self.health.doing = "idle (device unused by the plan)"
        barrier = Barrier(store, self.rank, self.world, self.timeout_s, beats=beat_counter(store),
                          name=self.health.name)
        reporter = self.health.name(self.report_rank)
        while True:
            key = f"event/{self._events}"
            try:
                barrier.wait(key, f"news from {reporter}", ranks=[self.report_rank])
            except BarrierError as e:
                if e.failed:
                    r = min(e.failed)
                    raise PeerError(f"{self.health.name(self.rank)} (idle): {self.health.name(r)} failed: "
                                    f"{e.failed[r].splitlines()[0]}") from None
                raise self.health.peer_error(f"idle, waiting for news from {reporter}", [self.report_rank],
                                             e) from None
            event = json.loads(store.get(f"{key}/{self.report_rank}"))
            self._events += 1
            if event["kind"] == "done":
                return
            self.step = int(event["step"])
            save_checkpoint(self.checkpoint_dir, self.step, {}, {}, event["meta"], owned_names=set(),
                            timeout_s=self.timeout_s)

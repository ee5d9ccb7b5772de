"""Watch every device's compute time for drift, and switch plans when it pays (``hetrain.drift`` decides).

On every used rank, after each step (``Trainer``)::

    executor.compute_s   this rank's forward and backward seconds of the step (``Executor.compute_s``)
    every share_every steps: all_gather of the last share_every steps' figures (one small float tensor per
        rank), posted without waiting; it is waited for at the next share (so a relaxed sync mode keeps
        its slack), with the job's timeout, naming the peers
    every rank feeds the same figures to the same DriftDetector, in step order; when it fires, every rank
        calls drift.decide_drift with the same inputs, and the ranks check that their plans' digests agree
    switch: the Trainer checkpoints at this step, rank 0 writes CKPT/plans/plan-step{N}.json, every rank
        (unused ones too) leaves with SWITCH_EXIT_STATUS; torchrun restarts the job, which takes that plan
        (``runtime.lifecycle.restart.adopt_drift_plan``) and resumes from the checkpoint

Why not in process: a plan's process groups, stages and sync machinery are built once at start-up
(``runtime.lifecycle.job``), and Gloo cannot re-form groups over a changed set of ranks in a running process
cleanly. A restart rebuilds them the one tested way.

Every decision is a metrics row (``{"step", "drift": "trigger" | "skip" | "switch", ...figures}``) and one
printed line on the reporting rank.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hetrain.distributed.barrier import poll
from hetrain.distributed.health import Health
from hetrain.drift import (
    CHECKPOINT_BYTES_PER_S,
    Drift,
    DriftDecision,
    DriftDetector,
    DriftError,
    DriftOptions,
    SwitchCost,
    decide_drift,
    drift_factors_of,
    predicted_compute_s,
)
from hetrain.elastic import REPLAN_KEY, ReplanError, check_same_plan
from hetrain.errors import RunError
from hetrain.plan import Plan

#: the exit status of a rank that left to switch plans (EX_TEMPFAIL: run it again); torchrun restarts the job
SWITCH_EXIT_STATUS = 75


class DriftSwitch(RunError):
    """Raised by ``Trainer.fit`` on every rank after a drift switch's checkpoint and plan are written."""

    def __init__(self, message: str, step: int, plan_file: str | None) -> None:
        super().__init__(message)
        self.step = step
        self.plan_file = plan_file


def leave_together(health: Health, step: int, timeout_s: float) -> None:
    """Before a switch's exit, on every rank of the job: stop the heartbeat and mark this rank as leaving; the
    rank that serves the job's store leaves last, once every rank has marked (at most ``timeout_s``), so that
    no rank loses the store while it still finishes the checkpoint."""
    health.stop()
    store = health.store
    if store is None:
        return
    key = f"drift-switch/{step}/left"
    store.set(f"{key}/{health.rank}", "1")
    if health.hosts_store():
        keys = [f"{key}/{r}" for r in range(len(health.devices))]
        if not poll(lambda: store.check(keys), timeout_s):
            late = ", ".join(health.name(r) for r in range(len(health.devices))
                             if not store.check([f"{key}/{r}"]))
            print(f"hetrain: switching plans at step {step}: {late} had not finished after {timeout_s:g} s; "
                  "leaving without them", file=sys.stderr, flush=True)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class DriftMonitor:
    """One used rank's part in watching for drift.

    Args:
        plan: the plan running now.
        device: this rank's device name.
        devices: the used ranks' device names, in the order of ``used_ranks`` (the work group's order).
        group: the process group of the used ranks.
        wait: ``wait(work, what)``: the job's wait with a timeout that names the peers.
        options: threshold, window, cooldown.
        started_s: ``time.perf_counter()`` when this attempt's Trainer was created (start-up, when the
            process's age cannot be read).
        start_step: the step this attempt starts from.
    """

    def __init__(self, plan: Plan, device: str, devices: Sequence[str], group: Any,
                 wait: Callable[[Any, str], None], options: DriftOptions, started_s: float, start_step: int) -> None:
        self.plan = plan
        self.device = device
        self.devices = list(devices)
        self.group = group
        self.wait = wait
        self.options = options
        unknown = sorted({d for d, _ in options.force[1]} - {d.name for d in plan.cluster.devices}
                         if options.force is not None else ())
        if unknown:
            raise DriftError(f"--force-drift: {', '.join(unknown)} is not a device of the plan's cluster "
                             f"({', '.join(d.name for d in plan.cluster.devices)})")
        record = plan.options.get(REPLAN_KEY)
        took_over = int(record["from_step"]) if drift_factors_of(plan) and isinstance(record, dict) else None
        self.detector = DriftDetector(predicted_compute_s(plan), options, took_over)
        age = process_age_s()  # None: count from the Trainer's creation
        self.startup_base_s = age if age is not None else time.perf_counter() - started_s
        self._t0 = time.perf_counter()
        self.startup_s = 0.0  # until the first step
        self.start_step = start_step
        self.rows: list[tuple[int, float, float]] = []  # (step, compute s, step s), not yet shared
        self.pending: tuple[Any, list[torch.Tensor], list[int]] | None = None
        self.step_times: deque[float] = deque(maxlen=options.window_steps)  # median over ranks, per step
        self.first_steps: list[float] = []  # the slowest rank's step seconds, first warmup_steps steps
        self.checkpoint_s: float | None = None  # this rank's last checkpoint write (the Trainer sets it)
        self.startup_s_all: float | None = None  # the slowest rank's, from the shared figures
        self.checkpoint_s_all: float | None = None

    def after_step(self, step: int, compute_s: float, step_s: float) -> None:
        """Record step ``step``'s figures; share them every ``share_every`` steps (posting, not waiting)."""
        if not self.rows and step == self.start_step + 1:
            self.startup_s = self.startup_base_s + (time.perf_counter() - self._t0) - step_s
        self.rows.append((step, compute_s, step_s))

    def due(self) -> bool:
        return len(self.rows) >= self.options.share_every

    def share(self, what_step: int) -> list[tuple[int, dict[str, float], float]]:
        """Post this rank's rows; wait for the previous post. Returns the steps it brought, in order:
        (step, compute seconds by device, median step seconds)."""
        k = self.options.share_every
        rows = self.rows[:k]
        self.rows = self.rows[k:]
        mine = torch.tensor([*(r[1] for r in rows), *(r[2] for r in rows), self.startup_s,
                             self.checkpoint_s if self.checkpoint_s is not None else -1.0], dtype=torch.float64)
        got = [torch.empty_like(mine) for _ in self.devices]
        work = dist.all_gather(got, mine, group=self.group, async_op=True) if len(self.devices) > 1 else None
        if work is None:
            got = [mine]
        previous, self.pending = self.pending, (work, got, [r[0] for r in rows])
        return self._read(previous, what_step) if previous is not None else []

    def flush(self, what_step: int) -> list[tuple[int, dict[str, float], float]]:
        """Wait for the post in flight (the end of training, or before a switch)."""
        previous, self.pending = self.pending, None
        return self._read(previous, what_step) if previous is not None else []

    def _read(self, posted: tuple[Any, list[torch.Tensor], list[int]],
              what_step: int) -> list[tuple[int, dict[str, float], float]]:
        work, got, steps = posted
        if work is not None:
            self.wait(work, f"the drift figures of steps {steps[0]}..{steps[-1]} (at step {what_step})")
        k = len(steps)
        table = [t.tolist() for t in got]
        self.startup_s_all = max(row[2 * k] for row in table)
        timed = [row[2 * k + 1] for row in table if row[2 * k + 1] >= 0]
        self.checkpoint_s_all = max(timed) if timed else None
        out = []
        for n, s in enumerate(steps):
            step_s = [row[k + n] for row in table]
            if len(self.first_steps) < self.options.warmup_steps + self.options.window_steps:
                self.first_steps.append(max(step_s))
            median_s = statistics.median(step_s)
            self.step_times.append(median_s)
            out.append((s, {d: row[n] for d, row in zip(self.devices, table, strict=True)}, median_s))
        return out

    def observe(self, shared: Sequence[tuple[int, dict[str, float], float]]) -> Drift | None:
        """Feed the shared steps to the detector; the first sustained drift, if any."""
        for s, measured, _ in shared:
            drift = self.detector.observe(s, measured)
            if drift is not None:
                return drift
        return None

    def switch_cost(self) -> SwitchCost:
        """The switch's cost from this attempt's figures (``drift.SwitchCost``), the same on every rank."""
        ckpt = self.checkpoint_s_all
        if ckpt is None:
            ckpt = 3.0 * self.plan.profile.param_bytes / CHECKPOINT_BYTES_PER_S  # weights, optimizer state
        steady = statistics.median(self.step_times) if self.step_times else 0.0
        warm = self.first_steps[:self.options.warmup_steps]
        warmup_s = sum(max(0.0, t - steady) for t in warm)
        startup_s = self.startup_s_all if self.startup_s_all is not None else self.startup_s
        return SwitchCost(float(ckpt), startup_s, warmup_s)

    def decide(self, drift: Drift, step: int, steps: int) -> DriftDecision:
        """Every rank: re-plan for the drift and decide; the ranks' plans must agree (their digests)."""
        self._agree_costs(step)
        decision = decide_drift(self.plan, drift, step, steps, statistics.median(self.step_times)
                                if self.step_times else 0.0, self.switch_cost())
        self.detector.decided(step)
        mine = decision.replanned.digest if decision.replanned is not None else "none"
        if len(self.devices) > 1:
            out: list[Any] = [None] * len(self.devices)
            try:
                dist.all_gather_object(out, mine, group=self.group)
            except RuntimeError as e:
                raise ReplanError(f"drift re-plan at step {step}: the {len(self.devices)} ranks did not all send "
                                  f"their plan's digest: {str(e).splitlines()[0] if str(e) else e}") from None
            check_same_plan([str(d) for d in out])
        return decision


    def _agree_costs(self, step: int) -> None:
        """The slowest rank's start-up and checkpoint seconds now, so that every rank prices the switch alike."""
        mine = torch.tensor([self.startup_s, self.checkpoint_s if self.checkpoint_s is not None else -1.0],
                            dtype=torch.float64)
        got = [torch.empty_like(mine) for _ in self.devices]
        if len(self.devices) > 1:
            self.wait(dist.all_gather(got, mine, group=self.group, async_op=True),
                      f"the switch cost's figures at step {step}")
        else:
            got = [mine]
        self.startup_s_all = max(float(t[0]) for t in got)
        timed = [float(t[1]) for t in got if float(t[1]) >= 0]
        self.checkpoint_s_all = max(timed) if timed else None


def drift_row(step: int, kind: str, drift: Drift, decision: DriftDecision | None) -> dict[str, Any]:
    """A metrics row for a drift decision: ``{"step", "drift": kind, "factors", "window", ...}``."""
    row: dict[str, Any] = {"step": step, "drift": kind, "factors": dict(drift.factors), "window": dict(drift.window),
                           "forced": drift.forced}
    if decision is not None:
        row["reason"] = decision.reason
        row.update({k: v for k, v in decision.figures.items() if k not in row})
        if decision.replanned is not None:
            row["plan_digest"] = decision.replanned.digest
    return row

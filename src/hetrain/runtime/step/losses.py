"""The steps' losses for metrics: summed over the used ranks in batches, while training goes on.

Only the last stages hold a part of a step's loss: each VW's last stage returns
``Σ_i loss_fn(out_i, target_i) · n_i / N`` over its micro-batches (``executor``),
every other rank returns 0, so the sum over the used ranks is the global batch's
mean loss. Summing one step at a time would put a collective on every step; here
the losses of several steps are stacked and all-reduced in one asynchronous
call, read at the next flush::

    step:    1  2  3  4 | 5  6  7  8 | 9 ...
    add:     ·  ·  ·  · | ·  ·  ·  · |
    flush:            start(1..4)  finish(1..4), start(5..8)  finish(5..8) ...

The trainer adds and flushes a batch's last step as soon as that step's forwards
are over (``Executor.on_losses``), so the sum runs during its backward and its
gradient all-reduces; the end of ``fit`` then reads a sum that has landed rather
than wait for one more collective of its own.

``EarlySum`` is that early add and flush: the executor's ``on_losses`` for such a step.

Example:
    >>> sums = LossSums(work_group, len(used_ranks), job.wait)          # doctest: +SKIP
    >>> sums.add({"step": 1, "loss": None}, loss)                       # doctest: +SKIP
    >>> rows = sums.flush()      # the rows of the batch before, with "loss" filled in
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Row = dict[str, Any]
WaitFn = Callable[[Any, str], None]


class LossSums:
    """Per-step losses waiting to be summed, and the batch being summed, over the used ranks.

    Args:
        group: the used ranks' process group.
        ranks: how many ranks it has (1: nothing to sum, no collective).
        wait: ``wait(work, what)`` waits for an asynchronous collective with the job's timeout
            (``Job.wait``), naming ``what`` if it fails.
    """

    def __init__(self, group: Any, ranks: int, wait: WaitFn) -> None:
        self._group = group
        self._ranks = ranks
        self._wait = wait
        self._waiting: list[tuple[Row, torch.Tensor]] = []  # steps whose loss is not being summed yet
        self._in_flight: tuple[list[Row], torch.Tensor, Any] | None = None  # (rows, (steps,) buffer, work)

    def add(self, row: Row, loss: torch.Tensor) -> None:
        """A step whose loss is known (its forwards are over): its metrics row (``row["loss"]`` is filled in
        when the sum is read) and its loss."""
        self._waiting.append((row, loss.detach()))

    @property
    def waiting(self) -> int:
        """Steps added since the last flush."""
        return len(self._waiting)

    def flush(self) -> list[Row]:
        """Read the batch being summed, if any, and start summing the steps added since; returns the rows read."""
        done = self.drain()
        if self._waiting:
            buf = torch.stack([loss for _, loss in self._waiting])  # (steps,)
            work = dist.all_reduce(buf, group=self._group, async_op=True) if self._ranks > 1 else None
            self._in_flight = ([row for row, _ in self._waiting], buf, work)
            self._waiting = []
        return done

    def drain(self) -> list[Row]:
        """Read the batch being summed, if any (steps added since the last flush stay waiting)."""
        if self._in_flight is None:
            return []
        rows, buf, work = self._in_flight
        self._in_flight = None
        if work is not None:
            self._wait(work, f"the losses of steps {rows[0]['step']}..{rows[-1]['step']}")
        for row, value in zip(rows, buf.tolist(), strict=True):
            row["loss"] = float(value)
        return rows


class EarlySum:
    """A step whose loss is summed over the ranks as soon as its forwards are over (``Executor.on_losses``),
    with the steps waiting before it: called with the loss, it adds the step's row (``{"step", "loss"}``, its
    other figures filled in after the step) and flushes ``sums``.

    Attributes:
        row: the step's metrics row, in ``sums`` once called.
        read: the rows that flush read (the batch before, with their losses), logged after the step; None until
            called.
    """

    def __init__(self, sums: LossSums, step: int) -> None:
        self._sums = sums
        self.row: Row = {"step": step, "loss": None}
        self.read: list[Row] | None = None

    def __call__(self, loss_sum: torch.Tensor) -> None:
        self._sums.add(self.row, loss_sum)
        self.read = self._sums.flush()

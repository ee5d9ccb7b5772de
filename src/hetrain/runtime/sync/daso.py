"""DASO's adaptive global sync rate, in one place: the period k, the loss that travels with each average, and
k's place in checkpoints (Coquelin et al., J. Big Data 2022, "Adaptive synchronization").

The plan's mode says whether its period adapts (``SyncMode.adaptive``); the schedule builds each iteration's
sync actions from a ``SyncState`` whose ``period`` is k (``hetrain.schedule``), and ``runtime.sync.modes``
carries the averages out. What adapts k lives here::

    AVERAGE_START s   the global loss of the step posted with it (one all-reduce over the used ranks)
    AVERAGE_MERGE s   that loss read; DasoRate.observe(loss) -> k for the iterations that follow
    checkpoint        k and its plateau test in the meta (``"daso"``); a resumed run goes on from them

Every used rank sees the same losses, so all choose the same k.

Example:
    >>> daso = DasoAdaptation(4, job.groups.work, len(job.used_ranks), job.wait)  # doctest: +SKIP
    >>> state = daso.apply(state)        # k into the coming iteration's sync state    # doctest: +SKIP
    >>> daso.after_step(actions, loss)   # post or read the loss with the averages     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from hetrain.schedule import Action, ActionKind, SyncState

WaitFn = Callable[[Any, str], None]


class DasoRate:
    """DASO's global sync period k, adapted to the loss (Coquelin et al., J. Big Data 2022, "Adaptive
    synchronization"): as training settles the global averages come more often; at every k, long runs of
    local steps with rare, stale averages are what buys time early on.

    ``observe`` takes the global loss at each merged average. The loss is on a plateau when it has not
    fallen below ``(1 - threshold)`` times its best for ``patience`` observations in a row; k is then
    halved, and from 1 it goes back up to ``max_period`` (the paper cycles k down from its maximum, 8 in
    its experiments, starting at 4 after the warm-up). After each change the plateau test starts over.

    Example:
        >>> rate = DasoRate(4)
        >>> [rate.observe(loss) for loss in (1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5)]
        [4, 4, 4, 2, 2, 2, 1, 1]
    """

    def __init__(self, period: int, max_period: int | None = None, threshold: float = 0.01,
                 patience: int = 2) -> None:
        if period < 1:
            raise ValueError(f"DASO's period k must be >= 1, got {period}")
        self.period = period
        self.max_period = max(period, max_period if max_period is not None else 2 * period)
        self.threshold = threshold
        self.patience = patience
        self.best: float | None = None
        self.bad = 0  # observations in a row without improvement
        self.changes = 0

    def observe(self, loss: float) -> int:
        """Record the global loss at a merge; return k for the iterations that follow."""
        if self.best is None or loss < self.best * (1.0 - self.threshold):
            self.best = loss if self.best is None else min(self.best, loss)
            self.bad = 0
            return self.period
        self.best = min(self.best, loss)
        self.bad += 1
        if self.bad >= self.patience:
            self.period = self.period // 2 if self.period > 1 else self.max_period
            self.best, self.bad = None, 0
            self.changes += 1
        return self.period

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, for the checkpoint's meta."""
        return {"period": self.period, "max_period": self.max_period, "best": self.best, "bad": self.bad,
                "changes": self.changes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.period = int(state["period"])
        self.max_period = int(state.get("max_period", self.max_period))
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.bad = int(state.get("bad", 0))
        self.changes = int(state.get("changes", 0))


class DasoAdaptation:
    """DASO's k on one used rank: put into each iteration's sync state, adapted at each merged average.

    The global loss travels with each non-blocking average (AVERAGE_START) and is read when the average is
    merged (AVERAGE_MERGE); ``DasoRate`` halves k when it has not improved by 1% over the last two merges
    (syncing more often near a plateau).

    Args:
        period: the plan's k (``SyncOptions.period``), where the rate starts.
        group: the used ranks' process group (``Groups.work``), over which the loss is summed.
        ranks: how many ranks it has (1: no collective).
        wait: ``wait(work, what)`` with the job's timeout (``Job.wait``).
    """

    def __init__(self, period: int, group: Any, ranks: int, wait: WaitFn) -> None:
        self.rate = DasoRate(period)
        self._group = group
        self._ranks = ranks
        self._wait = wait
        self._loss: tuple[Any, torch.Tensor] | None = None  # (work, buffer) of the loss posted with an average

    @property
    def period(self) -> int:
        """k now (iterations between global averages)."""
        return self.rate.period

    def apply(self, state: SyncState) -> SyncState:
        """``state`` with k now: the coming iteration's sync actions follow it."""
        return replace(state, period=self.rate.period)

    def after_step(self, actions: Sequence[Action], loss: torch.Tensor) -> None:
        """After a step that ran ``actions``, whose loss on this rank is ``loss``: read the loss posted with the
        average it merged (k for the iterations that follow), and post its own with the average it started."""
        if self._loss is not None and any(a.kind is ActionKind.AVERAGE_MERGE for a in actions):
            work, buf = self._loss
            self._loss = None
            if work is not None:
                self._wait(work, "the loss sent with DASO's global average")
            self.rate.observe(float(buf))
        if any(a.kind is ActionKind.AVERAGE_START for a in actions):
            buf = loss.detach().clone()
            work = dist.all_reduce(buf, group=self._group, async_op=True) if self._ranks > 1 else None
            self._loss = (work, buf)

    def state_dict(self) -> dict[str, Any]:
        """k and its plateau test, JSON-able, for the checkpoint's meta (``"daso"``)."""
        return self.rate.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rate.load_state_dict(state)


__all__ = ["DasoAdaptation", "DasoRate"]

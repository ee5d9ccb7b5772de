"""The learning rate of each step: linear warm-up, then constant, cosine or linear decay. Pure Python, no torch.

The rate is a pure function of the step's number, so every rank computes the
same rate, and a run resumed from a checkpoint at step k goes on with the
rates of an uninterrupted run (nothing of the schedule needs saving).
Steps are numbered from 1, as the metrics rows are (``t`` below); ``T`` is the
run's last step, ``W`` the warm-up steps::

    lr ▲        ___
       │      /     ‾‾-_            cosine: min_lr + (lr - min_lr) · (1 + cos(π p)) / 2
       │    /            ‾-_        linear: lr - (lr - min_lr) · p
       │  /                  ‾-_    constant: lr
       │/                        ‾  min_lr
       └──┬──────────────────────┬─► t
          W                      T

    t <= W:  lr · t / W                        (the first step already moves: lr / W, not 0)
    t >  W:  p = (t - W) / (T - W), in (0, 1]  (the last step, t = T, runs at min_lr)

``W >= T`` is allowed: the run then ends inside its warm-up. A step past ``T``
keeps ``min_lr`` (``p`` is capped at 1).

Example:
    >>> lr_at(1, lr=0.1, total_steps=10, schedule="cosine", warmup_steps=2)
    0.05
    >>> round(lr_at(6, lr=0.1, total_steps=10, schedule="linear", warmup_steps=2, min_lr=0.02), 6)
    0.06
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from hetrain.errors import InputError

LrScheduleKind = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrScheduleKind)


def lr_at(step: int, *, lr: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of step ``step`` (1-based: the metrics row's ``step``) of a run of ``total_steps``.

    Args:
        step: the step being taken, 1 for the first.
        lr: the peak rate, reached at the end of the warm-up.
        total_steps: the run's last step, where the decay reaches ``min_lr``.
        schedule: ``constant``, ``cosine`` or ``linear`` (the decay after the warm-up).
        warmup_steps: steps of linear warm-up from 0 (0: none).
        min_lr: the rate the decay ends at (not used by ``constant``).

    Raises:
        InputError: a value out of range (``LrSchedule`` names them).
    """
    LrSchedule(lr, schedule, warmup_steps, min_lr)  # type: ignore[arg-type]  # checked by LrSchedule
    if step < 1:
        raise InputError(f"learning-rate step numbers start at 1, got {step}")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * p)) / 2.0
    return lr - (lr - min_lr) * p


@dataclass(frozen=True)
class LrSchedule:
    """A learning-rate schedule: what ``Trainer(lr_schedule=...)`` sets every parameter group to, each step.

    Attributes:
        lr: the peak learning rate (> 0).
        schedule: the decay after the warm-up: ``constant``, ``cosine`` or ``linear``.
        warmup_steps: steps of linear warm-up from 0 to ``lr`` (>= 0).
        min_lr: the rate the decay reaches at the last step (0 <= min_lr <= lr).
        total_steps: the run's last step; None: the ``steps`` given to ``Trainer.fit`` (give it when one
            run is made of several ``fit`` calls, so that each call sees the same schedule).

    Example:
        >>> LrSchedule(0.1, "cosine", warmup_steps=2).at(2, total_steps=10)
        0.1
    """

    lr: float
    schedule: LrScheduleKind = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in LR_SCHEDULES:
            raise InputError(f"unknown learning-rate schedule {self.schedule!r}; choose one of "
                             f"{', '.join(LR_SCHEDULES)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"the learning rate must be a finite number > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise InputError(f"warm-up steps must be >= 0, got {self.warmup_steps}")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise InputError(f"the minimum learning rate must be between 0 and the learning rate {self.lr:g}, "
                             f"got {self.min_lr}")
        if self.total_steps is not None and self.total_steps < 1:
            raise InputError(f"the schedule's total steps must be >= 1, got {self.total_steps}")

    def at(self, step: int, total_steps: int) -> float:
        """The rate of step ``step`` (1-based); ``total_steps`` counts when the schedule has none of its own."""
        total = self.total_steps if self.total_steps is not None else total_steps
        return lr_at(step, lr=self.lr, total_steps=total, schedule=self.schedule, warmup_steps=self.warmup_steps,
                     min_lr=self.min_lr)


__all__ = ["LR_SCHEDULES", "LrSchedule", "LrScheduleKind", "lr_at"]

"""What one training step produced on one rank: ``StepRecord``, and the metrics row it gives.

``Trainer._step`` runs a step and returns its record; ``Trainer._after_step`` logs it, checkpoints, evaluates
and watches for drift. A row of the metrics JSONL is the record's ``metrics()`` after ``{"step", "loss"}``, the
loss being known once it is summed over the ranks (``runtime.step.losses``)::

    {"step": 3, "loss": 2.71, "samples_per_s": ..., "step_time_s": ..., "elapsed_s": ..., "sync_actions": [...],
     "lr": ..., "allreduce_bytes": ..., "grad_norm": ...,          clipping only
     "loss_scale": ..., "step_skipped": ...,                        fp16 only
     "daso_period": ...}                                            DASO only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hetrain.runtime.step.losses import EarlySum


@dataclass(frozen=True)
class StepRecord:
    """What one step produced on this rank.

    Attributes:
        step: the steps done once it is (1-based: the first step is 1).
        loss: this rank's share of the global batch's mean loss (a tensor, summed over the ranks later).
        lr: the learning rate it ran at.
        step_time_s: seconds from the end of the step before (or of an evaluation) to its end.
        elapsed_s: seconds since ``fit`` began, evaluations left out.
        samples_per_s: the global batch over ``step_time_s``.
        sync_actions: the sync actions it ended with, as text.
        allreduce_bytes: bytes this rank handed to its gradient all-reduces, in the plan's ``reduce_dtype``.
        compute_s: host seconds of its F and B actions (the drift watch's figure, ``Executor.compute_s``).
        early: its loss's sum over the ranks, started as soon as its forwards were over; None: not started.
        clipping: whether gradients are clipped (``grad_norm`` is then in the row).
        grad_norm: the global norm before clipping of the last step clipped (this one, unless fp16 skipped it),
            a 0-d tensor until the row is logged (no device sync in the step); None before any.
        loss_scale: fp16's loss scale after it; None: not fp16.
        step_skipped: whether fp16's overflow check skipped its optimizer step; None: not fp16.
        daso_period: DASO's k its sync actions were built with; None: not DASO.
    """

    step: int
    loss: torch.Tensor
    lr: float
    step_time_s: float
    elapsed_s: float
    samples_per_s: float
    sync_actions: tuple[str, ...]
    allreduce_bytes: int
    compute_s: float
    early: EarlySum | None = None
    clipping: bool = False
    grad_norm: torch.Tensor | None = None
    loss_scale: float | None = None
    step_skipped: bool | None = None
    daso_period: int | None = None

    def metrics(self) -> dict[str, Any]:
        """Its metrics row after ``step`` and ``loss``, in the order the JSONL has them (module docstring)."""
        row: dict[str, Any] = {
            "samples_per_s": self.samples_per_s, "step_time_s": self.step_time_s, "elapsed_s": self.elapsed_s,
            "sync_actions": list(self.sync_actions), "lr": self.lr, "allreduce_bytes": self.allreduce_bytes}
        if self.clipping:
            row["grad_norm"] = self.grad_norm
        if self.loss_scale is not None:
            row["loss_scale"] = self.loss_scale
            row["step_skipped"] = self.step_skipped
        if self.daso_period is not None:
            row["daso_period"] = self.daso_period
        return row


__all__ = ["StepRecord"]

"""fp16's loss scaling across the job: every rank unscales, then all agree whether the step is taken.

Under fp16 the backward starts from ``loss * S`` (``Executor.grad_scale``), so that small
gradients do not flush to zero in 16 bits (Micikevicius et al., 2018). Before the STEP::

    grad /= S                                   every gradient of the stage (fp32)
    bad   = any gradient inf or NaN here        one all-reduce (MAX) of one number over the used ranks
    bad  -> the step is skipped on every rank, S *= 1/2   (amp.LossScaler)
    good -> the step is taken; S *= 2 after growth_interval good steps in a row

A skipped step on one stage and not on another would tear the model apart, so the
verdict is global: the same all-reduce as clipping's, over the same group. VWs that step
on their own gradients (every sync mode but bsp) would need a verdict per VW; fp16 is
refused for them (use bf16, which needs no scaling).

Example:
    >>> guard = LossScaling(LossScaler(), sync, job.groups.work, len(job.used_ranks), job.wait,  # doctest: +SKIP
    ...                     job.device, executor)
    >>> executor.before_step = PreStepHooks(tied_grads, guard, clip).as_hook()   # runtime.step.hooks
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hetrain.amp import LossScaler
from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.step.losses import WaitFn
from hetrain.runtime.sync.allreduce import GradientSync


def check_fp16(plan: Plan, where: str = "the plan") -> None:
    """Refuse fp16 under a sync mode other than bsp (its loss scale needs one verdict per step for the job).

    Raises:
        InputError: naming the sync mode.
    """
    if plan.precision == "fp16" and not plan.sync_mode.supports_fp16:
        raise InputError(f"{where}: precision fp16 needs the bsp sync mode (its loss scaler skips a step on "
                         f"every rank at once); the plan's sync mode is {plan.sync!r}: re-plan with "
                         "--precision bf16, which needs no loss scaling")


class LossScaling:
    """The ``before_step`` hook of fp16: unscale, agree on overflow, move the scale; False skips the step.

    Args:
        scaler: the scale and its rule.
        sync: this stage's gradient buffers (the parameters' ``.grad`` are views of them).
        group: the used ranks' process group (``Groups.work``).
        ranks: how many ranks it has (1: no collective).
        wait: ``wait(work, what)`` with the job's timeout (``Job.wait``).
        on: the torch device the rank computes on.
        executor: its ``grad_scale`` is set to the new scale after each step.
    """

    def __init__(self, scaler: LossScaler, sync: GradientSync, group: Any, ranks: int, wait: WaitFn,
                 on: torch.device, executor: Any) -> None:
        self.scaler = scaler
        self._sync = sync
        self._group = group
        self._ranks = ranks
        self._wait = wait
        self._on = on
        self._executor = executor
        self.set_scale()
        self.skipped_last = False  # whether the last step was skipped

    def set_scale(self) -> None:
        """Have the backward start from the scaler's current scale (after a step, or a restored scaler)."""
        self._executor.grad_scale = self.scaler.scale

    def __call__(self, step: int) -> bool:
        flats = self._sync.step_grads()
        inverse = 1.0 / self.scaler.scale
        bad = torch.zeros(1, dtype=torch.float32, device=self._on)
        for flat in flats:
            flat.mul_(inverse)
            bad = torch.maximum(bad, (~torch.isfinite(flat)).any().to(torch.float32).reshape(1))
        if self._ranks > 1:
            self._wait(dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._group, async_op=True),
                       f"the fp16 overflow check of step {step}")
        taken = self.scaler.update(found_inf=bool(bad.item() > 0))
        self.set_scale()
        self.skipped_last = not taken
        return taken


__all__ = ["LossScaling", "check_fp16"]

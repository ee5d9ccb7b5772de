"""What runs at STEP before the optimizer steps: the pre-step hooks, in one ordered list built in one place.

The executor calls ``before_step(step)`` at each STEP, after the sends are waited for and once every
ALLREDUCE of the iteration has been waited for (``Executor.before_step``). ``build_pre_step_hooks`` makes
that call from the hooks that apply to the run, in the order its docstring gives::

    STEP:  tied (sum the copies) ─► loss_scale (fp16: unscale, overflow?) ─► clip (global norm) ─► optimizer.step()
                                         └── overflow: False, the rest is skipped, and so is the step

Example:
    >>> hooks = build_pre_step_hooks(plan, role.device, tied=parts.tied, sync=parts.sync,  # doctest: +SKIP
    ...                              executor=parts.executor, group=job.groups.work, ranks=len(job.used_ranks),
    ...                              wait=job.wait, on=job.device, clip_grad_norm=1.0)
    >>> parts.executor.before_step = hooks.as_hook()                                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hetrain.amp import LossScaler
from hetrain.plan import Plan
from hetrain.runtime.step.clip import GradClip
from hetrain.runtime.step.loss_scale import LossScaling
from hetrain.runtime.step.losses import WaitFn
from hetrain.runtime.step.tied import TiedGrads
from hetrain.runtime.sync.allreduce import GradientSync

#: a pre-step hook: called with the 0-based step; False skips the optimizer step
StepHook = Callable[[int], bool | None]


def chain_hooks(*hooks: StepHook | None) -> StepHook | None:
    """One ``before_step`` hook calling the given ones in order (None: none given).

    A hook that returns False skips the step: the hooks after it are not called, and the chain returns False.
    """
    present = [h for h in hooks if h is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def run(step: int) -> bool | None:
        for hook in present:
            if hook(step) is False:
                return False
        return None

    return run


@dataclass(frozen=True)
class PreStepHooks:
    """The pre-step hooks of a run, each None where it does not apply (``build_pre_step_hooks``, whose docstring
    gives their order).

    Attributes:
        tied: sums the tied copies' gradients (``runtime.step.tied``).
        loss_scaling: fp16's unscaling and overflow verdict (``runtime.step.loss_scale``).
        clip: clipping by the global norm (``runtime.step.clip``); ``clip.norm`` is the last norm.
    """

    tied: TiedGrads | None = None
    loss_scaling: LossScaling | None = None
    clip: GradClip | None = None

    def as_hook(self) -> StepHook | None:
        """The executor's ``before_step``: the hooks present, called in order (None: none)."""
        return chain_hooks(self.tied, self.loss_scaling, self.clip)


def build_pre_step_hooks(plan: Plan, device: str, *, tied: TiedGrads | None, sync: GradientSync, executor: Any,
                         group: Any, ranks: int, wait: WaitFn, on: torch.device,
                         clip_grad_norm: float | None, tp_member: int = 0) -> PreStepHooks:
    """The hooks that run at each STEP before the optimizer steps, in this order:

    1. ``tied`` (the model ties weights across layers): the copies' gradients summed, so that each copy takes
       the same step and what follows sees each tie's whole gradient;
    2. ``loss_scaling`` (the plan's precision is fp16): every gradient unscaled, and one verdict for the job on
       an overflow; on an overflow it returns False: the optimizer step is skipped on every rank, and so is
       what follows it (a skipped step is not clipped, ``clip.norm`` keeps the last norm);
    3. ``clip`` (``clip_grad_norm`` given): the gradients, unscaled, clipped by the global norm over the whole
       model, each tie counted once (``TiedGrads.duplicates``).

    Args:
        plan: the plan (its precision; its segments say who counts which layers in the norm).
        device: this rank's device in the plan.
        tied: this stage's ``TiedGrads`` (``StageParts.tied``), or None.
        sync: this stage's gradient buffers.
        executor: its ``grad_scale`` follows fp16's loss scale.
        group: the used ranks' process group (``Groups.work``).
        ranks: how many ranks it has (1: no collective).
        wait: ``wait(work, what)`` with the job's timeout (``Job.wait``).
        on: the torch device the rank computes on.
        clip_grad_norm: the largest global norm let through; None: no clipping.
        tp_member: this rank's index in its stage's TP group (0 without TP).
    """
    loss_scaling = (LossScaling(LossScaler(), sync, group, ranks, wait, on, executor)
                    if plan.precision == "fp16" else None)
    clip = None
    if clip_grad_norm is not None:
        clip = GradClip(clip_grad_norm, plan, device, sync, group, ranks, wait, on,
                        duplicates=tied.duplicates if tied is not None else (), tp_member=tp_member)
    return PreStepHooks(tied, loss_scaling, clip)


__all__ = ["PreStepHooks", "StepHook", "build_pre_step_hooks", "chain_hooks"]

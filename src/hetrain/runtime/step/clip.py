"""Gradient clipping by the global norm, over every parameter of the model, across stages and VWs (``bsp`` only).

After the segment all-reduces every owner of a segment holds the same, summed
gradient of its layers: one parameter, however many VWs replicate it. So each
segment is counted once, by its first owner, as a checkpoint writes each layer
once (``stage_state.owned_names``)::

    segment [0..2) owners (n0:0, n0:2)   ->  n0:0 adds the squares of its gradients, n0:2 adds nothing
    segment [2..4) owners (n0:1, n0:2)   ->  n0:1 adds them
    sharded segment (ZeRO), owners j     ->  each adds the squares of its range [lo_j, hi_j), which it holds summed
    TP group (n0:0, n0:1) leads a segment ->  each adds its shards of the split matrices; n0:0 alone adds the
                                             parameters both hold whole (norms, replicated biases, embeddings)

    norm  = sqrt(Σ over the used ranks of Σ_{p owned} ||grad p||²)    one all-reduce (SUM) of one number
    coef  = min(1, max_norm / (norm + 1e-6))                           as torch.nn.utils.clip_grad_norm_
    grad *= coef, for every gradient of the stage (owned or not: every replica is scaled alike)

The executor calls it before the optimizer's STEP (``Executor.before_step``), when
every ALLREDUCE of the iteration has been waited for. Other sync modes step on
gradients that are not yet summed across VWs; clipping is refused for them.

Example:
    >>> clip = GradClip(1.0, plan, "n0:1", sync, job.groups.work, len(job.used_ranks), job.wait,  # doctest: +SKIP
    ...                 job.device)
    >>> executor.before_step = clip     # the executor calls clip(step) before each optimizer step
    >>> clip.norm                       # the last step's norm before clipping (a 0-d tensor)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.step.losses import WaitFn
from hetrain.runtime.sync.allreduce import GradientSync


def check_clip(plan: Plan, max_norm: float | None) -> None:
    """Refuse a clipping threshold that is not a finite number > 0, or clipping under a sync mode other than bsp.

    Raises:
        InputError: naming the value or the plan's sync mode.
    """
    if max_norm is None:
        return
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise InputError(f"the gradient clipping norm must be a finite number > 0, got {max_norm}")
    if not plan.sync_mode.supports_clipping:
        raise InputError(f"gradient clipping by the global norm needs the bsp sync mode; the plan's is "
                         f"{plan.sync!r}, whose VWs step on gradients not yet summed across VWs")


class GradClip:
    """Scales this stage's gradients so that the model's global gradient norm is at most ``max_norm``.

    Args:
        max_norm: the largest global norm let through.
        plan: the plan (its segments say who counts which layers).
        device: this rank's device name in the plan.
        sync: this stage's gradient buffers (the parameters' ``.grad`` are views of them).
        group: the used ranks' process group (``Groups.work``).
        ranks: how many ranks it has (1: no collective).
        wait: ``wait(work, what)`` with the job's timeout (``Job.wait``).
        on: the torch device the rank computes on (where its share of the norm is summed).
        duplicates: parameters counted here whose gradient is another's too (tied copies after
            their sum, ``runtime.step.tied``): taken out of the norm, so a tied matrix counts once.
        tp_member: this rank's index in its stage's TP group (0 without TP).
    """

    def __init__(self, max_norm: float, plan: Plan, device: str, sync: GradientSync, group: Any, ranks: int,
                 wait: WaitFn, on: torch.device, duplicates: Sequence[torch.Tensor] = (), tp_member: int = 0) -> None:
        check_clip(plan, max_norm)
        self.max_norm = max_norm
        self._sync = sync
        self._group = group
        self._ranks = ranks
        self._wait = wait
        self._on = on
        self._duplicates = list(duplicates)
        # the segments this rank counts: those it leads (``Segment.lead``), and that hold gradients here; with TP,
        # member t of a group leads its shards (``sync.segments``): every member counts its shards of a split
        # parameter, member 0 alone the parameters every member holds whole
        self._owned = [s for s, seg in enumerate(sync.segments) if seg.lead == device and s in sync.buffers]
        # a sharded segment (ZeRO, runtime.sync.shard): every owner counts its own range, summed over the owners
        self._shards = sync.shards
        if self._shards is not None:
            self._owned = [s for s in self._owned if not self._shards.covers(s)]
        self._tp_member = tp_member
        self.norm: torch.Tensor | None = None  # the last step's global norm before clipping

    def __call__(self, step: int) -> None:
        """Clip the gradients of step ``step`` (0-based, for messages) by the global norm."""
        flats = self._sync.step_grads()  # ZeRO-2: this rank's range in place of the freed whole buffer
        split = {id(f) for f in self._sync.split_flats}
        owned = [flat for s in self._owned for flat, _ in self._sync.buffers[s]
                 if self._tp_member == 0 or id(flat) in split]
        if self._shards is not None:
            owned += self._shards.owned_grads()
        # Σ ||g||² of the owned gradients, in float32 (as clip_grad_norm_ takes the norm of the norms)
        squares = torch.zeros(1, dtype=torch.float32, device=self._on)
        for flat in owned:
            squares += torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2
        for p in self._duplicates:
            if p.grad is not None:
                squares -= torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
        squares.clamp_(min=0.0)  # what rounding may leave below 0 after the duplicates are taken out
        if self._ranks > 1:
            self._wait(dist.all_reduce(squares, group=self._group, async_op=True),
                       f"the gradient norm of step {step}")
        norm = squares.sqrt()[0]
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for flat in flats:
            flat.mul_(coef.to(flat.dtype))
        self.norm = norm


__all__ = ["GradClip", "check_clip"]

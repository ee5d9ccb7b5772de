"""Tied weights across layers: each layer holds its own copy; their gradients are summed before every step.

A Hugging Face GPT-2 uses one matrix as ``wte`` (layer 0) and ``lm_head`` (the last
layer). hetrain gives every layer its own parameters, so each holding layer gets a copy,
equal at the start (``ModelSource.tied``). Before each optimizer step the copies'
gradients are summed, so every copy takes the same step and they stay equal, as
Megatron's embedding group does for the first and last pipeline stage::

    after the segment all-reduces (bsp), every owner of a layer holds its gradient summed over the VWs
    contribution of a rank = Σ over the tie's copies it holds of (grad, if it is the first owner of
                              the copy's segment, else 0)                 each copy counted once
    total = all-reduce (SUM) of the contributions over the tie's ranks      one collective per tie
    every copy's grad := total

A tie whose every holder holds all its copies (a one-stage pipeline) is summed on the
rank, without a collective, under any sync mode. A tie across ranks needs ``bsp``:
other sync modes step on gradients not yet summed across VWs.

The tie's process groups are created by every rank of the job, in tie order, after the
sync mode's groups (``runtime.lifecycle.job.build_groups``); the executor calls ``TiedGrads`` at STEP,
first of the pre-step hooks (``runtime.step.hooks``).

Example:
    >>> ranks = tie_ranks(plan, rank_of, source.tied)          # doctest: +SKIP
    >>> executor.before_step = TiedGrads(source.tied, plan, "n0:0", module, groups, job.wait)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.step.losses import WaitFn
from hetrain.sync_layout import Segment

Tie = tuple[tuple[int, str], ...]


def _segment(plan: Plan, layer: int) -> Segment:
    """The segment that holds ``layer``."""
    for seg in plan.segments():
        if seg.first_layer <= layer < seg.end_layer:
            return seg
    raise InputError(f"tied layer {layer} is not in the plan's {plan.profile.num_layers} layers")


def _holders(plan: Plan, tie: Tie) -> set[str]:
    return {d for k, _ in tie for d in _segment(plan, k).owners}


def is_local(plan: Plan, tie: Tie) -> bool:
    """Whether every device that holds a copy of the tie holds all of them (no collective needed)."""
    return all(set(_segment(plan, k).owners) == _holders(plan, tie) for k, _ in tie)


def check_tied(plan: Plan, tied: Sequence[Tie]) -> None:
    """Refuse ties across ranks under a sync mode other than bsp.

    Raises:
        InputError: naming the tie's layers and the plan's sync mode.
    """
    for tie in tied:
        if not is_local(plan, tie) and not plan.sync_mode.supports_ties_across_devices:
            layers = " and ".join(f"layer {k} ({name})" for k, name in tie)
            raise InputError(f"the model ties {layers}, held by different devices; summing their gradients "
                             f"needs the bsp sync mode, the plan's is {plan.sync!r}")


def tie_ranks(plan: Plan, rank_of: dict[str, int], tied: Sequence[Tie]) -> list[list[int]]:
    """For each tie across ranks (in order), the ranks that hold a copy, ascending; pure."""
    return [sorted(rank_of[d] for d in _holders(plan, tie)) for tie in tied if not is_local(plan, tie)]


def build_tie_groups(plan: Plan, rank_of: dict[str, int], tied: Sequence[Tie], timeout_s: float) -> list[Any]:
    """One process group per tie across ranks; collective over the job (every rank, the same order)."""
    timeout = timedelta(seconds=timeout_s)
    return [dist.new_group(ranks, timeout=timeout) for ranks in tie_ranks(plan, rank_of, tied)]


class TiedGrads:
    """Sums the gradients of every tie's copies at STEP (module docstring); a no-op for ties this rank lacks.

    Args:
        tied: the model's ties (``ModelSource.tied``).
        plan: the plan (its segments say who holds which layers, and who counts them).
        device: this rank's device name in the plan.
        module: this rank's stage (``layers.{k}.…``, ``__getitem__`` by global layer index).
        groups: from ``build_tie_groups``, one per tie across ranks, in order.
        wait: ``wait(work, what)`` with the job's timeout (``Job.wait``).
    """

    def __init__(self, tied: Sequence[Tie], plan: Plan, device: str, module: Any, groups: Sequence[Any],
                 wait: WaitFn) -> None:
        check_tied(plan, tied)
        self._wait = wait
        # per tie: (group or None, [(param, counted here)]) for the ties this rank holds a copy of
        self._ties: list[tuple[Any, list[tuple[nn.Parameter, bool]]]] = []
        # the copies after a tie's first that this rank counts in a global norm: the same gradient again
        self.duplicates: list[nn.Parameter] = []
        group_of = iter(groups)
        for tie in tied:
            group = None if is_local(plan, tie) else next(group_of)
            if device not in _holders(plan, tie):
                continue
            copies = []
            for k, name in tie:
                seg = _segment(plan, k)
                if device in seg.owners:
                    copies.append((module[k].get_parameter(name), seg.lead == device))
                    if seg.lead == device and (k, name) != tie[0]:
                        self.duplicates.append(copies[-1][0])
            self._ties.append((group, copies))

    def __call__(self, step: int) -> None:
        """Sum the tied copies' gradients of step ``step`` (0-based, for messages)."""
        for j, (group, copies) in enumerate(self._ties):
            grads = [p.grad for p, _ in copies]
            present = [g for g in grads if g is not None]
            if len(present) < len(grads):
                continue  # no backward reached them (an unused rank's step): nothing to sum
            total = torch.zeros_like(present[0])
            for g, (_, counted) in zip(present, copies, strict=True):
                if counted or group is None:
                    total += g
            if group is not None:
                self._wait(dist.all_reduce(total, group=group, async_op=True),
                           f"the tied weights' gradient sum {j} of step {step}")
            for g in present:
                g.copy_(total)


__all__ = ["TiedGrads", "build_tie_groups", "check_tied", "is_local", "tie_ranks"]

"""What a rank feeds its stage: global batches, the same on every rank, cut into this VW's micro-batches.

Every rank draws the same global batch of a step (from the data seed); VW ``v``
takes its contiguous share of it and cuts that into its micro-batches in order
(``data.sharding``), so micro-batch ``i`` is one slice ``[lo, hi)`` of the global batch::

    global batch (N = 12)   [0 1 2 3 4 5 6 7 8 9 10 11]
    VW 0 (mini-batch 8)      mb0 [0,4)  mb1 [4,8)
    VW 1 (mini-batch 4)                            mb0 [8,10)  mb1 [10,12)

Only a first stage needs the inputs and only a last stage the targets.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hetrain.data.sharding import batch_length, shard_batch, split_batch
from hetrain.runtime.lifecycle.roles import Role


def global_batches(data: Any, global_batch: int, seed: int, start_step: int) -> Iterator[Any]:
    """The global batches of steps ``start_step, start_step + 1, ...``.

    Args:
        data: a dataset (``len`` and ``take(indices)``), drawn from by
            ``iter_batches(data, global_batch, seed)``; or an iterable of global batches from step 0.
        global_batch: N, samples per step.
        seed: the data seed (datasets only).
        start_step: the first step wanted (the batches before it are skipped).
    """
    if hasattr(data, "take") and hasattr(data, "__len__"):
        from hetrain.data.datasets import iter_batches

        stream: Iterable[Any] = iter_batches(data, global_batch, seed)
    else:
        stream = data
    return itertools.islice(iter(stream), start_step, None)


class MicroBatches:
    """Cuts a global batch into one rank's micro-batches: inputs for a first stage, targets for a last.

    Args:
        role: the rank's role (its VW, stage index and the plan's batch sizes).
        global_batch: N, samples per step.

    Example:
        >>> inputs, targets = MicroBatches(role, 12)((x, y), step=0)    # doctest: +SKIP
    """

    def __init__(self, role: Role, global_batch: int) -> None:
        self.role = role
        self.global_batch = global_batch
        self.slices: list[tuple[int, int]] = []  # micro-batch i of this VW = global batch [lo, hi)
        if role.vw is not None:
            bounds = list(itertools.accumulate(role.micro_batch_sizes,
                                               initial=sum(role.mini_batch_sizes[:role.vw])))
            self.slices = list(itertools.pairwise(bounds))

    def __call__(self, batch: Any, step: int) -> tuple[list[Any] | None, list[Any] | None]:
        """This VW's micro-batches of a global batch ``(inputs, targets)``: (inputs or None, targets or None).

        Raises:
            TypeError: the batch is not a pair.
            ValueError: the batch does not hold N samples.
        """
        role = self.role
        if not (role.is_first or role.is_last):
            return None, None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"step {step}: a global batch must be a pair (inputs, targets), got {type(batch).__name__}")
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):  # the common case, without the general code
            if len(x) != self.global_batch or len(y) != self.global_batch:
                raise ValueError(f"step {step}: a global batch of {len(x)} inputs and {len(y)} targets; the plan's "
                                 f"global batch is {self.global_batch}")
            return ([x[lo:hi] for lo, hi in self.slices] if role.is_first else None,
                    [y[lo:hi] for lo, hi in self.slices] if role.is_last else None)
        batch = (x, y)
        n = batch_length(batch)
        if n != self.global_batch:
            raise ValueError(f"step {step}: a global batch of {n} samples; the plan's global batch is "
                             f"{self.global_batch}")
        assert role.vw is not None
        micro = split_batch(shard_batch(batch, role.mini_batch_sizes, role.vw), role.micro_batch_sizes)
        return ([m[0] for m in micro] if role.is_first else None,
                [m[1] for m in micro] if role.is_last else None)

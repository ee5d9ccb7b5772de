"""Cut a global batch into per-VW mini-batches (and a mini-batch into micro-batches).

Pure Python: works on anything indexable by a ``slice`` along its first
dimension (torch tensors, numpy arrays, lists) and on tuples of them.

VW ``v`` with mini-batch size ``n_v`` takes the contiguous slice
``[n_0 + ... + n_{v-1}, n_0 + ... + n_v)`` of the global batch, so the VWs
together see every sample of the global batch exactly once, whatever the sizes::

    global batch (10 samples):   0 1 2 3 4 5 6 7 8 9
    mini-batch sizes (5, 3, 2):  |VW0------|VW1--|VW2|

Averaging the VWs' mean gradients with weights ``n_v / N`` (``sample_weights``)
gives the global batch's mean gradient, the one single-process training computes.

Example:
    >>> sizes = split_evenly(10, 3)
    >>> sizes, batch_slices(sizes)
    ([4, 3, 3], [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)])
    >>> shard_batch(list(range(10)), [5, 3, 2], 1)
    [5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split_evenly(total: int, parts: int) -> list[int]:
    """``parts`` sizes adding up to ``total``, as equal as possible, larger ones first."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} samples into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    return [base + 1 if j < extra else base for j in range(parts)]


def batch_slices(sizes: Sequence[int]) -> list[slice]:
    """Contiguous ``slice`` objects of the given sizes, in order, starting at 0."""
    if any(n < 1 for n in sizes):
        raise ValueError(f"every part of a batch needs at least one sample, got sizes {list(sizes)}")
    slices, start = [], 0
    for n in sizes:
        slices.append(slice(start, start + n))
        start += n
    return slices


def sample_weights(sizes: Sequence[int]) -> list[float]:
    """``n_v / sum(n)``: each part's share of the batch, the weight of its mean gradient."""
    total = sum(sizes)
    return [n / total for n in sizes]


def batch_length(batch: Any) -> int:
    """Samples in ``batch``: ``len`` of a tensor or array, or of every member of a tuple of them."""
    if isinstance(batch, tuple):
        lengths = {batch_length(part) for part in batch}
        if len(lengths) != 1:
            raise ValueError(f"batch members have different sample counts: {sorted(lengths)}")
        return lengths.pop()
    return len(batch)


def _take(batch: Any, s: slice) -> Any:
    if isinstance(batch, tuple):
        return tuple(_take(part, s) for part in batch)
    return batch[s]


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """The parts of ``batch`` with the given sizes (tuples are split member by member).

    Raises:
        ValueError: the sizes do not add up to the batch's sample count.
    """
    n = batch_length(batch)
    if sum(sizes) != n:
        raise ValueError(f"mini-batch sizes {list(sizes)} add up to {sum(sizes)}, but the batch has {n} samples")
    return [_take(batch, s) for s in batch_slices(sizes)]


def shard_batch(batch: Any, sizes: Sequence[int], index: int) -> Any:
    """Part ``index`` of ``split_batch(batch, sizes)``, without building the others."""
    if not 0 <= index < len(sizes):
        raise IndexError(f"part {index} does not exist: the batch is split into {len(sizes)} parts")
    n = batch_length(batch)
    if sum(sizes) != n:
        raise ValueError(f"mini-batch sizes {list(sizes)} add up to {sum(sizes)}, but the batch has {n} samples")
    return _take(batch, batch_slices(sizes)[index])

"""Datasets as pairs of tensors, and a deterministic batch iterator over any of them.

A dataset here has ``len(ds)`` samples and ``ds.take(indices)`` returning the
``(inputs, targets)`` batch of those samples; it is also a map-style
``torch.utils.data.Dataset`` for use with a ``DataLoader``.

``iter_batches`` draws global batches from a seed alone: every rank that calls
it with the same arguments gets the same sequence, and each VW then takes its
slice (``hetrain.data.sharding``).

Example:
    >>> ds = build_synthetic_dataset("mlp-digits", 64, seed=0)
    >>> x, y = next(iter_batches(ds, batch_size=16, seed=0))
    >>> tuple(x.shape), tuple(y.shape)
    ((16, 1, 8, 8), (16,))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import Dataset

from hetrain.models.registry import sample_batch

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchSource(Protocol):
    """What ``iter_batches`` needs: a sample count and a gather of samples by index."""

    def __len__(self) -> int: ...

    def take(self, indices: torch.Tensor) -> Batch: ...


class ArrayDataset(Dataset[Batch]):
    """Samples stored as two tensors with the same first dimension.

    Args:
        inputs: ``(N, ...)`` model inputs.
        targets: ``(N, ...)`` targets.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> Batch:
        return self.inputs[index], self.targets[index]

    def take(self, indices: torch.Tensor) -> Batch:
        return self.inputs[indices], self.targets[indices]

    def __repr__(self) -> str:
        return (f"ArrayDataset({len(self)} samples, inputs {tuple(self.inputs.shape[1:])} {self.inputs.dtype}, "
                f"targets {tuple(self.targets.shape[1:])} {self.targets.dtype})")


class DatasetSplit(NamedTuple):
    """A training set and a validation set that share no sample."""

    train: Any
    val: Any


def iter_batches(dataset: BatchSource, batch_size: int, seed: int = 0, *, shuffle: bool = True,
                 steps: int | None = None, epochs: int | None = None) -> Iterator[Batch]:
    """Batches of ``batch_size`` samples, epoch after epoch, deterministic in ``seed``.

    Each epoch visits the samples in a fresh random order (``torch.randperm``
    from a generator seeded with ``seed``; in index order when ``shuffle`` is
    false) and drops the last incomplete batch. Stops after ``steps`` batches or
    ``epochs`` epochs, whichever comes first; runs forever when neither is given.
    """
    n = len(dataset)
    if batch_size < 1 or batch_size > n:
        raise ValueError(f"batch_size must be between 1 and the dataset's {n} samples, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    done, epoch = 0, 0
    while epochs is None or epoch < epochs:
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for start in range(0, n - batch_size + 1, batch_size):
            if steps is not None and done >= steps:
                return
            yield dataset.take(order[start:start + batch_size])
            done += 1
        epoch += 1


def eval_batches(dataset: BatchSource, batch_size: int, count: int) -> list[Batch]:
    """``count`` batches of ``batch_size`` samples spread evenly over ``dataset``, the same every call.

    For measuring a validation loss at intervals during training: the samples are
    indices ``round(k * (len - 1) / (count * batch_size - 1))``, k = 0, 1, ..., so
    the batches cover the whole set (from its first sample to its last) without a
    seed, and every evaluation sees the same samples. On the text validation set,
    whose windows overlap, samples are at least ``seq_len`` apart when
    ``count * batch_size <= len / seq_len``.

    Raises:
        ValueError: ``batch_size`` or ``count`` below 1, or more samples asked for than the set has.
    """
    n, total = len(dataset), count * batch_size
    if batch_size < 1 or count < 1:
        raise ValueError(f"eval batches need batch_size >= 1 and count >= 1, got {batch_size} and {count}")
    if total > n:
        raise ValueError(f"{count} validation batches of {batch_size} need {total} samples, but the validation "
                         f"set has {n}")
    indices = torch.linspace(0, n - 1, total, dtype=torch.float64).round().long()  # (count * batch_size,)
    return [dataset.take(indices[k * batch_size:(k + 1) * batch_size]) for k in range(count)]


def build_synthetic_dataset(model_name: str, num_samples: int, seed: int = 0, **config: Any) -> ArrayDataset:
    """``num_samples`` random samples of model ``model_name``'s input and target shapes.

    See ``hetrain.models.registry.sample_batch``; deterministic in ``seed``.
    """
    inputs, targets = sample_batch(model_name, num_samples, torch.Generator().manual_seed(seed), **config)
    return ArrayDataset(inputs, targets)

"""Real images without a download: scikit-learn's bundled 8x8 handwritten digits.

``sklearn.datasets.load_digits`` reads a file that ships inside scikit-learn
(1,797 images of the digits 0-9, 8x8 pixels of 0..16; a copy of the test set of
the UCI "Optical Recognition of Handwritten Digits" data, Alpaydin and Kaynak
1998). scikit-learn is an optional dependency: it is imported on first use.

Example:
    >>> train, val = load_digits_dataset()                       # doctest: +SKIP
    >>> train.inputs.shape, train.targets.dtype                  # doctest: +SKIP
    (torch.Size([1438, 1, 8, 8]), torch.int64)
"""

from __future__ import annotations

import functools
import importlib

import torch

from hetrain.data.datasets import ArrayDataset, DatasetSplit

NUM_IMAGES = 1797
IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def _load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        sklearn_datasets = importlib.import_module("sklearn.datasets")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the digits data set comes from scikit-learn, which is not installed: pip install scikit-learn"
        ) from err
    bunch = sklearn_datasets.load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32)  # (N, 8, 8), pixel values 0..16
    images = images.unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)  # (N,)
    return images, labels


def load_digits_dataset(val_fraction: float = 0.2, seed: int = 0) -> DatasetSplit:
    """The 1,797 digits as float32 images ``(N, 1, 8, 8)`` in [0, 1] and int64 labels ``(N,)``.

    The images are shuffled by ``seed`` and the first ``val_fraction`` of them
    become the validation set.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    images, labels = _load_digits_arrays()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(images) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return DatasetSplit(ArrayDataset(images[train], labels[train]), ArrayDataset(images[val], labels[val]))

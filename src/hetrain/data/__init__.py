"""Data sets that ship offline, and the cutting of a global batch into per-VW parts.

- ``hetrain.data.text``: a real English text (Shakespeare) for character-level
  language modelling, packaged with hetrain (see README.md here for its origin).
- ``hetrain.data.digits``: scikit-learn's bundled 8x8 handwritten digits.
- ``hetrain.data.datasets``: tensor datasets, synthetic data, ``iter_batches``, ``eval_batches``.
- ``hetrain.data.sharding``: per-VW and per-micro-batch slices of a batch (pure Python).
- ``hetrain.data.registry``: the data sets by name, matched to a model.
- ``hetrain.data.user``: a user's data set (``--data MODULE:FUNCTION``), and ``--data`` resolved for any model.
- ``hetrain.data.tokens``: token and text files (``--data tokens:FILE.bin`` / ``text:FILE``), cut into windows.

Importing this package imports no torch; the names below load their module on
first use (``from hetrain.data import load_text_corpus``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArrayDataset": "datasets", "DatasetSplit": "datasets", "build_synthetic_dataset": "datasets",
    "eval_batches": "datasets", "iter_batches": "datasets",
    "TextDataset": "text", "VOCAB_SIZE": "text", "decode_ids": "text", "encode_text": "text",
    "load_text_corpus": "text", "load_text_datasets": "text",
    "load_digits_dataset": "digits",
    "DATA_NAMES": "registry", "build_datasets": "registry", "default_data": "registry",
    "MapDataset": "user", "build_model_datasets": "user", "load_user_datasets": "user",
    "TokenDataset": "tokens", "load_token_datasets": "tokens",
    "batch_slices": "sharding", "sample_weights": "sharding", "shard_batch": "sharding",
    "split_batch": "sharding", "split_evenly": "sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrain.data.{_EXPORTS[name]}"), name)

"""Data as Hugging Face users keep it: ``--data jsonl:FILE``, ``parquet:FILE`` or ``dataset:DIR``.

``dataset:DIR`` is a data set written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` gives its
``train`` split, and its ``validation`` or ``test`` split for validation); ``jsonl:`` and ``parquet:`` are
files of rows. All are read with the ``datasets`` library (the ``hf`` extra), offline. A table holds either

- a ``text`` column: every row tokenised by the model's tokenizer, the ids concatenated and cut into
  windows of ``seq_len + 1`` tokens as ``text:FILE`` is (``hetrain.data.tokens``), as transformers'
  ``run_clm`` groups texts; or
- an ``input_ids`` column (with ``attention_mask`` and ``labels`` optional): one sample per row, as
  transformers takes it (``hetrain.data.user.lm_pair`` shifts the labels).

Example:
    >>> split = load_table_datasets("jsonl:corpus.jsonl", 128, "tok/tokenizer.json", 50257)   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetrain.data.tokens import TokenDataError

TABLE_PREFIXES = ("jsonl:", "parquet:", "dataset:")
VALIDATION_SPLITS = ("validation", "test")
MODEL_INPUTS = ("input_ids", "attention_mask", "labels")


def is_table_spec(data: str | None) -> bool:
    """Whether ``--data`` names a table of rows (``jsonl:``, ``parquet:``, ``dataset:``)."""
    return data is not None and data.startswith(TABLE_PREFIXES)


def load_tables(spec: str) -> tuple[Any, Any | None]:
    """``(train, validation or None)`` as ``datasets.Dataset`` tables.

    Raises:
        TokenDataError: the ``datasets`` package missing, no such file, or one it cannot read (one line).
    """
    kind, _, where = spec.partition(":")
    try:
        import datasets
    except ImportError as e:
        raise TokenDataError(f"--data {spec} needs the datasets package, which is not installed: "
                             "pip install 'hetrain[hf]'") from e
    path = Path(where)
    if not path.exists():
        raise TokenDataError(f"--data {spec}: {path} does not exist")
    datasets.disable_progress_bars()
    try:
        if kind == "dataset":
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset("json" if kind == "jsonl" else "parquet", data_files=str(path),
                                           split="train")
    except Exception as e:  # the datasets library's own errors: one line naming the file
        text = " ".join(str(e).split())[:200]
        raise TokenDataError(f"--data {spec}: {path} cannot be read as {kind} ({type(e).__name__}: {text})") from e
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise TokenDataError(f"--data {spec}: {path} holds splits {sorted(loaded)}, none named 'train'")
        val = next((loaded[s] for s in VALIDATION_SPLITS if s in loaded), None)
        return loaded["train"], val
    return loaded, None


def table_kind(table: Any, spec: str) -> str:
    """``"text"`` or ``"input_ids"``: which column the rows are read from.

    Raises:
        TokenDataError: a table with neither column, naming the columns it has.
    """
    columns = list(table.column_names)
    for kind in ("input_ids", "text"):
        if kind in columns:
            return kind
    raise TokenDataError(f"--data {spec}: columns {columns}; hetrain reads a 'text' column (tokenised by the model's "
                         "tokenizer) or an 'input_ids' column (with attention_mask and labels optional)")


def table_tokens(table: Any, spec: str, tokenizer: Any) -> np.ndarray:
    """The ``text`` column tokenised row by row and concatenated, as int64 ids."""
    encoded = tokenizer.encode_batch([str(t) for t in table["text"]])
    ids = [i for e in encoded for i in e.ids]
    if not ids:
        raise TokenDataError(f"--data {spec}: its text column holds no tokens")
    return np.asarray(ids, dtype=np.int64)


class TableRows:
    """A table's rows as a map-style data set of dicts (``input_ids``, ``attention_mask``, ``labels``)."""

    def __init__(self, table: Any) -> None:
        # the columns a model takes; other columns (an id, the source text) are no input of the model. A model
        # input hetrain does not pass (token_type_ids) is kept, so that lm_pair refuses it
        keep = [c for c in (*MODEL_INPUTS, "token_type_ids", "position_ids") if c in table.column_names]
        self.table = table.select_columns(keep).with_format("torch")

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row: dict[str, Any] = self.table[index]
        return row

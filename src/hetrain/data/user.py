"""A user's data set, ``--data MODULE:FUNCTION``: any map-style ``torch.utils.data.Dataset`` of pairs.

The function takes no arguments and returns

- a map-style ``Dataset`` (``len(ds)`` and ``ds[i] -> (input, target)``): the training set, or
- a pair ``(train, validation)`` of them (``hetrain train --eval-every`` needs the second).

It must return the same samples in the same order on every rank (build them from a fixed
seed): each rank draws the same global batches by index (``datasets.iter_batches``) and
keeps its VW's slice. Samples are gathered into batches with torch's ``default_collate``
(tensors stacked, numbers made tensors), so ``ds[i]`` may hold tensors, numbers or numpy arrays.

Example:
    >>> train, val = load_user_datasets("examples/own_model/model.py:dataset")   # doctest: +SKIP
    >>> x, y = train.take(torch.arange(4))                                       # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from hetrain.data.datasets import Batch, DatasetSplit
from hetrain.data.seq_len import choose_seq_len, refuse_seq_len
from hetrain.data.tables import is_table_spec
from hetrain.data.tokens import TEXT_PREFIX, VOCAB_SETTING, load_corpus_token_datasets
from hetrain.models.hf import HF_PREFIX
from hetrain.models.spec import SpecError, call_spec, is_user_spec, load_function
from hetrain.models.user import ModelSource, check_model_on_batch

_HOW = ("return a map-style torch.utils.data.Dataset of (input, target) pairs or of dicts with input_ids (and "
        "attention_mask, labels), or a (train, validation) pair of them")


class MapDataset:
    """A map-style dataset seen as ``len`` and ``take(indices) -> (inputs, targets)``, what ``iter_batches`` reads.

    Args:
        dataset: ``len(dataset)`` samples, ``dataset[i] -> (input, target)``.
        name: how errors name it (the spec).
    """

    def __init__(self, dataset: Any, name: str, shift: bool = True) -> None:
        self.dataset = dataset
        self.name = name
        self.shift = shift  # dict samples: a causal LM's labels shifted to the next token (lm_pair); not a masked LM's

    def __len__(self) -> int:
        return len(self.dataset)

    def take(self, indices: torch.Tensor) -> Batch:
        samples = [self.dataset[int(i)] for i in indices]
        try:
            batch = default_collate(samples)  # (B, ...) each
        except (TypeError, RuntimeError, ValueError) as e:
            raise SpecError(f"data {self.name}: samples {[int(i) for i in indices[:4]]}... cannot be stacked into a "
                            f"batch ({type(e).__name__}: {e}); every sample must be an (input, target) pair of the "
                            "same shapes") from e
        if isinstance(batch, dict):
            return lm_pair(batch, self.name, self.shift)
        inputs, targets = batch
        return inputs, targets

    def __repr__(self) -> str:
        return f"MapDataset({self.name}, {len(self)} samples)"


#: the keys of a sample as transformers takes it (a tokenised Hugging Face data set's rows)
DICT_KEYS = ("input_ids", "attention_mask", "labels")
IGNORE = -100  # a label transformers' loss ignores (and torch's cross-entropy, by default)


def lm_pair(batch: dict[str, Any], name: str, shift: bool = True) -> Batch:
    """A batch of dicts, as transformers takes it, as hetrain's ``(inputs, targets)``: the same loss.

    transformers' labels are aligned with ``input_ids`` (default: ``input_ids``) and the model shifts them;
    hetrain's targets are the next tokens. So ``targets[:, t] = labels[:, t + 1]``, the last position ignored
    (-100), and a padded position (``attention_mask`` 0) is never a target::

        input_ids       a  b  c  PAD          inputs   a  b  c    PAD
        attention_mask  1  1  1  0      ->    targets  b  c  -100 -100
        labels          a  b  c  -100

    A masked LM's labels are its targets as they are (``shift`` False): the original token at each masked
    position, -100 elsewhere, as transformers' ``DataCollatorForLanguageModeling`` makes them.

    Raises:
        SpecError: a key transformers would give the model that hetrain does not pass (``token_type_ids``),
            left padding (the model would attend to the pads), or shapes that differ.
    """
    extra = sorted(set(batch) - set(DICT_KEYS))
    if extra or "input_ids" not in batch:
        what = f"has key {extra[0]!r}" if extra else "has no 'input_ids'"
        raise SpecError(f"data {name}: a sample {what}; hetrain passes the model input_ids only, and takes "
                        f"{', '.join(DICT_KEYS)} (attention_mask and labels optional)")
    ids = torch.as_tensor(batch["input_ids"])  # (B, T)
    labels = torch.as_tensor(batch.get("labels", ids)).clone()  # (B, T)
    mask = batch.get("attention_mask")
    if labels.shape != ids.shape or (mask is not None and torch.as_tensor(mask).shape != ids.shape):
        raise SpecError(f"data {name}: input_ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and attention_mask "
                        "must have one shape")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise SpecError(f"data {name}: attention_mask pads on the left; hetrain runs the model without the mask, "
                            "so the tokens would attend to the pads: pad on the right (tokenizer padding_side='right')")
        labels = labels.masked_fill(mask == 0, IGNORE)
    if not shift:
        return ids, labels
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    return ids, targets


def _check_dataset(ds: Any, spec: str, what: str) -> MapDataset:
    if not isinstance(ds, Dataset) and not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise SpecError(f"data function {spec} returned {what}a {type(ds).__name__}, not a data set; {_HOW}")
    try:
        n = len(ds)
    except TypeError as e:
        raise SpecError(f"data function {spec} returned {what}a {type(ds).__name__} without a length "
                        f"(an iterable-style data set?); {_HOW}") from e
    if n < 1:
        raise SpecError(f"data function {spec} returned {what}an empty {type(ds).__name__}; {_HOW}")
    try:
        first = ds[0]
    except Exception as e:  # the user's code: any error is theirs, named in one line
        raise SpecError(f"data {spec}: reading {what}sample 0 raised {type(e).__name__}: {e}") from e
    if isinstance(first, dict) and "input_ids" in first:  # a tokenised Hugging Face data set's rows
        return MapDataset(ds, spec)
    if not isinstance(first, tuple | list) or len(first) != 2:
        raise SpecError(f"data {spec}: {what}sample 0 is a {type(first).__name__}"
                        f"{f' of {len(first)} items' if isinstance(first, tuple | list) else ''}, "
                        "not an (input, target) pair; " + _HOW)
    return MapDataset(ds, spec)


def load_user_datasets(spec: str) -> DatasetSplit:
    """The training set (and the validation set, if returned; else None) of ``--data MODULE:FUNCTION``.

    Raises:
        SpecError: the spec cannot be loaded, its function raises, or it returns no data set of pairs.
    """
    fn, _ = load_function(spec)
    got = call_spec(spec, fn, "data function")
    if isinstance(got, tuple) and len(got) == 2 and not isinstance(got[0], torch.Tensor):
        return DatasetSplit(_check_dataset(got[0], spec, "as training set "),
                            _check_dataset(got[1], spec, "as validation set "))
    return DatasetSplit(_check_dataset(got, spec, ""), None)


def _token_shape(model: ModelSource, seq_len: int | None) -> tuple[int, int | None]:
    """``(T, vocab)`` that token data is cut and checked by: ``seq_len``, or the token model's default, at most
    its maximum positions (``hetrain.data.seq_len.choose_seq_len``), and its vocab; a user's model needs
    ``seq_len`` (its vocabulary is not known, so not checked)."""
    if model.tokens is None and model.preset is not None:
        from hetrain.models.registry import get_spec

        spec = get_spec(model.preset, **model.config)
        raise SpecError(f"token data is for GPT models; {model.name!r} is a {spec.kind} model")
    return choose_seq_len(model, seq_len), model.tokens.vocab if model.tokens is not None else None


def _vocab_setting(model: ModelSource) -> str:
    """How ``model``'s vocabulary is set, for the token data's errors (``hetrain.data.tokens.VOCAB_SETTING``):
    ``vocab_size`` in an ``hf:DIR`` model's config.json (``--set`` is refused for it), else ``--set vocab``."""
    if model.name.startswith(HF_PREFIX):
        return f'"vocab_size": {{n}} in {Path(model.name[len(HF_PREFIX):]) / "config.json"}'
    return VOCAB_SETTING


def _table_datasets(model: ModelSource, data: str, seq_len: int | None, tokenizer: str | None
                    ) -> tuple[str, DatasetSplit]:
    """``jsonl:`` / ``parquet:`` / ``dataset:`` data (``hetrain.data.tables``): text tokenised by the model's
    tokenizer and cut into windows, or rows of input_ids as transformers takes them."""
    from hetrain.data.tables import TableRows, load_tables, table_kind, table_tokens
    from hetrain.data.tokens import TokenDataset, check_ids, load_tokenizer, split_tokens

    t, vocab = _token_shape(model, seq_len)
    train, val = load_tables(data)
    name = data
    if table_kind(train, data) == "text":
        _refuse_windows(model, data)
        tokenizer = tokenizer or _model_tokenizer(model)
        if tokenizer is None:
            raise SpecError(f"--data {data}: its text needs the model's tokenizer; give --tokenizer FILE.json (an "
                            f"{HF_PREFIX}DIR model uses DIR/tokenizer.json)")
        tok = load_tokenizer(tokenizer, vocab, _vocab_setting(model))
        ids = table_tokens(train, data, tok)
        check_ids(ids, vocab, data, f"(from {tokenizer})", _vocab_setting(model))
        if val is None:
            split = split_tokens(ids, t, data, vocab, _vocab_setting(model))
        else:
            val_ids = table_tokens(val, data, tok)
            check_ids(val_ids, vocab, data, f"(from {tokenizer})", _vocab_setting(model))
            split = DatasetSplit(TokenDataset(ids, t, data, vocab, _vocab_setting(model)),
                                 TokenDataset(val_ids, t, data, vocab, _vocab_setting(model)))
        name = f"{data} (tokenized by {tokenizer})"
    else:
        if tokenizer is not None:
            raise SpecError(f"--tokenizer {tokenizer} is for text; --data {data} holds input_ids already")
        shift = not model.masked_lm
        split = DatasetSplit(MapDataset(TableRows(train), data, shift),
                             MapDataset(TableRows(val), data, shift) if val else None)
    x, y = split.train.take(torch.arange(min(2, len(split.train))))  # (2, T) each
    if model.preset is None:
        check_model_on_batch(model, x, y, data)
    return name, split


def _refuse_windows(model: ModelSource, data: str | None) -> None:
    """A masked LM trains on masked samples and their labels; token windows have no masked positions.

    Raises:
        SpecError: ``model`` is a masked LM, naming the data it was given.
    """
    if model.masked_lm:
        raise SpecError(f"model {model.name} is a masked LM: it trains on samples of masked input_ids and their "
                        f"labels (transformers' DataCollatorForLanguageModeling), not on token windows; give --data "
                        f"dataset:DIR, jsonl:FILE or parquet:FILE with input_ids and labels columns, or MODULE:FUNCTION"
                        + (f" (not {data})" if data else ""))


def _model_tokenizer(model: ModelSource) -> str | None:
    """An ``hf:DIR`` model's ``DIR/tokenizer.json``, where there is one."""
    if not model.name.startswith(HF_PREFIX):
        return None
    file = Path(model.name[len(HF_PREFIX):]) / "tokenizer.json"
    return str(file) if file.is_file() else None


def refuse_identity(x: Any, y: Any, data: str) -> None:
    """Refuse token pairs whose targets are their inputs: a language model would learn to copy its input.

    Raises:
        SpecError: naming the convention: hetrain's targets are the next tokens, transformers' labels are shifted
            by the model.
    """
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y):
        raise SpecError(f"data {data}: the targets equal the inputs (the model would learn to copy its input); "
                        "hetrain's targets are the next tokens (the inputs shifted by one), while transformers' labels "
                        "equal input_ids and the model shifts them: return (window[:-1], window[1:]), or dicts with "
                        "input_ids and labels")


def _hf_default_data(model: ModelSource, seq_len: int | None) -> tuple[str, DatasetSplit]:
    """An ``hf:DIR`` model's built-in data: the shipped Shakespeare text tokenized by ``DIR/tokenizer.json``."""
    tokenizer = Path(model.name[len(HF_PREFIX):]) / "tokenizer.json"
    if not tokenizer.is_file():
        raise SpecError(f"model {model.name}: no --data, and no {tokenizer} to tokenize the built-in Shakespeare "
                        "text with; give --data tokens:FILE.bin or text:FILE")
    t, vocab = _token_shape(model, seq_len)
    return f"shakespeare (tokenized by {tokenizer})", load_corpus_token_datasets(t, str(tokenizer), vocab,
                                                                                 _vocab_setting(model))


def build_model_datasets(model: ModelSource, data: str | None, seed: int = 0, *, seq_len: int | None = None,
                         val_data: str | None = None, tokenizer: str | None = None) -> tuple[str, DatasetSplit]:
    """``(data name, (train, validation))`` for ``model``: ``--data`` resolved as ``hetrain train`` does.

    ``tokens:FILE.bin`` / ``text:FILE`` read token data (``hetrain.data.tokens``), cut into windows of
    ``seq_len`` (default: the reference GPT's; a user's model and an ``hf:DIR`` model need it), its
    validation set ``val_data`` if given, ``text:`` tokenized by ``tokenizer`` (a tokenizer.json) if
    given, else by bytes. ``MODULE:FUNCTION`` loads the user's data set (for any model; a user's model
    is run on two of its samples, ``check_model_on_batch``); a name picks one of
    ``hetrain.data.registry`` shaped for a reference model (None: the one that fits it; a GPT's text
    is cut at ``seq_len`` where given). An ``hf:DIR`` model without ``data`` gets the shipped
    Shakespeare text tokenized by ``DIR/tokenizer.json`` (refused without one). A user's model has
    no known input shape, so it needs ``--data MODULE:FUNCTION``.

    Raises:
        SpecError: a user's model without a user's data set, a data spec that cannot be loaded, or a
            user's model that fails on its data.
        ValueError: an unknown data set name, or one that does not fit the reference model.
    """
    from hetrain.data.tokens import is_token_spec, load_token_datasets

    if data is None or is_token_spec(data):  # windows: the given tokens, or the shipped text
        _refuse_windows(model, data)
    if is_token_spec(data):
        assert data is not None
        t, vocab = _token_shape(model, seq_len)
        if tokenizer is None and data.startswith(TEXT_PREFIX):
            tokenizer = _model_tokenizer(model)  # a model directory's own tokenizer.json, where it has one
        split = load_token_datasets(data, t, vocab, val_data, tokenizer, _vocab_setting(model))
        if model.preset is None:
            x, y = split.train.take(torch.arange(min(2, len(split.train))))  # (2, T) each
            check_model_on_batch(model, x, y, data)
        if data.startswith(TEXT_PREFIX):  # the start-up line names what tokenised it
            return f"{data} (tokenized by {tokenizer})" if tokenizer else f"{data} (bytes)", split
        return data, split
    if is_table_spec(data) and val_data is None:
        assert data is not None
        return _table_datasets(model, data, seq_len, tokenizer)
    if val_data is not None or tokenizer is not None:
        flag = "--val-data" if val_data is not None else "--tokenizer"
        raise SpecError(f"{flag} is for --data tokens:FILE.bin or text:FILE, not --data {data}")
    if data is not None and is_user_spec(data):
        split = load_user_datasets(data)
        for part in split:
            if isinstance(part, MapDataset):
                part.shift = not model.masked_lm  # a masked LM's labels are its targets as they are
        x, y = split.train.take(torch.arange(min(2, len(split.train))))  # (2, ...) each
        if model.tokens is not None:
            refuse_identity(x, y, data)
        if model.preset is None:  # shapes hetrain cannot know: tried on two samples, so a mismatch is named here
            check_model_on_batch(model, x, y, data)
        return data, split
    if data is None and model.preset is None and model.tokens is not None:  # an hf:DIR model
        return _hf_default_data(model, seq_len)
    if model.preset is None:
        given = f"--data {data} is shaped for reference models" if data else "no --data given"
        raise SpecError(f"model {model.name} is your own, and {given}: hetrain does not know its input; give "
                        "--data MODULE:FUNCTION returning a torch Dataset of (input, target) pairs (docs/own-model.md)")
    from hetrain.data.registry import build_datasets, default_data

    config = dict(model.config)
    if seq_len is not None:  # a gpt model at a shorter length: its data cut at it (the model keeps its positions)
        refuse_seq_len(model, data, seq_len)
        config["seq_len"] = choose_seq_len(model, seq_len)
    name = data or default_data(model.preset, **config)
    return name, build_datasets(name, model.preset, seed=seed, **config)


def check_batch_fits(data_name: str, split: DatasetSplit, global_batch: int, eval_batches: int = 0) -> None:
    """Refuse a training set of fewer samples than one global batch (``iter_batches`` draws whole batches),
    and a validation set of fewer than ``eval_batches`` global batches (when evaluating: ``eval_batches > 0``).

    Raises:
        SpecError: too few samples, with the numbers.
    """
    if len(split.train) < global_batch:
        raise SpecError(f"--data {data_name}: {len(split.train)} training sample(s), fewer than the plan's global "
                        f"batch of {global_batch}; give more data (or, for token data, profile and plan at a shorter "
                        "--seq-len)")
    if eval_batches and split.val is not None and len(split.val) < eval_batches * global_batch:
        raise SpecError(f"--data {data_name}: {len(split.val)} validation sample(s), fewer than --eval-batches "
                        f"{eval_batches} x the global batch of {global_batch} = {eval_batches * global_batch}; "
                        "give fewer --eval-batches or more validation data")

"""Offline data: the packaged text corpus, the digits, synthetic data, batch sharding."""

from __future__ import annotations

import importlib.util
import itertools
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from hetrain.data.datasets import ArrayDataset, build_synthetic_dataset, eval_batches, iter_batches
from hetrain.data.registry import build_datasets, default_data
from hetrain.data.sharding import batch_slices, sample_weights, shard_batch, split_batch, split_evenly
from hetrain.data.text import (
    NEWLINE_ID,
    UNKNOWN_ID,
    VOCAB_SIZE,
    TextDataset,
    decode_ids,
    encode_text,
    load_text_corpus,
    load_text_datasets,
)
from hetrain.models.layers import run_layers
from hetrain.models.registry import build_layers, loss_fn

HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread is faster, and immune to a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_corpus_loads_without_network_and_is_english(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the corpus must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    load_text_corpus.cache_clear()
    text = load_text_corpus()
    assert len(text) == 730_047 and text.isascii()
    words = text.lower().split()
    for common in ("the", "and", "of", "to", "that", "is", "my", "not"):
        assert words.count(common) > 500, common
    for title in ("HAMLET", "MACBETH", "ROMEO", "TEMPEST", "MIDSUMMER", "JULIUS CAESAR"):
        assert title in text
    assert "To be, or not to be" in text


def test_vocabulary_has_96_ids_and_covers_the_corpus() -> None:
    assert VOCAB_SIZE == 96
    ids = encode_text(load_text_corpus())
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < VOCAB_SIZE
    assert not (ids == UNKNOWN_ID).any()  # every corpus character has its own id
    sample = "Who's there?\nNay, answer me: stand, and unfold yourself."
    assert decode_ids(encode_text(sample)) == sample
    odd = encode_text("a\tb~cé€")
    assert odd.tolist()[1::2] == [UNKNOWN_ID] * 3 and odd[0] != UNKNOWN_ID
    assert encode_text("\n").item() == NEWLINE_ID
    assert len({decode_ids([i]) for i in range(VOCAB_SIZE)}) == VOCAB_SIZE


def test_text_batches_shapes_targets_and_split() -> None:
    train, val = load_text_datasets(seq_len=64, val_fraction=0.1)
    n = len(train.ids) + len(val.ids)
    assert n == 730_047 and len(val.ids) == int(n * 0.1)
    x, y = next(iter_batches(train, batch_size=8, seed=0))
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Batches are a function of the seed alone.
    again = next(iter_batches(train, batch_size=8, seed=0))
    other = next(iter_batches(train, batch_size=8, seed=1))
    assert torch.equal(again[0], x) and not torch.equal(other[0], x)
    # The validation text is the corpus's tail, disjoint from the training text.
    assert decode_ids(val.ids) == load_text_corpus()[len(train.ids):]
    first_x, _ = val[0]
    assert decode_ids(first_x) == load_text_corpus()[len(train.ids):len(train.ids) + 64]


def test_validation_text_is_held_out_and_the_same_every_time() -> None:
    corpus = load_text_corpus()
    train, val = build_datasets("shakespeare", "gpt-tiny")  # what hetrain train uses
    cut = len(train.ids)
    assert len(val.ids) == len(corpus) - cut == int(len(corpus) * 0.1)  # the last 10% of the text
    # No training window reaches a validation character: the last one ends at the cut.
    _, last_y = train.take(torch.tensor([len(train) - 1]))
    assert decode_ids(last_y[0]) == corpus[cut - train.seq_len:cut]
    with pytest.raises(IndexError):
        train.take(torch.tensor([len(train)]))
    assert torch.equal(train.ids, encode_text(corpus[:cut])) and torch.equal(val.ids, encode_text(corpus[cut:]))
    # Deterministic: the same split and the same evaluation batches on every call (and so on every rank).
    train2, val2 = build_datasets("shakespeare", "gpt-tiny")
    assert torch.equal(train2.ids, train.ids) and torch.equal(val2.ids, val.ids)
    one, two = eval_batches(val, 32, 8), eval_batches(val2, 32, 8)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, two, strict=True))


def test_eval_batches_spread_over_the_whole_set() -> None:
    ds = ArrayDataset(torch.arange(100), torch.arange(100) * 2)
    batches = eval_batches(ds, 5, 2)
    assert [x.tolist() for x, _ in batches] == [[0, 11, 22, 33, 44], [55, 66, 77, 88, 99]]
    assert [y.tolist() for _, y in batches][1] == [110, 132, 154, 176, 198]
    # 8 batches of 32 windows of the held-out text: from its start to its end, no two windows overlapping
    train, val = load_text_datasets(seq_len=64)
    held_out = load_text_corpus()[len(train.ids):]
    windows = [decode_ids(row) for x, _ in eval_batches(val, 32, 8) for row in x]
    assert windows[0] == held_out[:64] and windows[-1] == held_out[-65:-1]
    at = [held_out.find(w) for w in windows]
    assert min(b - a for a, b in itertools.pairwise(at)) >= 64
    with pytest.raises(ValueError, match="need 101 samples, but the validation set has 100"):
        eval_batches(ds, 101, 1)
    with pytest.raises(ValueError, match="batch_size >= 1 and count >= 1"):
        eval_batches(ds, 4, 0)


def test_text_dataset_windows_and_epochs() -> None:
    ds = TextDataset(encode_text("abcdefghij"), seq_len=3)  # windows start at 0..6
    assert len(ds) == 7
    x, y = ds.take(torch.tensor([0, 6]))
    assert [decode_ids(r) for r in x] == ["abc", "ghi"] and [decode_ids(r) for r in y] == ["bcd", "hij"]
    seen = torch.cat([decode_x[:, 0] for decode_x, _ in iter_batches(ds, 2, seed=0, epochs=1)])
    assert len(seen) == 6 and len(set(seen.tolist())) == 6  # one epoch: distinct windows, last partial batch dropped
    assert len(list(iter_batches(ds, 2, seed=0, steps=10))) == 10  # crosses epochs
    with pytest.raises(IndexError):
        ds.take(torch.tensor([7]))
    with pytest.raises(ValueError, match="no window of seq_len 10"):
        TextDataset(encode_text("short"), seq_len=10)


@pytest.mark.slow  # trains gpt-tiny
def test_gpt_tiny_trains_on_the_corpus() -> None:
    """A few SGD steps on real text bring the loss below the uniform ln(96) = 4.56."""
    torch.manual_seed(0)
    layers = build_layers("gpt-tiny", seed=0, n_blocks=1)
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    loss = loss_fn("gpt-tiny")
    train, _ = load_text_datasets(seq_len=64)
    for x, y in iter_batches(train, batch_size=16, seed=0, steps=30):
        optimizer.zero_grad()
        value = loss(run_layers(layers, x), y)
        value.backward()
        optimizer.step()
    assert value.item() < 3.5


@pytest.mark.skipif(not HAS_SKLEARN, reason="scikit-learn is not installed: pip install scikit-learn for the digits")
def test_digits_load_offline_with_1797_images(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetrain.data.digits import load_digits_dataset

    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: pytest.fail("digits must not touch the network"))
    train, val = load_digits_dataset(val_fraction=0.2, seed=0)
    assert len(train) + len(val) == 1797 and len(val) == 359
    assert train.inputs.shape[1:] == (1, 8, 8) and train.inputs.dtype == torch.float32
    assert float(train.inputs.min()) >= 0.0 and float(train.inputs.max()) <= 1.0
    assert set(train.targets.tolist()) == set(range(10))
    again, _ = load_digits_dataset(val_fraction=0.2, seed=0)
    other, _ = load_digits_dataset(val_fraction=0.2, seed=1)
    assert torch.equal(again.inputs, train.inputs) and not torch.equal(other.inputs, train.inputs)
    logits = run_layers(build_layers("resnet-digits"), train.inputs[:4])
    assert logits.shape == (4, 10)


def test_synthetic_data_and_registry() -> None:
    ds = build_synthetic_dataset("resnet18-cifar", 5, seed=0)
    assert ds.inputs.shape == (5, 3, 32, 32) and ds.targets.shape == (5,)
    assert torch.equal(build_synthetic_dataset("resnet18-cifar", 5, seed=0).inputs, ds.inputs)
    assert default_data("gpt-tiny") == "shakespeare"
    assert default_data("mlp-digits") == "digits"
    assert default_data("gpt2-small") == default_data("vgg11-cifar") == "synthetic"
    train, val = build_datasets("synthetic", "gpt2-small", synthetic_samples=4, n_blocks=1)
    assert len(train) == 4 and len(val) == 1 and train.inputs.shape == (4, 1024)
    with pytest.raises(ValueError, match="shakespeare needs a vocab of 96 characters; 'gpt2-small' has vocab 50257"):
        build_datasets("shakespeare", "gpt2-small")
    with pytest.raises(ValueError, match=r"digits are \(1, 8, 8\) images of 10 classes; 'vgg11-cifar' takes \(3, 32"):
        build_datasets("digits", "vgg11-cifar")
    with pytest.raises(ValueError, match="unknown data set 'imagenet'"):
        build_datasets("imagenet", "gpt-tiny")


def test_sharding_covers_the_global_batch_exactly_once() -> None:
    global_batch = ArrayDataset(torch.arange(23).float()[:, None], torch.arange(23)).take(torch.arange(23))
    for sizes in ([23], [12, 11], [10, 1, 7, 5], split_evenly(23, 4)):
        shards = [shard_batch(global_batch, sizes, v) for v in range(len(sizes))]
        assert [len(x) for x, _ in shards] == sizes
        seen = torch.cat([y for _, y in shards])
        assert torch.equal(seen, torch.arange(23))  # every sample once, in order
        assert all(torch.equal(a[1], b[1]) for a, b in zip(shards, split_batch(global_batch, sizes), strict=True))
    assert split_evenly(23, 4) == [6, 6, 6, 5]
    assert batch_slices([2, 3]) == [slice(0, 2), slice(2, 5)]
    with pytest.raises(ValueError, match=r"mini-batch sizes \[10, 10\] add up to 20, but the batch has 23 samples"):
        shard_batch(global_batch, [10, 10], 0)
    with pytest.raises(ValueError, match="at least one sample"):
        batch_slices([3, 0])
    with pytest.raises(ValueError, match="cannot split 2 samples into 3"):
        split_evenly(2, 3)


def test_weighted_shard_gradients_equal_the_global_batch_gradient() -> None:
    """Uneven VW mini-batches, mean gradients weighted by n_v / N: the single-process gradient."""
    layers = build_layers("mlp-digits", seed=0)
    params = [p for layer in layers for p in layer.parameters()]
    x, y = build_synthetic_dataset("mlp-digits", 24, seed=0).take(torch.arange(24))
    loss = loss_fn("mlp-digits")
    reference = torch.autograd.grad(loss(run_layers(layers, x), y), params)
    sizes = [13, 4, 7]
    combined = [torch.zeros_like(p) for p in params]
    for (xv, yv), w in zip(split_batch((x, y), sizes), sample_weights(sizes), strict=True):
        for acc, g in zip(combined, torch.autograd.grad(loss(run_layers(layers, xv), yv), params), strict=True):
            acc += w * g
    for got, want in zip(combined, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_data_and_models_packages_import_no_torch() -> None:
    code = ("import sys, hetrain.data, hetrain.data.sharding, hetrain.models; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

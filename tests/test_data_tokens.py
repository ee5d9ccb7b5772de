"""Token and text data (``--data tokens:FILE.bin`` / ``text:FILE``): the windows hold the expected tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hetrain.data.datasets import iter_batches  # noqa: E402
from hetrain.data.tokens import TokenDataError, TokenDataset, load_token_datasets, open_token_file  # noqa: E402
from hetrain.data.user import build_model_datasets  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402


def write_tokens(path: Path, ids: object) -> str:
    np.asarray(ids, dtype="<u2").tofile(path)
    return str(path)


def test_windows_are_the_tokens_at_k_times_t_shifted_by_one(tmp_path: Path) -> None:
    ids = (np.arange(1000) * 7919) % 50_000  # ids above 255: two bytes each, little-endian
    path = write_tokens(tmp_path / "t.bin", ids)
    assert (tmp_path / "t.bin").read_bytes()[:4] == bytes([0, 0, 0xEF, 0x1E])  # 0, then 7919 = 0x1EEF
    ds = TokenDataset(open_token_file(path), seq_len=10, name=path)
    assert len(ds) == (1000 - 1) // 10 == 99
    x, y = ds.take(torch.tensor([0, 3, 98]))
    assert x.dtype == torch.int64 and x.shape == y.shape == (3, 10)
    for row, k in enumerate((0, 3, 98)):
        assert x[row].tolist() == ids[k * 10:k * 10 + 10].tolist()
        assert y[row].tolist() == ids[k * 10 + 1:k * 10 + 11].tolist()
    with pytest.raises(IndexError):
        ds.take(torch.tensor([99]))


def test_the_last_tenth_is_validation_and_no_window_spans_both(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", np.arange(2000) % 96)
    train, val = load_token_datasets(f"tokens:{path}", seq_len=16, vocab=96)
    assert len(train.tokens) == 1800 and len(val.tokens) == 200
    assert len(train) == 1799 // 16 and len(val) == 199 // 16
    _, last_y = train.take(torch.tensor([len(train) - 1]))  # window [1776, 1793): inside the training part
    assert last_y[0].tolist() == (np.arange(1777, 1793) % 96).tolist()
    assert val.take(torch.tensor([0]))[0][0].tolist() == (np.arange(1800, 1816) % 96).tolist()


def test_a_separate_validation_file_leaves_the_whole_training_file(tmp_path: Path) -> None:
    train_path = write_tokens(tmp_path / "train.bin", np.arange(500) % 96)
    val_path = write_tokens(tmp_path / "val.bin", np.arange(100) % 96)
    train, val = load_token_datasets(f"tokens:{train_path}", 8, 96, val_spec=f"tokens:{val_path}")
    assert len(train.tokens) == 500 and len(val.tokens) == 100 and val.name == val_path


def test_an_id_beyond_the_vocabulary_inside_a_big_file_stops_the_batch_that_reads_it(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    import hetrain.data.tokens as tokens

    monkeypatch.setattr(tokens, "CHECKED_AT_OPEN", 100)  # as if the file were far bigger than the part checked
    ids = np.arange(1000) % 96
    ids[500] = 300
    path = write_tokens(tmp_path / "t.bin", ids)
    ds = TokenDataset(open_token_file(path, vocab=96), 10, path, vocab=96)  # both ends are fine
    ds.take(torch.tensor([0, 1, 2]))
    with pytest.raises(TokenDataError, match=r"t\.bin: token id 300 .* vocabulary of 96"):
        ds.take(torch.tensor([50]))  # window [500, 511)
    monkeypatch.setattr(tokens, "CHECKED_AT_OPEN", 600)  # now the first part checked at open holds it
    with pytest.raises(TokenDataError, match=r"token id 300 in its first tokens"):
        open_token_file(path, vocab=96)


def test_text_bytes_are_the_tokens(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes("héllo, wörld\n".encode() * 10)
    model = resolve_model("gpt-tiny", vocab=256, seq_len=8)
    name, (train, val) = build_model_datasets(model, f"text:{tmp_path / 't.txt'}")
    raw = list("héllo, wörld\n".encode() * 10)
    assert name == f"text:{tmp_path / 't.txt'} (bytes)" and len(train.tokens) + len(val.tokens) == len(raw)
    x, y = train.take(torch.tensor([2]))
    assert x[0].tolist() == raw[16:24] and y[0].tolist() == raw[17:25]


def test_a_tokenizer_file_tokenizes_the_text(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("to be or not to be " * 50)
    train, val = load_token_datasets(f"text:{tmp_path / 't.txt'}", 4, vocab=96,
                                     tokenizer=str(tmp_path / "tokenizer.json"))
    assert len(train.tokens) + len(val.tokens) == 300
    assert train.take(torch.tensor([0]))[0][0].tolist() == [1, 2, 3, 4]


def test_without_the_tokenizers_package_the_error_says_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    (tmp_path / "t.txt").write_text("abc" * 100)
    with pytest.raises(TokenDataError, match=r"needs the tokenizers package.*pip install tokenizers"):
        load_token_datasets(f"text:{tmp_path / 't.txt'}", 4, tokenizer=str(tmp_path / "tokenizer.json"))


def test_seq_len_comes_from_the_gpt_model_or_is_given(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", np.arange(5000) % 96)
    _, (train, _) = build_model_datasets(resolve_model("gpt-tiny"), f"tokens:{path}")
    assert train.seq_len == 64 and train.vocab == 96
    _, (short, _) = build_model_datasets(resolve_model("gpt-tiny"), f"tokens:{path}", seq_len=16)
    assert short.seq_len == 16 and short.take(torch.tensor([0]))[0].shape == (1, 16)


def test_token_batches_are_drawn_like_any_data_set(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", np.arange(3000) % 96)
    train, _ = load_token_datasets(f"tokens:{path}", 16, 96)
    batches = list(iter_batches(train, 8, seed=1, steps=3))
    again = list(iter_batches(train, 8, seed=1, steps=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    x, y = batches[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one


def test_profiling_a_gpt_on_token_data_feeds_it_the_windows(tmp_path: Path) -> None:
    from hetrain.profiler.layers import profile_inputs

    path = write_tokens(tmp_path / "t.bin", (np.arange(5000) * 5) % 96)
    inputs = profile_inputs(resolve_model("gpt-tiny"), f"tokens:{path}")(3)
    assert inputs.shape == (3, 64) and inputs[1].tolist() == ((np.arange(64, 128) * 5) % 96).tolist()

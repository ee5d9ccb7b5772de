"""A ``--tokenizer`` with more tokens than the model's vocabulary: one line that says how large a vocabulary
takes it (``N >= its size``), never the tokenizer's size passed off as the model's setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from hetrain.data.tokens import TokenDataError  # noqa: E402
from hetrain.data.user import build_model_datasets  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402

SIZE = 120  # tokens of the tokenizer


def write_tokenizer(tmp_path: Path) -> tuple[str, str]:
    """A word-level tokenizer.json of ``SIZE`` tokens and a text of its words: (tokenizer, ``text:FILE``)."""
    words = {"[UNK]": 0, **{f"w{i}": i for i in range(1, SIZE)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("w1 w2 " * 200)
    return str(tmp_path / "tokenizer.json"), f"text:{tmp_path / 't.txt'}"


def test_a_reference_gpt_is_told_the_vocab_to_set(tmp_path: Path) -> None:
    tokenizer, data = write_tokenizer(tmp_path)
    with pytest.raises(TokenDataError) as info:
        build_model_datasets(resolve_model("gpt-tiny"), data, seq_len=8, tokenizer=tokenizer)  # vocabulary 96
    assert str(info.value) == (f"--tokenizer {tokenizer}: {SIZE} tokens, more than the model's vocabulary of 96; "
                               f"use a larger vocab (--set vocab=N, N >= {SIZE}) or the model's own tokenizer")


@pytest.mark.slow  # traces a transformers model
def test_an_hf_model_is_told_the_vocab_size_to_write_in_its_config_json(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    tokenizer, data = write_tokenizer(tmp_path)
    d = tmp_path / "model"
    d.mkdir()
    config = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(TokenDataError) as info:
        build_model_datasets(resolve_model(f"hf:{d}"), data, seq_len=8, tokenizer=tokenizer)
    message = str(info.value)
    assert message == (f"--tokenizer {tokenizer}: {SIZE} tokens, more than the model's vocabulary of 100; use a "
                       f'larger vocab ("vocab_size": N in {d / "config.json"}, N >= {SIZE}) or the model\'s own '
                       "tokenizer")
    assert f'"vocab_size": {SIZE}' not in message  # config.json says 100

"""Data as Hugging Face users have it: dicts of input_ids / attention_mask / labels (transformers' label
convention, -100 ignored, right padding), text tokenised by the model directory's own tokenizer.json, and tables
(JSONL, Parquet, ``save_to_disk``) of text or input_ids. The loss hetrain computes on them equals transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hetrain.data.user import build_model_datasets, lm_pair  # noqa: E402
from hetrain.errors import InputError  # noqa: E402
from hetrain.models.layers import run_layers  # noqa: E402
from hetrain.models.spec import SpecError  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402

VOCAB = 64
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def model_dir(tmp_path: Path, tokenizer: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    if tokenizer:
        words = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        tok.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.slow  # traces a transformers model
def test_dicts_with_labels_and_right_padding_give_transformers_loss(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    source = resolve_model(f"hf:{d}")
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [3, 4, 0, 0, 0, 0]])  # (B, T): the second row padded on the right
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2] = -100  # a position the user leaves out of the loss
    x, y = lm_pair({"input_ids": ids, "attention_mask": mask, "labels": labels}, "rows")
    assert torch.equal(x, ids)
    assert y.tolist() == [[6, -100, 8, 9, 0, -100], [4, -100, -100, -100, -100, -100]]
    layers = [m.eval() for m in source.build_layers(seed=2)]
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).eval()
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # transformers shifts inside
    torch.testing.assert_close(source.loss_fn(run_layers(layers, x), y), want, rtol=1e-5, atol=1e-6)
    # without labels, the padded positions are left out all the same
    _, y2 = lm_pair({"input_ids": ids, "attention_mask": mask}, "rows")
    assert y2[1].tolist() == [4, -100, -100, -100, -100, -100]


@pytest.mark.parametrize(("batch", "needle"), [
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "token_type_ids": torch.zeros(2, 4, dtype=torch.long)},
     "a sample has key 'token_type_ids'; hetrain passes the model input_ids only"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 0, 1, 1]])},
     "attention_mask pads on the left"),
])
def test_dicts_hetrain_would_run_otherwise_are_refused_in_one_line(batch: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecError) as info:
        lm_pair(batch, "rows")
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.slow  # traces a transformers model
def test_a_data_set_of_dicts_trains_with_its_labels(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (tmp_path / "rows.py").write_text(
        "import torch\n"
        "def rows():\n"
        "    ids = torch.arange(40).reshape(5, 8) % 60 + 1\n"
        "    return [{'input_ids': r, 'attention_mask': torch.ones(8, dtype=torch.long), 'labels': r} for r in ids]\n")
    _, split = build_model_datasets(resolve_model(f"hf:{d}"), f"{tmp_path / 'rows.py'}:rows", seq_len=8)
    x, y = split.train.take(torch.tensor([1]))
    assert x.tolist() == [list(range(9, 17))] and y.tolist() == [[*range(10, 17), -100]]


@pytest.mark.slow  # traces a transformers model
def test_pairs_whose_targets_are_their_inputs_are_refused_naming_the_convention(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (tmp_path / "same.py").write_text(
        "import torch\n"
        "def same():\n"
        "    ids = torch.arange(40).reshape(5, 8) % 60\n"
        "    return torch.utils.data.TensorDataset(ids, ids)\n")
    with pytest.raises(SpecError) as info:
        build_model_datasets(resolve_model(f"hf:{d}"), f"{tmp_path / 'same.py'}:same", seq_len=8)
    assert "the targets equal the inputs" in str(info.value) and "transformers' labels equal input_ids and the " \
        "model shifts them" in str(info.value)


@pytest.mark.slow  # traces a transformers model
def test_text_is_tokenised_by_the_model_directorys_tokenizer_and_named(tmp_path: Path) -> None:
    d = model_dir(tmp_path, tokenizer=True)
    (tmp_path / "t.txt").write_text("w1 w2 w3 " * 40)
    name, split = build_model_datasets(resolve_model(f"hf:{d}"), f"text:{tmp_path / 't.txt'}", seq_len=4)
    assert name == f"text:{tmp_path / 't.txt'} (tokenized by {d / 'tokenizer.json'})"
    x, y = split.train.take(torch.tensor([0]))
    assert x.tolist() == [[1, 2, 3, 1]] and y.tolist() == [[2, 3, 1, 2]]  # word ids, not bytes
    (d / "tokenizer.json").unlink()  # without one, bytes: which this model's vocabulary of 64 cannot take
    with pytest.raises(InputError, match=r"a byte of the text; bytes are tokens 0\.\.255"):
        build_model_datasets(resolve_model(f"hf:{d}"), f"text:{tmp_path / 't.txt'}", seq_len=4)


# traces a transformers model, yet stays in the fast tier: its one cover of tables (JSONL, Parquet, save_to_disk)
def test_tables_of_text_and_of_input_ids(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    d = model_dir(tmp_path, tokenizer=True)
    source = resolve_model(f"hf:{d}")
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"w{i} w{i + 1}", "id": i}) for i in range(1, 40)))
    name, split = build_model_datasets(source, f"jsonl:{tmp_path / 'c.jsonl'}", seq_len=4)
    assert name.endswith(f"(tokenized by {d / 'tokenizer.json'})")
    x, y = split.train.take(torch.tensor([0]))
    assert x.tolist() == [[1, 2, 2, 3]] and y.tolist() == [[2, 2, 3, 3]]
    table = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 6, "attention_mask": [[1, 1, 1, 0]] * 6})
    table.to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict({"train": table, "validation": table}).save_to_disk(str(tmp_path / "saved"))
    for spec in (f"parquet:{tmp_path / 'rows.parquet'}", f"dataset:{tmp_path / 'saved'}"):
        _, split = build_model_datasets(source, spec, seq_len=4)
        x, y = split.train.take(torch.tensor([0, 1]))
        assert x.tolist() == [[1, 2, 3, 4]] * 2 and y.tolist() == [[2, 3, -100, -100]] * 2
    assert split.val is not None and len(split.val) == 6
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "w1"}))
    with pytest.raises(InputError, match=r"columns \['body'\]; hetrain reads a 'text' column"):
        build_model_datasets(source, f"jsonl:{tmp_path / 'bad.jsonl'}", seq_len=4)

"""One sequence length from profile to train: ``hetrain profile --seq-len``, the profile's ``seq_len``, train's refusal.

    hetrain profile --model hf:DIR --seq-len 16 -o p.json     # p.json: "seq_len": 16
    hetrain plan --profile p.json ...  ->  plan.json
    hetrain train --plan plan.json --model hf:DIR --seq-len 32     # refused: re-profile at 32
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hetrain.cli import main  # noqa: E402
from hetrain.data.seq_len import train_seq_len  # noqa: E402
from hetrain.data.user import build_model_datasets  # noqa: E402
from hetrain.models.spec import SpecError  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402
from hetrain.profile import ModelProfile, ProfileError, parse_profile  # noqa: E402
from hetrain.profile_combine import merge_profiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, POSITIONS = 100, 64
ONE_CPU = """
name = "one-cpu"
[[node]]
name = "n0"
devices = [{type = "cpu", count = 1}]
intra_link = "loopback"
nic = "1Gbit/s"
"""
# samples of 16 token ids each, counting up from a random start
TOKENS16 = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def dataset():
        start = torch.randint(0, 64, (64, 1), generator=torch.Generator().manual_seed(0))
        seq = (start + torch.arange(17)) % 64          # (N, T + 1)
        return TensorDataset(seq[:, :-1], seq[:, 1:])  # (N, 16) each
""")


def hf_dir(tmp_path: Path, kind: str = "gpt2") -> str:
    """A tiny transformers model directory (config.json only) of ``POSITIONS`` positions."""
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS,
                                         bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=0)
    path = tmp_path / kind
    config.save_pretrained(path)
    return f"hf:{path}"


def profile(tmp_path: Path, *args: str, out: str = "p.json") -> dict[str, Any]:
    """``hetrain profile ARGS`` in this process (two micro-batch sizes, one repeat); the profile JSON."""
    code = main(["profile", *args, "--micro-batch", "1,2", "--repeats", "1", "-o", str(tmp_path / out)])
    assert code == 0
    data: dict[str, Any] = json.loads((tmp_path / out).read_text())
    return data


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``hetrain profile ARGS``'s one-line error (status 2)."""
    assert main(["profile", *args, "--micro-batch", "1", "--repeats", "1", "-o", os.devnull]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --- the profile's field ------------------------------------------------------------------------------

def minimal(**extra: Any) -> dict[str, Any]:
    return {"layers": [{"name": "l0", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
                        "forward_flops_per_sample": 8}], "input_bytes_per_sample": 4, **extra}


def test_the_profile_keeps_its_seq_len_and_reads_a_profile_without_one_as_unknown() -> None:
    assert parse_profile(minimal()).seq_len is None
    assert "seq_len" not in parse_profile(minimal()).to_dict()
    p = parse_profile(minimal(seq_len=128))
    assert p.seq_len == 128 and parse_profile(p.to_dict()).seq_len == 128


@pytest.mark.parametrize(("value", "message"), [
    (0, "seq_len: must be >= 1, got 0"),
    ("128", "seq_len: expected an integer, got '128'"),
    (2**21, "seq_len: 2097152 is more than the limit of 1048576 (MAX_SEQ_LEN)"),
])
def test_a_bad_seq_len_in_a_profile_is_named(value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(message)):
        parse_profile(minimal(seq_len=value))


def test_profiles_measured_at_different_lengths_are_not_merged() -> None:
    a, b = parse_profile(minimal(seq_len=16)), parse_profile(minimal(seq_len=32))
    with pytest.raises(ProfileError, match=r"profile 1 .* measured at seq_len 32, profile 0 at 16"):
        merge_profiles([a, b])
    assert merge_profiles([a, a]).seq_len == 16


# --- hetrain profile ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.slow  # traces a transformers model
def test_an_hf_model_is_profiled_at_the_given_length_and_its_activations_scale_with_it(kind: str,
                                                                                      tmp_path: Path) -> None:
    model = hf_dir(tmp_path, kind)
    short = profile(tmp_path, "--model", model, "--seq-len", "8", out="short.json")
    long = profile(tmp_path, "--model", model, "--seq-len", "32", out="long.json")
    assert short["seq_len"] == 8 and long["seq_len"] == 32
    assert ModelProfile.from_dict(long).seq_len == 32
    # (B, T, C) outputs and what travels with them ((B, T) position ids, (1, T, D) rotary tables): 4x the tokens,
    # 4x the bytes, give or take the tables, which one micro-batch carries once for all of its samples
    for a, b in zip(short["layers"], long["layers"], strict=True):
        assert 3.9 * a["output_bytes_per_sample"] <= b["output_bytes_per_sample"], a["name"]
        assert b["output_bytes_per_sample"] <= 4.8 * a["output_bytes_per_sample"], a["name"]
        assert b["param_bytes"] == a["param_bytes"]


@pytest.mark.parametrize(("kind", "field"), [("gpt2", "n_positions"), ("llama", "max_position_embeddings")])
@pytest.mark.slow  # traces a transformers model
def test_an_hf_model_needs_a_length_within_its_positions(kind: str, field: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = hf_dir(tmp_path, kind)
    assert "give --seq-len T" in refused(capsys, "--model", model)
    assert f"at most its {field} {POSITIONS}" in refused(capsys, "--model", model)
    err = refused(capsys, "--model", model, "--seq-len", str(POSITIONS + 1))
    assert f"--seq-len {POSITIONS + 1} is longer than model {model}'s {field} {POSITIONS}" in err


def test_a_gpt_model_is_profiled_at_its_seq_len_or_a_shorter_one(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    full = profile(tmp_path, "--model", "gpt-tiny", out="full.json")
    short = profile(tmp_path, "--model", "gpt-tiny", "--seq-len", "16", out="short.json")
    assert full["seq_len"] == 64 and short["seq_len"] == 16
    assert full["layers"][1]["output_bytes_per_sample"] == 4 * short["layers"][1]["output_bytes_per_sample"]
    err = refused(capsys, "--model", "gpt-tiny", "--seq-len", "65")
    assert "--seq-len 65 is longer than model gpt-tiny's seq_len 64 (--set seq_len=65)" in err


def test_token_data_is_profiled_in_windows_of_the_given_length(tmp_path: Path) -> None:
    (np.arange(4000) % 96).astype("<u2").tofile(tmp_path / "t.bin")
    got = profile(tmp_path, "--model", "gpt-tiny", "--data", f"tokens:{tmp_path / 't.bin'}", "--seq-len", "24")
    assert got["seq_len"] == 24


def test_a_model_without_a_sequence_length_refuses_seq_len_and_records_none(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--model", "mlp-digits", "--seq-len", "8")
    assert "--seq-len 8: model mlp-digits is not a token model" in err
    assert "seq_len" not in profile(tmp_path, "--model", "mlp-digits")


@pytest.mark.slow  # traces a transformers model
def test_an_hf_models_token_data_is_checked_against_its_vocabulary(tmp_path: Path) -> None:
    (np.arange(400) % (VOCAB + 1)).astype("<u2").tofile(tmp_path / "t.bin")  # id 100: one past the vocabulary
    from hetrain.data.tokens import TokenDataError

    with pytest.raises(TokenDataError, match=f"token id {VOCAB} .* is >= the model's vocabulary of {VOCAB}"):
        build_model_datasets(resolve_model(hf_dir(tmp_path)), f"tokens:{tmp_path / 't.bin'}", seq_len=8)


@pytest.mark.slow  # traces a transformers model
def test_an_hf_models_bad_token_id_points_to_vocab_size_in_its_config_json(tmp_path: Path, monkeypatch) -> None:
    """``--set`` is refused for an hf:DIR model, so the errors name its config.json's ``vocab_size`` instead:
    at open, in a batch read later, and for a tokenizer larger than the vocabulary."""
    import hetrain.data.tokens as tokens

    model = resolve_model(hf_dir(tmp_path))
    config = tmp_path / "gpt2" / "config.json"
    hint = f'use a larger vocab ("vocab_size": N in {config}, N > {VOCAB}) or tokens of the model\'s tokenizer'
    ids = np.arange(1000) % VOCAB
    ids[0] = VOCAB
    ids.astype("<u2").tofile(tmp_path / "first.bin")
    with pytest.raises(tokens.TokenDataError) as err:
        build_model_datasets(model, f"tokens:{tmp_path / 'first.bin'}", seq_len=8)
    assert hint in str(err.value) and "--set" not in str(err.value), err.value

    monkeypatch.setattr(tokens, "CHECKED_AT_OPEN", 100)  # as if the file were far bigger than the part checked
    ids = np.arange(1000) % VOCAB
    ids[400] = VOCAB
    ids.astype("<u2").tofile(tmp_path / "inside.bin")
    _, (train, _) = build_model_datasets(model, f"tokens:{tmp_path / 'inside.bin'}", seq_len=8)
    with pytest.raises(tokens.TokenDataError) as err:
        train.take(torch.tensor([50]))  # window [400, 409)
    assert hint in str(err.value) and "--set" not in str(err.value), err.value

    tokenizers = pytest.importorskip("tokenizers")
    words = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB + 20)}}  # 119 tokens, the vocabulary has 100
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("w1 w2 " * 100)
    with pytest.raises(tokens.TokenDataError) as err:
        build_model_datasets(model, f"text:{tmp_path / 't.txt'}", seq_len=8, tokenizer=str(tmp_path / "tokenizer.json"))
    assert (f'more than the model\'s vocabulary of {VOCAB}; use a larger vocab ("vocab_size": N in {config}, '
            f'N >= {VOCAB + 20})') in str(err.value), err.value


def test_a_reference_gpts_bad_token_id_points_to_set_vocab(tmp_path: Path) -> None:
    (np.arange(400) % 97).astype("<u2").tofile(tmp_path / "t.bin")  # id 96: one past gpt-tiny's vocabulary
    from hetrain.data.tokens import TokenDataError

    with pytest.raises(TokenDataError, match=r"use a larger vocab \(--set vocab=N, N > 96\)"):
        build_model_datasets(resolve_model("gpt-tiny"), f"tokens:{tmp_path / 't.bin'}")


@pytest.mark.slow  # traces a transformers model
def test_a_user_data_set_gives_the_length_and_must_match_seq_len(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tokens16.py").write_text(TOKENS16)
    model, data = hf_dir(tmp_path), f"{tmp_path / 'tokens16.py'}:dataset"
    assert profile(tmp_path, "--model", model, "--data", data)["seq_len"] == 16
    err = refused(capsys, "--model", model, "--data", data, "--seq-len", "8")
    assert f"--data {data}: samples of 16 tokens, not --seq-len 8" in err


# --- hetrain train ------------------------------------------------------------------------------------

def test_train_takes_the_profiles_length_and_refuses_another() -> None:
    assert train_seq_len(128, None) == 128 and train_seq_len(128, 128) == 128
    assert train_seq_len(None, 256) == 256 and train_seq_len(None, None) is None
    with pytest.raises(SpecError, match=r"^--seq-len 256 differs from the plan's profile \(measured at 128\); "
                                        r"re-profile with hetrain profile --seq-len 256 and re-plan$"):
        train_seq_len(128, 256)


def plan_at(tmp_path: Path, *profile_args: str) -> Path:
    profile(tmp_path, *profile_args)
    (tmp_path / "one-cpu.toml").write_text(ONE_CPU)
    assert main(["plan", "--cluster", str(tmp_path / "one-cpu.toml"), "--profile", str(tmp_path / "p.json"),
                 "--global-batch", "4", "-o", str(tmp_path / "plan.json")]) == 0
    return tmp_path / "plan.json"


@pytest.mark.slow  # traces a transformers model
def test_hetrain_train_refuses_a_length_other_than_the_plans_profile(tmp_path: Path, capsys: Any) -> None:
    model = hf_dir(tmp_path)
    plan = plan_at(tmp_path, "--model", model, "--seq-len", "16")
    (np.arange(4000) % VOCAB).astype("<u2").tofile(tmp_path / "t.bin")
    capsys.readouterr()
    # the command's main in this process: it refuses before it starts a process group or builds the model
    code = main(["train", "--plan", str(plan), "--model", model, "--data", f"tokens:{tmp_path / 't.bin'}",
                 "--seq-len", "32", "--steps", "1"])
    run = capsys.readouterr()
    assert code == 2, run.err
    assert not torch.distributed.is_initialized()
    assert run.err.strip() == ("hetrain train: error: --seq-len 32 differs from the plan's profile (measured at "
                                  "16); re-profile with hetrain profile --seq-len 32 and re-plan")


@pytest.mark.slow  # traces a transformers model
def test_train_cuts_token_data_at_the_profiles_length_and_refuses_a_data_set_of_another(tmp_path: Path,
                                                                                        capsys: Any) -> None:
    from hetrain.plan import load_plan
    from hetrain.runtime.command import build_train_datasets
    from hetrain.runtime.config import DataConfig, TrainConfig

    model = hf_dir(tmp_path)
    plan = load_plan(plan_at(tmp_path, "--model", model, "--seq-len", "8"))
    source = resolve_model(model)
    (np.arange(4000) % VOCAB).astype("<u2").tofile(tmp_path / "t.bin")
    _, (train, _) = build_train_datasets(plan, source, TrainConfig(data=DataConfig(f"tokens:{tmp_path / 't.bin'}")))
    assert train.take(torch.arange(2))[0].shape == (2, 8)  # (B, T): the profile's T, not given again
    (tmp_path / "tokens16.py").write_text(TOKENS16)
    data = f"{tmp_path / 'tokens16.py'}:dataset"
    with pytest.raises(SpecError, match=f"--data {data}: samples of 16 tokens, but the plan's profile was measured "
                                        "at 8; re-profile"):
        build_train_datasets(plan, source, TrainConfig(data=DataConfig(data)))


# --- an hf model's built-in data ----------------------------------------------------------------------

@pytest.mark.slow  # traces a transformers model
def test_an_hf_model_without_data_trains_on_the_shipped_text_tokenized_by_its_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from hetrain.data.text import load_text_corpus

    model = hf_dir(tmp_path)
    with pytest.raises(SpecError, match=r"no --data, and no .*tokenizer.json to tokenize the built-in Shakespeare "
                                        r"text with; give --data tokens:FILE.bin or text:FILE"):
        build_model_datasets(resolve_model(model), None, seq_len=16)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([load_text_corpus()[:20_000]],
                            tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "gpt2" / "tokenizer.json"))
    name, (train, val) = build_model_datasets(resolve_model(model), None, seq_len=16)
    assert name.startswith("shakespeare") and val is not None
    x, y = train.take(torch.tensor([0]))
    assert x.shape == (1, 16) and int(x.max()) < VOCAB
    assert x[0].tolist() == tok.encode(load_text_corpus()).ids[:16] and torch.equal(x[0, 1:], y[0, :-1])


def test_a_gpt_models_built_in_text_is_cut_at_a_shorter_seq_len() -> None:
    name, (train, _) = build_model_datasets(resolve_model("gpt-tiny"), None, seq_len=16)
    assert name == "shakespeare" and train.take(torch.tensor([0]))[0].shape == (1, 16)

"""``--model hf:DIR``: config.json values that transformers accepts in silence are refused in one line naming the
file, the key and the value; config.json files as the Hub publishes them (bookkeeping and legacy keys) still load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hetrain.cli import main
from hetrain.models.spec import SpecError
from hetrain.models.user import resolve_model

# openai-community/gpt2's config.json, every key as published, the sizes made tiny
GPT2_HUB = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 255,
    "embd_pdrop": 0.1, "eos_token_id": 255, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 64, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 64,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 256,
}
# meta-llama/Llama-3.2-1B's config.json, every key as published (written by transformers 4.45), the sizes tiny
LLAMA_HUB = {
    "_name_or_path": "meta-llama/Llama-3.2-1B", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 254, "eos_token_id": 255, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 64,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 32, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 256,
}
# Qwen/Qwen2-0.5B's config.json, every key as published, the sizes tiny
QWEN2_HUB = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 255, "eos_token_id": 255,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "max_position_embeddings": 64, "max_window_layers": 2, "model_type": "qwen2", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 64, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 256,
}
HUB = {"gpt2": GPT2_HUB, "llama": LLAMA_HUB, "qwen2": QWEN2_HUB}


def model_dir(tmp_path: Path, config: dict[str, Any]) -> tuple[str, Path]:
    """A model directory holding just ``config`` as config.json: (``hf:DIR``, the file)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return f"hf:{d}", d / "config.json"


@pytest.mark.parametrize("name", sorted(HUB))
@pytest.mark.slow  # traces a transformers model
def test_a_config_as_the_hub_publishes_it_loads(tmp_path: Path, name: str) -> None:
    spec, _ = model_dir(tmp_path, HUB[name])
    source = resolve_model(spec)
    assert source.layer_names == ("embed", "block1", "block2", "head")


@pytest.mark.parametrize(("base", "key", "value"), [
    (GPT2_HUB, "n_layer", -2),  # transformers builds no block at all: embed and head only
    (GPT2_HUB, "n_layer", 0),
    (LLAMA_HUB, "num_hidden_layers", -1),
    (LLAMA_HUB, "num_hidden_layers", 1.5),
    (GPT2_HUB, "n_head", 0),
])
def test_a_count_below_one_is_refused_naming_the_file_the_key_and_the_value(tmp_path: Path, base: dict[str, Any],
                                                                            key: str, value: Any) -> None:
    spec, file = model_dir(tmp_path, {**base, key: value})
    with pytest.raises(SpecError) as info:
        resolve_model(spec)
    message = str(info.value)
    assert f"{file}: {key} is {json.dumps(value)}; it must be a whole number >= 1" in message, message


@pytest.mark.parametrize(("base", "drop", "typo", "meant", "default"), [
    (GPT2_HUB, "n_layer", "n_layers", "n_layer", 12),  # transformers would build its default of 12 blocks
    (GPT2_HUB, "n_embd", "n_embed", "n_embd", 768),
    (LLAMA_HUB, "num_hidden_layers", "num_hidden_layer", "num_hidden_layers", 32),
    (LLAMA_HUB, "num_hidden_layers", "n_layer", "num_hidden_layers", 32),  # GPT-2's name in a Llama config
])
def test_a_misspelt_key_is_refused_with_the_field_it_meant(tmp_path: Path, base: dict[str, Any], drop: str,
                                                           typo: str, meant: str, default: int) -> None:
    config = {k: v for k, v in base.items() if k != drop} | {typo: 2}
    spec, file = model_dir(tmp_path, config)
    with pytest.raises(SpecError) as info:
        resolve_model(spec)
    message = str(info.value)
    assert f"{file}: unknown key {typo!r} (2); did you mean {meant!r}?" in message, message
    assert f"build {meant} = {default}" in message, message


def test_hetrain_profile_refuses_a_misspelt_layer_count_in_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = {k: v for k, v in GPT2_HUB.items() if k != "n_layer"} | {"n_layers": 2}
    spec, file = model_dir(tmp_path, config)
    capsys.readouterr()
    code = main(["profile", "--model", spec, "--seq-len", "8", "--micro-batch", "1", "-o", str(tmp_path / "p.json")])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert code == 2 and "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith(f"hetrain profile: error: --model {spec}: {file}: unknown key 'n_layers'"), lines[0]

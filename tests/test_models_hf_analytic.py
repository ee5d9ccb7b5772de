"""Analytic profiles from a transformers config.json (``hetrain.models.hf_analytic``): parameters equal to the
real model's, total and per cut layer; FLOPs against 6N; saved bytes against Korthikanti's formula; TP splits;
bad configs refused in one line naming the file, the field and the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetrain.models.analytic import PARAM_BYTES, gpt_block_saved_bytes, gpt_block_tp_split
from hetrain.models.hf_analytic import (
    HF_FAMILIES,
    block_flops,
    block_params,
    block_saved_bytes,
    build_hf_profile,
    hf_param_count,
    read_hf_shape,
)
from hetrain.models.spec import SpecError
from hf_families import FAMILIES

ANALYTIC = [f for f in FAMILIES if FAMILIES[f]["model_type"] in HF_FAMILIES]
# variants whose options change the parameters: each against transformers' own model
VARIANTS: dict[str, dict[str, Any]] = {
    "llama-bias": {**FAMILIES["llama"], "attention_bias": True, "mlp_bias": True, "head_dim": 16},
    "llama-mha": {k: v for k, v in FAMILIES["llama"].items() if k != "num_key_value_heads"},
    "qwen2-window": {**FAMILIES["qwen2"], "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gpt_neox-serial": {**FAMILIES["gpt_neox"], "use_parallel_residual": False, "attention_bias": False},
    "opt-projected": {**FAMILIES["opt"], "word_embed_proj_dim": 16, "enable_bias": False,
                      "do_layer_norm_before": False},
    "gpt2-inner": {**FAMILIES["gpt2"], "n_inner": 48, "tie_word_embeddings": False},
}

# Touvron et al. 2023, "Llama 2", table 1 and the published config.json of Llama-2-70b-hf
LLAMA2_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def param_count(layer: Any) -> int:
    return round(layer.param_bytes / PARAM_BYTES)


def _real_layers(model: Any) -> list[int]:
    """Parameters per cut layer of a transformers model, grouped by name: a block is ``...layers.{k}.`` (``h.{k}``
    for GPT-2); the head is the LM head, the final norm and OPT's project_out; the embed the rest. A tied table
    is counted in both, as the cut's layers each hold a copy."""
    n = model.config.num_hidden_layers
    counts = [0] * (n + 2)
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        index = next((int(parts[i + 1]) for i, part in enumerate(parts[:-1]) if part in ("layers", "h")), None)
        if index is not None:
            counts[index + 1] += p.numel()
        elif parts[0] == "lm_head" or any(w in name for w in ("final_layer_norm", "ln_f", "project_out", ".norm.")):
            counts[-1] += p.numel()
        else:
            counts[0] += p.numel()
    return counts


@pytest.mark.parametrize("name", [*ANALYTIC, *VARIANTS])
def test_parameters_equal_the_transformers_model_in_total_and_per_layer(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = FAMILIES.get(name) or VARIANTS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    profile = build_hf_profile(raw, seq_len=8)
    assert hf_param_count(read_hf_shape(raw)) == model.num_parameters()
    assert [param_count(layer) for layer in profile.layers] == _real_layers(model)


@pytest.mark.slow  # traces each family
@pytest.mark.parametrize("name", ANALYTIC)
def test_layers_line_up_with_the_cut_of_the_same_config(name: str, tmp_path: Path) -> None:
    """Names and parameters of the analytic layers are those of hetrain's traced cut (what a measured profile
    records), the tied copy included."""
    pytest.importorskip("transformers")
    from hetrain.models.layers import param_bytes
    from hetrain.models.user import resolve_model

    (tmp_path / "config.json").write_text(json.dumps(FAMILIES[name]))
    source = resolve_model(f"hf:{tmp_path}")
    profile = build_hf_profile(f"hf:{tmp_path}", seq_len=8)
    assert tuple(layer.name for layer in profile.layers) == source.layer_names
    assert [layer.param_bytes for layer in profile.layers] == [param_bytes(m) for m in source.build_layers(seed=0)]


def test_a_gpt2_config_gives_korthikanti_and_megatron_figures() -> None:
    """GPT-2 shapes, eager attention with dropout: Korthikanti et al. 2022 sec. 4.1, ``s h (34 + 5 a s / h)`` at
    16 bits, and the TP split of ``gpt_block_tp_split``; FLOPs ``24 s h^2 + 4 s^2 h``."""
    raw = {"model_type": "gpt2", "n_embd": 1600, "n_layer": 2, "n_head": 25, "n_positions": 1024, "vocab_size": 50257}
    s, h, a = 1024, 1600, 25
    block = build_hf_profile(raw, precision="fp16", attention="eager").layers[1]
    assert block.saved_bytes_per_sample == s * h * (34 + 5 * a * s / h)
    assert block.saved_bytes_per_sample == gpt_block_saved_bytes(h, a, s, 2)
    assert block.forward_flops_per_sample == 24 * s * h * h + 4 * s * s * h
    # GPT-2's blocks have no TP rule in the runtime (a fused Conv1D): the profile gives them no split, so no plan
    # puts them on a TP group; the split figures of its shape are still Megatron's
    assert block.tp is None
    megatron = gpt_block_tp_split(h, a, s, 2)
    shape = read_hf_shape(raw, "config.json")
    _, split_params = block_params(shape)
    _, split_saved = block_saved_bytes(shape, s, 2, "eager")
    assert split_saved == megatron.split_saved_bytes_per_sample
    # megatron's 12h^2 + 7h of the 12h^2 + 13h: the row-parallel biases (2h) and the two LayerNorms (4h) whole
    assert split_params * PARAM_BYTES == megatron.split_param_bytes == (12 * h * h + 7 * h) * PARAM_BYTES


def test_llama2_70b_parameters_and_flops_follow_the_published_figures() -> None:
    """68.98e9 parameters (Touvron et al. 2023 call it 70B); forward + backward ``6 N`` FLOPs per token for the
    matmul parameters plus the attention's ``12 L s a d`` (Kaplan et al. 2020, sec. 2.1, the full ``s x s``)."""
    shape = read_hf_shape(LLAMA2_70B)
    n = hf_param_count(shape)
    assert n == pytest.approx(68.98e9, rel=1e-3)
    s, L, h, V = 4096, 80, 8192, 32000
    profile = build_hf_profile(LLAMA2_70B)
    matmul_params = n - V * h - (2 * L + 1) * h  # all but the token table and the RMSNorms
    train_flops_per_token = 3 * sum(layer.forward_flops_per_sample for layer in profile.layers) / s
    assert train_flops_per_token == 6 * matmul_params + 12 * L * s * h
    assert 1.0 < train_flops_per_token / (6 * n) < 1.1  # the 6N rule, and the attention's few percent on top


def test_gqa_swiglu_block_by_hand() -> None:
    """A Llama-2-70B block: Q and O ``h x h``, K and V ``h x h/8`` (8 KV heads of 64), SwiGLU ``3 h I``; TP splits
    all but the two RMSNorms; fused attention keeps the row log-sum-exp, not the scores."""
    s, h, inner, e = 4096, 8192, 28672, 2
    block = build_hf_profile(LLAMA2_70B).layers[1]
    params = 2 * h * h + 2 * h * 1024 + 3 * h * inner + 2 * h
    assert param_count(block) == params
    assert block.tp is not None and block.tp.split_param_bytes == (params - 2 * h) * PARAM_BYTES
    assert block.saved_bytes_per_sample == s * e * (4 * h + 2 * h + 2 * 1024 + 4 * inner) + 64 * s * 4
    assert block.tp.split_saved_bytes_per_sample == block.saved_bytes_per_sample - 4 * s * h * e
    assert block.tp.allreduce_bytes_per_sample == 2 * s * h * e and block.tp.allreduces == 2


def test_a_sliding_window_bounds_the_attention_flops() -> None:
    shape = read_hf_shape({**FAMILIES["mistral"], "sliding_window": 16, "max_position_embeddings": 4096})
    full = read_hf_shape({**FAMILIES["mistral"], "sliding_window": None, "max_position_embeddings": 4096})
    q = shape.heads * shape.head_dim
    assert block_flops(shape, 64, 16) == block_flops(full, 64, None) - 4 * 64 * (64 - 16) * q
    windowed = build_hf_profile({**FAMILIES["mistral"], "sliding_window": 16, "max_position_embeddings": 4096},
                                seq_len=64)
    assert windowed.layers[1].forward_flops_per_sample == block_flops(shape, 64, 16)
    assert shape.windows == (16, 16) and full.windows == (None, None)
    assert read_hf_shape(VARIANTS["qwen2-window"]).windows == (None, 4)  # from max_window_layers on


def test_parallel_residual_keeps_one_norm_input_and_gpt_neox_blocks_have_no_tp_split() -> None:
    parallel = build_hf_profile(FAMILIES["gpt_neox"], seq_len=8, precision="fp32").layers[1]
    serial = build_hf_profile(VARIANTS["gpt_neox-serial"], seq_len=8, precision="fp32").layers[1]
    assert parallel.tp is None and serial.tp is None  # the runtime has no TP rule for them: none is planned
    assert build_hf_profile(FAMILIES["llama"], seq_len=8, precision="fp32").layers[1].tp is not None
    assert serial.saved_bytes_per_sample - parallel.saved_bytes_per_sample == 8 * 32 * 4


def test_precision_sets_the_activation_bytes_not_the_parameters() -> None:
    fp32, bf16 = (build_hf_profile(FAMILIES["llama"], seq_len=8, precision=p) for p in ("fp32", "bf16"))
    assert fp32.param_bytes == bf16.param_bytes
    assert fp32.layers[1].output_bytes_per_sample == 2 * bf16.layers[1].output_bytes_per_sample == 8 * 32 * 4


def test_a_config_path_and_its_directory_give_the_same_profile(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    by_dir = build_hf_profile(f"hf:{tmp_path}")
    assert by_dir == build_hf_profile(tmp_path / "config.json") and by_dir.name == tmp_path.name
    assert by_dir.seq_len == 4096 and by_dir.num_layers == 82


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "t5"}, 'model_type is "t5"; hetrain\'s analytic profile knows llama'),
    ({"model_type": None}, "model_type is missing"),
    ({"hidden_size": None}, "hidden_size is missing; a llama config.json gives it"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; it must be a whole number >= 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads is 3; it must divide num_attention_heads (4)"),
    ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings is "yes"; it must be true or false'),
    ({"intermediate_size": 2.5}, "intermediate_size is 2.5; it must be a whole number >= 1"),
])
def test_a_bad_config_is_refused_naming_the_file_the_field_and_the_value(tmp_path: Path, change: dict[str, Any],
                                                                          message: str) -> None:
    raw = {k: v for k, v in {**FAMILIES["llama"], **change}.items() if v is not None}
    file = tmp_path / "config.json"
    file.write_text(json.dumps(raw))
    with pytest.raises(SpecError) as info:
        build_hf_profile(f"hf:{tmp_path}")
    text = str(info.value)
    assert text.startswith(f"{file}: ") and message in text and "\n" not in text, text


def test_an_unreadable_file_or_a_sequence_too_long_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"config\.json does not exist"):
        build_hf_profile(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(SpecError, match="is not a JSON object, got list"):
        build_hf_profile(tmp_path)
    with pytest.raises(SpecError, match=r"seq_len 65: the model takes 1 to 64 tokens per sample \(its n_positions\)"):
        build_hf_profile(FAMILIES["gpt2"], seq_len=65)

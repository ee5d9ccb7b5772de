"""Which layers a TP stage splits (``hetrain.runtime.tp``): the reference GPT block by its rule, its embedding and
head whole; a Llama-style transformers block in its module form (``hetrain.models.hf_blocks``), checked against its
traced layer, the model's embedding and head whole; any other layer type (GPT-2's block, a user's modules) refused
in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hetrain.models.hf_blocks import FORM_CLASSES, BlockModule, ModuleForm, check_form
from hetrain.models.registry import build_layers
from hetrain.models.spec import SpecError
from hetrain.models.user import ModelSource, resolve_model
from hetrain.runtime.tp import RULES, WHOLE, TPError, block_type, check_rules, tp_stage_layers
from hf_families import FAMILIES


def test_the_reference_gpt_has_a_rule_for_its_blocks_and_keeps_the_rest_whole() -> None:
    layers = build_layers("gpt-tiny", seed=0, hidden=32, heads=2, seq_len=16)
    kinds = [block_type(layer) for layer in layers]
    assert kinds[0] in WHOLE and kinds[-1] in WHOLE and all(k in RULES for k in kinds[1:-1])
    check_rules(dict(enumerate(layers)), [f"l{i}" for i in range(len(layers))], "stage 0 of VW0", 2)


def _hf(family: str, tmp_path: Path, **changes: object) -> ModelSource:
    pytest.importorskip("transformers")
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**FAMILIES[family], **changes}))
    return resolve_model(f"hf:{d}")


@pytest.mark.slow  # traces each model (seconds)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_llama_style_block_runs_in_a_tp_stage_in_its_module_form_equal_to_its_trace(family: str,
                                                                                    tmp_path: Path) -> None:
    source = _hf(family, tmp_path)
    traced = source.build_layers(seed=3)
    names = list(source.layer_names)
    check_rules(dict(enumerate(traced)), names, "stage 0 of VW0", 2)  # embed and head whole, blocks by their form
    layers = tp_stage_layers(traced, 0, names, "stage 0 of VW0", 2)
    assert layers[0] is traced[0] and layers[-1] is traced[-1]
    for k in (1, 2):
        form = layers[k]
        assert isinstance(form, BlockModule) and block_type(form) in RULES and block_type(form) in FORM_CLASSES
        # the same parameter objects under the same names: checkpoints, sync and clipping see the layer unchanged
        assert dict(form.named_parameters()) == dict(traced[k].named_parameters())
        check_form(form, traced[k], f"block {k}", rtol=1e-6)
        rule = RULES[block_type(form)](form, 2)
        assert f"model.layers.{k - 1}.self_attn.q_proj" in rule and f"model.layers.{k - 1}.mlp.down_proj" in rule


@pytest.mark.slow
def test_a_module_form_whose_tuple_mapping_is_wrong_is_refused(tmp_path: Path) -> None:
    source = _hf("llama", tmp_path)
    traced = source.build_layers(1, 2, seed=0)[0]
    tp_form = traced.tp_form
    assert isinstance(tp_form, ModuleForm)
    wrong = dataclasses.replace(tp_form.form, cos=tp_form.form.sin, sin=tp_form.form.cos)  # cos and sin swapped
    with pytest.raises(SpecError, match=r"^cannot run hf:.* block 1 \(LlamaDecoderLayer\) as TP: its module form "
                                        r"differs from the traced forward by [0-9.e+-]+ \(of outputs up to .*\)$"):
        ModuleForm(tp_form.decoder, wrong, tp_form.what).build(traced)
    with pytest.raises(SpecError, match=r"holds other parameters than the traced layer"):  # another block's layer
        ModuleForm(source.build_layers(2, 3, seed=0)[0].tp_form.decoder, tp_form.form, tp_form.what).build(traced)


@pytest.mark.slow
def test_a_tp_degree_that_does_not_divide_the_key_value_heads_is_refused(tmp_path: Path) -> None:
    source = _hf("llama", tmp_path)  # 4 attention heads, 2 key-value heads
    form = tp_stage_layers(source.build_layers(1, 2, seed=0), 1, list(source.layer_names), "stage 0 of VW0", 4)[0]
    with pytest.raises(TPError, match=r"^a LlamaDecoderLayer block has 2 key-value heads, which TP 4 cannot split "
                                      r"evenly; plan with a TP degree that divides 2 \(--max-tp\)$"):
        RULES[block_type(form)](form, 4)


@pytest.mark.slow  # traces the model (seconds)
def test_a_gpt2_block_in_a_tp_stage_is_refused_by_name(tmp_path: Path) -> None:
    source = _hf("gpt2", tmp_path)
    layers = dict(enumerate(source.build_layers(1, 2, seed=0), start=1))
    with pytest.raises(TPError, match=r"^stage 1 of VW0 runs TP 2, but its layer 1 \(block1\) cannot run as TP: it "
                                      r"is a GPT2Block, which has no module form \(forms: LlamaDecoderLayer, "
                                      r"MistralDecoderLayer, Qwen2DecoderLayer\); plan with --max-tp 1$"):
        check_rules(layers, list(source.layer_names), "stage 1 of VW0", 2)


def test_a_user_layer_without_a_rule_is_refused_by_its_type() -> None:
    layers = dict(enumerate(build_layers("mlp-digits", seed=0)))
    with pytest.raises(TPError, match=r"^stage 0 of VW1 runs TP 4, but its layer 0 \(fc0\) is a \w+, which has "
                                      r"no TP rule"):
        check_rules(layers, ["fc0", "fc1", "fc2"], "stage 0 of VW1", 4)

"""Which layers a TP stage splits (``hetrain.runtime.tp``): the reference GPT block by its rule, its embedding and
head whole; any other layer type (a Hugging Face model's traced layers, a user's modules) refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.models.registry import build_layers
from hetrain.models.user import resolve_model
from hetrain.runtime.tp import RULES, WHOLE, TPError, block_type, check_rules
from hf_families import FAMILIES


def test_the_reference_gpt_has_a_rule_for_its_blocks_and_keeps_the_rest_whole() -> None:
    layers = build_layers("gpt-tiny", seed=0, hidden=32, heads=2, seq_len=16)
    kinds = [block_type(layer) for layer in layers]
    assert kinds[0] in WHOLE and kinds[-1] in WHOLE and all(k in RULES for k in kinds[1:-1])
    check_rules(dict(enumerate(layers)), [f"l{i}" for i in range(len(layers))], "stage 0 of VW0", 2)


@pytest.mark.slow  # traces each model (seconds)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_traced_hf_block_in_a_tp_stage_is_refused_by_name(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(FAMILIES[family]))
    source = resolve_model(f"hf:{d}")
    layers = dict(enumerate(source.build_layers(1, 2, seed=0), start=1))
    with pytest.raises(TPError, match=r"^stage 1 of VW0 runs TP 2, but its layer 1 \(block1\) is a TracedLayer "
                                      r"\(a traced graph .*\), which has no TP rule \(rules: Block\); "
                                      r"plan with --max-tp 1$"):
        check_rules(layers, list(source.layer_names), "stage 1 of VW0", 2)


def test_a_user_layer_without_a_rule_is_refused_by_its_type() -> None:
    layers = dict(enumerate(build_layers("mlp-digits", seed=0)))
    with pytest.raises(TPError, match=r"^stage 0 of VW1 runs TP 4, but its layer 0 \(fc0\) is a \w+, which has "
                                      r"no TP rule"):
        check_rules(layers, ["fc0", "fc1", "fc2"], "stage 0 of VW1", 4)

"""Analytic model profiles: parameter counts, FLOPs, saved bytes, registry, errors, roofline times."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from hetrain.cluster import Device, parse_cluster
from hetrain.cost import estimate_layer_times
from hetrain.models.analytic import (
    MODEL_NAMES,
    PARAM_BYTES,
    UnknownModelError,
    build_gpt_profile,
    build_mlp_profile,
    build_profile,
    build_resnet_profile,
    build_vgg19_profile,
    gpt_block_flops,
    gpt_block_saved_bytes,
)
from hetrain.profile import ModelProfile, parse_profile

# Published parameter counts (torchvision model cards; GPT-2 counted exactly,
# with the LM head tied to the token embedding as released).
KNOWN_PARAMS = {
    "gpt2-small": 124.4e6,
    "gpt2-medium": 354.8e6,
    "gpt2-large": 774.0e6,
    "gpt2-xl": 1557.6e6,
    "vgg19": 143.7e6,
    "resnet50": 25.6e6,
    "resnet101": 44.5e6,
    "resnet152": 60.2e6,
}


def param_count(p: ModelProfile) -> float:
    return p.param_bytes / PARAM_BYTES  # parameters are counted in fp32 whatever the precision of compute


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS))
def test_param_counts_match_published(name: str) -> None:
    # published GPT-2 sizes count the tied LM head once; the presets give the head its own copy
    tied = {"tie_embeddings": True} if name.startswith("gpt2") else {}
    assert param_count(build_profile(name, **tied)) == pytest.approx(KNOWN_PARAMS[name], rel=0.02)


# Touvron et al. 2023 table 1 (7B, 13B), as the published Llama-2 checkpoints count them; Brown et al. 2020
# table 2.1 (GPT-3 2.7B, its head tied)
BIG_PRESETS = {"llama2-7b": 6.74e9, "llama2-13b": 13.02e9, "gpt-2.7b": 2.65e9}


@pytest.mark.parametrize("name", sorted(BIG_PRESETS))
def test_big_presets_have_their_published_sizes(name: str) -> None:
    assert param_count(build_profile(name)) == pytest.approx(BIG_PRESETS[name], rel=0.01)


def test_llama2_presets_are_read_as_a_config_json_is() -> None:
    from hetrain.models.analytic import LLAMA2_7B_CONFIG
    from hetrain.models.hf_analytic import build_hf_profile

    preset = build_profile("llama2-7b", seq_len=1024)
    assert preset == build_hf_profile(LLAMA2_7B_CONFIG, seq_len=1024, name="llama2-7b")
    assert [layer.name for layer in preset.layers[:2]] == ["embed", "block1"] and preset.num_layers == 34
    assert preset.precision == "bf16" and all(layer.tp is not None for layer in preset.layers[1:-1])
    # Llama-2-7B exactly: 2 V h + L (4 h^2 + 3 h I + 2 h) + h
    h, inner = 4096, 11008
    assert param_count(preset) == 2 * 32000 * h + 32 * (4 * h * h + 3 * h * inner + 2 * h) + h == 6_738_415_616


def test_exact_param_counts() -> None:
    # GPT-2 small: V h + s h + 12 (12 h^2 + 13 h) + 2 h, with V=50257, s=1024, h=768.
    assert param_count(build_profile("gpt2-small", tie_embeddings=True)) == 124_439_808
    # the preset is untied, as the model hetrain trains: its head holds a V x h matrix of its own
    assert param_count(build_profile("gpt2-small")) == 124_439_808 + 50257 * 768
    assert param_count(build_vgg19_profile()) == 143_667_240
    assert param_count(build_vgg19_profile(batch_norm=True)) == 143_667_240 + 2 * 5504  # 2 per BN channel
    assert param_count(build_resnet_profile(50)) == 25_557_032
    assert param_count(build_resnet_profile(152)) == 60_192_808


def test_untied_head_adds_the_vocab_matrix() -> None:
    tied = build_gpt_profile(2, 64, 4, 32, 100, precision="fp32", tie_embeddings=True)
    untied = build_gpt_profile(2, 64, 4, 32, 100, precision="fp32", tie_embeddings=False)
    assert untied.param_bytes - tied.param_bytes == 100 * 64 * 4
    assert untied.layers[-1].param_bytes == (2 * 64 + 100 * 64) * 4


def test_gpt_tiny_matches_the_cpu_model_layout() -> None:
    p = build_profile("gpt-tiny")
    assert [layer.name for layer in p.layers] == ["embed", "block0", "block1", "block2", "block3", "head"]
    assert p.precision == "fp32"
    h, s, V = 128, 64, 96
    assert p.layers[0].param_bytes == (V * h + s * h) * 4  # token + position tables
    assert p.layers[1].param_bytes == (12 * h * h + 13 * h) * 4
    assert p.layers[-1].param_bytes == (2 * h + h * V) * 4  # final LN + untied head, no bias
    assert p.input_bytes_per_sample == s * 8


def test_gpt_block_flops_hand_computed() -> None:
    # GPT-2 medium block, s = 1024, h = 1024:
    # 24 s h^2 = 24 * 2^30 = 25_769_803_776; 4 s^2 h = 4 * 2^30 = 4_294_967_296.
    assert gpt_block_flops(1024, 1024) == 30_064_771_072
    p = build_profile("gpt2-medium")
    assert p.layers[1].forward_flops_per_sample == 30_064_771_072
    # head: 2 s h V
    assert p.layers[-1].forward_flops_per_sample == 2 * 1024 * 1024 * 50257
    # small block by hand: s=4, h=8 -> 24*4*64 + 4*16*8 = 6144 + 512
    assert gpt_block_flops(8, 4) == 6656


def test_gpt_saved_bytes_korthikanti() -> None:
    s, h, a = 1024, 768, 12
    # 16-bit: s h (34 + 5 a s / h)
    assert gpt_block_saved_bytes(h, a, s, 2) == pytest.approx(s * h * (34 + 5 * a * s / h))
    # fp32: s h (66 + 9 a s / h)
    assert gpt_block_saved_bytes(h, a, s, 4) == pytest.approx(s * h * (66 + 9 * a * s / h))
    fp16 = build_profile("gpt2-small")
    fp32 = build_profile("gpt2-small", precision="fp32")
    assert fp16.layers[1].saved_bytes_per_sample < fp32.layers[1].saved_bytes_per_sample


def test_saved_bytes_positive_and_ordered() -> None:
    for name in MODEL_NAMES:
        for layer in build_profile(name).layers:
            assert layer.saved_bytes_per_sample > 0, (name, layer.name)
            assert layer.forward_flops_per_sample >= 0
    # longer sequences keep more per block (the s^2 term grows faster than s)
    short = build_profile("gpt2-small", seq_len=512).layers[1].saved_bytes_per_sample
    long = build_profile("gpt2-small", seq_len=1024).layers[1].saved_bytes_per_sample
    assert long > 2 * short
    # the embedding keeps only token ids, far less than a block
    gpt = build_profile("gpt2-small")
    assert gpt.layers[0].saved_bytes_per_sample < gpt.layers[1].saved_bytes_per_sample
    # convnets: early, high-resolution layers keep far more than the classifier
    vgg = build_vgg19_profile()
    assert vgg.layers[0].saved_bytes_per_sample > vgg.layers[-1].saved_bytes_per_sample
    assert build_vgg19_profile(batch_norm=True).layers[0].saved_bytes_per_sample > vgg.layers[0].saved_bytes_per_sample
    r = build_resnet_profile(50)
    saved = [layer.saved_bytes_per_sample for layer in r.layers]
    assert saved[1] > saved[-2] > saved[-1]


def test_convnet_shapes_and_flops() -> None:
    vgg = build_vgg19_profile()
    assert vgg.num_layers == 19
    # conv1_1: 2 * 3*3*3*64 * 224*224
    assert vgg.layers[0].forward_flops_per_sample == 2 * 9 * 3 * 64 * 224 * 224
    assert vgg.layers[1].output_bytes_per_sample == 64 * 112 * 112 * 4  # pooled after conv1_2
    assert vgg.layers[-1].output_bytes_per_sample == 1000 * 4
    # ~19.6 GMACs (Simonyan & Zisserman) -> ~39.3 GFLOPs; ResNet-50 ~4.1 GMACs; -152 ~11.5
    assert sum(layer.forward_flops_per_sample for layer in vgg.layers) == pytest.approx(39.3e9, rel=0.02)
    r50 = build_resnet_profile(50)
    assert sum(layer.forward_flops_per_sample for layer in r50.layers) == pytest.approx(8.2e9, rel=0.03)
    r152 = build_resnet_profile(152)
    assert sum(layer.forward_flops_per_sample for layer in r152.layers) == pytest.approx(23.0e9, rel=0.03)
    assert r50.num_layers == 1 + 16 + 1 and r152.num_layers == 1 + 50 + 1
    assert r50.layers[1].name == "layer1.0" and r50.layers[-1].name == "head"
    assert r50.layers[-2].output_bytes_per_sample == 2048 * 7 * 7 * 4


def test_mlp() -> None:
    p = build_mlp_profile([10, 20, 5])
    assert [layer.param_bytes for layer in p.layers] == [(10 * 20 + 20) * 4, (20 * 5 + 5) * 4]
    assert [layer.forward_flops_per_sample for layer in p.layers] == [400, 200]
    assert p.input_bytes_per_sample == 40


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_registry_builds_and_round_trips(name: str) -> None:
    p = build_profile(name)
    assert p.name == name
    assert 0 < p.compute_efficiency <= 1
    again = parse_profile(json.loads(json.dumps(p.to_dict())))
    assert again == p


def test_registry_overrides() -> None:
    p = build_profile("gpt2-small", seq_len=128, precision="bf16", compute_efficiency=0.3)
    assert p.input_bytes_per_sample == 128 * 8
    assert (p.precision, p.compute_efficiency) == ("bf16", 0.3)
    assert build_profile("GPT2-Small").name == "gpt2-small"
    assert build_profile("resnet50", image_size=112).layers[-2].output_bytes_per_sample == 2048 * 4 * 4 * 4


def test_unknown_model_suggests_near_names() -> None:
    with pytest.raises(UnknownModelError, match=r"unknown model 'gpt2-smal' \(did you mean 'gpt2-small'") as info:
        build_profile("gpt2-smal")
    assert "resnet152" in str(info.value)  # lists the known names
    with pytest.raises(KeyError, match="; known models: gpt-tiny"):
        build_profile("alexnet")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: build_gpt_profile(12, 768, 7, 1024, 50257), r"heads \(7\) must divide hidden \(768\)"),
        (lambda: build_gpt_profile(0, 768, 12, 1024, 50257), "num_layers must be a positive integer, got 0"),
        (lambda: build_gpt_profile(2, 64, 4, -5, 100), "seq_len must be a positive integer, got -5"),
        (lambda: build_gpt_profile(2, 64, 4, 32, 100, precision="int8"),  # type: ignore[arg-type]
         "precision must be one of .* 'int8'"),
        (lambda: build_gpt_profile(2, 64, 4, 32, 100, compute_efficiency=1.5), r"compute_efficiency .* 1\.5"),
        (lambda: build_resnet_profile(34), "depth must be one of .* got 34"),
        (lambda: build_resnet_profile(50, image_size=16), "image_size must be >= 32 .* got 16"),
        (lambda: build_vgg19_profile(num_classes=0), "num_classes must be a positive integer, got 0"),
        (lambda: build_mlp_profile([10]), "sizes needs at least 2 entries"),
        (lambda: build_mlp_profile([10, 0, 3]), r"sizes\[1\] must be a positive integer, got 0"),
        (lambda: build_profile("gpt2-small", hiden=10), "takes no option 'hiden'; its options: num_layers, hidden"),
        (lambda: build_profile("gpt2-small", heads=5), r"heads \(5\) must divide hidden \(768\)"),
    ],
)
def test_bad_input_is_named(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture(scope="module")
def a100() -> Device:
    return parse_cluster({"node": [{"name": "n", "devices": ["A100-40GB"]}]}).devices[0]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_roofline_times_positive(name: str, a100: Device) -> None:
    fwd, bwd = estimate_layer_times(build_profile(name), a100, 2)
    assert np.all(fwd > 0) and np.all(bwd > 0)
    assert np.all(bwd >= fwd)


def test_gpt2_medium_forward_on_a100_is_plausible(a100: Device) -> None:
    # ~0.83 TFLOP for one 1024-token sample; at 0.45 x 312 TFLOP/s fp16 that is ~6 ms.
    # Measured GPT-2 medium forward passes on an A100 take a few to a few tens of ms.
    fwd, bwd = estimate_layer_times(build_profile("gpt2-medium"), a100, 1)
    assert 3e-3 < float(fwd.sum()) < 50e-3
    assert float(bwd.sum()) == pytest.approx(2 * float(fwd.sum()), rel=0.1)
    # compute-bound blocks: time grows linearly with the micro-batch
    fwd8, _ = estimate_layer_times(build_profile("gpt2-medium"), a100, 8)
    assert float(fwd8[1]) == pytest.approx(8 * float(fwd[1]), rel=0.01)

"""Reference models as layer lists: global layer identity, composition, losses, shapes."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hetrain.models.layers import LayerRange, build_seeded, layer_seed, named_parameters_global, run_layers
from hetrain.models.registry import (
    build_layers,
    get_spec,
    input_shape,
    layer_names,
    loss_fn,
    model_names,
    num_layers,
    sample_batch,
)

# Small enough to build whole in a few milliseconds; the GPT-2 preset shrunk by overrides.
SMALL = {
    "gpt-tiny": {},
    "gpt2-small": {"n_blocks": 3, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 50},
    "resnet-digits": {},
    "vgg-digits": {},
    "mlp-digits": {},
    "resnet18-cifar": {"widths": [8, 16], "blocks": [1, 2], "image_size": 8},
    "vgg11-cifar": {"convs": [8, "M", 16, 16, "M"], "fcs": [32], "image_size": 8},
    "resnet50": {"widths": [4, 8], "blocks": [1, 2], "image_size": 16, "classes": 7},  # bottleneck, BatchNorm
    "mlp": {"hidden": [16, 8], "input_shape": [3, 4]},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread is faster, and immune to a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", sorted(SMALL))
def test_any_layer_range_has_the_full_models_weights(name: str) -> None:
    config = SMALL[name]
    full = build_layers(name, seed=7, **config)
    n = len(full)
    assert n == num_layers(name, **config) == len(layer_names(name, **config))
    for first, end in [(0, 1), (1, n - 1), (n // 2, n), (n - 1, n)]:
        part = build_layers(name, first, end, seed=7, **config)
        assert len(part) == end - first
        for k, layer in enumerate(part):
            _assert_same_weights(layer, full[first + k])


def test_gpt2_small_preset_layers_are_built_alone() -> None:
    """Block 3 of the real GPT-2 small preset, built alone and with its neighbour: same weights."""
    alone = build_layers("gpt2-small", 4, 5, seed=3)[0]
    with_neighbour = build_layers("gpt2-small", 3, 5, seed=3)[1]
    _assert_same_weights(alone, with_neighbour)
    # One GPT-2 block holds 12·C² + 13·C parameters (C = 768): 7,087,872.
    assert sum(p.numel() for p in alone.parameters()) == 12 * 768**2 + 13 * 768


def test_presets_layer_counts() -> None:
    expected = {"gpt-tiny": 6, "gpt2-small": 14, "gpt2-medium": 26, "gpt2-large": 38, "gpt2-xl": 50,
                "resnet-digits": 6, "resnet18-cifar": 10, "vgg-digits": 6, "vgg11-cifar": 11,
                "mlp-digits": 3, "mlp-cifar": 5, "vgg19": 19, "resnet50": 18, "resnet101": 35, "resnet152": 52,
                "mlp": 5}
    assert {name: num_layers(name) for name in model_names()} == expected
    assert layer_names("gpt2-small")[:2] == ["embed", "block0"]
    assert layer_names("gpt2-small")[-1] == "head"
    assert layer_names("vgg11-cifar") == ["conv1_1", "conv2_1", "conv3_1", "conv3_2", "conv4_1", "conv4_2",
                                          "conv5_1", "conv5_2", "fc6", "fc7", "fc8"]
    assert layer_names("resnet-digits") == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "head"]


@pytest.mark.parametrize(("name", "profile_options"), [
    ("gpt-tiny", {}),
    ("gpt2-small", {"precision": "fp32"}),
    ("vgg19", {}),
    ("resnet50", {}),
    ("resnet152", {}),
    ("mlp", {}),
])
def test_torch_models_match_the_analytic_profiles(name: str, profile_options: dict[str, object],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layers, same names, same parameter count per layer as hetrain.models.analytic."""
    from hetrain.models.analytic import build_profile

    profile = build_profile(name, **profile_options)
    assert profile.precision == "fp32"
    # Shapes only: build on the meta device (no memory), and skip normal_, whose first
    # call on meta tensors costs over a second of one-time set-up.
    monkeypatch.setattr(nn.init, "normal_", lambda tensor, *args, **kwargs: tensor)
    with torch.device("meta"):
        layers = build_layers(name)
    assert layer_names(name) == [layer.name for layer in profile.layers]
    assert [4 * sum(p.numel() for p in layer.parameters()) for layer in layers] == [
        layer.param_bytes for layer in profile.layers]


def test_seed_changes_weights_and_building_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_layers("mlp-digits", seed=0)
    b = build_layers("mlp-digits", seed=1)
    assert torch.equal(torch.rand(3), expected)
    assert not torch.equal(a[0][1].weight, b[0][1].weight)
    # Different layers of one model, and one layer of neighbouring seeds, get distinct seeds.
    assert len({layer_seed(s, k) for s in range(4) for k in range(4)}) == 16


@pytest.mark.parametrize("name", sorted(SMALL))
def test_layer_list_equals_monolithic_sequential(name: str) -> None:
    config = SMALL[name]
    layers = build_layers(name, seed=0, **config)
    x, y = sample_batch(name, 4, _generator(), **config)
    reference = nn.Sequential(*build_layers(name, seed=0, **config))(x)
    # Two stages of global layer ranges, one after the other.
    cut = len(layers) // 2
    stages = [LayerRange(layers[:cut], 0), LayerRange(layers[cut:], cut)]
    out = stages[1](stages[0](x))
    assert torch.equal(out, reference)
    assert torch.equal(run_layers(layers, x), reference)
    loss = loss_fn(name)(out, y)
    loss.backward()
    assert all(p.grad is not None for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-digits", "vgg-digits", "mlp-digits"])
def test_output_does_not_depend_on_micro_batching(name: str) -> None:
    """No BatchNorm, no dropout: a mini-batch cut into micro-batches gives the same outputs."""
    layers = build_layers(name, seed=0)
    x, _ = sample_batch(name, 6, _generator())
    whole = run_layers(layers, x)
    parts = torch.cat([run_layers(layers, part) for part in x.split([1, 2, 3])])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_stage_parameters_carry_global_layer_names() -> None:
    full = build_layers("mlp-digits", seed=0)
    stage = LayerRange(full[1:], first=1)
    assert sorted(stage.state_dict()) == ["layers.1.0.bias", "layers.1.0.weight",
                                          "layers.2.0.bias", "layers.2.0.weight"]
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in named_parameters_global(full[1:], 1)]
    assert len(stage) == 2 and stage[2] is full[2]
    with pytest.raises(IndexError, match=r"layer 0 is not in this stage's range \[1, 3\)"):
        stage[0]
    # A checkpoint of the whole model, filtered to a stage's names, loads into that stage.
    whole = LayerRange(build_layers("mlp-digits", seed=5), 0).state_dict()
    stage.load_state_dict({k: v for k, v in whole.items() if not k.startswith("layers.0.")})
    assert torch.equal(stage[1][0].weight, whole["layers.1.0.weight"])


class _Split(nn.Module):
    """Returns a tuple: two halves of the features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x).chunk(2, dim=1)


class _Mix(nn.Module):
    """Takes a tuple, returns a tuple (a residual pair)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return b, a + torch.tanh(self.linear(b))


class _Join(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.cat(pair, dim=1)


def test_tuple_passing_layers() -> None:
    def make(k: int) -> nn.Module:
        return _Split() if k == 0 else _Join() if k == 4 else _Mix()

    layers = [build_seeded(functools.partial(make, k), seed=0, index=k) for k in range(5)]
    x = torch.randn(5, 6, generator=_generator())
    reference = nn.Sequential(*layers)(x)
    for cut in range(1, 5):
        out = LayerRange(layers[cut:], cut)(LayerRange(layers[:cut], 0)(x))
        assert torch.equal(out, reference)
    # A stage may end on a tuple: that is what crosses the stage boundary.
    middle = LayerRange(layers[:2], 0)(x)
    assert isinstance(middle, tuple) and [t.shape for t in middle] == [(5, 3), (5, 3)]


def test_gpt_tiny_loss_starts_near_uniform() -> None:
    layers = build_layers("gpt-tiny", seed=0)
    x, y = sample_batch("gpt-tiny", 4, _generator())
    logits = run_layers(layers, x)
    assert logits.shape == (4, 64, 96)
    mean = loss_fn("gpt-tiny")(logits, y)
    assert abs(mean.item() - math.log(96)) < 0.2  # small initial weights: almost uniform predictions
    total = loss_fn("gpt-tiny", reduction="sum")(logits, y)
    torch.testing.assert_close(total, mean * 4 * 64)


def test_gpt_rejects_sequences_longer_than_seq_len() -> None:
    embedding = build_layers("gpt-tiny", 0, 1)[0]
    with pytest.raises(ValueError, match="65 tokens is longer than the model's seq_len 64"):
        embedding(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_sample_batch_shapes_dtypes_and_determinism(name: str) -> None:
    config = SMALL[name]
    x, y = sample_batch(name, 3, _generator(1), **config)
    x2, y2 = sample_batch(name, 3, _generator(1), **config)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (3, *input_shape(name, **config))
    spec = get_spec(name, **config)
    if spec.kind == "gpt":
        assert x.dtype == y.dtype == torch.int64 and y.shape == x.shape
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    else:
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.shape == (3,)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'.*; known models: gpt-tiny"):
        num_layers("gpt5")
    with pytest.raises(ValueError, match="has no setting width; its settings: heads, hidden"):
        num_layers("gpt-tiny", width=3)
    with pytest.raises(ValueError, match="hidden 130 is not divisible by heads 4"):
        num_layers("gpt-tiny", hidden=130)
    with pytest.raises(ValueError, match=r"\[4, 9\) is not a non-empty part of the 6 layers \[0, 6\) of 'gpt-tiny'"):
        build_layers("gpt-tiny", 4, 9)
    with pytest.raises(ValueError, match="image_size 8 is not divisible by 2\\^4"):
        num_layers("vgg-digits", convs=[4, "M", 4, "M", 4, "M", 4, "M"])
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        loss_fn("gpt-tiny", reduction="none")  # type: ignore[arg-type]


def test_a_python_file_without_its_function_is_told_the_spec() -> None:
    from hetrain.models.user import resolve_model

    with pytest.raises(ValueError, match=r"'net\.py': your own model is FILE\.py:FUNCTION.*net\.py:build"):
        resolve_model("net.py")

"""Layer profiler, profile merging and scaling, time-model fits, and the pure parts of discovery."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys

import pytest
import torch
from torch import nn

from hetrain.catalog import lookup_device_type
from hetrain.cluster import Device, parse_cluster
from hetrain.cost import estimate_layer_time
from hetrain.fit import fit_error, fit_linear, fit_link, predict_from_measurements
from hetrain.profile import DeviceFigures, Measurement, ModelProfile, ProfileError, load_profile
from hetrain.profile_combine import average_profiles, merge_profiles, scale_to
from hetrain.profiler.layers import match_device_type, measure_device_figures, profile_layers, run_profile_command
from hetrain.profiler.network import (
    DiscoveryError,
    LinkMeasurement,
    RankInfo,
    build_plan,
    cluster_toml,
    discover,
    parse_message_sizes,
    round_robin,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FAST = {"repeats": 3, "warmup": 1}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def linear_relu_stack() -> list[nn.Module]:
    return [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)]


# ---------------------------------------------------------------------------
# profile_layers
# ---------------------------------------------------------------------------


def test_linear_relu_stack_times_and_exact_bytes(tmp_path):
    p = profile_layers(linear_relu_stack(), torch.randn(1, 32), micro_batches=(1, 2, 4, 8), model_name="stack", **FAST)
    assert [layer.name for layer in p.layers] == ["linear0", "relu1", "linear2"]
    for layer in p.layers:
        ms = layer.measurements("cpu")
        assert [m.micro_batch for m in ms] == [1, 2, 4, 8]
        assert all(m.forward_s > 0 and m.backward_s > 0 and m.source == "measured" for m in ms)
    # parameters, exactly: weights + biases in fp32
    assert [layer.param_bytes for layer in p.layers] == [(32 * 64 + 64) * 4, 0, (64 * 16 + 16) * 4]
    # hand count of what autograd keeps per sample (fp32):
    #   Linear(32, 64) keeps its input (32 floats; the weight is a parameter, not counted)
    #   ReLU keeps its output (64 floats); Linear(64, 16) keeps its input (64 floats)
    hand = [32 * 4, 64 * 4, 64 * 4]
    for layer, expected in zip(p.layers, hand, strict=True):
        assert layer.saved_bytes_per_sample == pytest.approx(expected, rel=0.10)
    assert [layer.output_bytes_per_sample for layer in p.layers] == [64 * 4, 64 * 4, 16 * 4]
    assert p.layers[0].forward_flops_per_sample == 2 * 32 * 64  # one multiply-add per weight
    assert p.input_bytes_per_sample == 32 * 4
    assert p.figures_of("cpu") is not None
    # the profile is a file the planner reads back unchanged
    p.save(tmp_path / "stack.json")
    assert load_profile(tmp_path / "stack.json").to_dict() == p.to_dict()


class MaskedLinear(nn.Module):
    """Takes and returns (x, mask): a layer that carries a mask along, as a transformer block might."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.linear(x)) * mask, mask


class Split(nn.Module):
    """One argument in, a (hidden, skip) pair out: the start of a residual block."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x


class Join(nn.Module):
    """Takes the (hidden, skip) pair as one argument and adds the skip."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, skip = pair
        return self.linear(hidden) + skip


def test_tuple_layers_are_passed_as_args():
    layers = [MaskedLinear(8), MaskedLinear(8)]
    sample = (torch.randn(1, 8), torch.ones(1, 8))
    p = profile_layers(layers, sample, micro_batches=(1, 4), **FAST)
    assert p.input_bytes_per_sample == 2 * 8 * 4
    assert p.layers[0].output_bytes_per_sample == 2 * 8 * 4  # hidden and mask cross the boundary
    assert all(m.backward_s > 0 for layer in p.layers for m in layer.measurements("cpu"))


def test_tuple_passed_as_one_argument():
    p = profile_layers([Split(), Join(8)], torch.randn(1, 8), micro_batches=(2,), unpack_tuples=False, **FAST)
    assert p.layers[0].output_bytes_per_sample == 2 * 8 * 4
    assert p.layers[1].param_bytes == (8 * 8 + 8) * 4


def test_callable_input_and_integer_ids():
    layers = [nn.Embedding(50, 16), nn.Linear(16, 16)]
    p = profile_layers(layers, lambda b: torch.randint(0, 50, (b, 5)), micro_batches=(1, 3), **FAST)
    assert p.input_bytes_per_sample == 5 * 8  # int64 ids
    assert p.layers[0].param_bytes == 50 * 16 * 4
    assert p.layers[0].measurements("cpu")[0].backward_s > 0  # embedding weights get gradients
    assert p.layers[0].output_bytes_per_sample == 5 * 16 * 4


def test_sample_input_must_be_one_sample():
    with pytest.raises(ValueError, match="leading batch dimension of 1"):
        profile_layers(linear_relu_stack(), torch.randn(4, 32), micro_batches=(1,))
    with pytest.raises(ValueError, match="micro_batches"):
        profile_layers(linear_relu_stack(), torch.randn(1, 32), micro_batches=(0, 2))


def test_layers_keep_their_mode():
    layers = linear_relu_stack()
    for layer in layers:
        layer.eval()
    profile_layers(layers, torch.randn(1, 32), micro_batches=(1,), **FAST)
    assert not any(layer.training for layer in layers)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


@pytest.mark.parametrize(("name", "memory", "expected"), [
    ("NVIDIA A100-SXM4-40GB", 42.4e9, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 85.1e9, "A100-80GB"),
    ("Tesla V100-SXM2-32GB", 34.1e9, "V100-32GB"),
    ("NVIDIA H100 80GB HBM3", 85.0e9, "H100"),
    ("NVIDIA GeForce RTX 3090", 25.4e9, "RTX3090"),
    ("Tesla T4", 15.8e9, "T4"),
    ("Quadro P4000", 8.5e9, "P4000"),
    ("NVIDIA A10G", 24e9, "A10G"),
    ("NVIDIA H100 PCIe", 85.0e9, "H100-PCIe"),
    ("NVIDIA H100 NVL", 100.0e9, "H100-NVL"),
    ("Tesla V100-PCIE-16GB", 17.0e9, "V100-PCIe-16GB"),
    ("NVIDIA L40S", 48.3e9, "L40S"),
    ("NVIDIA RTX A6000", 51.0e9, "RTX-A6000"),
    ("Tesla P40", 24.0e9, "P40"),
    ("Tesla P100-PCIE-16GB", 17.1e9, "P100"),
    ("Tesla P100-SXM2-16GB", 17.1e9, None),  # 10.6 TFLOPS, not the PCIe card's 9.3
    ("NVIDIA GeForce RTX 3090 Ti", 25.4e9, None),
])
def test_gpu_names_map_to_catalog(name, memory, expected):
    assert match_device_type(name, memory) == expected


def test_measure_device_figures_on_cpu():
    f = measure_device_figures("cpu", matmul_size=128, copy_bytes=2**20, repeats=2)
    assert f.peak_flops > 1e6 and f.memory_bandwidth_bytes_per_s > 1e6


# ---------------------------------------------------------------------------
# merge, scale, fit
# ---------------------------------------------------------------------------


def cpu_profile() -> ModelProfile:
    return profile_layers(linear_relu_stack(), torch.randn(1, 32), micro_batches=(1, 2, 4, 8), **FAST)


def renamed(p: ModelProfile, type_name: str, factor: float) -> ModelProfile:
    """The same profile as if measured on ``type_name``, ``factor`` times as long."""
    layers = tuple(dataclasses.replace(layer, measured=((type_name, tuple(
        Measurement(m.micro_batch, m.forward_s * factor, m.backward_s * factor)
        for m in layer.measurements("cpu"))),)) for layer in p.layers)
    t = lookup_device_type(type_name)
    return dataclasses.replace(p, layers=layers, measured_on=((type_name, DeviceFigures(
        t.peak_fp32_flops, t.memory_bandwidth_bytes_per_s)),))


def catalog_device(type_name: str) -> Device:
    t = lookup_device_type(type_name)
    return Device("x:0", "x", 0, t.name, t.peak_fp32_flops, t.peak_fp16_flops, t.memory_bytes,
                  t.memory_bandwidth_bytes_per_s)


def test_merge_then_scale(tmp_path):
    cpu = cpu_profile()
    t4 = renamed(cpu, "T4", 0.01)
    merged = merge_profiles([cpu, t4])
    assert {t for t, _ in merged.layers[0].measured} == {"cpu", "T4"}
    assert {t for t, _ in merged.measured_on} == {"cpu", "T4"}

    scaled = scale_to(merged, ["A100-40GB", "t4"])
    for i, layer in enumerate(scaled.layers):
        a100 = layer.measurements("A100-40GB")
        assert [m.source for m in a100] == ["scaled"] * 4
        assert [m.source for m in layer.measurements("T4")] == ["measured"] * 4  # measured wins
        for m in a100:  # exactly what the cost model would estimate from the measured types
            assert (m.forward_s, m.backward_s) == pytest.approx(
                estimate_layer_time(merged, i, catalog_device("A100-40GB"), m.micro_batch))
    scaled.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.layers[0].measurements("A100-40GB")[0].source == "scaled"
    # scaling again recomputes from measured figures only
    assert scale_to(again, ["A100-40GB"]).to_dict() == scaled.to_dict()


def test_average_takes_the_median_of_each_measurement():
    cpu = cpu_profile()
    rated = dataclasses.replace(cpu, optimizer_step_s_per_byte=(("cpu", (("sgd", 1e-10),)),))
    runs = [renamed(rated, "cpu", f) for f in (1.0, 3.0, 2.0)]
    runs = [dataclasses.replace(r, optimizer_step_s_per_byte=(("cpu", (("sgd", f * 1e-10),)),))
            for r, f in zip(runs, (1.0, 3.0, 2.0), strict=True)]
    avg = average_profiles(runs)
    for i, layer in enumerate(avg.layers):
        for m, base in zip(layer.measurements("cpu"), cpu.layers[i].measurements("cpu"), strict=True):
            assert (m.micro_batch, m.source) == (base.micro_batch, "measured")
            assert (m.forward_s, m.backward_s) == pytest.approx((2 * base.forward_s, 2 * base.backward_s))
    assert dict(dict(avg.optimizer_step_s_per_byte)["cpu"])["sgd"] == pytest.approx(2e-10)
    # two profiles: the median is their mean; a micro-batch size only one of them has is kept as it is
    first = runs[0]
    only_b1 = dataclasses.replace(runs[1], layers=tuple(dataclasses.replace(layer, measured=(("cpu", tuple(
        m for m in layer.measurements("cpu") if m.micro_batch == 1)),)) for layer in runs[1].layers))
    pair = average_profiles([first, only_b1])
    for i, layer in enumerate(pair.layers):
        by_b = {m.micro_batch: m for m in layer.measurements("cpu")}
        base = {m.micro_batch: m for m in cpu.layers[i].measurements("cpu")}
        assert by_b[1].forward_s == pytest.approx(2 * base[1].forward_s)
        assert all(by_b[b].forward_s == pytest.approx(base[b].forward_s) for b in base if b != 1)
    with pytest.raises(ProfileError, match="has 2 layers, profile 0"):
        average_profiles([cpu, dataclasses.replace(cpu, layers=cpu.layers[:2])])


def test_merge_and_scale_errors():
    cpu = cpu_profile()
    other = profile_layers([nn.Linear(32, 65), nn.ReLU(), nn.Linear(65, 16)], torch.randn(1, 32),
                           micro_batches=(1,), **FAST)
    with pytest.raises(ProfileError, match="layer 0"):
        merge_profiles([cpu, other])
    with pytest.raises(ProfileError, match="has 2 layers, profile 0"):
        merge_profiles([cpu, dataclasses.replace(cpu, layers=cpu.layers[:2])])
    with pytest.raises(ProfileError, match="A100"):
        scale_to(cpu, ["A100-40G"])


def test_fit_error_exact_on_linear_data():
    layer_ms = tuple(Measurement(b, 1e-4 + 2e-5 * b, 2e-4 + 4e-5 * b) for b in (1, 2, 4, 8, 16))
    p = cpu_profile()
    p = dataclasses.replace(p, layers=tuple(dataclasses.replace(layer, measured=(("cpu", layer_ms),))
                                            for layer in p.layers))
    for model in ("piecewise", "linear"):
        err = fit_error(p, "cpu", model=model)
        assert err.held_out == (2, 4, 8)
        assert err.total < 1e-9 and err.max < 1e-9
    assert predict_from_measurements(layer_ms, 32, "linear") == pytest.approx((1e-4 + 2e-5 * 32, 2e-4 + 4e-5 * 32))


def test_fit_error_on_measured_profile():
    p = cpu_profile()
    err = fit_error(p, "cpu", held_out=[2, 4], model="linear")
    assert err.held_out == (2, 4) and len(err.per_layer) == 3
    assert math.isfinite(err.total) and err.total >= 0
    assert "held-out micro-batch 2, 4" in err.summary()
    with pytest.raises(ProfileError, match="not measured"):
        fit_error(p, "cpu", held_out=[3])
    with pytest.raises(ProfileError, match="3 or more"):
        fit_error(p, "T4")


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [4096 * 4**k for k in range(8)]
    times = [50e-6 + s / 1.25e9 for s in sizes]
    bw, lat, residual = fit_link(sizes, times)
    assert bw == pytest.approx(1.25e9, rel=1e-6) and lat == pytest.approx(50e-6, rel=1e-6)
    assert residual < 1e-9
    # a token bucket's burst makes the intercept negative: clamped to 0, slope kept
    bw, lat, _ = fit_link([2**20, 2**22], [2**20 / 25e6 - 0.005, 2**22 / 25e6 - 0.005])
    assert bw == pytest.approx(25e6) and lat == 0.0
    with pytest.raises(ValueError, match="two distinct"):
        fit_linear([1, 1], [2, 3])


# ---------------------------------------------------------------------------
# discovery's pure parts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 10))
def test_round_robin_covers_every_pair_once_without_overlap(n):
    rounds = round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (0 if n == 1 else n - 1 if n % 2 == 0 else n)


def test_build_plan_groups_ranks_by_host():
    plan = build_plan(["a", "a", "b", "b", "c"])
    assert plan.node_names == ("a", "b", "c")
    assert plan.node_ranks == ((0, 1), (2, 3), (4,))
    assert [t.ranks for t in plan.rounds[0]] == [(0, 1), (2, 3)]
    inter = sorted(t.nodes for r in plan.rounds[1:] for t in r)
    assert inter == [(0, 1), (0, 2), (1, 2)]
    for r in plan.rounds:
        ranks = [x for t in r for x in t.ranks]
        assert len(ranks) == len(set(ranks))
    assert plan.digest({"x": 1}) == build_plan(["a", "a", "b", "b", "c"]).digest({"x": 1})
    assert plan.digest({"x": 1}) != plan.digest({"x": 2})


def test_parse_message_sizes():
    assert parse_message_sizes("4KiB..64KiB") == [4096, 16384, 65536]
    assert parse_message_sizes("4KB, 1MB") == [4000, 1000000]
    with pytest.raises(ValueError, match="unit"):
        parse_message_sizes("4096")


def test_cluster_toml_loads():
    infos = [RankInfo(r, h, "cpu", None, 32e9) for r, h in enumerate(["a", "a", "b"])]
    infos.append(RankInfo(3, "c", "Mystery-GPU", 12e9, 64e9,
                          {"peak_fp32_flops": 2e13, "peak_fp16_flops": 8e13, "memory_bandwidth_bytes_per_s": 9e11}))
    plan = build_plan([i.host for i in infos])
    links = [LinkMeasurement((0, 1), (0, 0), (1, 2), (1e-3, 2e-3), 5e9, 1e-5, 0.01),
             LinkMeasurement((0, 2), (0, 1), (1, 2), (1e-3, 2e-3), 1e9, 3e-5, 0.01),
             LinkMeasurement((0, 3), (0, 2), (1, 2), (1e-3, 2e-3), 2e9, 3e-5, 0.01),
             LinkMeasurement((2, 3), (1, 2), (1, 2), (1e-3, 2e-3), 1e8, 5e-5, 0.01)]
    c = parse_cluster(tomllib.loads(cluster_toml(plan, infos, links, ["a header"])))
    assert [n.name for n in c.nodes] == ["a", "b", "c"]
    assert c.nodes[0].devices[0].memory_bytes == 16e9  # host memory shared by its two ranks
    assert c.nodes[2].devices[0].type_name == "Mystery-GPU"
    assert c.link(0, 1).bandwidth_bytes_per_s == pytest.approx(5e9)
    assert c.link(2, 3).bandwidth_bytes_per_s == pytest.approx(1e8)
    assert c.nodes[0].nic.bandwidth_bytes_per_s == pytest.approx(2e9)  # the node's fastest measured link


def test_discover_outside_torchrun_names_missing_variables(monkeypatch, tmp_path):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DiscoveryError, match="WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set"):
        discover(tmp_path / "c.toml")


# ---------------------------------------------------------------------------
# the CLI-facing command
# ---------------------------------------------------------------------------


def test_run_profile_command(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    assert run_profile_command("mlp-digits", [1, 2, 4], str(out), "cpu", repeats=2, warmup=1) == 0
    p = load_profile(out)
    assert p.name == "mlp-digits" and p.num_layers == 3
    printed = capsys.readouterr().out
    assert "piecewise fit on cpu" in printed and "linear fit on cpu" in printed
    assert run_profile_command("no-such-model", [1], str(tmp_path / "x.json"), "cpu") == 2  # bad input
    assert "unknown model" in capsys.readouterr().err

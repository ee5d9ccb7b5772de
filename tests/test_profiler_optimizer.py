"""The measured optimizer step: profile field, JSON, measurement, merge/relabel, simulator and planner."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from factories import make_plan
from hetrain.cluster import parse_cluster
from hetrain.cost import OPTIMIZER_STATE_PER_PARAM, estimate_optimizer_time
from hetrain.plan import Plan
from hetrain.planner import plan
from hetrain.profile import (
    OPTIMIZER_NAMES,
    LayerProfile,
    Measurement,
    ModelProfile,
    ProfileError,
    load_profile,
    parse_profile,
    relabel_profile,
)
from hetrain.profile_combine import merge_profiles
from hetrain.profiler.layers import measure_layers, measure_optimizer_step, profile_layers
from hetrain.simulator import simulate

A100 = "A100-40GB"
PARAM_BYTES = 4e6


def two_layer_profile(rates: dict[str, dict[str, float]] | None = None) -> ModelProfile:
    """Two layers of 4 MB of parameters each, measured on the A100 at micro-batch 2."""
    layers = tuple(LayerProfile(f"l{j}", PARAM_BYTES, 1e3, 1e4, 1e9, ((A100, (Measurement(2, 0.01, 0.02),)),))
                   for j in range(2))
    optimizer = tuple((t, tuple(r.items())) for t, r in (rates or {}).items())
    return ModelProfile("two", layers, 1e3, optimizer_step_s_per_byte=optimizer)


def test_names_are_the_cost_models() -> None:
    assert set(OPTIMIZER_NAMES) == set(OPTIMIZER_STATE_PER_PARAM)


# --- the profile field -------------------------------------------------------------


def test_round_trip_and_lookup(tmp_path) -> None:
    p = two_layer_profile({"cpu-slow": {"sgd": 1.2e-9, "adam": 4e-9}, A100: {"momentum": 3e-12}})
    data = p.to_dict()
    assert data["optimizer_step_s_per_byte"] == {"cpu-slow": {"sgd": 1.2e-9, "adam": 4e-9}, A100: {"momentum": 3e-12}}
    p.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again == p
    assert again.optimizer_s_per_byte("cpu-slow", "adam") == 4e-9
    assert again.optimizer_s_per_byte("cpu-slow", "adamw") == 4e-9  # the runtime's name
    assert again.optimizer_s_per_byte("cpu-slow", "momentum") is None
    assert again.optimizer_s_per_byte("cpu-fast", "sgd") is None


def test_old_profiles_load_and_write_unchanged() -> None:
    data = two_layer_profile().to_dict()
    assert "optimizer_step_s_per_byte" not in data
    p = parse_profile(json.loads(json.dumps(data)))
    assert p.optimizer_step_s_per_byte == ()
    assert p.to_dict() == data


def test_adamw_is_read_as_adam() -> None:
    data = two_layer_profile().to_dict()
    data["optimizer_step_s_per_byte"] = {"cpu": {"adamw": 2e-9}}
    assert parse_profile(data).optimizer_s_per_byte("cpu", "adam") == 2e-9
    data["optimizer_step_s_per_byte"] = {"cpu": {"adamw": 2e-9, "adam": 3e-9}}
    with pytest.raises(ProfileError, match=r"\['cpu'\] gives 'adam' twice"):
        parse_profile(data)


@pytest.mark.parametrize(("rates", "message"), [
    ({"T4": {"adam": -1.0}}, r"optimizer_step_s_per_byte\['T4'\]\['adam'\] must be a positive finite .* got -1.0"),
    ({"T4": {"sgd": 0}}, r"\['T4'\]\['sgd'\] must be a positive finite .* got 0"),
    ({"T4": {"sgd": float("inf")}}, r"\['T4'\]\['sgd'\] must be a positive finite .* got inf"),
    ({"T4": {"sgd": float("nan")}}, r"\['T4'\]\['sgd'\] must be a positive finite .* got nan"),
    ({"T4": {"sgd": "1e-9"}}, r"\['T4'\]\['sgd'\] must be a positive finite .* got '1e-9'"),
    ({"T4": {"sgd": True}}, r"\['T4'\]\['sgd'\] must be a positive finite .* got True"),
    ({"T4": {"lamb": 1e-9}}, r"\['T4'\]\['lamb'\]: unknown optimizer 'lamb'; known: sgd, momentum, adam"),
    ({"T4": 1e-9}, r"optimizer_step_s_per_byte\['T4'\] must be an object"),
    ([1e-9], r"optimizer_step_s_per_byte must be an object"),
])
def test_bad_rates_are_refused_with_the_type_and_name(rates: object, message: str) -> None:
    data = two_layer_profile().to_dict()
    data["optimizer_step_s_per_byte"] = rates
    with pytest.raises(ProfileError, match=message):
        parse_profile(data)


def test_bad_rates_are_refused_when_built_in_code() -> None:
    with pytest.raises(ProfileError, match=r"\['cpu'\]\['adam'\] must be a positive finite"):
        two_layer_profile({"cpu": {"adam": -2e-9}})


# --- the cost model ----------------------------------------------------------------


def one_device_plan(profile: ModelProfile, optimizer: str) -> Plan:
    cluster = parse_cluster({"name": "one", "node": [{"name": "n0", "devices": [{"type": A100, "count": 1}]}]})
    return make_plan(cluster, profile, [(["n0:0"], [0, 2], 2, 1)], optimizer=optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_simulator_takes_the_measured_step(optimizer: str) -> None:
    huge = 1e-6  # 8 s for the 8 MB stage, far above the bandwidth formula's microseconds
    bare = one_device_plan(two_layer_profile(), optimizer)
    without = simulate(bare)
    with_rate = simulate(one_device_plan(two_layer_profile({A100: {optimizer: huge}}), optimizer))
    # same plan, same compute: only the step differs
    formula = estimate_optimizer_time(2 * PARAM_BYTES, 4, bare.cluster.devices[0], optimizer)
    assert with_rate.iteration_s > without.iteration_s
    assert with_rate.iteration_s - without.iteration_s == pytest.approx(2 * PARAM_BYTES * huge - formula)
    # a rate measured for another optimizer changes nothing
    other = "sgd" if optimizer == "adam" else "adam"
    unrelated = simulate(one_device_plan(two_layer_profile({A100: {other: huge}}), optimizer))
    assert unrelated.iteration_s == pytest.approx(without.iteration_s)


def test_planner_predicts_the_measured_step() -> None:
    cluster = parse_cluster({"name": "one", "node": [{"name": "n0", "devices": [{"type": A100, "count": 1}]}]})
    rate = 1e-9
    got = plan(cluster, two_layer_profile({A100: {"adam": rate}}), 2, optimizer="adam", simulate_top_k=0)
    assert got.prediction.optimizer_s == pytest.approx(2 * PARAM_BYTES * rate)
    bare = plan(cluster, two_layer_profile(), 2, optimizer="adam", simulate_top_k=0)
    assert bare.prediction.optimizer_s == pytest.approx(2 * 2 * 4 * PARAM_BYTES / 1555e9)


# --- measurement -------------------------------------------------------------------


def linear_stack() -> list[nn.Module]:
    return [nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)]


def test_measure_optimizer_step_on_a_linear_stack() -> None:
    layers = linear_stack()
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    rates = measure_optimizer_step(layers, "cpu", optimizers=("sgd", "momentum", "adamw"), min_time_s=0.01)
    assert set(rates) == {"sgd", "momentum", "adam"}
    assert all(r > 0 for r in rates.values())
    assert rates["adam"] > rates["sgd"]  # AdamW does several passes over parameters and state; SGD one
    after = [p.detach() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the layers keep their weights
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_measure_optimizer_step_edge_cases() -> None:
    assert measure_optimizer_step([nn.ReLU()], "cpu") == {}
    shared = nn.Linear(16, 16)
    assert set(measure_optimizer_step([shared, shared], "cpu", optimizers=("sgd",))) == {"sgd"}
    with pytest.raises(ValueError, match=r"unknown optimizers \['lamb'\]; known: sgd, momentum, adam"):
        measure_optimizer_step([shared], "cpu", optimizers=("lamb",))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure_optimizer_step([shared], "cpu", repeats=0)


def test_profiles_carry_the_optimizer_step(tmp_path) -> None:
    p = profile_layers(linear_stack(), torch.randn(1, 128), micro_batches=(1, 2), repeats=2, warmup=1)
    assert [t for t, _ in p.optimizer_step_s_per_byte] == ["cpu"]
    assert all(p.optimizer_s_per_byte("cpu", name) is not None for name in OPTIMIZER_NAMES)
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").optimizer_step_s_per_byte == p.optimizer_step_s_per_byte
    measured = measure_layers(linear_stack(), torch.randn(1, 128), (1,), repeats=1, warmup=0, optimizers=())
    assert measured.to_profile().optimizer_step_s_per_byte == ()
    assert "optimizer step" in measure_layers(linear_stack(), torch.randn(1, 128), (1,), repeats=1, warmup=0,
                                              optimizers=("sgd",)).table()


# --- merge and relabel ---------------------------------------------------------------


def test_merge_keeps_every_profiles_rates_later_wins() -> None:
    a = two_layer_profile({"cpu-fast": {"sgd": 1e-9, "adam": 4e-9}})
    b = two_layer_profile({"cpu-slow": {"sgd": 3e-9}, "cpu-fast": {"adam": 5e-9}})
    merged = merge_profiles([a, b])
    assert merged.optimizer_s_per_byte("cpu-fast", "sgd") == 1e-9
    assert merged.optimizer_s_per_byte("cpu-fast", "adam") == 5e-9
    assert merged.optimizer_s_per_byte("cpu-slow", "sgd") == 3e-9
    assert merge_profiles([two_layer_profile(), two_layer_profile()]).optimizer_step_s_per_byte == ()


def test_relabel_refiles_the_rates_under_the_new_type() -> None:
    p = two_layer_profile({"cpu": {"sgd": 1e-9, "adam": 4e-9}})
    slow = relabel_profile(p, "cpu-slow", (4.8e12, 4e9))
    assert slow.optimizer_step_s_per_byte == (("cpu-slow", (("sgd", 1e-9), ("adam", 4e-9))),)
    assert relabel_profile(two_layer_profile(), "cpu-slow").optimizer_step_s_per_byte == ()
    both = merge_profiles([slow, relabel_profile(dataclasses.replace(
        p, optimizer_step_s_per_byte=(("cpu", (("sgd", 2e-9),)),)), "cpu-fast")])
    assert both.optimizer_s_per_byte("cpu-slow", "adam") == 4e-9
    assert both.optimizer_s_per_byte("cpu-fast", "sgd") == 2e-9
    assert both.optimizer_s_per_byte("cpu-fast", "adam") is None

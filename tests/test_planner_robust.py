"""Plans under profile noise (planner.robust) and the order of a pipeline's stages, scored by the simulator."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import hetrain
from hetrain.cluster import parse_cluster
from hetrain.plan import Plan, Stage
from hetrain.planner import PlannerOptions
from hetrain.planner.robust import (
    choose_robust,
    describe_layout,
    draw_profiles,
    format_confidence,
    has_spread,
    rank_robust,
)
from hetrain.planner.search import _to_plan, reversed_orders, search
from hetrain.planner.vw import candidate_orders
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile
from hetrain.simulator import simulate


def _device(type_name: str, tflops: float) -> dict[str, object]:
    return {"type": type_name, "tflops": tflops, "memory": "16GB", "memory_bandwidth": "300GB/s"}


def _cluster(nic: str = "1Gbit/s"):
    """Two nodes of one device each: ``noisy`` (fast) and ``steady`` (slower)."""
    return parse_cluster({"name": "two", "node": [
        {"name": "a", "devices": [_device("noisy", 20)], "nic": nic},
        {"name": "b", "devices": [_device("steady", 8)], "nic": nic}]})


def _profile(noisy_s: float = 1e-3, steady_s: float = 2.5e-3, noisy_spread: float | None = None,
             layers: int = 10) -> ModelProfile:
    """``layers`` identical layers measured on both types (backward 2x forward, time proportional to the
    micro-batch); the ``noisy`` type's times with a relative spread ``noisy_spread``."""
    def measured(f: float, spread: float | None) -> tuple[Measurement, ...]:
        return tuple(Measurement(b, f * b, 2 * f * b, "measured",
                                 None if spread is None else spread * f * b,
                                 None if spread is None else spread * 2 * f * b) for b in (1, 2, 4, 8))
    layer_list = tuple(LayerProfile(f"l{i}", 4e6, 2e5, 1e6, 1e9, (("noisy", measured(noisy_s, noisy_spread)),
                                                                   ("steady", measured(steady_s, None))))
                       for i in range(layers))
    return ModelProfile("uniform", layer_list, 2e5, measured_on=(("noisy", DeviceFigures(20e12, 3e11)),
                                                                 ("steady", DeviceFigures(8e12, 3e11))))


def _moved(plan: Plan, layers: int) -> Plan:
    """``plan`` (one pipeline of two stages) with ``layers`` layers moved from its first stage to its second."""
    vw = plan.virtual_workers[0]
    first, second = vw.stages
    cut = first.end_layer - layers
    stages = (Stage(first.device, first.first_layer, cut), Stage(second.device, cut, second.end_layer))
    return dataclasses.replace(plan, virtual_workers=(dataclasses.replace(vw, stages=stages),))


def _objective(p: Plan, t: float) -> float:
    return t / p.global_batch


def _simulated(p: Plan) -> Plan:
    return dataclasses.replace(p, prediction=dataclasses.replace(p.prediction,
                                                                 simulated_iteration_s=simulate(p).iteration_s))


def _noisy_first_pair(profile: ModelProfile) -> list[Plan]:
    """The mean-best pipeline noisy -> steady, and the runner-up with one layer fewer on the noisy device,
    ranked by simulated time at the medians."""
    best = hetrain.plan(_cluster(), profile, 16, strategy="pp", micro_batch_sizes=(1,), robust_draws=0,
                        schedule="1f1b")  # the figures below are 1F1B's (auto may replay it as 1F1B-eager)
    if best.virtual_workers[0].stages[0].device != "a:0":  # the noisy device first, whichever order won
        vw = best.virtual_workers[0]
        n = vw.stages[1].end_layer - vw.stages[1].first_layer
        stages = (Stage("a:0", 0, n), Stage("b:0", n, profile.num_layers))
        best = dataclasses.replace(best, virtual_workers=(dataclasses.replace(vw, stages=stages),))
    pair = [_simulated(best), _simulated(_moved(best, 1))]
    return sorted(pair, key=lambda p: _objective(p, p.prediction.simulated_iteration_s or 0.0))


def test_the_rule_on_literal_figures() -> None:
    # medians 1.00, 1.02, 1.30; worst draws 1.40, 1.10, 1.31: the second and the third are within the
    # first's spread (<= 1.40); the second has the best worst case
    assert choose_robust([1.00, 1.02, 1.30], [1.40, 1.10, 1.31]) == 1
    # no spread: every worst case is the median, only ties are within, the fastest stays
    assert choose_robust([1.00, 1.02, 1.30], [1.00, 1.02, 1.30]) == 0
    # a runner-up outside the fastest's spread never wins, however steady
    assert choose_robust([1.00, 1.20], [1.10, 1.20]) == 0
    # equal worst cases: the faster at the medians
    assert choose_robust([1.05, 1.00], [1.20, 1.20]) == 1


def test_draws_are_deterministic_and_keep_what_has_no_spread() -> None:
    profile = _profile(noisy_spread=0.3)
    assert has_spread(profile) and not has_spread(_profile())
    a, b = draw_profiles(profile, 4, seed=7), draw_profiles(profile, 4, seed=7)
    assert [p.layers for p in a] == [p.layers for p in b]
    assert [p.layers for p in a] != [p.layers for p in draw_profiles(profile, 4, seed=8)]
    for drawn in a:
        for layer, base in zip(drawn.layers, profile.layers, strict=True):
            assert layer.measurements("steady") == base.measurements("steady")  # no spread: as measured
            moved = [m.forward_s / o.forward_s for m, o in zip(layer.measurements("noisy"),
                                                                base.measurements("noisy"), strict=True)]
            assert all(r > 0 for r in moved)
            assert max(moved) == pytest.approx(min(moved))  # one draw per layer and direction, every size
    assert draw_profiles(_profile(), 2)[0].layers == _profile().layers


def test_robust_choice_prefers_the_steadier_runner_up_within_the_spread() -> None:
    # the mean-best split gives the noisy device 15 of 20 layers; 14 is 1.4% slower at the medians but
    # steadier: with a 60% spread on the noisy device the robust rule takes it
    noisy = _profile(noisy_spread=0.6, layers=20)
    best, runner_up = _noisy_first_pair(noisy)
    assert best.virtual_workers[0].stages[0].end_layer > runner_up.virtual_workers[0].stages[0].end_layer
    ranked, figures = rank_robust([best, runner_up], _objective, lambda p: simulate(p).iteration_s)
    assert describe_layout(ranked[0]) == describe_layout(runner_up)
    first, second = figures["candidates"]
    assert first["layout"] == describe_layout(runner_up)
    assert first["objective"] > second["objective"]  # slower at the medians ...
    assert first["worst_objective"] < second["worst_objective"]  # ... faster in the worst draw
    assert second["objective"] <= first["objective"] <= second["worst_objective"]  # within the spread
    assert figures["draws"] == 8
    assert ranked[0].options["confidence"] == figures
    # the same instance without spread: the mean-best, no draws
    steady = [dataclasses.replace(p, profile=_profile(layers=20)) for p in (best, runner_up)]
    ranked0, figures0 = rank_robust(steady, _objective, lambda p: simulate(p).iteration_s)
    assert describe_layout(ranked0[0]) == describe_layout(best)
    assert figures0["draws"] == 0
    # deterministic: the same plans, the same figures
    again, figures_again = rank_robust([best, runner_up], _objective, lambda p: simulate(p).iteration_s)
    assert figures_again == figures and describe_layout(again[0]) == describe_layout(ranked[0])


def test_the_planner_with_spread_is_deterministic_and_says_how_sure_it_is() -> None:
    profile = _profile(noisy_spread=0.3)
    one = hetrain.plan(_cluster(), profile, 16)
    two = hetrain.plan(_cluster(), profile, 16)
    assert one.to_dict() == two.to_dict()
    figures = one.options["confidence"]
    assert figures["draws"] == 8 and len(figures["candidates"]) >= 2
    assert figures["candidates"][0]["layout"] == describe_layout(one)
    assert sum(c["fastest_in_draws"] for c in figures["candidates"]) == 8
    # plans alike in every figure (the same VWs, devices paired otherwise) are listed once
    assert len({(c["objective"], c["worst_objective"]) for c in figures["candidates"]}) == len(figures["candidates"])
    text = format_confidence(one)
    assert "next best plan" in text or "chosen for its worst case" in text
    assert "of 8 draws" in text
    # round trip: the figures are in plan.json
    assert Plan.from_dict(one.to_dict()).options["confidence"] == figures


def test_without_spread_the_plan_is_the_one_without_robust_scoring() -> None:
    profile = _profile()
    plain = hetrain.plan(_cluster(), profile, 16)
    off = hetrain.plan(_cluster(), profile, 16, robust_draws=0)
    assert describe_layout(plain) == describe_layout(off)
    assert plain.options["confidence"]["draws"] == 0
    assert "no spread" in format_confidence(plain)
    with pytest.raises(ValueError, match="robust_draws must be >= 0, got -1"):
        PlannerOptions(robust_draws=-1)


def test_stage_order_slow_first_and_fast_first_differ_and_the_planner_takes_the_faster() -> None:
    cluster, profile = _cluster("100Mbit/s"), _profile()
    vw = list(cluster.devices)
    assert sorted(candidate_orders(cluster, vw, profile.num_layers, 1e9)) == [(0, 1), (1, 0)]
    # both orders under 1F1B, as the plan chosen below (under auto the search may price either as 1F1B-eager)
    opts = PlannerOptions(strategy="pp", micro_batch_sizes=(1,), schedule="1f1b")
    best = search(cluster, profile, 16, opts)[0]
    flipped = reversed_orders(cluster, profile, best, opts)
    assert flipped is not None
    orders = [tuple(d.type_name for d in c.parts[0].devices) for c in (best, flipped)]
    assert sorted(orders) == [("noisy", "steady"), ("steady", "noisy")]
    # the closed form cannot tell them apart: sum + (m - 1) * max is symmetric in the order of the stages
    assert flipped.pipeline_s == pytest.approx(best.pipeline_s, rel=1e-9)
    times = {order: simulate(_to_plan(cluster, profile, c, opts)).iteration_s
             for order, c in zip(orders, (best, flipped), strict=True)}
    assert abs(times[orders[0]] - times[orders[1]]) > 1e-6 * max(times.values())  # the simulator can
    chosen = hetrain.plan(cluster, profile, 16, strategy="pp", micro_batch_sizes=(1,), schedule="1f1b")
    order = tuple(cluster.device(s.device).type_name for s in chosen.virtual_workers[0].stages)
    assert times[order] == min(times.values())
    assert chosen.prediction.simulated_iteration_s == pytest.approx(min(times.values()))
    # under schedule auto both orders are also replayed as 1F1B-eager: never slower than the faster 1F1B
    auto = hetrain.plan(cluster, profile, 16, strategy="pp", micro_batch_sizes=(1,))
    assert auto.prediction.simulated_iteration_s is not None
    assert auto.prediction.simulated_iteration_s <= min(times.values()) * (1 + 1e-9)


@pytest.mark.slow  # plans with robust draws
def test_plan_takes_robust_draws_from_the_command_line(tmp_path: Path) -> None:
    """``hetrain plan --robust-draws N`` reaches the planner, recorded with the plan's planner options."""
    from hetrain.cli import main
    from hetrain.plan import load_plan

    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "pipetorch.toml"
    for draws in (0, 3):
        out = tmp_path / f"plan{draws}.json"
        assert main(["plan", "--cluster", str(cluster), "--model", "gpt2-small", "--global-batch", "16",
                     "--robust-draws", str(draws), "-o", str(out)]) == 0
        assert load_plan(out).options["planner"]["robust_draws"] == draws
    with pytest.raises(SystemExit) as refused:
        main(["plan", "--cluster", str(cluster), "--model", "gpt2-small", "--global-batch", "16",
              "--robust-draws", "-1"])
    assert refused.value.code == 2


def _with_noisy_shifted(profile: ModelProfile, factor: float, common: float | None) -> ModelProfile:
    """``profile`` with every ``noisy`` time (and its spread) times ``factor``: another profiling of the same
    devices, shifted as a whole; ``common``: the ``noisy`` type's common spread (None: not known)."""
    def moved(type_name: str, ms: tuple[Measurement, ...]) -> tuple[Measurement, ...]:
        k = factor if type_name == "noisy" else 1.0
        return tuple(dataclasses.replace(m, forward_s=k * m.forward_s, backward_s=k * m.backward_s,
                                         forward_spread_s=m.forward_spread_s and k * m.forward_spread_s,
                                         backward_spread_s=m.backward_spread_s and k * m.backward_spread_s)
                     for m in ms)
    layers = tuple(dataclasses.replace(layer, measured=tuple((t, moved(t, ms)) for t, ms in layer.measured))
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers, common_spread=() if common is None else (("noisy", common),))


def test_a_common_shift_moves_every_time_of_its_type_alike_and_leaves_the_old_draws_alone() -> None:
    plain = dataclasses.replace(_profile(), optimizer_step_s_per_byte=(("noisy", (("adam", 1e-9),)),
                                                                       ("steady", (("adam", 2e-9),))))
    common = dataclasses.replace(plain, common_spread=(("noisy", 0.1),))
    assert not has_spread(plain) and has_spread(common)
    drawn = draw_profiles(common, 6, seed=3)
    assert [p.layers for p in drawn] == [p.layers for p in draw_profiles(common, 6, seed=3)]  # deterministic
    factors = []
    for p in drawn:
        ratios = {m.backward_s / o.backward_s for layer, base in zip(p.layers, common.layers, strict=True)
                  for m, o in zip(layer.measurements("noisy"), base.measurements("noisy"), strict=True)}
        assert max(ratios) == pytest.approx(min(ratios))  # one factor for every layer and size of the type
        factor = ratios.pop()
        assert p.optimizer_s_per_byte("noisy", "adam") == pytest.approx(1e-9 * factor)  # and its optimizer step
        assert p.optimizer_s_per_byte("steady", "adam") == 2e-9
        assert [layer.measurements("steady") for layer in p.layers] == [
            layer.measurements("steady") for layer in common.layers]
        factors.append(factor)
    assert len(set(factors)) == 6 and all(f > 0 for f in factors)
    # a profile with per-layer spreads only draws exactly what it drew before the common shift existed
    layered = _profile(noisy_spread=0.3)
    zero = dataclasses.replace(layered, common_spread=(("noisy", 0.0),))
    assert [p.layers for p in draw_profiles(zero, 4, seed=7)] == [p.layers for p in draw_profiles(layered, 4, seed=7)]


@pytest.mark.slow  # plans with robust draws
def test_with_the_common_shift_profiles_that_differ_within_it_choose_one_plan() -> None:
    # 20 layers, 15 or 14 on the noisy device first: at the medians the two are 1.4% apart, and which is
    # ahead depends on where a profiling of the noisy type fell (2-3% either way). Per-layer spreads of 5%
    # average out over 15 layers, so the independent draws follow the medians and the choice flips with the
    # profile; a 5% shift common to the noisy type moves all its 15 layers at once, and the plan that leans
    # on it less is chosen from all five profiles, for its worst case
    base = _profile(noisy_spread=0.05, layers=20)
    pair = _noisy_first_pair(base)
    by_noisy_layers = {p.virtual_workers[0].stages[0].end_layer: describe_layout(p) for p in pair}
    assert sorted(by_noisy_layers) == [14, 15]

    def chosen(factor: float, common: float | None) -> tuple[str, dict[str, Any]]:
        profile = _with_noisy_shifted(base, factor, common)
        plans = sorted((_simulated(dataclasses.replace(p, profile=profile)) for p in pair),
                       key=lambda p: _objective(p, p.prediction.simulated_iteration_s or 0.0))
        ranked, figures = rank_robust(plans, _objective, lambda p: simulate(p).iteration_s)
        return describe_layout(ranked[0]), figures

    factors = (0.97, 0.98, 1.0, 1.02, 1.03)
    independent = [chosen(f, None)[0] for f in factors]
    assert independent[0] == by_noisy_layers[15] and independent[-1] == by_noisy_layers[14]  # it flips
    shared = [chosen(f, 0.05) for f in factors]
    assert {layout for layout, _ in shared} == {by_noisy_layers[14]}
    figures = shared[0][1]  # the profile where 15 layers is 3.7% ahead at the medians
    mine, other = figures["candidates"]
    assert other["objective"] < mine["objective"] <= other["worst_objective"]  # slower, within its spread
    assert mine["worst_objective"] < other["worst_objective"]  # and the better worst case
    assert [chosen(f, 0.05) for f in factors] == shared  # deterministic


def _with_overhead(profile: ModelProfile, overhead_s: float, spread_s: float) -> ModelProfile:
    from hetrain.calibrate import with_action_overhead

    return with_action_overhead(profile, overhead_s, ["noisy", "steady"], spread_s)


def test_the_overhead_is_drawn_once_per_draw_for_every_type_and_leaves_the_other_draws_alone() -> None:
    profile = _with_overhead(_profile(noisy_spread=0.3), 1e-3, 2e-3)
    assert has_spread(_with_overhead(_profile(), 1e-3, 2e-3)) and not has_spread(_with_overhead(_profile(), 1e-3, 0))
    drawn = draw_profiles(profile, 8, seed=3)
    overheads = [dict(p.action_overhead_s) for p in drawn]
    assert all(o["noisy"] == o["steady"] for o in overheads)  # the host's work: one draw for every type
    positive = [o["noisy"] for o in overheads if o["noisy"] > 0]
    assert len(set(positive)) == len(positive) >= 4 and min(o["noisy"] for o in overheads) >= 0
    assert len(positive) < 8  # 1 ms with a 2 ms spread: some draws are clipped at 0
    assert all(p.action_overhead_spread_s == profile.action_overhead_spread_s for p in drawn)
    # the layer and common draws are the ones drawn without the overhead's spread (their own streams)
    without = draw_profiles(_with_overhead(_profile(noisy_spread=0.3), 1e-3, 0.0), 8, seed=3)
    assert [p.layers for p in drawn] == [p.layers for p in without]
    assert all(dict(p.action_overhead_s) == {"noisy": 1e-3, "steady": 1e-3} for p in without)


def test_with_the_overheads_spread_the_plan_of_fewer_larger_micro_batches_wins_a_close_call() -> None:
    # 1 ms per action: 16 micro-batches of 1 are 1.5% faster than 8 of 2 at the medians; with the overhead
    # moving by 1 ms from step to step, 16 x 1 (34 actions on the critical path, 18 for 8 x 2) is slower in its
    # worst draw, and 8 x 2 is within its spread
    def candidates(profile: ModelProfile) -> list[Plan]:
        return [_simulated(hetrain.plan(_cluster(), profile, 16, strategy="pp", micro_batch_sizes=(b,),
                                        robust_draws=0)) for b in (1, 2)]

    many, few = candidates(_with_overhead(_profile(), 1e-3, 1e-3))
    assert (many.virtual_workers[0].micro_batches, few.virtual_workers[0].micro_batches) == (16, 8)
    ranked, figures = rank_robust([many, few], _objective, lambda p: simulate(p).iteration_s)
    assert describe_layout(ranked[0]) == describe_layout(few)
    chosen, other = figures["candidates"]
    assert chosen["objective"] > other["objective"] and chosen["worst_objective"] < other["worst_objective"]
    # no spread of the overhead, nothing drawn: the faster at the medians
    steady = candidates(_with_overhead(_profile(), 1e-3, 0.0))
    ranked0, figures0 = rank_robust(steady, _objective, lambda p: simulate(p).iteration_s)
    assert ranked0[0].virtual_workers[0].micro_batches == 16 and figures0["draws"] == 0

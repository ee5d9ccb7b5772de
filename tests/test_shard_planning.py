"""Sharded optimizer state on the planning side: the plan's shards, their memory, their cost, the planner's choice."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.factories import A100, V100, make_cluster, make_plan

from hetrain.cluster import parse_cluster
from hetrain.cost import (
    MEMORY_MARGIN_FRACTION,
    ZERO2_IN_FLIGHT_BYTES,
    estimate_stage_memory,
    estimate_weight_memory,
    runtime_footprint,
    tensor_budget,
)
from hetrain.models.analytic import build_gpt_profile, build_profile
from hetrain.plan import PlanError, load_plan, parse_plan
from hetrain.planner.search import PlannerError, PlannerOptions, plan
from hetrain.planner.shards import lighten_segments, reprice, size_shards, stage_memory
from hetrain.simulator import simulate
from hetrain.simulator.compile import estimate_stage_costs
from hetrain.sync_layout import SHARD_MODES, SyncLayoutError, SyncOptions, check_mode_options, shard_fractions

ZERO1 = SyncOptions(shard="optimizer")
ZERO2 = SyncOptions(shard="optimizer+gradients")


def _profile():  # type: ignore[no-untyped-def]
    return build_gpt_profile(4, 256, 8, 128, 1000)


def _dp_plan(options: SyncOptions, weights: dict[str, float] | None = None):  # type: ignore[no-untyped-def]
    cluster = make_cluster({"n0": 2, "n1": 2})
    profile = _profile()
    vws = [([d], [0, profile.num_layers], 4, 1) for d in ("n0:0", "n0:1", "n1:0", "n1:1")]
    p = make_plan(cluster, profile, vws, optimizer="adam", sync_options=options)
    return replace(p, shard_weights=weights) if weights is not None else p


def test_shards_follow_the_weights_and_cover_every_element() -> None:
    assert shard_fractions(("a", "b"), {"a": 3.0, "b": 1.0}) == (0.75, 0.25)
    assert shard_fractions(("a", "b", "c"), None) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert shard_fractions(("a", "b"), {"a": -5.0, "b": 0.0}) == (0.5, 0.5)  # none positive: even
    p = _dp_plan(ZERO1, {"n0:0": 1.0, "n0:1": 2.0, "n1:0": 1.0, "n1:1": 0.0})
    seg = p.segments()[0]
    assert seg.sharded and seg.shard_fractions == (0.25, 0.5, 0.25, 0.0)
    bounds = seg.shard_bounds(1001)
    assert bounds[0][0] == 0 and bounds[-1][1] == 1001
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert [hi - lo for lo, hi in bounds] == [250, 501, 250, 0]
    assert p.shard_shares("n0:1") == (pytest.approx(0.5), 1.0)  # ZeRO-1 keeps the whole gradients
    z2 = _dp_plan(ZERO2, {"n0:0": 1.0, "n0:1": 2.0, "n1:0": 1.0, "n1:1": 0.0})
    assert z2.shard_shares("n0:1") == (pytest.approx(0.5), pytest.approx(0.5))
    assert _dp_plan(SyncOptions()).shard_shares("n0:1") == (1.0, 1.0)


def test_a_sharded_plan_round_trips_and_a_hand_edited_share_is_refused(tmp_path: Path) -> None:
    p = _dp_plan(ZERO2, {"n0:0": 4.0, "n0:1": 1.0, "n1:0": 1.0, "n1:1": 2.0})
    path = tmp_path / "plan.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["sync"]["shard_weights"] == {"n0:0": 4.0, "n0:1": 1.0, "n1:0": 1.0, "n1:1": 2.0}
    assert data["sync"]["segments"][0]["shard"] == "optimizer+gradients"
    back = load_plan(path)
    assert back.segments() == p.segments() and back.shard_weights == p.shard_weights
    data["sync"]["segments"][0]["shard_fractions"] = [0.25, 0.25, 0.25, 0.25]
    with pytest.raises(PlanError, match=r"sync.segments\[0\].shard_fractions: .* the stages and options give"):
        parse_plan(data)
    data = json.loads(path.read_text())
    data["sync"]["shard_weights"]["n0:0"] = -1
    with pytest.raises(PlanError, match=r"sync.shard_weights.n0:0: expected a finite number >= 0, got -1"):
        parse_plan(data)


def _mixed_plan(modes: tuple[str, ...] = ("optimizer+gradients", "none", "optimizer")):  # type: ignore[no-untyped-def]
    """Two VWs cut at layers 2 and 4 and a third whole: segments [0, 2) {n0:0, n0:2, n1:0}, [2, 4) {n0:1, n0:2, n1:0}
    and [4, 6) {n0:1, n0:2, n1:1}, sharded as ``modes`` says."""
    cluster = make_cluster({"n0": 3, "n1": 2})
    profile = _profile()
    vws = [(["n0:0", "n0:1"], [0, 2, 6], 4, 2), (["n1:0", "n1:1"], [0, 4, 6], 4, 2), (["n0:2"], [0, 6], 4, 1)]
    p = make_plan(cluster, profile, vws, optimizer="adam", shard=max(modes, key=SHARD_MODES.index))
    return replace(p, segment_shards=modes, shard_weights={"n0:0": 1.0, "n0:1": 2.0, "n1:0": 3.0, "n1:1": 1.0,
                                                            "n0:2": 2.0})


def test_segments_shard_as_the_plan_says_each_its_own_way(tmp_path: Path) -> None:
    """A plan whose segments shard differently: each segment's mode, its wire bytes, each device's shares; it
    round-trips through plan.json and the simulator compiles and replays it."""
    p = _mixed_plan()
    segs = p.segments()
    assert [(s.first_layer, s.end_layer) for s in segs] == [(0, 2), (2, 4), (4, 6)]
    assert [s.shard for s in segs] == ["optimizer+gradients", "none", "optimizer"]
    assert p.layout.mixed_shards and p.sync_options.shard == "optimizer+gradients"
    assert segs[1].shard_fractions == () and segs[2].shard_fractions == pytest.approx((2 / 5, 2 / 5, 1 / 5))
    # n0:0 holds [0, 2) only, ZeRO-2 at 1 / (1 + 3 + 2); n1:0 holds [0, 4): a share of [0, 2), [2, 4) whole
    layers = p.profile.layers
    size = [sum(x.param_bytes for x in layers[a:b]) for a, b in ((0, 2), (2, 4))]
    assert p.shard_shares("n0:0") == (pytest.approx(1 / 6), pytest.approx(1 / 6))
    share = 3 / 6
    want = (share * size[0] + size[1]) / (size[0] + size[1])
    assert p.shard_shares("n1:0") == (pytest.approx(want), pytest.approx(want))
    # n0:2 holds every segment: ZeRO-2 in the first, whole in the second, ZeRO-1 in the third
    assert p.shard_shares("n0:2")[1] > p.shard_shares("n0:2")[0]
    assert [p.layout.wire_bytes(1.0, s) for s in segs] == [0.5, 1.0, 0.5]
    path = tmp_path / "plan.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["sync"]["segment_shards"] == ["optimizer+gradients", "none", "optimizer"]
    assert [row.get("shard", "none") for row in data["sync"]["segments"]] == data["sync"]["segment_shards"]
    back = load_plan(path)
    assert back.segments() == segs and back.segment_shards == p.segment_shards
    assert "shard per segment: [0, 2) optimizer+gradients; [2, 4) none; [4, 6) optimizer" in back.summary()
    sim = simulate(back)
    assert sim.iteration_s > 0
    uniform = simulate(replace(back, segment_shards=()))  # every segment ZeRO-2: less memory on n0:1's stage
    assert sim.devices["n0:1"].peak_memory_bytes > uniform.devices["n0:1"].peak_memory_bytes


def test_per_segment_modes_that_do_not_fit_the_segments_are_refused(tmp_path: Path) -> None:
    p = _mixed_plan()
    with pytest.raises(SyncLayoutError, match=r"sync.segment_shards: 2 modes for the 3 segments the stages give"):
        replace(p, segment_shards=("optimizer", "none"))
    with pytest.raises(SyncLayoutError, match=r"the most any segment shards is optimizer, the sync option shard is "
                                              r"optimizer\+gradients; they must agree"):
        replace(p, segment_shards=("optimizer", "none", "optimizer"))
    with pytest.raises(SyncLayoutError, match=r"sync.segment_shards\[1\]: 'zero3' is not a shard mode"):
        replace(p, segment_shards=("optimizer+gradients", "zero3", "none"))
    one = make_plan(make_cluster({"n0": 2}), _profile(), [(["n0:0", "n0:1"], [0, 3, 6], 4, 2)], shard="optimizer")
    with pytest.raises(SyncLayoutError, match=r"sync.segment_shards\[0\]: optimizer, but segment 0 \(layers \[0, 3\)\) "
                                              r"has one owner, n0:0: nothing to shard; use none"):
        replace(one, segment_shards=("optimizer", "none"))
    p.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["sync"]["segment_shards"] = "optimizer"
    with pytest.raises(PlanError, match=r"sync.segment_shards: expected a list of shard modes, one per segment"):
        parse_plan(data)
    # another shard option lays every shared segment out at it
    assert [s.shard for s in p.with_sync(options=ZERO1).segments()] == ["optimizer"] * 3


@pytest.mark.parametrize("mode", ["wsp", "hybrid-ps", "daso", "local-sgd"])
def test_relaxed_modes_refuse_sharding_in_one_line(mode: str) -> None:
    with pytest.raises(SyncLayoutError, match=f"shard=optimizer shards the bsp mode's optimizer state; sync mode "
                                              f"{mode} steps each replica's own optimizer"):
        check_mode_options(mode, ZERO1, "--sync-option")


def test_sharding_with_tp_stages_is_refused() -> None:
    cluster = make_cluster({"n0": (A100, 2), "n1": (A100, 2)})
    profile = build_gpt_profile(4, 256, 8, 128, 1000, precision="fp16")
    with pytest.raises(PlannerError, match="no node of cluster"):
        plan(cluster, profile, 8, PlannerOptions(tp=4, shard="optimizer"))
    from tests.test_tp_planning import _tp_plan
    with pytest.raises(SyncLayoutError, match="shard=optimizer with TP stages is not supported"):
        _tp_plan([("n0:0", "n0:1")], [0, 6], sync_options=ZERO1)


def test_the_memory_model_keeps_a_share_of_the_state_and_of_the_gradients() -> None:
    n = 1e9  # bytes of fp32 parameters
    assert estimate_weight_memory(n, 4, "adam") == 4 * n
    assert estimate_weight_memory(n, 4, "adam", 0.25) == pytest.approx(2 * n + 0.5 * n)
    assert estimate_weight_memory(n, 4, "adam", 0.25, 0.25) == pytest.approx(n + 0.25 * n + 0.5 * n)
    profile = _profile()
    end = profile.num_layers
    plain = estimate_stage_memory(profile, 0, end, [], 4, 1, "adam")
    z1 = estimate_stage_memory(profile, 0, end, [], 4, 1, "adam", state_share=0.25)
    z2 = estimate_stage_memory(profile, 0, end, [], 4, 1, "adam", state_share=0.25, grad_share=0.25)
    params = profile.param_bytes
    assert plain - z1 == pytest.approx(0.75 * 2 * params, rel=0.01)
    in_flight = min(0.75 * params, max(ZERO2_IN_FLIGHT_BYTES, max(x.param_bytes for x in profile.layers)))
    assert z1 - z2 == pytest.approx(0.75 * params - in_flight, rel=0.01)
    # several micro-batches: the gradients accumulate whole until the last backward, as unsharded at the peak
    z2m = estimate_stage_memory(profile, 0, end, [], 4, 1, "adam", state_share=0.25, grad_share=0.25,
                                micro_batches=3)
    assert z2m == pytest.approx(z1, rel=1e-9)


def test_the_simulator_counts_a_devices_share_and_the_all_gather_after_the_step() -> None:
    plain = _dp_plan(SyncOptions())
    sharded = _dp_plan(ZERO1, {"n0:0": 3.0, "n0:1": 1.0, "n1:0": 1.0, "n1:1": 1.0})
    dev = {d.name: d for d in plain.cluster.devices}
    vw0, vw1 = sharded.virtual_workers[0], sharded.virtual_workers[1]
    big = estimate_stage_costs(sharded, vw0, vw0.stages[0], dev["n0:0"])
    small = estimate_stage_costs(sharded, vw1, vw1.stages[0], dev["n0:1"])
    whole = estimate_stage_costs(plain, plain.virtual_workers[0], plain.virtual_workers[0].stages[0], dev["n0:0"])
    state = 2 * plain.profile.param_bytes  # AdamW's m and v
    assert whole.weights_bytes - big.weights_bytes == pytest.approx(state * 0.5, rel=1e-6)
    assert whole.weights_bytes - small.weights_bytes == pytest.approx(state * (1 - 1 / 6), rel=1e-6)
    assert big.optimizer_s > small.optimizer_s  # a larger shard to step, the same all-gather
    assert simulate(sharded).iteration_s > 0


@pytest.mark.slow
def test_gpt2_xl_as_pure_dp_on_8_t4s_fits_only_with_zero2() -> None:
    """One sample per T4 per iteration: one micro-batch, so ZeRO-2 holds only the buckets in flight beyond its share
    during the backward; at 8 samples per T4 the activations leave no room even so."""
    cluster = make_cluster({"a": ("T4", 4), "b": ("T4", 4)}, intra_link="pcie3", nic="10Gbit/s")
    profile = build_profile("gpt2-xl")
    opts = PlannerOptions(strategy="dp", max_tp=1, time_budget_s=20)
    for mode in ("none", "optimizer"):
        with pytest.raises(PlannerError, match="fits no arrangement"):
            plan(cluster, profile, 8, replace(opts, shard=mode))
    with pytest.raises(PlannerError, match="fits no arrangement"):
        plan(cluster, profile, 64, replace(opts, shard="optimizer+gradients"))
    p = plan(cluster, profile, 8, replace(opts, shard="auto"))
    assert p.sync_options.shard == "optimizer+gradients" and len(p.virtual_workers) == 8
    assert p.options["shard_choice"]["chosen"] == "optimizer+gradients"
    assert all(m.peak_bytes <= m.capacity_bytes for m in p.prediction.memory)
    assert "sharded (optimizer+gradients, by memory)" in p.summary()


def test_shards_are_sized_by_the_memory_each_stage_leaves_free() -> None:
    cluster = make_cluster({"a": (A100, 1), "v": (V100, 1)}, nic="10Gbit/s")
    profile = build_profile("gpt2-medium")
    p = plan(cluster, profile, 16, PlannerOptions(strategy="dp", max_tp=1, shard="optimizer", time_budget_s=10))
    share = {d: p.shard_shares(d)[0] for d in ("a:0", "v:0")}
    assert share["a:0"] > 0.5 > share["v:0"] and share["a:0"] + share["v:0"] == pytest.approx(1.0)
    by_speed = plan(cluster, profile, 16, PlannerOptions(strategy="dp", max_tp=1, time_budget_s=10,
                                                         sync_options=SyncOptions(shard="optimizer",
                                                                                  shard_by="speed")))
    assert by_speed.shard_weights["a:0"] > by_speed.shard_weights["v:0"]
    assert all(m.peak_bytes <= m.capacity_bytes for m in p.prediction.memory)


def test_auto_plans_without_sharding_where_every_vw_is_one_plain_stage() -> None:
    cluster = make_cluster({"n0": 2})
    p = plan(cluster, _profile(), 8, PlannerOptions(strategy="dp", shard="auto", time_budget_s=5))
    assert p.sync_options.shard == "none" and p.options["shard_choice"]["chosen"] == "none"


def test_the_cli_refuses_shard_flags_that_disagree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetrain.cli import main
    cluster = tmp_path / "c.toml"
    cluster.write_text('name = "c"\n[[node]]\nname = "n0"\ndevices = [{ type = "cpu", count = 2 }]\n')
    base = ["plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--global-batch", "8", "--shard", "optimizer"]
    assert main([*base, "--sync-option", "shard=none"]) != 0
    assert "--shard optimizer and --sync-option shard=none disagree: give one" in capsys.readouterr().err
    assert main([*base, "--sync", "wsp"]) != 0
    assert "--shard optimizer: sharding is the bsp mode's; sync mode wsp" in capsys.readouterr().err


def _two_segment_plan(small_memory: float, shard: str = "optimizer+gradients"):  # type: ignore[no-untyped-def]
    """Two VWs of two stages cut at layer 3: segment [0, 3) (the embeddings) on a:0, a:1 of ``small_memory`` bytes,
    segment [3, 6) on b:0, b:1 of 64 GB; one micro-batch each (so ZeRO-2 holds less than ZeRO-1); every shared
    segment at ``shard``, shards sized as the planner sizes them."""
    cluster = parse_cluster({"name": "c", "node": [
        {"name": "a", "devices": [{"type": "cpu", "count": 2, "memory_bytes": small_memory}], "nic": "1Gbit/s"},
        {"name": "b", "devices": [{"type": "cpu", "count": 2, "memory_bytes": 64e9}], "nic": "1Gbit/s"}]})
    profile = build_gpt_profile(4, 256, 8, 128, 200_000)  # the embeddings, 200 MB, are most of the weights
    p = make_plan(cluster, profile, [(["a:0", "b:0"], [0, 3, 6], 4, 1), (["a:1", "b:1"], [0, 3, 6], 4, 1)],
                  optimizer="adam", shard=shard)
    sized = size_shards(p)
    assert sized is not None
    return sized


def _memory_for(profile, device, tensor_bytes: float) -> float:  # type: ignore[no-untyped-def]
    """The device memory whose tensor budget (``cost.tensor_budget``) is ``tensor_bytes``."""
    fp = runtime_footprint(profile, device)
    return (tensor_bytes * (1.0 + fp.allocator_fraction) + fp.fixed_bytes) / (1.0 - MEMORY_MARGIN_FRACTION)


def test_each_segment_takes_the_lightest_mode_its_owners_fit() -> None:
    """The embeddings' segment on small devices keeps ZeRO-1 (unsharded they do not fit, ZeRO-1 is the lightest
    that does); the other segment, whose owners have room, is not sharded: its all-gather after the step and its
    owners' larger optimizer step go, and its gradients are all-reduced whole."""
    big = _two_segment_plan(64e9)
    device = big.cluster.device("a:0")
    whole = stage_memory(replace(big, sync_options=SyncOptions(), shard_weights={}), "a:0")
    zero1 = stage_memory(_two_segment_plan(64e9, "optimizer"), "a:0")
    assert zero1 < whole
    small = _memory_for(big.profile, device, (whole + zero1) / 2)  # fits ZeRO-1, not unsharded
    p = _two_segment_plan(small)
    lighter, rows = lighten_segments(p)
    assert [s.shard for s in lighter.segments()] == ["optimizer", "none"]
    assert lighter.segment_shards == ("optimizer", "none") and lighter.sync_options.shard == "optimizer"
    assert [(r["layers"], r["shard"], r["why"]) for r in rows] == [
        ([0, 3], "optimizer", "needs optimizer sharding"), ([3, 6], "none", "fits unsharded")]
    for s in (s for vw in lighter.virtual_workers for s in vw.stages):
        assert s.predicted_memory_bytes <= tensor_budget(lighter.profile, lighter.cluster.device(s.device))
    assert {m.device: m.peak_bytes for m in lighter.prediction.memory}["a:0"] < small
    # b's owners step their whole state and gather nothing; their gradients travel whole
    assert [lighter.layout.wire_bytes(1.0, s) for s in lighter.segments()] == [0.5, 1.0]
    assert lighter.shard_shares("b:0") == (1.0, 1.0) and lighter.shard_weights["a:0"] > 0
    assert set(lighter.shard_weights) == {"a:0", "a:1"}  # b's stages size no shard
    # where every segment's owners have room, none is sharded; where none fits, the plan's modes stay
    assert lighten_segments(big)[0].sync_options.shard == "none"
    tight = _two_segment_plan(_memory_for(big.profile, device, stage_memory(p, "a:0")))
    assert [(r["shard"], r["why"]) for r in lighten_segments(tight)[1]] == [
        ("optimizer+gradients", "needs optimizer+gradients sharding"), ("none", "fits unsharded")]


def test_auto_shards_the_embeddings_stages_and_not_the_others() -> None:
    """gpt2-xl at a global batch of 128 on two nodes of four T4s, one node's of 16 GB and the other's of 16 GiB: two
    VWs of four stages. ZeRO-1 for every segment is what the search finds; then only the first stages' segment,
    which holds the embeddings (the largest layers), needs it: the others fit unsharded, and lose their all-gather.
    Every device fits, and the plan is no slower than ZeRO-1 for all, by the simulator and by the closed forms."""
    cluster = parse_cluster({"name": "t4", "node": [
        {"name": "a", "devices": [{"type": "T4", "count": 4, "memory": "16GB"}], "intra_link": "pcie3",
         "nic": "10Gbit/s"},
        {"name": "b", "devices": [{"type": "T4", "count": 4}], "intra_link": "pcie3", "nic": "10Gbit/s"}]})
    profile = build_profile("gpt2-xl")
    opts = PlannerOptions(max_tp=1, time_budget_s=None)  # no budget: the same plan however loaded the host

    def score(q):  # type: ignore[no-untyped-def]
        return simulate(q).iteration_s

    p = plan(cluster, profile, 128, replace(opts, shard="auto"), score)
    modes = [s.shard for s in p.segments() if s.shared]
    assert modes[0] == "optimizer" and "none" in modes, modes
    assert p.segment_shards == tuple(s.shard for s in p.segments()) and p.sync_options.shard == "optimizer"
    assert all(m.peak_bytes <= m.capacity_bytes for m in p.prediction.memory)
    for s in (s for vw in p.virtual_workers for s in vw.stages):
        assert s.predicted_memory_bytes <= tensor_budget(profile, cluster.device(s.device))
    choice = p.options["shard_choice"]
    assert choice["chosen"] == "optimizer"
    assert [r["why"] for r in choice["segments"]][:2] == ["needs optimizer sharding", "fits unsharded"]
    per = choice["modes"]["optimizer"]["per_segment"]
    assert per["kept"] and per["simulated_iteration_s"] <= per["uniform_simulated_iteration_s"]
    uniform = plan(cluster, profile, 128, replace(opts, shard="optimizer"), score)
    assert not uniform.segment_shards and uniform.prediction.simulated_iteration_s is not None
    def cuts(q):  # type: ignore[no-untyped-def]
        return [(s.device, s.first_layer, s.end_layer, s.recompute) for vw in q.virtual_workers for s in vw.stages]
    assert cuts(p) == cuts(uniform)  # the same stages, sharded otherwise
    assert p.prediction.simulated_iteration_s <= uniform.prediction.simulated_iteration_s
    assert p.prediction.iteration_s <= uniform.prediction.iteration_s
    assert reprice(uniform).prediction.iteration_s == pytest.approx(uniform.prediction.iteration_s, rel=1e-9)
    text = p.summary()
    assert "sharded (per segment, at most optimizer, by memory)" in text
    assert "shard per segment: [0, 12) optimizer (needs optimizer sharding); [12, 25) none (fits unsharded)" in text


def test_per_segment_modes_are_kept_only_where_they_are_not_slower() -> None:
    """The plan with each segment at its lightest mode replaces the planning's where it simulates no slower; else
    the planning's stays, and its record says which segments could have been lighter and why they were not."""
    from hetrain.planner.budget import PlannerReport
    from hetrain.planner.search import REPORT_KEY, _per_segment
    big = _two_segment_plan(64e9)
    whole = stage_memory(replace(big, sync_options=SyncOptions(), shard_weights={}), "a:0")
    zero1 = stage_memory(_two_segment_plan(64e9, "optimizer"), "a:0")
    p = _two_segment_plan(_memory_for(big.profile, big.cluster.device("a:0"), (whole + zero1) / 2))
    report = PlannerReport(1, 1, 1, 1, "all candidates", None).to_dict()
    p = replace(p, options={REPORT_KEY: report}, prediction=replace(p.prediction, simulated_iteration_s=1.0))
    for mixed_s, kept in ((1.0, True), (1.1, False)):
        got, record = _per_segment(PlannerOptions(), p, lambda q, t=mixed_s: t if q.segment_shards else 1.0, None)
        assert record["per_segment"]["kept"] is kept and record["per_segment"]["simulated_iteration_s"] == mixed_s
        assert got.segment_shards == (("optimizer", "none") if kept else ())
        assert got.prediction.simulated_iteration_s == (mixed_s if kept else 1.0)
        assert PlannerReport.from_dict(got.options[REPORT_KEY]).simulations == 2  # the per-segment plan's
        assert [(r["shard"], r["why"]) for r in record["segments"]] == ([
            ("optimizer", "needs optimizer sharding"), ("none", "fits unsharded")] if kept else [
            ("optimizer+gradients", "needs optimizer sharding, but kept optimizer+gradients: the plan with "
                                    "per-segment modes was slower"),
            ("optimizer+gradients", "fits unsharded, but kept optimizer+gradients: the plan with per-segment modes "
                                    "was slower")])
    got, record = _per_segment(PlannerOptions(), p, lambda q: 0.5, 0.0)  # the budget is spent: not simulated
    assert got is p and record["per_segment"] == {"kept": False}
    # without a simulation, the closed forms of both at their own shards
    unsimulated = replace(p, prediction=replace(p.prediction, simulated_iteration_s=None))
    got, record = _per_segment(PlannerOptions(), unsimulated, None, None)
    per = record["per_segment"]
    assert per["kept"] is (per["iteration_s"] <= per["uniform_iteration_s"])
    # nor re-priced once the budget is spent: the budget covers the closed forms of the whole plan too
    got, record = _per_segment(PlannerOptions(), unsimulated, None, 0.0)
    assert got is unsimulated and record["per_segment"] == {"kept": False}
    assert all("not tried: the time budget was spent" in r["why"] for r in record["segments"]), record["segments"]


def test_a_sharded_planning_past_the_budget_is_skipped_only_where_memory_did_not_shape_the_plan() -> None:
    """gpt2-small on eight T4s over 10 Gbit/s pipelines for its links, not for memory (each T4 holds the whole model
    and its state): under a budget the plan without sharding has already spent, a second search would only run past
    it (at 4096 devices, 4 to 17 s), so ZeRO-1 is skipped, recorded, and the summary says so. Without a budget it is
    planned. gpt2-xl does not fit a T4 whole: memory shaped its pipeline, and ZeRO-1 is planned whatever the
    budget (at 1024 devices x 200 layers it was 27% faster)."""
    cluster = parse_cluster({"name": "t4", "node": [
        {"name": n, "devices": [{"type": "T4", "count": 4}], "intra_link": "pcie3", "nic": "10Gbit/s"}
        for n in ("a", "b")]})

    def score(q):  # type: ignore[no-untyped-def]
        return simulate(q).iteration_s

    small = build_profile("gpt2-small")
    tight = plan(cluster, small, 64, PlannerOptions(max_tp=1, shard="auto", time_budget_s=1e-6), score)
    choice = tight.options["shard_choice"]
    assert max(len(vw.stages) for vw in tight.virtual_workers) > 1  # a pipeline: sharding is worth asking about
    assert not any(s.recompute for vw in tight.virtual_workers for s in vw.stages)
    assert choice["chosen"] == "none" and tight.sync_options.shard == "none"
    assert set(choice["modes"]) == {"none", "optimizer"}
    skipped = choice["modes"]["optimizer"]["skipped"]
    assert skipped.startswith("its search (about ") and "would not fit the time budget left (0.0 s)" in skipped
    assert skipped.endswith("and memory shaped no part of the plan without it")
    assert "shard optimizer: not planned (the time budget)" in tight.summary()
    assert tight.prediction.simulated_iteration_s is not None  # the plan returned is simulated all the same
    free = plan(cluster, small, 64, PlannerOptions(max_tp=1, shard="auto", time_budget_s=None), score)
    assert "iteration_s" in free.options["shard_choice"]["modes"]["optimizer"]
    xl = plan(cluster, build_profile("gpt2-xl"), 128, PlannerOptions(max_tp=1, shard="auto", time_budget_s=1e-6),
              score)
    assert "iteration_s" in xl.options["shard_choice"]["modes"]["optimizer"]  # memory-shaped: planned past it


def test_past_the_budget_only_the_shard_mode_chosen_is_simulated() -> None:
    """gpt2-xl on eight T4s: memory shaped its pipeline, so ZeRO-1 is planned past a spent budget too. Each
    mode's planning leaves its chosen plan's simulation to ``plan_shards``, which chooses among them by the closed
    forms and simulates that one plan: one call of the scorer, not one per mode (at 4096 devices x 200 layers a
    simulation takes 20 s); the report counts it and its seconds past the budget. Without a budget every mode's
    plan is simulated and the simulator chooses, as before."""
    cluster = parse_cluster({"name": "t4", "node": [
        {"name": n, "devices": [{"type": "T4", "count": 4}], "intra_link": "pcie3", "nic": "10Gbit/s"}
        for n in ("a", "b")]})
    calls: list[int] = []

    def score(q):  # type: ignore[no-untyped-def]
        calls.append(len(q.virtual_workers))
        return simulate(q).iteration_s

    xl = build_profile("gpt2-xl")
    tight = plan(cluster, xl, 128, PlannerOptions(max_tp=1, shard="auto", time_budget_s=1e-6), score)
    modes = tight.options["shard_choice"]["modes"]
    planned = {m: row for m, row in modes.items() if "iteration_s" in row}
    assert len(planned) >= 2 and len(calls) == 1
    chosen = tight.options["shard_choice"]["chosen"]
    assert min(planned, key=lambda m: planned[m]["iteration_s"]) == chosen  # by the closed forms
    assert [m for m, row in planned.items() if row["simulated_iteration_s"] is not None] == [chosen]
    assert tight.prediction.simulated_iteration_s == pytest.approx(simulate(tight).iteration_s)
    report = tight.options["planner_report"]
    assert report["simulations"] == 1 and report["past_budget_s"] > 0
    calls.clear()
    free = plan(cluster, xl, 128, PlannerOptions(max_tp=1, shard="auto", time_budget_s=None), score)
    rows = free.options["shard_choice"]["modes"]
    assert all(row["simulated_iteration_s"] is not None for row in rows.values() if "iteration_s" in row)
    assert len(calls) > 1

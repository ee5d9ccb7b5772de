"""Tensor parallelism on the planning side: the plan's TP groups, one rank's costs, the planner's choice of degree."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.factories import A100, make_cluster, make_plan

import hetrain
from hetrain.cluster import ClusterError, tp_cluster
from hetrain.cost import (
    MEASURED_TP,
    SCALED_TP,
    estimate_layer_time,
    estimate_ring_allreduce_time,
    estimate_tp_collective_time,
    tp_rank_profile,
)
from hetrain.models.analytic import build_gpt_profile, build_profile, gpt_block_params
from hetrain.plan import FORMAT_VERSION, PlanError, Stage, VirtualWorker, load_plan, parse_plan
from hetrain.planner.search import PlannerError, PlannerOptions, plan
from hetrain.profile import LayerProfile, Measurement, ProfileError, parse_profile
from hetrain.simulator import simulate

NVLINK = {"a0": (A100, 8), "a1": (A100, 8), "v0": ("V100-32GB", 8), "v1": ("V100-32GB", 8)}


def _gpt(num_layers: int = 4, hidden: int = 256, heads: int = 8, seq: int = 128) -> hetrain.ModelProfile:
    return build_gpt_profile(num_layers, hidden, heads, seq, 1000, precision="fp16")


# --- one rank's profile ---------------------------------------------------------------------------------------


def test_a_rank_holds_a_kth_of_the_split_parts_and_all_of_the_rest() -> None:
    p = _gpt(hidden=256)
    block, embed = p.layers[1], p.layers[0]
    h = 256
    assert block.tp is not None and embed.tp is None
    for k in (2, 4):
        r = tp_rank_profile(p, k)
        assert r.tp_degree == k and r.name == p.name
        rb = r.layers[1]
        whole_params = gpt_block_params(h)
        split = 12 * h * h + 7 * h  # Megatron: QKV, fc1 (weights and biases), projection, fc2 (weights)
        assert rb.param_bytes == pytest.approx(4 * (whole_params - split + split / k))
        assert rb.saved_bytes_per_sample < block.saved_bytes_per_sample
        assert rb.saved_bytes_per_sample > block.saved_bytes_per_sample / k  # the LN inputs and masks stay whole
        assert rb.output_bytes_per_sample == block.output_bytes_per_sample  # every rank holds the whole output
        assert r.sent_bytes_per_sample(1) == pytest.approx(block.output_bytes_per_sample / k)
        assert r.layers[0] == embed  # no TP rule: replicated, the same on every rank
    assert tp_rank_profile(p, 1) is p
    assert tp_rank_profile(p, 2) is tp_rank_profile(p, 2)  # cached


def test_a_ranks_profile_is_never_saved() -> None:
    with pytest.raises(ValueError, match="one TP rank's view"):
        tp_rank_profile(_gpt(), 2).to_dict()


def test_measured_times_split_by_the_flop_share_unless_measured_on_a_rank() -> None:
    base = _gpt()
    block = base.layers[1]
    one = (Measurement(4, 1.0, 2.0),)
    at2 = (Measurement(4, 0.3, 0.7),)
    measured = replace(block, measured=(("A100-40GB", one),), measured_tp=(("A100-40GB", 2, at2),))
    p = replace(base, layers=(base.layers[0], measured, *base.layers[2:]))
    r2, r4 = tp_rank_profile(p, 2), tp_rank_profile(p, 4)
    assert r2.layers[1].measured == (("A100-40GB", tuple(replace(m, source=MEASURED_TP) for m in at2)),)
    (t4,) = r4.layers[1].measured[0][1]
    assert t4.source == SCALED_TP
    # every FLOP of a GPT block is split: 1 / (k * efficiency)
    assert t4.forward_s == pytest.approx(1.0 / (4 * p.tp_efficiency))
    assert t4.backward_s == pytest.approx(2.0 / (4 * p.tp_efficiency))
    group2 = tp_cluster(make_cluster({"n0": (A100, 4)}, intra_link="nvlink3"), 2).devices[0]
    group4 = tp_cluster(make_cluster({"n0": (A100, 4)}, intra_link="nvlink3"), 4).devices[0]
    # measured on a rank of 2: the collectives are in the figure, none added
    assert estimate_layer_time(r2, 1, group2, 4) == pytest.approx((0.3, 0.7))
    comm = estimate_tp_collective_time(block.tp.allreduce_bytes_per_sample * 4, 2, 4, group4.tp_link)
    assert comm > 0
    f, b = estimate_layer_time(r4, 1, group4, 4)
    assert f == pytest.approx(t4.forward_s + comm) and b == pytest.approx(t4.backward_s + comm)


def test_the_collectives_are_megatrons_ring_all_reduces_on_the_nodes_link() -> None:
    link = make_cluster({"n0": (A100, 8)}, intra_link="nvlink3").nodes[0].intra_link
    one = estimate_ring_allreduce_time(1e6, 8, link.bandwidth_bytes_per_s, link.step_latency_s)
    assert estimate_tp_collective_time(2e6, 2, 8, link) == pytest.approx(2 * one)
    assert estimate_tp_collective_time(2e6, 2, 1, link) == 0.0


def test_a_rank_profile_costed_on_a_lone_device_is_a_bug_caught() -> None:
    lone = make_cluster({"n0": (A100, 2)}).devices[0]
    with pytest.raises(ValueError, match="TP 2 profile"):
        estimate_layer_time(tp_rank_profile(_gpt(), 2), 1, lone, 1)


def test_tp_fields_round_trip_and_bad_ones_are_named() -> None:
    p = _gpt()
    data = p.to_dict()
    assert "tp" in data["layers"][1] and "tp" not in data["layers"][0]
    assert parse_profile(json.loads(json.dumps(data))) == p
    data["layers"][1]["tp"]["split_param_bytes"] = 10 * p.layers[1].param_bytes
    with pytest.raises(ProfileError, match=r"layer 'block0': tp.split_param_bytes = .* must be in \[0, "):
        parse_profile(data)
    bad = p.to_dict()
    bad["layers"][1]["tp"]["splitt"] = 1
    with pytest.raises(ProfileError, match=r"layers\[1\].tp: unknown key 'splitt'"):
        parse_profile(bad)
    with pytest.raises(ProfileError, match="degree 3 must be a power of two"):
        LayerProfile("x", 1, 1, 1, 1, measured_tp=(("A100-40GB", 3, (Measurement(1, 1, 1),)),))


# --- the cluster of TP groups -----------------------------------------------------------------------------


def test_tp_cluster_groups_a_nodes_devices_of_one_type_and_shares_its_nic() -> None:
    c = make_cluster({"n0": (A100, 4), "n1": ("V100-32GB", 2)}, intra_link="nvlink3", nic="100Gbit/s")
    g2 = tp_cluster(c, 2)
    assert [d.tp_group for d in g2.devices] == [("n0:0", "n0:1"), ("n0:2", "n0:3"), ("n1:0", "n1:1")]
    assert [d.index for d in g2.devices] == [0, 1, 2]
    assert g2.nodes[0].nic.bandwidth_bytes_per_s == pytest.approx(c.nodes[0].nic.bandwidth_bytes_per_s / 2)
    assert g2.devices[0].tp_link == c.nodes[0].intra_link
    g4 = tp_cluster(c, 4)
    assert [n.name for n in g4.nodes] == ["n0"]  # n1 has no group of 4
    with pytest.raises(ClusterError, match=r"no node .* has 8 devices of one type"):
        tp_cluster(c, 8)
    assert tp_cluster(c, 1) is c


# --- the plan -----------------------------------------------------------------------------------------------


def _tp_plan(groups: list[tuple[str, ...]], bounds: list[int], profile: hetrain.ModelProfile | None = None,
             **kw: object) -> hetrain.Plan:
    cluster = make_cluster({"n0": (A100, 4), "n1": (A100, 4)}, intra_link="nvlink3", nic="100Gbit/s")
    stages = tuple(Stage(g[0], bounds[j], bounds[j + 1], tp_group=g if len(g) > 1 else ())
                   for j, g in enumerate(groups))
    return make_plan(cluster, profile or _gpt(), [VirtualWorker(stages, 8, 4)], **kw)  # type: ignore[arg-type]


def test_a_plan_with_tp_groups_round_trips_and_reads_older_plans(tmp_path: Path) -> None:
    p = _tp_plan([("n0:0", "n0:1"), ("n1:0", "n1:1", "n1:2", "n1:3")], [0, 3, 6])
    assert p.devices_used == ["n0:0", "n0:1", "n1:0", "n1:1", "n1:2", "n1:3"]
    assert p.unused_devices == ["n0:2", "n0:3"]
    assert p.stage_of("n1:2") == (0, 1) and p.stage_on("n0:1").tp == 2 and p.max_tp == 4
    path = tmp_path / "plan.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION
    assert data["virtual_workers"][0]["stages"][1]["tp_group"] == ["n1:0", "n1:1", "n1:2", "n1:3"]
    assert load_plan(path).virtual_workers == p.virtual_workers
    assert "TP4" in p.summary() and "TP groups: n0:0 = n0:0 .. n0:1 (2)" in p.summary()
    old = _tp_plan([("n0:0",), ("n1:0",)], [0, 3, 6]).to_dict()
    old["format_version"] = 2  # a plan of the format before TP reads as it is
    assert parse_plan(old).max_tp == 1
    old["format_version"] = 6
    with pytest.raises(PlanError, match="format_version: 6 is not supported"):
        parse_plan(old)


@pytest.mark.parametrize(("group", "message"), [
    (("n0:0", "n1:0"), "spans nodes n0, n1"),
    (("n0:0", "n0:1", "n0:2"), "has 3 device"),
    (("n0:1", "n0:0"), "must start with the stage's device 'n0:0'"),
    (("n0:0", "n0:0"), "names a device twice"),
    (("n0:0", "n9:0"), "device 'n9:0' is not in cluster"),
])
def test_a_bad_tp_group_is_refused_in_one_line(group: tuple[str, ...], message: str) -> None:
    cluster = make_cluster({"n0": (A100, 4), "n1": (A100, 4)}, intra_link="nvlink3", nic="100Gbit/s")
    stage = Stage("n0:0", 0, 6, tp_group=group)
    with pytest.raises(PlanError, match=message):
        make_plan(cluster, _gpt(), [VirtualWorker((stage,), 8, 4)])


def test_a_tp_group_of_two_types_is_refused() -> None:
    cluster = hetrain.parse_cluster({"name": "mixed", "node": [
        {"name": "n0", "devices": [{"type": A100, "count": 1}, {"type": "V100-32GB", "count": 1}],
         "intra_link": "nvlink3"}]})
    with pytest.raises(PlanError, match="mixes device types"):
        make_plan(cluster, _gpt(), [VirtualWorker((Stage("n0:0", 0, 6, tp_group=("n0:0", "n0:1")),), 8, 4)])


def test_vws_that_split_a_layer_differently_are_refused() -> None:
    cluster = make_cluster({"n0": (A100, 4)}, intra_link="nvlink3")
    vw0 = VirtualWorker((Stage("n0:0", 0, 6, tp_group=("n0:0", "n0:1")),), 4, 2)
    vw1 = VirtualWorker((Stage("n0:2", 0, 3), Stage("n0:3", 3, 6)), 4, 2)
    with pytest.raises(PlanError, match="layer 0 runs at TP degree 2 in VW0 and 1 in VW1"):
        make_plan(cluster, _gpt(), [vw0, vw1])
    vw1 = VirtualWorker((Stage("n0:2", 0, 6, tp_group=("n0:2", "n0:3")),), 4, 2)
    two = make_plan(cluster, _gpt(), [vw0, vw1])
    (seg,) = two.segments()
    assert seg.owners == ("n0:0", "n0:2")  # the groups' first devices: rank j reduces with rank j
    assert seg.param_bytes == pytest.approx(tp_rank_profile(_gpt(), 2).param_bytes)  # one rank's bytes


# --- the simulator -----------------------------------------------------------------------------------------


def test_a_tp_stage_simulates_as_one_rank_of_its_group() -> None:
    big = _gpt(hidden=2048, heads=16, seq=1024)  # blocks of milliseconds: the all-reduces' latency is small beside
    tp = _tp_plan([("n0:0", "n0:1"), ("n1:0", "n1:1")], [0, 3, 6], big)
    one = _tp_plan([("n0:0",), ("n1:0",)], [0, 3, 6], big)
    a, b = simulate(tp), simulate(one)
    assert a.iteration_s < b.iteration_s  # half the FLOPs per rank at 0.9, the all-reduces on NVLink
    assert set(a.devices) == {"n0:0", "n1:0"}  # the schedule names the groups' first devices
    assert a.devices["n0:0"].peak_memory_bytes < b.devices["n0:0"].peak_memory_bytes


# --- the planner ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_on_nvlink_nodes_a_13b_model_plans_with_tp_and_predicts_1_3x() -> None:
    """Issue 34's target: 8-GPU NVLink nodes (A100 and V100) on 25 Gbit/s, a 13B GPT (Narayanan et al. 2021,
    table 1 shape at seq 2048) at global batch 64: a plan with TP, predicted >= 1.3x the best without."""
    cluster = make_cluster(NVLINK, intra_link="nvlink3", nic="25Gbit/s")
    profile = build_gpt_profile(40, 5120, 40, 2048, 50257, name="gpt-13b")
    opts = PlannerOptions(time_budget_s=None, simulate_top_k=0)
    with_tp = plan(cluster, profile, 64, replace(opts, max_tp=8))
    without = plan(cluster, profile, 64, replace(opts, max_tp=1))
    assert with_tp.max_tp > 1
    assert with_tp.options["tp_choice"]["chosen"] == with_tp.max_tp
    assert without.prediction.iteration_s / with_tp.prediction.iteration_s >= 1.3
    assert all(len({hetrain_node(with_tp, d) for d in s.devices}) == 1
               for vw in with_tp.virtual_workers for s in vw.stages)


def hetrain_node(p: hetrain.Plan, device: str) -> str:
    return p.cluster.device(device).node


def test_on_pcie_nodes_a_model_that_fits_plans_without_tp() -> None:
    cluster = make_cluster({"n0": ("RTX3090", 8), "n1": ("RTX3090", 8)}, intra_link="pcie3", nic="10Gbit/s")
    p = plan(cluster, build_profile("gpt2-xl"), 64, PlannerOptions(time_budget_s=None, simulate_top_k=0))
    assert p.max_tp == 1
    assert set(p.options["tp_choice"]["degrees"]) == {"1", "2", "4", "8"}  # every degree was planned


def test_tp_is_forced_capped_or_refused_by_name() -> None:
    cluster = make_cluster({"n0": (A100, 4), "n1": (A100, 4)}, intra_link="nvlink3", nic="100Gbit/s")
    opts = PlannerOptions(time_budget_s=None, simulate_top_k=0)
    forced = plan(cluster, _gpt(), 32, replace(opts, tp=4))
    assert {s.tp for vw in forced.virtual_workers for s in vw.stages} == {4}
    assert set(forced.options["tp_choice"]["degrees"]) == {"4"}  # no other degree was planned
    assert plan(cluster, _gpt(), 32, replace(opts, max_tp=1)).max_tp == 1
    with pytest.raises(PlannerError, match="no layer with a TP rule"):
        plan(cluster, build_profile("vgg19"), 32, replace(opts, tp=2))
    with pytest.raises(PlannerError, match=r"no node of cluster .* has 8 devices of one type"):
        plan(cluster, _gpt(), 32, replace(opts, tp=8))
    with pytest.raises(ValueError, match="max_tp must be a power of two"):
        PlannerOptions(max_tp=3)


def test_the_plan_command_takes_max_tp_and_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetrain.cli import main

    out = tmp_path / "p.json"
    rc = main(["plan", "--cluster", "examples/clusters/nvlink-nodes.toml", "--model", "gpt2-medium",
               "--global-batch", "64", "--tp", "2", "--time-budget", "1s", "-o", str(out)])
    assert rc == 0
    p = load_plan(out)
    assert p.max_tp == 2 and "TP2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--cluster", "examples/clusters/nvlink-nodes.toml", "--model", "gpt2-medium",
              "--global-batch", "64", "--max-tp", "3"])
    assert exit_info.value.code == 2
    assert "--max-tp: expected a power of two from 1 to 16, got 3" in capsys.readouterr().err


def test_a_measured_profile_takes_its_tp_splits_from_the_analytic_one_where_layers_line_up() -> None:
    from hetrain.profile_combine import with_tp_splits

    analytic = _gpt()
    measured = replace(analytic, layers=tuple(
        replace(layer, tp=None, saved_bytes_per_sample=2 * layer.saved_bytes_per_sample,
                measured=(("cpu", (Measurement(1, 1e-3, 2e-3),)),)) for layer in analytic.layers))
    both, note = with_tp_splits(measured, analytic)
    assert "TP splits of 4 layer(s)" in note and "estimated" in note
    a, m = analytic.layers[1].tp, both.layers[1].tp
    assert m is not None and a is not None
    assert m.split_param_bytes == pytest.approx(a.split_param_bytes)
    assert m.split_saved_bytes_per_sample == pytest.approx(2 * a.split_saved_bytes_per_sample)  # the same share
    assert both.layers[0].tp is None and both.layers[1].measured == measured.layers[1].measured
    other = replace(measured, layers=(measured.layers[0], replace(measured.layers[1], param_bytes=1.0),
                                      *measured.layers[2:]))
    same, why = with_tp_splits(other, analytic)
    assert same is other and why.startswith("no TP splits: layer 1 (block0)")


def test_tp_plans_only_under_the_sync_mode_the_runtime_runs_them_in() -> None:
    cluster = make_cluster({"n0": (A100, 4)}, intra_link="nvlink3")
    opts = PlannerOptions(time_budget_s=None, simulate_top_k=0)
    assert plan(cluster, _gpt(), 32, replace(opts, sync="wsp")).max_tp == 1
    with pytest.raises(PlannerError, match="sync mode wsp does not run TP stages yet"):
        plan(cluster, _gpt(), 32, replace(opts, sync="wsp", tp=2))
    forced = plan(cluster, _gpt(), 32, replace(opts, sync="auto", tp=2))
    assert forced.max_tp == 2 and forced.sync == "bsp"

"""Re-planning on a changed world (hetrain.elastic): the cluster of the devices present, the plan's options, the
new plan, and the agreement check between ranks."""

from __future__ import annotations

import json

import pytest

import hetrain
from factories import make_plan
from hetrain.catalog import lookup_device_type
from hetrain.cluster import parse_cluster
from hetrain.elastic import (
    PresentDevice,
    ReplanError,
    build_world_cluster,
    check_same_plan,
    made_by_planner,
    plan_digest,
    planner_options_of,
    replan,
    world_differs,
)
from hetrain.models.analytic import build_mlp_profile
from hetrain.plan import parse_plan
from hetrain.sync_layout import SyncOptions

MLP = build_mlp_profile([64, 256, 256, 10], name="mlp-digits")
#: two nodes of two devices each, a slow link between them
TWO_NODES = {
    "name": "pair",
    "node": [
        {"name": "a", "devices": [{"type": "V100-16GB", "count": 2}], "intra_link": "nvlink2", "nic": "100Gbit/s"},
        {"name": "b", "devices": [{"type": "T4", "count": 2}], "intra_link": "pcie3", "nic": "25Gbit/s"},
    ],
    "link": [{"nodes": ["a", "b"], "bandwidth": "10Gbit/s"}],
}


def cpus(count: int, memory: str | None = None) -> dict[str, object]:
    device: dict[str, object] = {"type": "cpu", "count": count}
    if memory is not None:  # a device type of small memory, so that a model needs several of them
        device = {"type": "small", "tflops": 0.1, "memory": memory, "memory_bandwidth": "20GB/s", "count": count}
    return {"name": "cpus", "node": [{"name": "n0", "devices": [device], "intra_link": "loopback",
                                      "nic": "1Gbit/s"}]}


def present(*names: str, type_name: str = "cpu") -> list[PresentDevice]:
    return [PresentDevice(n, type_name) for n in names]


def test_survivors_keep_their_figures_and_links_and_a_lost_nodes_links_go() -> None:
    saved = parse_cluster(TWO_NODES)
    cluster, change = build_world_cluster(saved, present("a:1", "b:0", "b:1"))
    assert [d.name for d in cluster.devices] == ["a:1", "b:0", "b:1"]
    assert [d.index for d in cluster.devices] == [0, 1, 2]
    assert cluster.devices[0].type_name == "V100-16GB" and cluster.devices[1].type_name == "T4"
    assert cluster.nodes[0].intra_link == saved.nodes[0].intra_link and cluster.nodes[1].nic == saved.nodes[1].nic
    assert cluster.link(0, 1).bandwidth_bytes_per_s == pytest.approx(10e9 / 8)  # the [[link]] override stays
    assert change.lost == ("a:0",) and change.added == () and change.assumed_links == ()
    alone, _ = build_world_cluster(saved, present("b:0"))
    assert alone.node_links == ()  # its other end is gone


def test_a_new_node_takes_catalog_figures_and_the_slowest_saved_links() -> None:
    saved = parse_cluster(TWO_NODES)
    cluster, change = build_world_cluster(saved, [*present("c:1", "c:0", type_name="A100"), *present("a:0")])
    assert [d.name for d in cluster.devices] == ["a:0", "c:0", "c:1"]
    new = cluster.device("c:0")
    a100 = lookup_device_type("A100-40GB")
    assert (new.type_name, new.memory_bytes, new.peak_fp32_flops) == ("A100-40GB", a100.memory_bytes,
                                                                       a100.peak_fp32_flops)
    assert cluster.nodes[1].intra_link.bandwidth_bytes_per_s == saved.nodes[1].intra_link.bandwidth_bytes_per_s  # pcie3
    assert cluster.nodes[1].nic.bandwidth_bytes_per_s == pytest.approx(25e9 / 8)
    assert change.added == ("c:0", "c:1") and change.lost == ("a:1", "b:0", "b:1") and change.assumed_links == ("c",)
    assert "links of c assumed" in change.describe()


def test_a_new_device_of_an_unknown_type_is_named() -> None:
    with pytest.raises(ReplanError, match=r"device c:0 is new .* type 'H900' is not in the catalog.*"
                                          "HETRAIN_DEVICE_TYPE"):
        build_world_cluster(parse_cluster(TWO_NODES), present("c:0", type_name="H900"))


def test_a_world_differs_when_a_used_device_is_gone_or_an_unknown_one_is_there() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="sgd", strategy="dp")
    assert plan.devices_used == ["n0:0", "n0:1", "n0:2"]
    assert not world_differs(plan, ["n0:2", "n0:0", "n0:1"])
    assert world_differs(plan, ["n0:0", "n0:1"])
    assert world_differs(plan, ["n0:0", "n0:1", "n0:2", "n1:0"])
    assert not world_differs(plan, ["n0:0", "n0:0", "n0:1", "n0:2"])  # a duplicate is for assign_ranks to refuse


def test_the_options_are_the_plans_own() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="momentum", strategy="pp", schedule="gpipe",
                        sync_options=SyncOptions(bucket_bytes=1_000_000))
    assert made_by_planner(plan)
    opts = planner_options_of(plan)
    assert (opts.strategy, opts.schedule, opts.sync, opts.optimizer, opts.objective) == (
        "pp", "gpipe", "bsp", "momentum", "throughput")
    assert opts.sync_options == plan.sync_options


def test_every_option_is_recorded_and_comes_back_from_the_file() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="sgd", micro_batch_sizes=(2, 4),
                        allow_recompute=False, sync="auto", staleness_penalty=0.5, refine_top_k=2)
    assert plan.options["planner"]["micro_batch_sizes"] == [2, 4] and plan.options["planner"]["sync"] == "auto"
    opts = planner_options_of(parse_plan(json.loads(json.dumps(plan.to_dict()))))
    assert (opts.micro_batch_sizes, opts.allow_recompute, opts.staleness_penalty, opts.refine_top_k) == (
        (2, 4), False, 0.5, 2)
    assert opts.sync == plan.sync != "auto"  # the mode the plan runs, not chosen again
    assert opts.global_batch_choices == ()
    new = replan(plan, present("n0:0", "n0:1")).plan
    assert all(vw.micro_batch_size in (2, 4) for vw in new.virtual_workers)
    assert all(not s.recompute for vw in new.virtual_workers for s in vw.stages)
    assert new.options["planner"] == {**plan.options["planner"], "sync": plan.sync, "schedule": plan.schedule,
                                      "global_batch_choices": [], "time_budget_s": None,
                                      "simulate_top_k": plan.options["planner_report"]["simulated"]}


def test_a_replan_runs_no_clock_and_simulates_as_many_as_the_planning_did() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="sgd")
    assert plan.options["planner"]["time_budget_s"] == 10.0 and plan.options["planner"]["simulate_top_k"] is None
    opts = planner_options_of(plan)
    assert opts.time_budget_s is None
    assert opts.simulate_top_k == plan.options["planner_report"]["simulated"] >= 1
    without = parse_plan({**plan.to_dict(), "options": {k: v for k, v in plan.options.items()
                                                        if k != "planner_report"}})
    assert planner_options_of(without).simulate_top_k == 3
    bounded = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="sgd", simulate_top_k=1)
    assert planner_options_of(bounded).simulate_top_k == 1


def test_a_plan_without_its_options_recorded_is_remade_from_what_it_has() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="momentum", strategy="dp", schedule="gpipe")
    bare = parse_plan({**plan.to_dict(), "options": {k: v for k, v in plan.options.items() if k != "planner"}})
    opts = planner_options_of(bare)
    assert (opts.strategy, opts.schedule, opts.optimizer, opts.micro_batch_sizes) == ("dp", "gpipe", "momentum", None)
    manual = make_plan(parse_cluster(cpus(1)), MLP, [(["n0:0"], [0, 3], 4, 1)])
    assert not made_by_planner(manual)


def test_replanning_is_deterministic_and_keeps_the_global_batch() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3)), MLP, 16, optimizer="sgd")
    first = replan(plan, present("n0:0", "n0:1"), from_step=4)
    again = replan(parse_plan(json.loads(json.dumps(plan.to_dict()))), present("n0:1", "n0:0"), from_step=4)
    assert first.digest == again.digest == plan_digest(first.plan)
    new = first.plan
    assert sorted(new.devices_used) == ["n0:0", "n0:1"] and new.global_batch == 16
    assert (new.optimizer, new.sync, new.precision) == ("sgd", "bsp", plan.precision)
    record = first.record
    assert record["lost"] == ["n0:2"] and record["added"] == [] and record["from_step"] == 4
    assert record["previous_devices"] == plan.devices_used
    assert parse_plan(json.loads(json.dumps(new.to_dict()))).options["replan"] == record  # survives the file


def test_a_world_too_small_is_told_the_memory_it_lacks() -> None:
    plan = hetrain.plan(parse_cluster(cpus(3, "600KB")), MLP, 16, optimizer="sgd")
    with pytest.raises(ReplanError) as info:
        replan(plan, present("n0:0"))
    text = str(info.value)
    assert "\n" not in text
    assert "the 1 device(s) present (n0:0; lost n0:1, n0:2) cannot run the plan's model at global batch 16" in text
    assert "needs at least 682.4 KB" in text and "offers is 570.0 KB" in text


def test_ranks_that_disagree_or_fail_are_named() -> None:
    check_same_plan(["ab12", "ab12", "ab12"])
    with pytest.raises(ReplanError, match="rank 0 ab12, rank 1 cd34, rank 2 ab12"):
        check_same_plan(["ab12", "cd34", "ab12"])
    with pytest.raises(ReplanError, match=r"^re-planning failed on rank 1: boom$"):
        check_same_plan(["ab12", "error: boom", "ab12"])
    with pytest.raises(ReplanError, match=r"^too small$"):  # every rank alike: the reason itself
        check_same_plan(["error: too small", "error: too small"])


def test_a_node_that_joins_is_planned_for_with_its_links_assumed() -> None:
    plan = hetrain.plan(parse_cluster(cpus(2)), MLP, 16, optimizer="sgd")
    replanned = replan(plan, [*present("n0:0", "n0:1"), *present("n1:0", type_name="T4")], from_step=7)
    new = replanned.plan
    assert [d.name for d in new.cluster.devices] == ["n0:0", "n0:1", "n1:0"]
    assert new.cluster.device("n1:0").type_name == "T4"
    assert new.cluster.nodes[1].nic == plan.cluster.nodes[0].nic  # the saved cluster's slowest (its only one)
    assert replanned.record["added"] == ["n1:0"] and replanned.record["assumed_links"] == ["n1"]
    assert replanned.record["lost"] == []
    assert "n1:0" in new.devices_used  # a T4 is far faster than a CPU: the plan gives it work

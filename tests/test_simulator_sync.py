"""The simulator replays the sync modes other than BSP: periodic averages, node-local all-reduce, pushes and
pulls to parameter-server shards with bounded staleness."""

from __future__ import annotations

import dataclasses

import pytest

from factories import A100, V100, link, make_cluster, make_plan, make_profile, replicas
from hetrain.cluster import Cluster
from hetrain.plan import Plan
from hetrain.profile import ModelProfile
from hetrain.simulator import simulate, simulated_iterations
from hetrain.sync_layout import SyncOptions


def two_nodes(nic_bytes_per_s: float = 1e9) -> Cluster:
    return make_cluster({"n0": (A100, 2), "n1": (V100, 2)}, intra_link=link(1e11, 1e-6),
                        nic=link(nic_bytes_per_s, 1e-5), name="t")


def profile(param_bytes: float = 4e7) -> ModelProfile:
    return make_profile(4, times={A100: (0.01, 0.02), V100: (0.02, 0.04)}, micro_batch=4, param_bytes=param_bytes)


def dp_plan(sync: str, param_bytes: float = 4e7, **options: int) -> Plan:
    """Four one-stage VWs: two A100s on n0, two V100s (half as fast) on n1."""
    return make_plan(two_nodes(), profile(param_bytes), replicas(("n0:0", "n0:1", "n1:0", "n1:1"), 4, 4), sync=sync,
                     **options)


@pytest.mark.parametrize("mode", ["wsp", "local-sgd", "hybrid-ps", "daso"])
def test_every_mode_replays_several_iterations(mode: str) -> None:
    plan = dp_plan(mode)
    r = simulate(plan)
    n = simulated_iterations(plan)
    assert n >= 12 and r.timeline.meta["iterations"] == n
    assert r.iteration_s > 0 and r.samples_per_s == pytest.approx(plan.global_batch / r.iteration_s)
    assert sum(e.kind == "forward" for e in r.timeline.devices["n0:0"]) == n


@pytest.mark.parametrize("mode", ["local-sgd", "hybrid-ps", "daso"])
def test_modes_that_sync_less_often_beat_bsp_on_a_slow_network(mode: str) -> None:
    # a NIC slow enough that BSP's all-reduce outlasts the backward it overlaps
    slow = two_nodes(2e8)
    bsp = simulate(dataclasses.replace(dp_plan("bsp"), cluster=slow))
    other = simulate(dataclasses.replace(dp_plan(mode, period=4, aggregate=4), cluster=slow))
    assert other.iteration_s < 0.8 * bsp.iteration_s, (mode, other.iteration_s, bsp.iteration_s)


def test_wsp_staleness_lets_fast_workers_run_ahead() -> None:
    def finish(plan: Plan, dev: str) -> float:
        return max(e.end_s for e in simulate(plan, iterations=12).timeline.devices[dev])

    tight, loose = dp_plan("wsp", 1e5, staleness=0), dp_plan("wsp", 1e5, staleness=3)
    # with D = 0 the A100s wait for the V100s every wave; with D = 3 they finish 3 waves early at most
    assert finish(tight, "n0:0") == pytest.approx(finish(tight, "n1:0"), rel=0.1)
    assert finish(loose, "n0:0") < 0.9 * finish(loose, "n1:0")
    assert simulate(loose).samples_per_s > simulate(tight).samples_per_s


def test_pushes_occupy_the_network() -> None:
    r = simulate(dp_plan("wsp", staleness=1))
    pushes = [e for evs in r.timeline.links.values() for e in evs if e.kind == "push"]
    assert pushes and all(e.end_s > e.start_s for e in pushes)


def test_a_single_iteration_is_replayed_for_bsp() -> None:
    plan = dp_plan("bsp")
    assert simulated_iterations(plan) == 1
    assert dataclasses.replace(plan, sync="local-sgd").sync == "local-sgd"


@pytest.mark.parametrize("placement, senders", [
    ("local", {"n0 NIC out", "n0:0->n0:1", "n1:0->n1:1"}),
    ("sharded", {"n0 NIC out", "n1 NIC out", "n0:0->n0:1", "n1:0->n1:1", "n0:1->n0:0", "n1:1->n1:0"}),
])
def test_pulls_occupy_the_links_from_the_shard_hosts_back(placement: str, senders: set[str]) -> None:
    plan = dp_plan("wsp", staleness=1, placement=placement)
    r = simulate(plan, iterations=12)
    pulls = {name: [e for e in evs if e.kind == "pull"] for name, evs in r.timeline.links.items()}
    # the weights go back from the hosts through their NICs, and inside each node from the node's leader of
    # the shard (the host, else ``cost.ps_node_leader``: the owner after the node's host) to its mate
    assert {name for name, evs in pulls.items() if evs and "NIC in" not in name} == senders
    for name in senders:  # every wave's weights go back once its pushes are in, pulled or not (as the runtime)
        assert [e.label for e in pulls[name]] == [f"PS seg0 wave{c} pull" for c in range(12)]
        assert all(e.end_s > e.start_s for e in pulls[name])


def four_nodes_plan(sync: str, **options: int | str) -> Plan:
    """Eight one-stage VWs on four nodes of two devices, 1 GB/s NICs, 400 MB of parameters: the exchange
    outlasts the compute."""
    cluster = make_cluster({f"n{k}": (A100, 2) for k in range(4)}, intra_link=link(1e11, 1e-6),
                           nic=link(1e9, 1e-5), name="four")
    devices = [f"n{k}:{j}" for k in range(4) for j in range(2)]
    return make_plan(cluster, profile(1e8), replicas(devices, 4, 4), sync=sync, **options)


@pytest.mark.parametrize("sync", ["wsp", "hybrid-ps"])
def test_sharded_servers_spread_the_exchange_and_the_closed_form_follows(sync: str) -> None:
    """One host takes every other owner's 400 MB through its NIC; a shard per node takes a quarter from each.
    The simulator replays both within 10% of the closed form (``planner.sync.estimate_mode_sync_time``)."""
    from hetrain.planner.sync import repredict_sync

    seen = {}
    for placement in ("local", "sharded"):
        plan = four_nodes_plan(sync, staleness=1, placement=placement, aggregate=1)
        closed = repredict_sync(plan, sync, plan.sync_options).prediction.iteration_s
        seen[placement] = simulate(plan, iterations=12).iteration_s
        assert seen[placement] == pytest.approx(closed, rel=0.1), (placement, seen[placement], closed)
    assert seen["sharded"] < 0.5 * seen["local"], seen


def three_vw_plan(placement: str) -> Plan:
    """One VW on n0, two on n1: round-robin puts the shard on n0, local on n1."""
    return make_plan(two_nodes(1e8), profile(), replicas(("n0:0", "n1:0", "n1:1"), 4, 4), sync="wsp", staleness=0,
                     placement=placement)


def test_a_nodes_owners_cross_its_nic_once_wherever_the_server_is() -> None:
    """Local puts the server on n1 (two owners), round-robin on n0 (one). n1's two owners sum their updates in
    the node and cross its NIC once (``cost.estimate_ps_loads``), so either way one segment's range crosses
    each way per wave: the NICs are as busy, where two separate pushes from n1 would double round-robin's."""
    local, robin = three_vw_plan("local"), three_vw_plan("round-robin")
    assert local.segments()[0].ps_shards[0].host == "n1:0" and robin.segments()[0].ps_shards[0].host == "n0:0"

    def nic_busy_s(plan: Plan) -> float:
        r = simulate(plan, iterations=12)
        return sum(e.end_s - e.start_s for name, evs in r.timeline.links.items() if "NIC" in name for e in evs)

    assert nic_busy_s(robin) == pytest.approx(nic_busy_s(local), rel=0.05)
    assert simulate(local).samples_per_s == pytest.approx(simulate(robin).samples_per_s, rel=0.05)
    with pytest.raises(ValueError, match="placement must be one of"):
        dataclasses.replace(local, sync_options=SyncOptions(placement="far"))


def test_the_prediction_replays_daso_past_its_blocking_warm_up_and_cool_down() -> None:
    """A long run's steady iterations (``schedule.steady_sync_state``): the warm-up and the cool-down average
    blocking, a cost per run that the closed form leaves out; ``iterations=n`` still replays a whole run of n."""
    slow = dataclasses.replace(dp_plan("daso", period=4), cluster=two_nodes(2e8))
    never = slow.with_sync("daso", dataclasses.replace(slow.sync_options, warmup=0, cooldown=0))
    steady = simulate(slow).iteration_s
    assert steady == pytest.approx(simulate(never).iteration_s, rel=1e-9)  # whole periods, each start merged
    assert simulate(slow, iterations=12).iteration_s > 1.2 * steady


def test_a_transfer_shares_a_link_with_a_parameter_server_phase_half_each() -> None:
    from hetrain.simulator.links import share

    # a phase holds link 0 until t = 10: a 2 s transfer from t = 4 runs at half rate, both end 2 s later
    until = [10.0, 0.0]
    assert share(until, (0, 1), 4.0, 2.0) == (8.0, [0]) and until == [12.0, 0.0]
    # the phase has 1 s left: 1 s shared (2 s of time), then the transfer's last second alone
    until = [5.0]
    assert share(until, (0,), 4.0, 2.0) == (7.0, [0]) and until == [6.0]

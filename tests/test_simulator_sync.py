"""The simulator replays the sync modes other than BSP: periodic averages, node-local all-reduce, pushes and
pulls to parameter-server shards with bounded staleness."""

from __future__ import annotations

import dataclasses

import pytest

from hetrain.cluster import Cluster, parse_cluster
from hetrain.plan import Plan, Prediction, Stage, VirtualWorker
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.simulator import simulate, simulated_iterations

A100, V100 = "A100-40GB", "V100-16GB"


def two_nodes(nic_bytes_per_s: float = 1e9) -> Cluster:
    fast = {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6}
    nic = {"bandwidth_bytes_per_s": nic_bytes_per_s, "latency_s": 1e-5}
    return parse_cluster({"name": "t", "node": [
        {"name": "n0", "devices": [{"type": A100, "count": 2}], "intra_link": fast, "nic": nic},
        {"name": "n1", "devices": [{"type": V100, "count": 2}], "intra_link": fast, "nic": nic}]})


def profile(param_bytes: float = 4e7) -> ModelProfile:
    ms = ((A100, (Measurement(4, 0.01, 0.02),)), (V100, (Measurement(4, 0.02, 0.04),)))
    return ModelProfile("toy", tuple(LayerProfile(f"l{i}", param_bytes, 1e3, 1e4, 1e9, ms) for i in range(4)), 1e3)


def dp_plan(sync: str, param_bytes: float = 4e7, **options: int) -> Plan:
    """Four one-stage VWs: two A100s on n0, two V100s (half as fast) on n1."""
    vws = tuple(VirtualWorker((Stage(d, 0, 4),), 4, 1) for d in ("n0:0", "n0:1", "n1:0", "n1:1"))
    return Plan("toy", 16, "1f1b", sync, "sgd", vws, Prediction(0, 0, 0, 0, 0),  # type: ignore[arg-type]
                "dp", "manual", two_nodes(), profile(param_bytes), options)


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
    bsp = simulate(dp_plan("bsp"))
    other = simulate(dp_plan(mode, period=4, aggregate=4))
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

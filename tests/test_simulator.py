"""The simulator against closed forms, hand-computed timelines and the memory model."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from factories import make_cluster, make_plan, replicas
from hetrain.cluster import Cluster, parse_cluster
from hetrain.cost import (
    estimate_1f1b_period,
    estimate_1f1b_pipeline_time,
    estimate_allreduce_time,
    estimate_blocking_pipeline_time,
    estimate_optimizer_step_memory,
    estimate_optimizer_time,
    estimate_pipeline_time,
    estimate_stage_memory,
    in_flight,
    runtime_footprint,
)
from hetrain.plan import Plan
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.schedule import ScheduleError, build_schedule, parse_action
from hetrain.simulator import simulate

A100 = "A100-40GB"
V100 = "V100-16GB"


def link(bandwidth_bytes_per_s: float, latency_s: float) -> dict[str, float]:
    return {"bandwidth_bytes_per_s": bandwidth_bytes_per_s, "latency_s": latency_s}


def one_node(count: int, bandwidth_bytes_per_s: float = 1e30, latency_s: float = 0.0) -> Cluster:
    """One node of A100s joined by a link so fast that transfers take ~0 s (no contention)."""
    return parse_cluster({"name": "flat", "node": [{
        "name": "n0", "devices": [{"type": A100, "count": count}],
        "intra_link": link(bandwidth_bytes_per_s, latency_s), "nic": link(bandwidth_bytes_per_s, latency_s)}]})


def layer(name: str, times: dict[str, tuple[float, float]], b: int, param_bytes: float = 0.0,
          output_bytes: float = 1e3, saved_bytes: float = 1e4) -> LayerProfile:
    """A layer measured at micro-batch ``b`` on each device type of ``times`` (forward_s, backward_s)."""
    measured = tuple((t, (Measurement(b, f, g),)) for t, (f, g) in times.items())
    return LayerProfile(name, param_bytes, output_bytes, saved_bytes, 1e9, measured)


# --- closed forms ------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 6), (3, 1), (1, 5), (5, 3), (2, 8)])
def test_uniform_stages_match_the_closed_form(schedule: str, p: int, m: int) -> None:
    t_f, t_b, b = 0.3, 0.7, 2
    profile = ModelProfile("uniform", tuple(layer(f"l{j}", {A100: (t_f, t_b)}, b) for j in range(p)), 1e3)
    plan = make_plan(one_node(p), profile, [([f"n0:{j}" for j in range(p)], list(range(p + 1)), m * b, m)],
                     schedule=schedule)
    result = simulate(plan)
    expected = (m + p - 1) * (t_f + t_b)
    assert result.iteration_s == pytest.approx(expected, rel=1e-9)
    assert result.pipeline_s == pytest.approx(expected, rel=1e-9)
    assert result.iteration_s == pytest.approx(estimate_pipeline_time([t_f + t_b] * p, m), rel=1e-9)
    assert result.samples_per_s == pytest.approx(m * b / expected, rel=1e-9)
    # the last stage idles exactly the bubble (p - 1)(t_f + t_b)
    last = result.devices[f"n0:{p - 1}"]
    assert last.bubble_s == pytest.approx((p - 1) * (t_f + t_b), rel=1e-9, abs=1e-12)


def uniform_blocking_plan(schedule: str, p: int, m: int, t_f: float, t_b: float, c: float,
                          transfers: str = "blocking") -> Plan:
    """p uniform stages on one node whose links take ``c`` seconds per transfer (activation or gradient)."""
    b, out = 2, 1e3
    profile = ModelProfile("uniform", tuple(layer(f"l{j}", {A100: (t_f, t_b)}, b, output_bytes=out)
                                            for j in range(p)), 1e3)
    return make_plan(one_node(p, b * out / c, 0.0), profile,
                     [([f"n0:{j}" for j in range(p)], list(range(p + 1)), m * b, m)],
                     schedule=schedule, transfers=transfers)


@pytest.mark.parametrize(("p", "m"), [(4, 6), (3, 1), (1, 5), (5, 3), (2, 8), (3, 3)])
@pytest.mark.parametrize("c", [0.05, 0.5, 2.0])
def test_the_blocking_transfer_replay_equals_its_closed_form_on_uniform_stages(p: int, m: int, c: float) -> None:
    t_f, t_b = 0.3, 0.7
    result = simulate(uniform_blocking_plan("gpipe", p, m, t_f, t_b, c))
    expected = estimate_blocking_pipeline_time([t_f + t_b] * p, [2 * c] * (p - 1), m)
    assert result.iteration_s == pytest.approx(expected, rel=1e-9)
    # by hand: the first micro-batch crosses every stage and link, the others follow at a middle stage's pace
    held = t_f + t_b + (4 * c if p > 2 else 2 * c if p == 2 else 0.0)
    assert expected == pytest.approx(p * (t_f + t_b) + 2 * c * (p - 1) + (m - 1) * held, rel=1e-12)
    # overlapped, the same pipeline is faster once the links are not the bottleneck
    overlapped = simulate(uniform_blocking_plan("gpipe", p, m, t_f, t_b, c, "overlap"))
    assert overlapped.iteration_s <= result.iteration_s + 1e-12
    if p > 1:
        sends = [e for e in result.timeline.devices["n0:0"] if e.kind == "send"]
        assert len(sends) == m and all(e.end_s - e.start_s >= c - 1e-12 for e in sends)  # the sender is held


@pytest.mark.parametrize(("p", "m"), [(4, 6), (3, 3), (5, 10), (2, 8), (3, 1)])
@pytest.mark.parametrize("c", [0.05, 0.2, 1.0])
def test_blocking_one_f_one_b_is_within_one_stage_of_the_closed_form(p: int, m: int, c: float) -> None:
    """1F1B starts a backward while a fill transfer still holds its neighbour: the replay is faster than
    the closed form by at most one stage's compute, whatever m (the steady state is the closed form's)."""
    t_f, t_b = 0.3, 0.7
    result = simulate(uniform_blocking_plan("1f1b", p, m, t_f, t_b, c))
    expected = estimate_blocking_pipeline_time([t_f + t_b] * p, [2 * c] * (p - 1), m)
    assert expected - (t_f + t_b) - 1e-9 <= result.iteration_s <= expected + 1e-9
    if p <= 2:
        assert result.iteration_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("p", "m"), [(4, 16), (4, 6), (5, 10), (2, 8), (8, 32), (3, 3), (4, 2), (3, 1)])
@pytest.mark.parametrize("c", [0.05, 0.3, 1.0])
def test_overlapped_one_f_one_b_is_within_one_period_of_its_closed_form(p: int, m: int, c: float) -> None:
    """Transfers that overlap compute: 1F1B's steady state turns at the period of ``cost.estimate_1f1b_period``
    (each link in the cycle of the stages on its two sides), so the replay is never slower than the closed
    form. The closed form pays the first micro-batch's crossing, then a whole period for each of the other
    m - 1; the replay's last micro-batches leave the cycle before a whole turn (the cool-down drains them one
    backward at a time), so it is faster by less than one period, whatever m: less than 1/m of the closed form
    (whose first crossing is at least a period), at most 7% on these (p = 4, m = 6, transfers as long as a
    stage), 0.2% at p = 8, m = 32. GPipe's form stays exact on the same pipelines."""
    t_f, t_b = 0.3, 0.7
    t, links = [t_f + t_b] * p, [2 * c] * (p - 1)
    result = simulate(uniform_blocking_plan("1f1b", p, m, t_f, t_b, c, "overlap"))
    expected = estimate_1f1b_pipeline_time(t, links, m)
    period = estimate_1f1b_period(t, links, m)
    assert expected - period < result.iteration_s <= expected + 1e-9
    assert result.iteration_s > expected * (1 - 1 / m)
    gpipe = simulate(uniform_blocking_plan("gpipe", p, m, t_f, t_b, c, "overlap"))
    assert gpipe.iteration_s == pytest.approx(estimate_pipeline_time(t + links, m), rel=1e-9)


def test_one_f_one_b_pays_its_transfers_in_its_cycle_by_hand() -> None:
    """4 stages of 1 s (F 0.3, B 0.7), transfers of 0.3 s each way, 16 micro-batches. In the steady state stage 0
    runs F(i + 3), then B(i), whose gradient comes back through every stage: each turn of that cycle holds 4
    micro-batches' compute on 4 stages and 3 links out and back, (4 + 6 * 0.3) / 4 = 1.45 s per micro-batch.
    The replay: 27.4 s, (27.4 - 5.8) / 15 = 1.44 s per micro-batch after the first; the closed form
    5.8 + 15 * 1.45 = 27.55 s (+0.5%). GPipe's form, each link a stage of its own, gives GPipe's replay (20.8 s)
    and was 24% under 1F1B's."""
    result = simulate(uniform_blocking_plan("1f1b", 4, 16, 0.3, 0.7, 0.3, "overlap"))
    assert result.iteration_s == pytest.approx(27.4, rel=1e-9)
    assert estimate_1f1b_period([1.0] * 4, [0.6] * 3, 16) == pytest.approx(1.45, rel=1e-12)
    assert estimate_1f1b_pipeline_time([1.0] * 4, [0.6] * 3, 16) == pytest.approx(27.55, rel=1e-12)
    assert simulate(uniform_blocking_plan("gpipe", 4, 16, 0.3, 0.7, 0.3, "overlap")).iteration_s == \
        pytest.approx(estimate_pipeline_time([1.0] * 4 + [0.6] * 3, 16), rel=1e-9) == pytest.approx(20.8)


def test_the_iteration_overhead_is_paid_once_per_iteration() -> None:
    p, m, t_f, t_b = 3, 4, 0.3, 0.7
    base = uniform_blocking_plan("1f1b", p, m, t_f, t_b, 1e-9, "overlap")
    profile = replace(base.profile, iteration_overhead_s=((A100, 0.25),))
    again = ModelProfile.from_dict(profile.to_dict())
    assert again.iteration_overhead_of(A100) == 0.25 and again.iteration_overhead_of(V100) == 0.0
    assert simulate(replace(base, profile=again)).iteration_s == pytest.approx(simulate(base).iteration_s + 0.25,
                                                                               rel=1e-9)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (3, 3)])
def test_one_f_one_b_keeps_at_most_p_minus_j_micro_batches_in_flight(p: int, m: int) -> None:
    profile = ModelProfile("uniform", tuple(layer(f"l{j}", {A100: (0.1, 0.2)}, 1) for j in range(p)), 1e3)
    devices = [f"n0:{j}" for j in range(p)]
    for schedule, bound in (("1f1b", lambda j: min(m, p - j)), ("gpipe", lambda j: m),
                            ("1f1b-eager", lambda j: min(m, p - j + 1) if j < p - 1 else 1)):
        result = simulate(make_plan(one_node(p), profile, [(devices, list(range(p + 1)), m, m)], schedule=schedule))
        for j, dev in enumerate(devices):
            assert result.devices[dev].max_in_flight == bound(j), (schedule, j)


# --- a heterogeneous case by hand -------------------------------------------------


def hetero_plan(schedule: str, m: int) -> Plan:
    """Stage 0 on a fast A100 (F 1 s, B 2 s), stage 1 on a slow V100 (F 2 s, B 4 s), micro-batches of 4.

    The nodes are joined at 1 MB/s with 0.1 s latency; an activation is 4 x 350 kB
    = 1.4 MB, so each transfer takes 0.1 + 1.4 = 1.5 s in either direction.
    """
    cluster = parse_cluster({"name": "hetero", "node": [
        {"name": "fast", "devices": [A100], "intra_link": "nvlink3", "nic": link(1e6, 0.1)},
        {"name": "slow", "devices": [V100], "intra_link": "nvlink2", "nic": link(1e6, 0.1)},
    ]})
    profile = ModelProfile("two", (layer("l0", {A100: (1.0, 2.0)}, 4, output_bytes=350e3),
                                   layer("l1", {V100: (2.0, 4.0)}, 4)), 1e3)
    return make_plan(cluster, profile, [(["fast:0", "slow:0"], [0, 1, 2], 4 * m, m)], schedule=schedule)


def spans(result: Any, track: str, kind: str) -> list[tuple[float, float]]:
    return [(round(e.start_s, 9), round(e.end_s, 9)) for e in result.timeline.devices.get(track, [])
            + result.timeline.links.get(track, []) if e.kind == kind]


def test_heterogeneous_gpipe_by_hand() -> None:
    # GPipe, m = 2. T = 1.5 s per transfer; the fast node's NIC carries one transfer at a time.
    #   fast:0  F0 [0,1]  F1 [1,2]                             B0 [12,14]      B1 [16,18]
    #   link ->     SEND_F0 [1,2.5]  SEND_F1 [2.5,4] (queued behind mb0 until 2.5)
    #   slow:0  F0 [2.5,4.5] F1 [4.5,6.5] B0 [6.5,10.5] B1 [10.5,14.5]
    #   link <-                                 SEND_B0 [10.5,12]  SEND_B1 [14.5,16]
    # iteration 18 s = closed form 3 + 3 + 6 + (2 - 1) * 6 (the link as a stage of 1.5 + 1.5)
    result = simulate(hetero_plan("gpipe", 2))
    assert result.iteration_s == pytest.approx(18.0, rel=1e-12)
    assert result.iteration_s == pytest.approx(estimate_pipeline_time([3.0, 3.0, 6.0], 2), rel=1e-12)
    assert spans(result, "fast NIC out", "send_f") == [(1.0, 2.5), (2.5, 4.0)]
    assert spans(result, "slow NIC in", "send_f") == [(1.0, 2.5), (2.5, 4.0)]
    assert spans(result, "slow:0", "forward") == [(2.5, 4.5), (4.5, 6.5)]
    assert spans(result, "fast:0", "backward") == [(12.0, 14.0), (16.0, 18.0)]
    assert spans(result, "fast:0", "recv") == [(2.0, 12.0), (14.0, 16.0)]  # waiting for gradients
    fast = result.devices["fast:0"]
    assert fast.busy_s == pytest.approx(6.0) and fast.bubble_fraction == pytest.approx(12 / 18)


def test_heterogeneous_one_f_one_b_by_hand() -> None:
    # 1F1B, m = 3: fast:0 runs F0 F1 B0 F2 B1 B2, slow:0 runs F0 B0 F1 B1 F2 B2.
    #   fast:0  F0 [0,1] F1 [1,2] . B0 [10,12] F2 [12,13] . B1 [16,18] . B2 [22,24]
    #   ->      SEND_F0 [1,2.5] SEND_F1 [2.5,4]       SEND_F2 [13,14.5]
    #   slow:0  F0 [2.5,4.5] B0 [4.5,8.5] F1 [8.5,10.5] B1 [10.5,14.5] F2 [14.5,16.5] B2 [16.5,20.5]
    #   <-      SEND_B0 [8.5,10]  SEND_B1 [14.5,16]  SEND_B2 [20.5,22]
    result = simulate(hetero_plan("1f1b", 3))
    assert result.iteration_s == pytest.approx(24.0, rel=1e-12)
    assert spans(result, "fast:0", "backward") == [(10.0, 12.0), (16.0, 18.0), (22.0, 24.0)]
    assert spans(result, "fast:0", "forward") == [(0.0, 1.0), (1.0, 2.0), (12.0, 13.0)]
    assert spans(result, "slow:0", "forward") == [(2.5, 4.5), (8.5, 10.5), (14.5, 16.5)]
    assert spans(result, "slow NIC out", "send_b") == [(8.5, 10.0), (14.5, 16.0), (20.5, 22.0)]
    assert result.devices["slow:0"].max_in_flight == 1 and result.devices["fast:0"].max_in_flight == 2


# --- memory -----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_peak_memory_equals_the_cost_model(schedule: str) -> None:
    saved = [4e6, 9e6, 2e6, 7e6, 5e6, 3e6]
    layers = tuple(layer(f"l{i}", {A100: (0.01 * (i + 1), 0.02 * (i + 1))}, 2, param_bytes=1e7 * (i + 1),
                         output_bytes=1e5, saved_bytes=s) for i, s in enumerate(saved))
    profile = ModelProfile("mem", layers, 1e5)
    plan = make_plan(one_node(5, 1e11, 1e-6), profile, [
        (["n0:0", "n0:1", "n0:2"], [0, 2, 5, 6], 8, 4),
        (["n0:3", "n0:4"], [0, 3, 6], 9, 3),
    ], schedule=schedule, optimizer="adam", recompute={"n0:1": (3, 4), "n0:3": (0, 1)})
    result = simulate(plan)
    for vw in plan.virtual_workers:
        p = len(vw.stages)
        for j, stage in enumerate(vw.stages):
            expected = estimate_stage_memory(profile, stage.first_layer, stage.end_layer, stage.recompute,
                                             vw.micro_batch_size, in_flight(schedule, vw.micro_batches, p, j),
                                             "adam")
            device = next(d for d in plan.cluster.devices if d.name == stage.device)
            footprint = runtime_footprint(profile, device)
            assert footprint.fixed_bytes > 0  # an A100: the catalog's CUDA footprint, added to the tensors' peak
            assert result.devices[stage.device].peak_memory_bytes == pytest.approx(
                footprint.device_bytes(expected), rel=1e-9), stage
            curve = result.memory_curve(stage.device)
            weights = estimate_stage_memory(profile, stage.first_layer, stage.end_layer, (), 0, 0, "adam",
                                            with_step=False)
            assert curve[0] == (0.0, pytest.approx(weights))
            # Adam's step holds one more word per parameter while it runs, after the activations are freed
            step = estimate_optimizer_step_memory(sum(profile.layers[i].param_bytes for i in stage.layers),
                                                  profile.bytes_per_element, "adam")
            assert step > 0 and curve[-2][1] == pytest.approx(weights + step)
            assert curve[-1][1] == pytest.approx(weights)  # every activation freed at the end
            assert [t for t, _ in curve] == sorted(t for t, _ in curve)


# --- links, sync and the optimizer ---------------------------------------------------


def two_node_cluster(nic_bytes_per_s: float, latency_s: float = 0.0) -> Cluster:
    return parse_cluster({"name": "pair", "node": [
        {"name": name, "devices": [{"type": A100, "count": 2}], "intra_link": link(1e30, 0.0),
         "nic": link(nic_bytes_per_s, latency_s)} for name in ("a", "b")]})


def test_transfers_leaving_one_node_share_its_nic() -> None:
    # two VWs a:0 -> b:0 and a:1 -> b:1; both ship mb0 at t = 1 through "a NIC out" (1 s each)
    profile = ModelProfile("two", (layer("l0", {A100: (1.0, 1.0)}, 1, output_bytes=1e6),
                                   layer("l1", {A100: (1.0, 1.0)}, 1)), 1e3)
    plan = make_plan(two_node_cluster(1e6), profile, [(["a:0", "b:0"], [0, 1, 2], 1, 1),
                                                      (["a:1", "b:1"], [0, 1, 2], 1, 1)], schedule="gpipe")
    result = simulate(plan)
    assert sorted(spans(result, "a NIC out", "send_f")) == [(1.0, 2.0), (2.0, 3.0)]
    starts = sorted([spans(result, "b:0", "forward")[0][0], spans(result, "b:1", "forward")[0][0]])
    assert starts == [2.0, 3.0]


def test_data_parallel_sync_takes_the_allreduce_time() -> None:
    # one stage per VW on two nodes: compute, all-reduce of all gradients, step
    params = 4e6
    profile = ModelProfile("dp", (layer("l0", {A100: (0.5, 1.0)}, 2, param_bytes=params),), 1e3)
    cluster = two_node_cluster(1e8, 1e-3)
    plan = make_plan(cluster, profile, [(["a:0"], [0, 1], 2, 1), (["b:0"], [0, 1], 2, 1)], schedule="gpipe")
    assert [str(a) for a in build_schedule(plan)["a:0"]] == ["0F0", "0B0", "ALLREDUCE_START seg0 bucket0",
                                                             "ALLREDUCE_WAIT seg0 bucket0", "STEP"]
    result = simulate(plan)
    sync = estimate_allreduce_time(cluster, [0, 2], params)
    step = estimate_optimizer_time(params, 4, cluster.devices[0], "sgd")
    assert result.iteration_s == pytest.approx(1.5 + sync + step, rel=1e-12)
    assert result.devices["a:0"].sync_s == pytest.approx(sync, rel=1e-12)
    phases = result.timeline.links["a NIC out"]
    assert [e.label for e in phases] == ["ALLREDUCE seg0 bucket0 reduce-scatter", "ALLREDUCE seg0 bucket0 all-gather"]
    assert phases[-1].end_s == pytest.approx(1.5 + sync)


def test_concurrent_allreduces_contend_for_the_nics() -> None:
    # VWs a:0 -> a:1 and b:0 -> b:1; segment 1 (stage 1) syncs while stage 0 still runs its
    # backward (sync overlaps compute), and segment 0 then contends with it for the NICs
    params = 1e8
    layers = (layer("l0", {A100: (0.1, 0.2)}, 1, param_bytes=params, output_bytes=10.0),
              layer("l1", {A100: (0.1, 0.2)}, 1, param_bytes=params))
    cluster = two_node_cluster(1e8)
    plan = make_plan(cluster, ModelProfile("c", layers, 1e3), [(["a:0", "a:1"], [0, 1, 2], 1, 1),
                                                               (["b:0", "b:1"], [0, 1, 2], 1, 1)], schedule="gpipe")
    result = simulate(plan)
    assert estimate_allreduce_time(cluster, [0, 2], params) == pytest.approx(1.0)  # 0.5 s per ring phase
    # stage 1 is done at 0.4 s, stage 0 at 0.6 s. The NICs serve the phases in the order they ask:
    #   seg1 reduce-scatter [0.4, 0.9]; seg0 asked at 0.6: reduce-scatter [0.9, 1.4];
    #   seg1 all-gather asked at 0.9: [1.4, 1.9]; seg0 all-gather asked at 1.4: [1.9, 2.4]
    phases = {s: [(round(e.start_s, 9), round(e.end_s, 9)) for e in result.timeline.links["a NIC out"]
                  if f"seg{s} " in e.label] for s in (0, 1)}
    assert phases == {1: [(0.4, 0.9), (1.4, 1.9)], 0: [(0.9, 1.4), (1.9, 2.4)]}
    assert result.pipeline_s == pytest.approx(0.6)
    assert result.devices["a:0"].sync_s == pytest.approx(1.8)  # waits from the end of its backward to 2.4 s
    step = estimate_optimizer_time(params, 4, cluster.devices[0], "sgd")
    assert result.iteration_s == pytest.approx(2.4 + step)
    for tracks in (result.timeline.devices, result.timeline.links):
        for name, evs in tracks.items():
            ordered = sorted(evs)
            assert all(x.end_s <= y.start_s + 1e-12 for x, y in itertools.pairwise(ordered)), name


def test_hierarchical_allreduce_runs_in_three_phases() -> None:
    # four one-stage VWs on two nodes of two: NVLink-fast inside, 1 GB/s between, so the
    # cost model picks intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather
    params = 1e8
    cluster = parse_cluster({"name": "h", "node": [
        {"name": name, "devices": [{"type": A100, "count": 2}], "intra_link": "nvlink3", "nic": link(1e9, 1e-5)}
        for name in ("a", "b")]})
    profile = ModelProfile("dp", (layer("l0", {A100: (0.5, 1.0)}, 2, param_bytes=params),), 1e3)
    plan = make_plan(cluster, profile, [([d], [0, 1], 2, 1) for d in ("a:0", "a:1", "b:0", "b:1")],
                     schedule="gpipe")
    result = simulate(plan)
    sync = estimate_allreduce_time(cluster, [0, 1, 2, 3], params)
    assert result.devices["b:1"].sync_s == pytest.approx(sync, rel=1e-12)
    assert result.pipeline_s == pytest.approx(1.5)
    assert [e.label for e in result.timeline.links["a:0->a:1"]] == [
        "ALLREDUCE seg0 bucket0 intra-node reduce-scatter", "ALLREDUCE seg0 bucket0 intra-node all-gather"]
    assert [e.label for e in result.timeline.links["b NIC in"]] == ["ALLREDUCE seg0 bucket0 inter-node all-reduce"]
    assert result.timeline.links["b NIC in"][0].end_s < 1.5 + sync


def bucket_plan(recompute: tuple[int, ...] = ()) -> tuple[Plan, float]:
    """Two one-stage VWs a:0, b:0 of 4 layers (forward 0.1 s, backward 0.2 s each), one bucket per layer,
    each bucket's all-reduce 0.2 s between the nodes: as long as one layer's backward."""
    params = 2e7
    layers = tuple(layer(f"l{k}", {A100: (0.1, 0.2)}, 2, param_bytes=params) for k in range(4))
    cluster = two_node_cluster(1e8)
    plan = make_plan(cluster, ModelProfile("b", layers, 1e3), [(["a:0"], [0, 4], 2, 1), (["b:0"], [0, 4], 2, 1)],
                     schedule="gpipe", recompute={"a:0": recompute, "b:0": recompute} if recompute else None,
                     first_bucket_bytes=params, bucket_bytes=params)
    assert estimate_allreduce_time(cluster, [0, 2], params) == pytest.approx(0.2)
    return plan, params


def test_bucket_allreduces_overlap_the_backward() -> None:
    plan, params = bucket_plan()
    assert [str(a) for a in build_schedule(plan)["a:0"]] == [
        "0F0", "0B0", *(f"ALLREDUCE_START seg0 bucket{b}" for b in range(4)),
        *(f"ALLREDUCE_WAIT seg0 bucket{b}" for b in range(4)), "STEP"]
    result = simulate(plan)
    # backward [0.4, 1.2]: layer 3's gradients are final at 0.6, layer 2's at 0.8, ...; each bucket's
    # all-reduce (two ring phases of 0.1 s) runs as soon as both owners have its gradients
    link = [(round(e.start_s, 9), round(e.end_s, 9)) for e in result.timeline.links["a NIC out"]]
    assert link == [(0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0), (1.0, 1.1), (1.1, 1.2), (1.2, 1.3), (1.3, 1.4)]
    assert spans(result, "a:0", "backward") == [(0.4, 1.2)]
    assert spans(result, "a:0", "sync") == [(1.2, 1.4)]  # only the last bucket's all-reduce is left to wait for
    step = estimate_optimizer_time(4 * params, 4, plan.cluster.devices[0], "sgd")
    assert result.iteration_s == pytest.approx(1.4 + step)
    # shorter than backward, then every all-reduce: 1.2 + 4 x 0.2
    assert result.iteration_s < result.pipeline_s + 4 * estimate_allreduce_time(plan.cluster, [0, 2], params)
    assert result.devices["a:0"].sync_s == pytest.approx(0.2)


def test_a_bucket_cut_inside_a_layer_is_ready_after_its_share_of_that_layers_backward() -> None:
    # bucket_cut "exact", a first bucket of half a layer and the others of one: buckets (3.5, 4), (2.5, 3.5),
    # (1.5, 2.5), (0.5, 1.5), (0, 0.5). The first is final half-way through layer 3's backward (0.4 + 0.1),
    # not at its end (0.6 under the layer cut); each all-reduce of a whole layer's bytes takes two ring
    # phases of 0.1 s, of half a layer's two of 0.05 s
    plan, params = bucket_plan()
    plan = plan.with_sync("bsp", replace(plan.sync_options, bucket_cut="exact",
                                         first_bucket_bytes=params / 2))
    assert [b.bounds for b in plan.layout.segments[0].buckets] == [
        (3.5, 4.0), (2.5, 3.5), (1.5, 2.5), (0.5, 1.5), (0.0, 0.5)]
    result = simulate(plan)
    link = [(round(e.start_s, 9), round(e.end_s, 9)) for e in result.timeline.links["a NIC out"]]
    assert link == [(0.5, 0.55), (0.55, 0.6), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0), (1.0, 1.1), (1.1, 1.2),
                    (1.2, 1.3), (1.3, 1.35), (1.35, 1.4)]
    assert spans(result, "a:0", "backward") == [(0.4, 1.2)]
    assert spans(result, "a:0", "sync") == [(1.2, 1.3), (1.3, 1.4)]  # the last two buckets waited for


def test_recomputed_layers_delay_their_buckets() -> None:
    # layers 2 and 3 recomputed: their forwards (0.1 s each) rerun inside the backward, before their gradients
    plan, _ = bucket_plan(recompute=(2, 3))
    result = simulate(plan)
    assert spans(result, "a:0", "backward") == [(0.4, 1.4)]
    starts = [round(e.start_s, 9) for e in result.timeline.links["a NIC out"] if "reduce-scatter" in e.label]
    assert starts == [0.7, 1.0, 1.2, 1.4]


def test_a_schedule_passed_in_is_validated() -> None:
    plan = hetero_plan("gpipe", 2)
    schedule = build_schedule(plan)
    schedule["slow:0"] = [a for a in schedule["slow:0"] if str(a) != "RECV_F 0->1 mb1 from fast:0"]
    with pytest.raises(ScheduleError, match="ERROR HERE"):
        simulate(plan, schedule)
    good = build_schedule(plan)
    assert simulate(plan, good).iteration_s == pytest.approx(18.0)
    good["fast:0"].insert(0, parse_action("STEP"))
    with pytest.raises(ScheduleError, match="appears twice"):
        simulate(plan, good)


# --- the command ---------------------------------------------------------------------


def test_the_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetrain.cli import main

    plan = hetero_plan("1f1b", 3)
    path = tmp_path / "plan.json"
    plan.save(path)
    trace, gantt = tmp_path / "trace.json", tmp_path / "gantt.png"
    assert main(["simulate", str(path), "--trace", str(trace), "--gantt", str(gantt)]) == 0
    out = capsys.readouterr().out
    assert "simulated iteration 24 s" in out and "fast:0" in out and "slow:0" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["iteration_s"] == pytest.approx(24.0)
    assert {d["device"] for d in data["devices"]} == {"fast:0", "slow:0"}
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2  # bad input
    assert "cannot read plan" in capsys.readouterr().err


def two_by_two_dp_plan(options: dict[str, Any]) -> Plan:
    """Pure DP over 2 nodes x 2 CPU devices, fast intra link and slow NIC: the cost model picks hierarchical."""
    from hetrain.models.analytic import build_profile

    cluster = make_cluster({"n0": 2, "n1": 2}, intra_link="100Gbit/s", nic="100Mbit/s", name="2x2")
    return make_plan(cluster, build_profile("gpt-tiny"), replicas(("n0:0", "n0:1", "n1:0", "n1:1"), 6, 4), **options)


def test_the_allreduce_option_ring_replays_a_flat_ring_where_auto_goes_hierarchical() -> None:
    from hetrain.errors import InputError

    auto, ring = simulate(two_by_two_dp_plan({})), simulate(two_by_two_dp_plan({"allreduce": "ring"}))
    phases = {name: {e.label.rsplit(" ", 1)[-1] for evs in r.timeline.links.values() for e in evs}
              for name, r in (("auto", auto), ("ring", ring))}
    # hierarchical: the NICs carry one node's buffer each way; the flat ring crosses each NIC twice as often
    assert "n0 NIC out" in auto.timeline.links and "n0 NIC out" in ring.timeline.links
    nic = {name: sum(e.duration_s for e in r.timeline.links["n0 NIC out"]) for name, r in (("auto", auto),
                                                                                          ("ring", ring))}
    assert nic["ring"] > 1.5 * nic["auto"], (nic, phases)
    assert ring.iteration_s > auto.iteration_s
    with pytest.raises(InputError, match="allreduce must be one of auto, ring, got 'tree'"):
        two_by_two_dp_plan({"allreduce": "tree"})

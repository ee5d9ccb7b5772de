"""The hand-built baseline plans: the even-split pipeline, even data parallelism, torch's micro-batch count."""

from __future__ import annotations

from dataclasses import replace

import pytest

from e2e_cluster import CLUSTER
from hetrain.cluster import parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.planner import plan
from hetrain.planner.baselines import even_dp_plan, even_split_plan, torch_pipelining_micro_batches
from hetrain.simulator import simulate, with_simulated_prediction

# 4 devices of one type on one node: more stages than gpt-tiny's 6 layers cut evenly.
FOUR = {"name": "four", "node": [{"name": "n", "devices": [{"type": "cpu", "count": 4}], "intra_link": "loopback",
                                  "nic": "1Gbit/s"}]}


def test_even_split_plan_is_one_pipeline_over_every_device() -> None:
    cluster = parse_cluster(CLUSTER)
    profile = build_profile("gpt-tiny")
    pp = plan(cluster, profile, 12, strategy="pp", micro_batch_sizes=(4,), simulate_top_k=0)
    even = even_split_plan(pp, with_simulated_prediction)
    (vw,) = even.virtual_workers
    assert vw.devices == ["fast:0", "fast:1", "slow:0"] and vw.mini_batch == 12
    counts = [s.end_layer - s.first_layer for s in vw.stages]
    assert sum(counts) == profile.num_layers and max(counts) - min(counts) <= 1
    assert even.prediction.simulated_iteration_s is not None and even.prediction.iteration_s > 0
    # every figure comes from the one replay: no "pipeline 0 us" or "mem ?" in its summary
    sim = simulate(even)
    pr = even.prediction
    assert pr.iteration_s == sim.iteration_s and pr.pipeline_s == sim.pipeline_s
    assert pr.pipeline_s + pr.sync_s + pr.optimizer_s == pytest.approx(pr.iteration_s)
    assert pr.optimizer_s > 0 and vw.predicted_pipeline_s == pytest.approx(sim.pipeline_s)
    assert {m.device: m.peak_bytes for m in pr.memory} == {
        d: s.peak_memory_bytes for d, s in sim.devices.items()}
    assert "mem ?" not in even.summary() and "pipeline 0 us" not in even.summary()


def test_even_split_cuts_every_layer_once_in_order_earlier_stages_take_the_extra() -> None:
    profile = build_profile("gpt-tiny")
    assert profile.num_layers == 6
    pp = plan(parse_cluster(FOUR), profile, 8, strategy="pp", micro_batch_sizes=(2,), simulate_top_k=0)
    (vw,) = even_split_plan(pp, with_simulated_prediction).virtual_workers
    assert [(s.first_layer, s.end_layer) for s in vw.stages] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert vw.mini_batch == 8 and vw.micro_batches == max(v.micro_batches for v in pp.virtual_workers)
    # each stage's times are its own layers' (and the overhead per action), the first stage the slowest
    assert vw.stages[0].predicted_forward_s > vw.stages[3].predicted_forward_s > 0


def test_even_split_follows_the_device_order_and_leaves_devices_beyond_the_layers_unused() -> None:
    profile = build_profile("gpt-tiny")
    pp = plan(parse_cluster(FOUR), profile, 8, strategy="pp", micro_batch_sizes=(2,), simulate_top_k=0)
    (vw,) = even_split_plan(pp, with_simulated_prediction, ["n:3", "n:1"]).virtual_workers
    assert vw.devices == ["n:3", "n:1"] and [(s.first_layer, s.end_layer) for s in vw.stages] == [(0, 3), (3, 6)]
    eight = {**FOUR, "node": [{**FOUR["node"][0], "devices": [{"type": "cpu", "count": 8}]}]}
    base = plan(parse_cluster(eight), profile, 8, micro_batch_sizes=(2,), simulate_top_k=0)  # no pp on 8
    # 8 devices, 6 layers: one layer each on the first 6
    (vw,) = even_split_plan(base, with_simulated_prediction).virtual_workers
    assert vw.devices == [f"n:{k}" for k in range(6)]
    assert [(s.first_layer, s.end_layer) for s in vw.stages] == [(i, i + 1) for i in range(6)]


def test_even_dp_plan_splits_the_batch_evenly_over_every_device() -> None:
    cluster = parse_cluster(CLUSTER)
    profile = build_profile("gpt-tiny")
    dp = plan(cluster, profile, 13, strategy="dp", micro_batch_sizes=(4,), simulate_top_k=0)
    ddp = even_dp_plan(dp, with_simulated_prediction)
    assert [vw.devices for vw in ddp.virtual_workers] == [["fast:0"], ["fast:1"], ["slow:0"]]
    assert [vw.mini_batch for vw in ddp.virtual_workers] == [5, 4, 4]  # DDP's even split, not by speed
    assert all(vw.micro_batches == 1 and len(vw.stages) == 1 for vw in ddp.virtual_workers)
    assert ddp.strategy == "dp" and ddp.prediction.iteration_s > 0


def test_even_dp_mini_batches_add_up_and_every_replica_holds_the_whole_model() -> None:
    profile = build_profile("gpt-tiny")
    for global_batch in (4, 7, 32):
        dp = plan(parse_cluster(FOUR), profile, global_batch, strategy="dp", micro_batch_sizes=(1,),
                  simulate_top_k=0)
        ddp = even_dp_plan(dp, with_simulated_prediction)
        sizes = [vw.mini_batch for vw in ddp.virtual_workers]
        assert sum(sizes) == global_batch and max(sizes) - min(sizes) <= 1
        assert all((s.first_layer, s.end_layer) == (0, 6) for vw in ddp.virtual_workers for s in vw.stages)
        assert ddp.sync_options.allreduce == "ring" and ddp.formation == "even-batch"
        assert ddp.prediction.sync_s > 0  # one all-reduce every step, found by the replay


def test_torch_pipelining_micro_batches_divide_the_batch() -> None:
    pp = plan(parse_cluster(CLUSTER), build_profile("gpt-tiny"), 12, strategy="pp", micro_batch_sizes=(4,),
              simulate_top_k=0)
    even = even_split_plan(pp, with_simulated_prediction)
    assert torch_pipelining_micro_batches(even) == even.virtual_workers[0].micro_batches == 3
    (vw,) = even.virtual_workers
    five = replace(even, virtual_workers=(replace(vw, micro_batches=5),))
    assert torch_pipelining_micro_batches(five) == 4  # 12 samples do not cut into 5 equal micro-batches

"""Measured runs in the Sailor artifact's format as hetrain plans, against values computed by hand.

tests/data/sailor holds two plans of the development set (README there: source and licence).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hetrain.cost import (
    MEASURED_TP,
    estimate_blocking_pipeline_time,
    estimate_optimizer_time,
    estimate_stage_memory,
    tp_rank_profile,
)
from hetrain.imports.sailor import (
    DEEPSPEED,
    MeasuredRunError,
    SailorData,
    build_sailor_profile,
    convert_plan,
    fitted_bandwidth,
    load_sailor_data,
    solve_split,
    stage_link_bandwidth,
)
from hetrain.plan import validate_plan
from hetrain.simulator import simulate

DATA = Path(__file__).resolve().parent / "data" / "sailor"
GH200 = "clariden/OPT-350/N2/N2_D1"
MIT = "superseded/mit/N4/N4_D2@37ded10"
#: the network part of the rule alone: the runtime without its receiver's rebuild (tested on its own below)
NO_REBUILD = replace(DEEPSPEED, rebuild_bytes_per_s=0.0)


@pytest.fixture(scope="module")
def data() -> SailorData:
    return load_sailor_data(DATA)


def raw_plan(data: SailorData, plan_id: str) -> dict:
    return copy.deepcopy(next(p for p in data.plans if p["id"] == plan_id))


def curve_gb_s(coeffs: tuple[float, float, float], size_bytes: float) -> float:
    level = math.log2(size_bytes / 1e6)
    return coeffs[0] * level**2 + coeffs[1] * level + coeffs[2]


def test_fitted_bandwidth_is_the_quadratic_in_log_size_capped_at_the_largest_measured() -> None:
    fit = {"coeffs": [-0.65351182, 11.42553946, 45.25031399], "max_bw_Bps": 92551901043.9898}
    # 16 MiB: L = log2(16.777216) = 4.0704; -0.6535 * 16.568 + 11.4255 * 4.0704 + 45.2503 = 80.93 GB/s
    assert fitted_bandwidth(fit, 2**24) == pytest.approx(80.93e9, rel=1e-3)
    # at its top (L = 11.4255 / (2 x 0.6535) = 8.74, 428 MB) the quadratic gives 95.2 GB/s: capped at 92.6
    assert curve_gb_s((-0.65351182, 11.42553946, 45.25031399), 4.28e8) > 92.6
    assert fitted_bandwidth(fit, 4.28e8) == 92551901043.9898
    assert fitted_bandwidth({"coeffs": [0, 1, -5], "max_bw_Bps": 3e9}, 1e6) == 3e9  # not positive: the largest


def test_a_gh200_pipeline_by_hand(data: SailorData) -> None:
    """Two stages, each a TP group of the 4 GH200 of a node, micro-batches of 8, 4 of them, nothing else."""
    run = convert_plan(raw_plan(data, GH200), data, NO_REBUILD)
    plan, profile, cluster = run.plan, run.plan.profile, run.plan.cluster
    validate_plan(plan)
    # real GH200 devices, 4 per node as the run had them; each stage on its node's TP group of 4
    assert cluster.type_names == ["GH200"] and [n.name for n in cluster.nodes] == ["s0r0", "s1r0"]
    assert [d.name for d in cluster.devices] == [f"s{j}r0:{g}" for j in (0, 1) for g in range(4)]
    dev = cluster.devices[0]
    assert dev.memory_bytes == 102625181696  # the cluster's 95.6 GiB per GPU
    assert dev.peak_fp32_flops == 67e12 and dev.memory_bandwidth_bytes_per_s == 4000e9
    assert [(s.device, s.tp_group) for s in plan.virtual_workers[0].stages] == [
        ("s0r0:0", ("s0r0:0", "s0r0:1", "s0r0:2", "s0r0:3")), ("s1r0:0", ("s1r0:0", "s1r0:1", "s1r0:2", "s1r0:3"))]
    # DeepSpeed's runtime as it runs: blocking transfers, one bucket after the last backward, a ring, fp32 AdamW
    opts = plan.sync_options
    assert (opts.transfers, opts.allreduce, plan.optimizer, plan.precision, plan.schedule) == (
        "blocking", "ring", "adam", "fp32", "1f1b")
    vw = plan.virtual_workers[0]
    assert (vw.mini_batch, vw.micro_batches, plan.global_batch) == (32, 4, 32)
    assert [(s.first_layer, s.end_layer) for s in vw.stages] == [(0, 12), (12, 26)]
    # the link between the nodes: the curve of 4 GPUs sending at once, at a rank's quarter of
    # 8 x 2097152 x 4 = 67108864 bytes (16 MiB); its 4 ranks share it, each sending its quarter
    bw = curve_gb_s((-0.65351182, 11.42553946, 45.25031399), 2**24) * 1e9
    assert cluster.node_link(0, 1).bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-12)
    assert tp_rank_profile(profile, 4).sent_bytes_per_sample(11) == 2097152  # a quarter of 2048 x 1024 x 4
    c = (67108864 / 4) / (bw / 4)  # one transfer: the whole tensor at the link's bandwidth, about 0.83 ms
    # the stages' times: the profile's seconds at micro-batch 8 and TP 4 (collectives in), summed per stage
    timing = data.profiles["models"]["OPT-350"]["timing"]["GH-96"]["8"]["4"]
    t = [sum(timing["fwd_s"][a:b]) + sum(timing["bwd_s"][a:b]) for a, b in ((0, 12), (12, 26))]
    pipeline = estimate_blocking_pipeline_time(t, [2 * c], 4)  # exact for two stages
    rank = tp_rank_profile(profile, 4)
    group = cluster.group_device(vw.stages[0].tp_group)
    step = estimate_optimizer_time(sum(rank.layers[i].param_bytes for i in range(12)), 4, group, "adam", rank)
    result = simulate(plan)
    assert result.iteration_s == pytest.approx(pipeline + step, rel=1e-9)
    assert run.measured_iter_time_s == 0.65705 and run.usable_for_time and run.memory_reliable


def test_layers_are_whole_with_a_tp_split_that_gives_the_data_per_rank(data: SailorData) -> None:
    """The profile holds the whole (TP 1) layers; one rank's view at TP 4 holds the data's counts at TP 4."""
    profile = convert_plan(raw_plan(data, GH200), data).plan.profile
    sizes = data.profiles["models"]["OPT-350"]["layer_sizes_per_tp"]
    block, head = profile.layers[1], profile.layers[25]
    assert (block.param_bytes, block.output_bytes_per_sample, block.saved_bytes_per_sample) == (
        4 * 12596224, 4 * 2097152, 4 * 90181632)
    # the split: (whole - rank) x 4 / 3 of a block's parameters, 12596224 - 3153664 = 9442560 -> 12590080
    assert solve_split(12596224, 3153664, 4) == 12590080
    assert block.tp is not None and block.tp.split_param_bytes == 4 * 12590080
    assert block.tp.allreduces == 2 and block.tp.allreduce_bytes_per_sample == 2 * 2048 * 1024 * 4
    # the head: its logits (the loss term's) are split among the ranks, its saved bytes are its activations less them
    assert head.output_bytes_per_sample == 4 * 103022593
    assert head.saved_bytes_per_sample == 4 * (208673536 - 103022593)
    rank = tp_rank_profile(profile, 4)
    for i in range(profile.num_layers):
        at4 = sizes["4"]
        want_out = 4 * at4["act_output_floats"][i]
        want_saved = 4 * at4["act_mem_floats"][i] - (want_out if i == 25 else 0)
        assert rank.layers[i].param_bytes == pytest.approx(4 * at4["params_floats"][i], rel=1e-12)
        assert rank.layers[i].output_bytes_per_sample == pytest.approx(want_out, rel=1e-12)
        # the embedding's rank keeps 4608 elements more than the whole layer: no split can give that (0.2%)
        assert rank.layers[i].saved_bytes_per_sample == pytest.approx(want_saved, rel=1e-12 if i else 3e-3)
    # the measured times: TP 4 as one rank's (collectives in); at micro-batch 8 exactly the data's
    ms = rank.layers[1].measurements("GH200")
    assert ms[0].source == MEASURED_TP
    timing = data.profiles["models"]["OPT-350"]["timing"]["GH-96"]["8"]["4"]
    assert [(m.micro_batch, m.forward_s, m.backward_s) for m in ms] == [(8, timing["fwd_s"][1], timing["bwd_s"][1])]


def test_a_split_the_data_does_not_give_is_refused(data: SailorData) -> None:
    doctored = copy.deepcopy(dict(data.profiles))
    doctored["models"]["OPT-350"]["layer_sizes_per_tp"]["4"]["act_mem_floats"][0] *= 1.05  # over the whole layer
    with pytest.raises(MeasuredRunError, match=r"model OPT-350: layer 0 \(embedding\) at TP 4: its split gives a "
                                               r"rank \d+ saved activation bytes, the data \d+"):
        build_sailor_profile(SailorData(data.directory, data.plans, doctored, data.network), "OPT-350", 4, ["GH-96"])


def test_the_receivers_rebuild_holds_each_stage_once_per_received_tensor_by_hand(data: SailorData) -> None:
    """The GH200 pipeline above under the default runtime: each stage rebuilds the tensor it receives."""
    assert DEEPSPEED.rebuild_bytes_per_s == 11e9
    run = convert_plan(raw_plan(data, GH200), data)
    plan, profile, cluster = run.plan, run.plan.profile, run.plan.cluster
    # a whole activation of micro-batch 8: 8 x 2048 x 1024 x 4 = 67108864 bytes, rebuilt at 11 GB/s: 6.10 ms
    assert DEEPSPEED.rebuild_time_s(67108864) == pytest.approx(67108864 / 11e9, rel=1e-12)
    network = curve_gb_s((-0.65351182, 11.42553946, 45.25031399), 2**24) * 1e9  # 80.93 GB/s, as above
    # half a rebuild on each of the link's transfers: 1 / (1 / 80.93 + 1 / 22) GB/s = 17.30 GB/s
    link_bw = 1 / (1 / network + 0.5 / 11e9)
    assert link_bw == pytest.approx(17.30e9, rel=1e-3)
    assert cluster.node_link(0, 1).bandwidth_bytes_per_s == pytest.approx(link_bw, rel=1e-12)
    assert stage_link_bandwidth(network, NO_REBUILD) == network
    # per micro-batch each stage is held for the activation and the gradient (0.83 ms each on the network)
    # and its one rebuild (6.10 ms): the link's two transfers, 2 x 0.83 + 6.10 = 7.76 ms; each of the 4 ranks
    # sends a quarter of the tensor at a quarter of the link
    c = 67108864 / network
    both = 2 * c + 67108864 / 11e9
    assert 2 * (67108864 / 4) / (link_bw / 4) == pytest.approx(both, rel=1e-12)
    assert both == pytest.approx(7.76e-3, rel=1e-3)
    timing = data.profiles["models"]["OPT-350"]["timing"]["GH-96"]["8"]["4"]
    t = [sum(timing["fwd_s"][a:b]) + sum(timing["bwd_s"][a:b]) for a, b in ((0, 12), (12, 26))]
    rank = tp_rank_profile(profile, 4)
    group = cluster.group_device(plan.virtual_workers[0].stages[0].tp_group)
    step = estimate_optimizer_time(sum(rank.layers[i].param_bytes for i in range(12)), 4, group, "adam", rank)
    result = simulate(plan)
    assert result.iteration_s == pytest.approx(estimate_blocking_pipeline_time(t, [both], 4) + step, rel=1e-9)
    # the first micro-batch crosses the link once, the other 3 follow a stage held one rebuild longer:
    # 4 rebuilds on the critical path, 24.4 ms more than without them (0.649 s against 0.625 s)
    without = simulate(convert_plan(raw_plan(data, GH200), data, NO_REBUILD).plan).iteration_s
    assert result.iteration_s - without == pytest.approx(4 * 67108864 / 11e9, rel=1e-9)


def test_a_run_without_transfers_rebuilds_nothing(data: SailorData) -> None:
    """One stage (data parallelism only): no tensor crosses a stage boundary, the rebuild changes nothing."""
    raw = raw_plan(data, GH200)
    raw["stages"] = [{**raw["stages"][0], "layers": list(range(26))}]
    assert simulate(convert_plan(raw, data).plan).iteration_s == pytest.approx(
        simulate(convert_plan(raw, data, NO_REBUILD).plan).iteration_s, rel=1e-12)


def test_the_runtime_footprint_enters_the_memory_of_a_converted_plan(data: SailorData) -> None:
    run = convert_plan(raw_plan(data, GH200), data)
    rank = tp_rank_profile(run.plan.profile, 4)
    result = simulate(run.plan)
    # one TP rank of each stage; stage 1 of 2 holds 1 micro-batch in flight under 1F1B, stage 0 two
    tensors = [estimate_stage_memory(rank, 0, 12, (), 8, 2, "adam"),
               estimate_stage_memory(rank, 12, 26, (), 8, 1, "adam")]
    per_gpu = [DEEPSPEED.fixed_bytes_per_gpu + (1 + DEEPSPEED.allocator_fraction) * x for x in tensors]
    peaks = {name: d.peak_memory_bytes for name, d in result.devices.items()}
    assert [peaks["s0r0:0"], peaks["s1r0:0"]] == pytest.approx(per_gpu, rel=1e-9)
    assert run.per_gpu_bytes(peaks) == pytest.approx(max(per_gpu), rel=1e-9)
    # measured 26.94 GB per GPU; without the footprint the tensors alone are 20 GB short
    assert run.per_gpu_bytes(peaks) == pytest.approx(26942111744, rel=0.05)
    assert max(tensors) < 0.8 * 26942111744
    # the last stage's loss keeps a rank's quarter of the logits (vocab-parallel), not the whole
    assert rank.layers[25].output_bytes_per_sample == 4 * 25952257


def test_a_heterogeneous_pipeline_with_data_parallelism_by_hand(data: SailorData) -> None:
    """Two Titan-RTX TP groups feed two RTX-2080 TP groups; micro-batches of 2, 64 per replica."""
    run = convert_plan(raw_plan(data, MIT), data, NO_REBUILD)
    plan, cluster = run.plan, run.plan.cluster
    validate_plan(plan)
    assert cluster.type_names == ["TITAN-RTX", "RTX2080Ti"]
    assert [d.memory_bytes for d in cluster.devices] == [25769803776] * 8 + [11811160064] * 8
    assert [vw.devices for vw in plan.virtual_workers] == [["s0r0:0", "s1r0:0"], ["s0r1:0", "s1r1:0"]]
    assert [len(s.tp_group) for vw in plan.virtual_workers for s in vw.stages] == [4] * 4
    assert [(vw.mini_batch, vw.micro_batches) for vw in plan.virtual_workers] == [(128, 64)] * 2
    assert plan.global_batch == 256 and plan.strategy == "hybrid"
    node = {n.name: k for k, n in enumerate(cluster.nodes)}
    # replica r of stage 0 sends to replica r of stage 1: 2 x 2097152 x 4 bytes, a quarter per rank (4 MiB)
    p2p = curve_gb_s((-0.00218887321, 0.0231685991, 2.81825896), 2**22) * 1e9
    for r in (0, 1):
        assert cluster.node_link(node[f"s0r{r}"], node[f"s1r{r}"]).bandwidth_bytes_per_s == pytest.approx(p2p)
    # the all-reduce among a stage's replicas: a ring step moves a rank's gradients / 2
    sizes = data.profiles["models"]["OPT-350"]["layer_sizes_per_tp"]["4"]["params_floats"]
    rank_0, rank_1 = 4 * sum(sizes[:12]), 4 * sum(sizes[12:])
    # (the Titan-RTX curve reaches 3.03 GB/s at 99 MB, above its largest measurement 2.86 GB/s: capped)
    titan = min(curve_gb_s((0.00180047079, 0.0196319076, 2.82089851), rank_0 / 2) * 1e9, 2857686333.2586045)
    rtx = min(curve_gb_s((-0.00567164, 0.05690722, 2.77867113), rank_1 / 2) * 1e9, 2857722937.2829)
    assert titan == 2857686333.2586045
    assert cluster.node_link(node["s0r0"], node["s0r1"]).bandwidth_bytes_per_s == pytest.approx(titan)
    assert cluster.node_link(node["s1r0"], node["s1r1"]).bandwidth_bytes_per_s == pytest.approx(rtx)
    # one bucket per stage of one rank's gradients, all-reduced by a ring after the last backward
    segments = plan.segments()
    assert [(s.owners, len(s.buckets), s.buckets[0].algorithm) for s in segments] == [
        (("s0r0:0", "s0r1:0"), 1, "ring"), (("s1r0:0", "s1r1:0"), 1, "ring")]
    assert segments[0].param_bytes == pytest.approx(rank_0)
    assert not run.memory_reliable and run.usable_for_time
    # the simulated iteration is within the run-to-run noise of the measured 33.5 s
    assert simulate(plan).iteration_s == pytest.approx(run.measured_iter_time_s, rel=0.05)
    # the candidate where each TP rank's ring has the whole NIC: the all-reduce links 4x, the stage links as they were
    own = convert_plan(raw_plan(data, MIT), data, replace(NO_REBUILD, rings_share_nic=False)).plan.cluster
    assert own.node_link(node["s0r0"], node["s0r1"]).bandwidth_bytes_per_s == pytest.approx(4 * titan)
    assert own.node_link(node["s1r0"], node["s1r1"]).bandwidth_bytes_per_s == pytest.approx(4 * rtx)
    assert own.node_link(node["s0r0"], node["s1r0"]).bandwidth_bytes_per_s == pytest.approx(p2p)


def test_a_plan_hetrain_cannot_express_is_refused_with_its_id(data: SailorData) -> None:
    raw = raw_plan(data, MIT)
    raw["stages"][1]["replicas"] = raw["stages"][1]["replicas"][:1]
    with pytest.raises(MeasuredRunError, match=r"plan superseded/mit/N4/N4_D2@37ded10: stages with different "
                                               r"data-parallel degrees \[2, 1\]"):
        convert_plan(raw, data)
    raw = raw_plan(data, GH200)
    raw["model"] = "OPT-999"
    with pytest.raises(MeasuredRunError, match=r"profiles\.json has no model 'OPT-999'"):
        convert_plan(raw, data)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(MeasuredRunError, match=r"measured_plans\.json: cannot read"):
        load_sailor_data(tmp_path)


def test_a_converted_plan_round_trips_through_plan_json(data: SailorData, tmp_path: Path) -> None:
    from hetrain.plan import load_plan

    run = convert_plan(raw_plan(data, MIT), data)
    run.plan.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again.sync_options == run.plan.sync_options and again.sync_options.transfers == "blocking"
    assert again.profile.memory_footprint == run.plan.profile.memory_footprint
    assert again.profile.layers[25].tp == run.plan.profile.layers[25].tp  # the head's logits split, as saved
    assert [s.tp_group for vw in again.virtual_workers for s in vw.stages] == [
        s.tp_group for vw in run.plan.virtual_workers for s in vw.stages]
    assert simulate(again).iteration_s == pytest.approx(simulate(run.plan).iteration_s, rel=1e-12)

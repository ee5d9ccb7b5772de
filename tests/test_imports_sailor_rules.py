"""The import's rules for runs the development set does not have (docs/measured-runs.md): fp16, replicas that
share a node, profiles measured forward only or at one micro-batch size. Each against values computed by hand
from the rule, on a small hand-made run: three layers, V100 and T4 nodes, curves simple enough to evaluate here.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hetrain.imports.sailor import (
    BACKWARD_PER_FORWARD,
    DEEPSPEED,
    MeasuredRunError,
    SailorData,
    convert_plan,
    load_sailor_data,
)
from hetrain.plan import validate_plan
from hetrain.simulator import simulate

#: the runtime without its fitted memory beyond tensors, so that a device's peak is its tensors alone
TENSORS_ONLY = replace(DEEPSPEED, fixed_bytes_per_gpu=0.0, allocator_fraction=0.0)
PARAMS = [1_000_000, 2_000_000, 500_000]  # embedding, one block, head (elements)
OUT = [262_144, 262_144, 400_000]  # per sample: a block's output is 1 MiB in fp32
SAVED = [524_288, 1_048_576, 800_000]
V100_FWD, V100_BWD = [0.001, 0.004, 0.002], [0.002, 0.009, 0.003]  # at micro-batch 2
T4_FWD = [0.002, 0.010, 0.004]  # micro-batch 1, forward only
V100_BW = 900e9  # the catalog's V100 memory bandwidth (optimizer step, roofline)


def curve(c1: float, c2: float, top: float) -> dict[str, Any]:
    """A fitted curve of network.json: (c1 log2(S / 1 MB) + c2) GB/s, at most ``top`` bytes/s."""
    return {"coeffs": [0.0, c1, c2], "max_bw_Bps": top}


def gb_s(c1: float, c2: float, size: float) -> float:
    return (c1 * math.log2(size / 1e6) + c2) * 1e9


def stage(i: int, layers: list[int], replicas: list[dict[str, Any]]) -> dict[str, Any]:
    return {"stage_id": i, "layers": layers, "dp": len(replicas), "replicas": replicas}


def v100(**extra: Any) -> dict[str, Any]:
    return {"gpu_type": "V100-16", "tp": 1, "gpus_per_node": 4, **extra}


def write_run(tmp_path: Path, plans: list[dict[str, Any]]) -> SailorData:
    """measured_plans.json, profiles.json and network.json of a tiny model on V100 and T4 nodes."""
    timing = {"V100-16": {"2": {"1": {"fwd_s": V100_FWD, "bwd_s": V100_BWD}}},
              "T4": {"1": {"1": {"fwd_s": T4_FWD}}}}
    profiles = {"models": {"tiny": {
        "dims": {"hidden_size": 256, "sequence_length": 1024},
        "timing": timing,
        "layer_sizes_per_tp": {"1": {"params_floats": PARAMS, "act_output_floats": OUT,
                                     "act_input_floats": [1024, 262_144, 262_144], "act_mem_floats": SAVED}}}}}
    pair = {"V100-16": {"1": {"V100-16": {"1": curve(1.0, 8.0, 12e9)}},
                        "2": {"V100-16": {"2": curve(1.0, 10.0, 12e9)}}},
            "T4": {"1": {"T4": {"1": curve(0.5, 4.0, 6e9)}}}}
    network = {"inter_node": pair,
               "intra_node": {"V100-16": {"2": curve(2.0, 40.0, 80e9)}, "T4": {"2": curve(1.0, 8.0, 12e9)}},
               "basic_cluster_config": {"V100-16": {"mem_per_gpu": 16e9}, "T4": {"mem_per_gpu": 15e9}}}
    for name, content in (("measured_plans.json", {"plans": plans}), ("profiles.json", profiles),
                          ("network.json", network)):
        (tmp_path / name).write_text(json.dumps(content))
    return load_sailor_data(tmp_path)


def measured_plan(stages: list[dict[str, Any]], mbs: int, m: int, **extra: Any) -> dict[str, Any]:
    return {"id": "hand", "group": "hand", "model": "tiny", "mbs": mbs, "num_microbatches": m, "stages": stages,
            "measured": {"iter_time_s": 1.0, "max_mem_bytes": 1e9}, **extra}


PIPELINE = [stage(0, [0, 1], [v100()]), stage(1, [2], [v100()])]


def test_an_fp16_run_keeps_16_bit_activations_and_deepspeeds_16_bytes_per_parameter(tmp_path: Path) -> None:
    """Two V100 stages at micro-batch 2, 4 micro-batches, fp16: memory and a transfer by the rules."""
    data = write_run(tmp_path, [measured_plan(PIPELINE, 2, 4, precision="fp16")])
    run = convert_plan(data.plans[0], data, TENSORS_ONLY)
    plan, profile, cluster = run.plan, run.plan.profile, run.plan.cluster
    validate_plan(plan)
    assert (plan.precision, profile.mixed_precision) == ("fp16", "master-weights")
    # activations at 2 bytes an element, parameters counted at 4 (the master weights)
    assert [x.output_bytes_per_sample for x in profile.layers] == [2 * 262_144, 2 * 262_144, 2 * 400_000]
    assert [x.param_bytes for x in profile.layers] == [4 * p for p in PARAMS]
    # a transfer: micro-batch 2 of the block's output, 2 x 262144 x 2 bytes = 1 MiB, over the one-GPU curve at it
    sent = 2 * 262_144 * 2
    assert 2 * profile.sent_bytes_per_sample(1) == sent
    link = cluster.node_link(0, 1).bandwidth_bytes_per_s  # TP 1: nothing partitioned, nothing to rebuild
    assert link == pytest.approx(gb_s(1.0, 8.0, sent), rel=1e-12)
    # memory of one GPU: DeepSpeed's fp16 optimizer, 2 (weights) + 2 (gradients) + 4 (master) + 8 (Adam) bytes per
    # parameter, + the activations of the micro-batches in flight (1F1B: stage 0 of 2 holds 2, stage 1 one)
    weights = [16 * (1_000_000 + 2_000_000), 16 * 500_000]
    acts_0 = 2 * 2 * 2 * (524_288 + 1_048_576)  # in flight x micro-batch x bytes x saved elements
    # the head keeps its activations less its logits, and the loss one logits' worth per micro-batch in flight;
    # its backward holds two logits' worth more for one micro-batch
    logits = 2 * 400_000
    acts_1 = 1 * 2 * (2 * (800_000 - 400_000) + logits) + 2 * 2 * logits
    peaks = {name: d.peak_memory_bytes for name, d in simulate(plan).devices.items()}
    assert peaks["s0r0:0"] == pytest.approx(weights[0] + acts_0, rel=1e-12)
    assert peaks["s1r0:0"] == pytest.approx(weights[1] + acts_1, rel=1e-12)
    # the same run at fp32 keeps 4 + 4 + 8 bytes per parameter (as many) and activations twice the size
    fp32 = convert_plan(measured_plan(PIPELINE, 2, 4), data, TENSORS_ONLY).plan
    assert (fp32.precision, fp32.profile.mixed_precision) == ("fp32", "autocast")
    assert simulate(fp32).devices["s0r0:0"].peak_memory_bytes == pytest.approx(weights[0] + 2 * acts_0, rel=1e-12)
    # hetrain's own runtime at fp16 keeps fp32 gradients and a 16-bit copy: 18 bytes per parameter, not 16
    own = replace(profile, mixed_precision="autocast")
    assert simulate(replace(plan, profile=own)).devices["s0r0:0"].peak_memory_bytes == pytest.approx(
        18 * 3_000_000 + acts_0, rel=1e-12)


def test_an_fp16_runs_gradient_all_reduce_moves_16_bit_gradients(tmp_path: Path) -> None:
    """One stage, two V100 replicas on nodes of their own: the ring moves 2 bytes per parameter."""
    data = write_run(tmp_path, [measured_plan([stage(0, [0, 1, 2], [v100(), v100()])], 2, 1, fp16=True)])
    run = convert_plan(data.plans[0], data, TENSORS_ONLY)
    layout, cluster = run.plan.layout, run.plan.cluster
    (segment,) = layout.segments
    assert segment.param_bytes == 4 * 3_500_000
    assert layout.wire_bytes(segment.param_bytes, segment) == 2 * 3_500_000
    # the link between the replicas' nodes: the one-GPU curve at a ring step's message, 2 x 3.5M / 2 bytes
    assert cluster.node_link(0, 1).bandwidth_bytes_per_s == pytest.approx(gb_s(1.0, 8.0, 3_500_000), rel=1e-12)


def test_replicas_that_share_a_node_take_its_intra_link_and_share_its_nic(tmp_path: Path) -> None:
    """Stage 0's two replicas on node "a", stage 1's two on node "b"; one micro-batch of 2, fp32."""
    stages = [stage(0, [0, 1], [v100(node="a"), v100(node="a")]), stage(1, [2], [v100(node="b"), v100(node="b")])]
    data = write_run(tmp_path, [measured_plan(stages, 2, 1)])
    run = convert_plan(data.plans[0], data, TENSORS_ONLY)
    plan, cluster = run.plan, run.plan.cluster
    validate_plan(plan)
    assert [n.name for n in cluster.nodes] == ["a", "b"]
    assert [d.name for d in cluster.devices] == [f"{n}:{g}" for n in "ab" for g in range(4)]
    assert [vw.devices for vw in plan.virtual_workers] == [["a:0", "b:0"], ["a:1", "b:1"]]
    # between the nodes one link: two GPUs of each sending at once (the count-2 curve) at 2 x 1 MiB
    activation = 2 * 4 * 262_144
    between = gb_s(1.0, 10.0, activation)
    assert len(cluster.node_links) == 1
    assert cluster.node_link(0, 1).bandwidth_bytes_per_s == pytest.approx(between, rel=1e-12)
    # inside a node: the intra-node curve at a ring step of the stage's gradient all-reduce (a replica's / 2)
    ring = {"a": 4 * 3_000_000 / 2, "b": 4 * 500_000 / 2}
    for n in cluster.nodes:
        assert n.intra_link.bandwidth_bytes_per_s == pytest.approx(gb_s(2.0, 40.0, ring[n.name]), rel=1e-12)
    assert cluster.link(0, 1) == cluster.nodes[0].intra_link
    # the NIC: the count-2 curve's largest bandwidth
    assert cluster.nodes[0].nic.bandwidth_bytes_per_s == 12e9
    # by hand: both pipelines start together; their activations leave "a" one after the other on its NIC (c each),
    # so pipeline 1 runs c behind pipeline 0 from there on, its gradient leaving "b" just as pipeline 0's has
    # arrived. Each stage's all-reduce (two replicas on one node: a ring of two over the intra link, 2 latencies
    # and the bytes once) follows the later replica's last backward; stage 0's is last, then its optimizer step.
    c = activation / between
    f0, b0 = V100_FWD[0] + V100_FWD[1], V100_BWD[0] + V100_BWD[1]
    f1, b1 = V100_FWD[2], V100_BWD[2]
    intra = cluster.nodes[0].intra_link
    allreduce_0 = 2 * intra.latency_s + 4 * 3_000_000 / intra.bandwidth_bytes_per_s
    step_0 = 2 * 16 * 3_000_000 / V100_BW  # roofline: weights, gradients and Adam state read and written
    shared = f0 + 2 * c + f1 + b1 + c + b0 + allreduce_0 + step_0
    assert simulate(plan).iteration_s == pytest.approx(shared, rel=1e-9)


def test_a_node_shared_by_different_gpus_is_refused_naming_the_field(tmp_path: Path) -> None:
    t4 = {"gpu_type": "T4", "tp": 1, "gpus_per_node": 4, "node": "a"}
    stages = [stage(0, [0, 1], [v100(node="a")]), stage(1, [2], [t4])]
    data = write_run(tmp_path, [measured_plan(stages, 1, 1)])
    with pytest.raises(MeasuredRunError, match=r"measured_plans\.json: plan hand: stages\[1\]\.replicas\[0\]\.node "
                                               r"= 'a' puts gpu_type 'T4' on the node of stages\[0\]\.replicas\[0\], "
                                               r"whose gpu_type is 'V100-16'"):
        convert_plan(data.plans[0], data)
    crowded = [stage(0, [0, 1, 2], [v100(node="a", gpus_per_node=2)] * 3)]
    with pytest.raises(MeasuredRunError, match=r"node 'a' .* holds 3 replicas of 1 GPUs, gpus_per_node = 2"):
        convert_plan(measured_plan(crowded, 1, 1), data)
    with pytest.raises(MeasuredRunError, match=r"stages\[0\]\.replicas\[0\]\.node = 'a:1': a node id"):
        convert_plan(measured_plan([stage(0, [0, 1, 2], [v100(node="a:1")])], 1, 1), data)


@pytest.mark.parametrize(("extra", "message"), [
    ({"precision": "fp8"}, r"field 'precision' = 'fp8': one of fp32, fp16, bf16"),
    ({"fp16": "yes"}, r"field 'fp16' = 'yes': true or false"),
    ({"precision": "bf16", "fp16": True}, r"field 'precision' = 'bf16', but field 'fp16' is true"),
])
def test_an_unknown_precision_is_refused_naming_the_file_field_and_value(tmp_path: Path, extra: dict[str, Any],
                                                                         message: str) -> None:
    data = write_run(tmp_path, [measured_plan(PIPELINE, 2, 1, **extra)])
    with pytest.raises(MeasuredRunError, match=r"measured_plans\.json: plan hand: " + message):
        convert_plan(data.plans[0], data)


def test_a_forward_only_profile_at_micro_batch_1_is_extrapolated_and_flagged(tmp_path: Path) -> None:
    """One T4 runs the whole model at micro-batch 2, 3 micro-batches; its profile has forwards at micro-batch 1."""
    t4 = {"gpu_type": "T4", "tp": 1, "gpus_per_node": 4}
    data = write_run(tmp_path, [measured_plan([stage(0, [0, 1, 2], [t4])], 2, 3)])
    run = convert_plan(data.plans[0], data, TENSORS_ONLY)
    assert run.extrapolated == ("T4 at TP 1: backward = 2 x forward (no bwd_s in profiles.json)",
                                "T4 at TP 1: micro-batch 2 not measured; taken as 2 x its time at micro-batch 1")
    assert BACKWARD_PER_FORWARD == 2.0
    ms = run.plan.profile.layers[1].measurements("T4")
    assert [(m.micro_batch, m.forward_s, m.backward_s) for m in ms] == [(1, 0.010, 0.020)]
    # one stage: 3 micro-batches of forward (2 x the micro-batch-1 forward) and backward (2 x that), then the step
    per_micro_batch = sum(2 * f + 2 * (2 * f) for f in T4_FWD)
    step = 2 * 16 * 3_500_000 / 320e9  # the catalog's T4 memory bandwidth
    assert simulate(run.plan).iteration_s == pytest.approx(3 * per_micro_batch + step, rel=1e-9)
    # a plan the profile has measured is not flagged
    v = convert_plan(measured_plan([stage(0, [0, 1, 2], [v100()])], 2, 3), data)
    assert v.extrapolated == ()


def test_a_profile_whose_backward_is_null_for_a_layer_takes_twice_its_forward(tmp_path: Path) -> None:
    data = write_run(tmp_path, [measured_plan(PIPELINE, 2, 1)])
    profiles = copy.deepcopy(dict(data.profiles))
    profiles["models"]["tiny"]["timing"]["V100-16"]["2"]["1"]["bwd_s"] = [0.002, None, 0.003]
    doctored = SailorData(data.directory, data.plans, profiles, data.network)
    run = convert_plan(data.plans[0], doctored)
    assert run.extrapolated == ("V100-16 at TP 1: backward = 2 x forward (no bwd_s in profiles.json)",)
    assert [m.backward_s for x in run.plan.profile.layers for m in x.measurements("V100-16GB")] == [
        0.002, 2 * 0.004, 0.003]


def test_the_scorer_flags_a_plan_on_an_extrapolated_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """benchmarks/real_cluster_accuracy.py: the group's row counts it, a note names it and its rules, --json too."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import real_cluster_accuracy

    t4 = {"gpu_type": "T4", "tp": 1, "gpus_per_node": 4}
    plans = [measured_plan([stage(0, [0, 1, 2], [t4])], 2, 3), measured_plan(PIPELINE, 2, 1)]
    plans[1]["id"] = "measured"
    write_run(tmp_path, plans)
    assert real_cluster_accuracy.main(["--data", str(tmp_path), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| DeepSpeed (default) | hand (1 on extrapolated profiles) | 2 |" in out
    assert ("1 plans rest on an extrapolated profile" in out and "  hand: T4 at TP 1: backward = 2 x forward (no "
            "bwd_s in profiles.json); T4 at TP 1: micro-batch 2 not measured" in out)
    assert "measured:" not in out
    entries = json.loads((tmp_path / "out.json").read_text())["plans"]
    assert [len(e["extrapolated"]) for e in entries] == [2, 0]


def test_an_fp16_plan_round_trips_and_hetrains_runtime_refuses_it(tmp_path: Path) -> None:
    from hetrain.errors import InputError
    from hetrain.plan import load_plan
    from hetrain.runtime.command import check_plan_precision

    data = write_run(tmp_path, [measured_plan(PIPELINE, 2, 4, precision="fp16")])
    plan = convert_plan(data.plans[0], data).plan
    plan.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again.profile.mixed_precision == "master-weights" and again.precision == "fp16"
    before, after = simulate(plan), simulate(again)
    assert after.iteration_s == pytest.approx(before.iteration_s, rel=1e-12)
    assert after.devices["s0r0:0"].peak_memory_bytes == pytest.approx(before.devices["s0r0:0"].peak_memory_bytes,
                                                                      rel=1e-12)
    with pytest.raises(InputError, match=r"plan\.json: its profile's mixed_precision is 'master-weights'"):
        check_plan_precision(again, None, "plan.json")


def test_a_shared_node_without_a_curve_for_its_count_takes_the_largest_count_below(tmp_path: Path) -> None:
    """Two T4 replicas per node; network.json has T4 curves of one GPU sending only."""
    t4 = {"gpu_type": "T4", "tp": 1, "gpus_per_node": 4}
    stages = [stage(0, [0, 1], [{**t4, "node": "t"}, {**t4, "node": "t"}]),
              stage(1, [2], [{**t4, "node": 7}, {**t4, "node": 7}])]
    data = write_run(tmp_path, [measured_plan(stages, 1, 1)])
    cluster = convert_plan(data.plans[0], data).plan.cluster
    assert [n.name for n in cluster.nodes] == ["t", "7"]
    # the count-1 curve at a T4's whole activation (TP 1: 1 x 4 x 262144 bytes), its largest bandwidth the NICs'
    assert cluster.node_link(0, 1).bandwidth_bytes_per_s == pytest.approx(gb_s(0.5, 4.0, 4 * 262_144), rel=1e-12)
    assert [n.nic.bandwidth_bytes_per_s for n in cluster.nodes] == [6e9, 6e9]
    # a node id that is another replica's own node name is refused
    clash = [stage(0, [0, 1, 2], [v100(), v100(node="s0r0")])]
    with pytest.raises(MeasuredRunError, match=r"a replica's node = 's0r0': the name of the node of its own of "
                                               r"stages\[0\]\.replicas\[0\]"):
        convert_plan(measured_plan(clash, 1, 1), data)

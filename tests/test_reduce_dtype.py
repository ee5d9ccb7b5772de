"""Gradients all-reduced in bf16 (sync option ``reduce_dtype``): priced, simulated, planned, remembered and refused.

bf16 halves the bytes of every bsp gradient all-reduce. The layout picks each
all-reduce's algorithm on those bytes, the closed forms and the simulator price them,
the memory model counts the 16-bit copies alive from a bucket's post to its wait, the
planner may choose another plan for them, and a mode that does not all-reduce gradients
(the others average weights or push to parameter servers) refuses the option, naming
where it came from. The runtime's side (the bytes sent, the weights it trains) is
checked on Gloo ranks in tests/distributed/test_runtime_hierarchical.py and
test_runtime_equivalence.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from factories import A100, make_cluster, make_plan, replicas
from hetrain import plan
from hetrain.cli import main
from hetrain.cluster import Cluster, parse_cluster
from hetrain.cost import (
    MEMORY_MARGIN_FRACTION,
    allreduce_shape,
    estimate_allreduce,
    estimate_device_memory,
    estimate_optimizer_step_memory,
    estimate_stage_memory,
    estimate_weight_memory,
    runtime_footprint,
    tensor_budget,
)
from hetrain.errors import InputError
from hetrain.models.analytic import build_mlp_profile, build_profile
from hetrain.plan import Plan, PlanError, load_plan, parse_plan
from hetrain.planner.search import PlannerError
from hetrain.planner.sync import estimate_mode_sync_time
from hetrain.profile import ModelProfile
from hetrain.simulator import simulate
from hetrain.sync_layout import SYNC_MODES, SyncLayoutError, SyncOptions, check_mode_options, modes_for


def two_nodes(nic: str) -> Cluster:
    """Two nodes of two A100s: NVLink inside, ``nic`` between."""
    return make_cluster({"n0": 2, "n1": 2}, device_type=A100, intra_link="nvlink3", nic=nic, name="2x2")


def dp_plan(reduce_dtype: str, cluster: Cluster, profile: ModelProfile | None = None, optimizer: str = "sgd",
            **options: Any) -> Plan:
    """Four one-stage VWs (pure data parallelism) of ``profile`` (gpt2-small), 4 samples each."""
    profile = profile or build_profile("gpt2-small")
    return make_plan(cluster, profile, replicas([d.name for d in cluster.devices], profile.num_layers, 4),
                     optimizer=optimizer, reduce_dtype=reduce_dtype, **options)


def test_the_option_is_fp32_by_default_and_bf16_moves_half_the_bytes() -> None:
    assert SyncOptions().reduce_dtype == "fp32" and SyncOptions().reduce_wire == 1.0
    assert SyncOptions().reduce_copy == 0.0  # fp32: reduced in the gradient buffer itself
    bf16 = SyncOptions.from_items(["reduce_dtype=bf16"])
    assert bf16.reduce_wire == 0.5 and bf16.reduce_copy == 0.5
    with pytest.raises(SyncLayoutError, match="reduce_dtype must be one of fp32, bf16, got 'fp16'"):
        SyncOptions.from_items(["reduce_dtype=fp16"])


def test_only_bsp_takes_bf16_and_the_refusal_names_its_source() -> None:
    assert modes_for(SyncOptions()) == SYNC_MODES
    assert modes_for(SyncOptions(reduce_dtype="bf16")) == ("bsp",)
    check_mode_options("bsp", SyncOptions(reduce_dtype="bf16"))
    for mode in SYNC_MODES[1:]:
        check_mode_options(mode, SyncOptions())
        with pytest.raises(SyncLayoutError, match=rf"--sync {mode}: reduce_dtype=bf16 applies to the bsp mode"):
            check_mode_options(mode, SyncOptions(reduce_dtype="bf16"), f"--sync {mode}")


def test_a_plan_file_of_another_mode_with_bf16_is_refused_naming_the_field() -> None:
    data = dp_plan("bf16", two_nodes("10Gbit/s")).to_dict()
    assert data["sync"]["options"]["reduce_dtype"] == "bf16"
    assert parse_plan(data).sync_options.reduce_dtype == "bf16"  # round-trips
    data["sync"]["mode"] = "wsp"
    with pytest.raises(PlanError, match=r"sync\.options: reduce_dtype=bf16 applies to the bsp mode's gradient"):
        parse_plan(data)
    old = dp_plan("fp32", two_nodes("10Gbit/s")).to_dict()
    del old["sync"]["options"]["reduce_dtype"]  # a plan written before the option: fp32
    assert parse_plan(old, check_layout=False).sync_options.reduce_dtype == "fp32"


def test_the_closed_form_halves_a_bandwidth_bound_all_reduce() -> None:
    # gpt2-small's 500 MB of fp32 gradients over 1 Gbit/s: seconds of bytes, microseconds of latency
    cluster = two_nodes("1Gbit/s")
    profile = build_profile("gpt2-small")
    layouts = [[(d, 0, profile.num_layers)] for d in range(4)]
    fp32, bf16 = (estimate_mode_sync_time(cluster, profile, layouts, "bsp", SyncOptions(reduce_dtype=r), 0.0)
                  for r in ("fp32", "bf16"))
    assert fp32 > 1.0
    assert bf16 / fp32 == pytest.approx(0.5, rel=0.02)


def test_the_layout_picks_each_algorithm_on_the_bytes_that_travel() -> None:
    cluster = two_nodes("1Gbit/s")
    p = dp_plan("bf16", cluster)
    shape = allreduce_shape(cluster, [0, 1, 2, 3])
    for bucket in p.segments()[0].buckets:
        assert bucket.algorithm == estimate_allreduce(bucket.param_bytes * 0.5, shape)[1]
    # the buckets are cut on the fp32 gradients (the runtime's buffer), whatever travels
    assert [b.param_bytes for b in p.segments()[0].buckets] == \
        [b.param_bytes for b in dp_plan("fp32", cluster).segments()[0].buckets]


def test_the_simulator_spends_half_the_sync_and_counts_the_copies() -> None:
    cluster = two_nodes("1Gbit/s")
    fp32, bf16 = simulate(dp_plan("fp32", cluster)), simulate(dp_plan("bf16", cluster))
    assert bf16.iteration_s < fp32.iteration_s
    sync32, sync16 = (max(d.sync_s for d in r.devices.values()) for r in (fp32, bf16))
    assert sync16 / sync32 == pytest.approx(0.5, rel=0.1)
    # SGD has no step transient: the bf16 copies of the gradients (half their bytes) are the iteration's end
    params = build_profile("gpt2-small").param_bytes
    assert estimate_optimizer_step_memory(params, 4, "sgd", reduce_copy=0.5) == 0.5 * params
    assert estimate_optimizer_step_memory(params, 4, "adam", reduce_copy=0.5) == params  # Adam's is larger
    mlp = build_mlp_profile([64, 256, 256, 10], name="mlp")  # 340 kB of weights, 2 kB of activations a sample
    tiny32, tiny16 = (simulate(dp_plan(r, cluster, mlp)) for r in ("fp32", "bf16"))
    weights = estimate_weight_memory(mlp.param_bytes, mlp.bytes_per_element, "sgd")  # and the gradients
    with_copies = estimate_stage_memory(mlp, 0, 3, (), 4, 1, "sgd", reduce_copy=0.5)
    assert with_copies == pytest.approx(weights + 0.5 * mlp.param_bytes)  # its activations are smaller than that
    assert estimate_stage_memory(mlp, 0, 3, (), 4, 1, "sgd") < with_copies
    for name, d in tiny16.devices.items():  # the simulated peak: those tensors, the allocator's share, the context
        assert d.peak_memory_bytes == pytest.approx(estimate_device_memory(mlp, cluster.device(name), with_copies))
        assert tiny32.devices[name].peak_memory_bytes < d.peak_memory_bytes


def test_the_planner_leaves_room_for_the_copies_where_replicas_share_a_stage() -> None:
    # two devices whose tensor budget is SGD's weights and gradients (2x the parameters) + 0.3x: the whole
    # model fits each in fp32, not with bf16 copies of the gradients (0.5x) once two replicas share it
    mlp = build_mlp_profile([64, 1024, 1024, 1024, 10], name="mlp")  # 8.7 MB of weights, 4 kB of activations

    def cluster(memory_bytes: float) -> Cluster:
        return parse_cluster({"name": "small", "node": [{"name": "n0", "intra_link": "pcie3", "nic": "10Gbit/s",
                                                         "devices": [{"type": "tiny", "tflops": 10, "count": 2,
                                                                      "memory": f"{int(memory_bytes)}B",
                                                                      "memory_bandwidth": "100GB/s"}]}]})

    fp = runtime_footprint(mlp, cluster(1e9).devices[0])
    tensors = estimate_weight_memory(mlp.param_bytes, 4, "sgd") + 0.3 * mlp.param_bytes
    small = cluster((fp.fixed_bytes + (1 + fp.allocator_fraction) * tensors) / (1 - MEMORY_MARGIN_FRACTION))
    budget = tensor_budget(mlp, small.devices[0])
    bf16 = SyncOptions(reduce_dtype="bf16")
    dp32 = plan(small, mlp, 16, strategy="dp", optimizer="sgd", simulate_top_k=0)
    assert [len(vw.stages) for vw in dp32.virtual_workers] == [1, 1]
    assert all(vw.stages[0].predicted_memory_bytes <= budget for vw in dp32.virtual_workers)
    # before the partitioner counted the copies, this plan was made and refused afterwards (21.8 MB needed)
    with pytest.raises(PlannerError, match="16-bit copies of its gradients at the step"):
        plan(small, mlp, 16, strategy="dp", optimizer="sgd", simulate_top_k=0, sync_options=bf16)
    chosen = plan(small, mlp, 16, optimizer="sgd", simulate_top_k=0, sync_options=bf16)
    for vw in chosen.virtual_workers:  # a plan that fits: a pipeline (one VW, no copies) or shorter stages
        for stage in vw.stages:
            assert stage.predicted_memory_bytes <= budget


def test_the_planner_predicts_more_throughput_and_records_only_bsp() -> None:
    cluster = two_nodes("1Gbit/s")
    profile = build_profile("gpt2-small")
    fp32 = plan(cluster, profile, 64, strategy="dp", simulate_top_k=0)
    bf16 = plan(cluster, profile, 64, strategy="dp", simulate_top_k=0, sync_options=SyncOptions(reduce_dtype="bf16"))
    assert bf16.sync_options.reduce_dtype == "bf16"
    assert bf16.prediction.sync_s < 0.6 * fp32.prediction.sync_s
    assert bf16.prediction.samples_per_s > fp32.prediction.samples_per_s
    assert set(bf16.options["sync_predictions"]) == {"bsp"}
    assert set(fp32.options["sync_predictions"]) == set(SYNC_MODES)
    auto = plan(cluster, profile, 64, strategy="dp", sync="auto", simulate_top_k=0,
                sync_options=SyncOptions(reduce_dtype="bf16"))
    assert auto.sync == "bsp"
    with pytest.raises(InputError, match="sync mode daso exchanges weights and updates in fp32"):
        plan(cluster, profile, 64, strategy="dp", sync="daso", sync_options=SyncOptions(reduce_dtype="bf16"))


def test_with_sync_to_another_mode_is_refused() -> None:
    p = dp_plan("bf16", two_nodes("10Gbit/s"))
    with pytest.raises(SyncLayoutError, match="sync mode local-sgd"):
        p.with_sync("local-sgd")
    assert replace(p, sync_options=SyncOptions()).with_sync("local-sgd").sync == "local-sgd"


def test_hetrain_plan_says_what_bf16_would_give_and_refuses_it_with_another_mode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text('name = "2x2"\n' + "".join(
        f'[[node]]\nname = "{n}"\ndevices = [{{ type = "A100-40GB", count = 2 }}]\nintra_link = "nvlink3"\n'
        'nic = "1Gbit/s"\n' for n in ("n0", "n1")))
    base = ["plan", "--cluster", str(cluster), "--model", "gpt2-small", "--global-batch", "64", "--strategy", "dp",
            "--time-budget", "5s"]
    assert main([*base, "-o", str(tmp_path / "fp32.json")]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if "reduce_dtype=bf16" in line]
    assert len(hint) == 1 and "samples/s on these stages" in hint[0]
    assert main([*base, "--sync-option", "reduce_dtype=bf16", "-o", str(tmp_path / "bf16.json")]) == 0
    out = capsys.readouterr().out
    assert "reduce_dtype=bf16" not in out  # no hint once it is the plan's
    bf16 = load_plan(tmp_path / "bf16.json")
    assert bf16.sync_options.reduce_dtype == "bf16"
    assert bf16.prediction.samples_per_s > load_plan(tmp_path / "fp32.json").prediction.samples_per_s
    assert main([*base, "--sync", "wsp", "--sync-option", "reduce_dtype=bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hetrain plan: error: --sync wsp with --sync-option: reduce_dtype=bf16 applies to the bsp mode's "
                   "gradient all-reduces; sync mode wsp exchanges weights and updates in fp32 (use reduce_dtype=fp32, "
                   "or sync bsp)"]

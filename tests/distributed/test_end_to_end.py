"""The main job end to end on an emulated cluster: plan, train a few steps, tear down.

2 nodes, 3 devices (two at share 0.5 on a 1 Gbit/s NIC, one at 0.25 on 100 Mbit/s),
each a throttled CPU process in its node's network namespace, one torchrun per
node joined by c10d rendezvous. Skips, saying why, where namespaces cannot be made
(not root, no iproute2). Afterwards nothing of the run may be left: no namespace,
no cgroup, no state file.
"""

from __future__ import annotations

import io
import json
import math
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from hetrain.cluster import parse_cluster
from hetrain.emulate import EmulatedCluster, EmulationError, EmulationSettings, list_runs
from hetrain.emulate.cgroups import list_run_dirs
from hetrain.emulate.emulator import check_permissions
from hetrain.emulate.network import list_namespaces, run_id_of
from hetrain.planner import plan
from hetrain.profile import load_profile, relabel_profile
from hetrain.profiler.layers import run_profile_command

CLUSTER = {
    "name": "e2e",
    "node": [
        {"name": "fast", "devices": [{"type": "cpu", "cpu_share": 0.5, "count": 2}], "intra_link": "loopback",
         "nic": "1Gbit/s"},
        {"name": "slow", "devices": [{"type": "cpu", "cpu_share": 0.25}], "intra_link": "loopback",
         "nic": "100Mbit/s"},
    ],
}
STEPS = 3


def _can_emulate() -> str:
    try:
        check_permissions("up")
    except EmulationError as e:
        return str(e)
    return ""


@pytest.mark.timeout(240)
@pytest.mark.skipif(bool(_can_emulate()), reason=f"cannot emulate a cluster here: {_can_emulate()}")
def test_plan_train_and_tear_down_on_an_emulated_cluster(tmp_path: Path) -> None:
    start = time.perf_counter()
    cluster = parse_cluster(CLUSTER)
    assert run_profile_command("gpt-tiny", (4, 8), str(tmp_path / "local.json"), repeats=2, warmup=1) == 0
    profile = relabel_profile(load_profile(tmp_path / "local.json"), "cpu")
    p = plan(cluster, profile, 12, micro_batch_sizes=(4,), simulate_top_k=1)
    plan_path, metrics = tmp_path / "plan.json", tmp_path / "metrics.jsonl"
    p.save(plan_path)

    run_id = secrets.token_hex(3)
    em = EmulatedCluster(cluster, EmulationSettings(), run_id=run_id)
    try:
        em.up()
    except EmulationError as e:
        pytest.skip(f"cannot emulate a cluster here: {e}")
    out = io.StringIO()
    try:
        assert {run_id_of(ns) for ns in list_namespaces()} >= {run_id}
        status = em.launch(["python", "-m", "hetrain.runtime.command", "--plan", str(plan_path), "--model",
                            "gpt-tiny", "--data", "shakespeare", "--steps", str(STEPS), "--metrics-out",
                            str(metrics), "--no-progress", "--log-every", "1"], timeout_s=180, stdout=out,
                           stderr=out)
    finally:
        em.down()
    assert status == 0, out.getvalue()[-3000:]

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time_s" in r]
    assert [r["step"] for r in steps][-STEPS:] == list(range(STEPS - len(steps) + 1, STEPS + 1))[-STEPS:]
    assert len(steps) == STEPS
    assert all(math.isfinite(r["loss"]) for r in steps)

    # nothing of the run is left: namespaces, cgroups, state, processes
    assert run_id not in {run_id_of(ns) for ns in list_namespaces()}
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hetrain-emu-{run_id}" not in names
    assert run_id not in list_run_dirs()
    assert run_id not in {r.run_id for r in list_runs()}
    print(f"end to end: {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------
# the demo's pure parts: no emulation needed
# ---------------------------------------------------------------------------


def test_relabel_files_measurements_under_the_device_type() -> None:
    from hetrain.profile import parse_profile

    raw = {"name": "m", "input_bytes_per_sample": 8, "layers": [
        {"name": "a", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
         "forward_flops_per_sample": 10, "measured": {"cpu": [{"micro_batch": 2, "forward_s": 0.1,
                                                                "backward_s": 0.2}]}}],
           "measured_on": {"cpu": {"peak_flops": 1e9, "memory_bandwidth_bytes_per_s": 1e9}}}
    p = relabel_profile(parse_profile(raw), "cpu-slow", (2e9, 3e9))
    assert p.layers[0].measurements("cpu-slow")[0].forward_s == 0.1
    assert p.layers[0].measurements("cpu") == ()
    f = p.figures_of("cpu-slow")
    assert f is not None and (f.peak_flops, f.memory_bandwidth_bytes_per_s) == (2e9, 3e9)


def test_measured_links_replace_the_nominal_ones() -> None:
    from hetrain.cluster_fixups import with_measured_links

    discovered = {"node": [{"name": "fast", "intra_link": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
                            "nic": {"bandwidth_bytes_per_s": 1.2e7, "latency_s": 2e-4}}],
                  "link": [{"nodes": ["fast", "slow"], "bandwidth_bytes_per_s": 1.2e7, "latency_s": 2e-4}]}
    # with idle fillers (the default) the discovery met the stall as training does: the measured latency stands
    filled = with_measured_links({**CLUSTER, "emulation": {"cpu_scale": 0.5}}, discovered)
    assert filled["link"] == discovered["link"]
    assert filled["node"][0]["intra_link"] == discovered["node"][0]["intra_link"]
    merged = with_measured_links({**CLUSTER, "emulation": {"cpu_scale": 0.5, "fill_idle": False}}, discovered)
    # without: shares 0.25 and 0.125 at a 10 ms period: quotas 2.5 and 1.25 ms, stalls (10 - q) / 2 = 3.75 and
    # 4.375 ms, added at each throttled end of a link
    fast, slow = 3.75e-3, 4.375e-3
    assert merged["node"][0]["nic"] == {"bandwidth_bytes_per_s": 1.2e7, "latency_s": pytest.approx(2e-4 + fast)}
    assert merged["node"][0]["intra_link"]["latency_s"] == pytest.approx(1e-5 + 2 * fast)
    assert merged["node"][1]["nic"] == "100Mbit/s" and "emulation" not in merged
    assert merged["link"][0]["latency_s"] == pytest.approx(2e-4 + fast + slow)
    c = parse_cluster(merged)
    assert c.link(c.device("fast:0").index, c.device("slow:0").index).bandwidth_bytes_per_s == 1.2e7
    unthrottled = with_measured_links({**CLUSTER, "node": [{**n, "devices": [{"type": "cpu", "count": 2}]}
                                                           for n in CLUSTER["node"]]}, discovered)
    assert unthrottled["link"] == discovered["link"]  # no share, no stall


def test_even_split_plan_is_one_pipeline_over_every_device() -> None:
    from hetrain.models.analytic import build_profile
    from hetrain.planner.baselines import even_split_plan

    cluster = parse_cluster(CLUSTER)
    profile = build_profile("gpt-tiny")
    pp = plan(cluster, profile, 12, strategy="pp", micro_batch_sizes=(4,), simulate_top_k=0)
    even = even_split_plan(pp)
    (vw,) = even.virtual_workers
    assert vw.devices == ["fast:0", "fast:1", "slow:0"] and vw.mini_batch == 12
    counts = [s.end_layer - s.first_layer for s in vw.stages]
    assert sum(counts) == profile.num_layers and max(counts) - min(counts) <= 1
    assert even.prediction.simulated_iteration_s is not None and even.prediction.iteration_s > 0
    # every figure comes from the one replay: no "pipeline 0 us" or "mem ?" in its summary
    from hetrain.simulator import simulate

    sim = simulate(even)
    pr = even.prediction
    assert pr.iteration_s == sim.iteration_s and pr.pipeline_s == sim.pipeline_s
    assert pr.pipeline_s + pr.sync_s + pr.optimizer_s == pytest.approx(pr.iteration_s)
    assert pr.optimizer_s > 0 and vw.predicted_pipeline_s == pytest.approx(sim.pipeline_s)
    assert {m.device: m.peak_bytes for m in pr.memory} == {
        d: s.peak_memory_bytes for d, s in sim.devices.items()}
    assert "mem ?" not in even.summary() and "pipeline 0 us" not in even.summary()


def test_even_dp_plan_splits_the_batch_evenly_over_every_device() -> None:
    from hetrain.models.analytic import build_profile
    from hetrain.planner.baselines import even_dp_plan

    cluster = parse_cluster(CLUSTER)
    profile = build_profile("gpt-tiny")
    dp = plan(cluster, profile, 13, strategy="dp", micro_batch_sizes=(4,), simulate_top_k=0)
    ddp = even_dp_plan(dp)
    assert [vw.devices for vw in ddp.virtual_workers] == [["fast:0"], ["fast:1"], ["slow:0"]]
    assert [vw.mini_batch for vw in ddp.virtual_workers] == [5, 4, 4]  # DDP's even split, not by speed
    assert all(vw.micro_batches == 1 and len(vw.stages) == 1 for vw in ddp.virtual_workers)
    assert ddp.strategy == "dp" and ddp.prediction.iteration_s > 0


def test_torch_pipelining_micro_batches_divide_the_batch() -> None:
    from dataclasses import replace

    from hetrain.models.analytic import build_profile
    from hetrain.planner.baselines import even_split_plan, torch_pipelining_micro_batches

    pp = plan(parse_cluster(CLUSTER), build_profile("gpt-tiny"), 12, strategy="pp", micro_batch_sizes=(4,),
              simulate_top_k=0)
    even = even_split_plan(pp)
    assert torch_pipelining_micro_batches(even) == even.virtual_workers[0].micro_batches == 3
    (vw,) = even.virtual_workers
    five = replace(even, virtual_workers=(replace(vw, micro_batches=5),))
    assert torch_pipelining_micro_batches(five) == 4  # 12 samples do not cut into 5 equal micro-batches

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

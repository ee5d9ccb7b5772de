"""A drift switch, end to end through ``hetrain train`` on 3 Gloo ranks (runtime.lifecycle: drift_watch, restart).

    attempt 1   the planner's plan for n0:0..n0:2 (mlp-digits as a pipeline), --force-drift 3:n0:1=5:
                at step 3 every rank re-plans with n0:1 five times slower, the ranks agree on the plan's
                digest, the job checkpoints, rank 0 writes CKPT/plans/plan-step3.json, and every rank
                exits with status 75 (what torchrun --max-restarts restarts)
    attempt 2   the same command: every rank takes the drift plan (not plan.json) and trains to step 6

In fp32 with BSP the weights after step 6 are those of one process training the whole model for 6 steps
on the same global batches (relative error <= 1e-5), and the losses of every step are its losses: the
switch lost nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from worker_ranks import Rank, single_process_mlp

import hetrain
from factories import make_cluster, mlp_digits_profile
from hetrain.elastic import plan_digest
from hetrain.plan import Plan, load_plan
from hetrain.runtime.lifecycle.drift_watch import SWITCH_EXIT_STATUS
from hetrain.runtime.state.checkpoint import load_checkpoint, load_manifest

#: a rank of ``hetrain train``, forked from the fork server (worker_ranks.Rank)
TRAIN = ["-m", "hetrain.runtime.command"]
MLP = mlp_digits_profile()
LR, SWITCH_AT, STEPS = 0.2, 3, 6


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, the same global batches: weights after ``steps`` steps and the losses."""
    return single_process_mlp(steps, LR)


def run_attempt(spawn, clean_env, port: int, args: list[str]) -> list[tuple[int, str, str]]:
    env = {**clean_env, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "HETRAIN_NODE": "n0", "HETRAIN_DEVICE": "cpu"}
    procs = [spawn([*TRAIN, *args], {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(3)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=150)
        out.append((p.returncode, stdout, stderr))
    return out


def stages(plan: Plan) -> list[list[tuple[str, int, int]]]:
    return [[(s.device, s.first_layer, s.end_layer) for s in vw.stages] for vw in plan.virtual_workers]


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import os
    import socket

    root = tmp_path_factory.mktemp("drift")
    plan = hetrain.plan(make_cluster({"n0": 3}), MLP, 16, optimizer="sgd")
    assert sorted(plan.devices_used) == ["n0:0", "n0:1", "n0:2"], plan.summary()
    plan.save(root / "plan.json")
    args = ["--plan", str(root / "plan.json"), "--model", "mlp-digits", "--data", "synthetic", "--steps", str(STEPS),
            "--checkpoint-dir", str(root / "ckpt"), "--metrics-out", str(root / "metrics.jsonl"), "--lr", str(LR),
            "--timeout-s", "60", "--no-progress", "--force-drift", f"{SWITCH_AT}:n0:1=5"]
    procs: list[Rank] = []
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HETRAIN_HOST")}
    clean.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("drift-logs")

    def spawn(cmd: list[str], env: dict[str, str]) -> Rank:
        procs.append(Rank(cmd[0], cmd[1:], env, logs, len(procs)))
        return procs[-1]

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    try:
        first = run_attempt(spawn, clean, port(), args)
        second = run_attempt(spawn, clean, port(), args)
    finally:
        for p in procs:
            p.kill()
    return {"plan": plan, "root": root, "first": first, "second": second}


def test_every_rank_switches_with_the_same_plan_and_exits_for_a_restart(switched: dict[str, Any]) -> None:
    first = switched["first"]
    assert [code for code, _, _ in first] == [SWITCH_EXIT_STATUS] * 3, [err[-2000:] for _, _, err in first]
    written = load_plan(switched["root"] / "ckpt" / "plans" / f"plan-step{SWITCH_AT}.json")
    digests = {m for _, out, _ in first for m in re.findall(r"the new plan is \S+ \(plan ([0-9a-f]{16})\)", out)}
    assert digests == {plan_digest(written)}  # each rank made it by itself: the same plan
    record = written.options["replan"]
    assert (record["kind"], record["from_step"], record["slowdown"]) == ("drift", SWITCH_AT, {"n0:1": 5.0})
    assert record["base_digest"] == plan_digest(switched["plan"])
    assert written.cluster.device("n0:1").type_name == "cpu@n0:1"
    assert stages(written) != stages(switched["plan"])  # n0:1 holds less, or nothing
    rows = [json.loads(line) for line in (switched["root"] / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in rows if "drift" in r]
    assert [(r["drift"], r["step"], r["forced"]) for r in decisions] == [("trigger", SWITCH_AT, True),
                                                                          ("switch", SWITCH_AT, True)]
    assert {"current_s", "new_s", "gain_s", "switch_cost", "plan_digest"} <= set(decisions[1])


def test_the_restart_takes_the_drift_plan_and_the_weights_equal_single_process_training(
        switched: dict[str, Any]) -> None:
    second = switched["second"]
    assert [code for code, _, _ in second] == [0] * 3, [err[-2000:] for _, _, err in second]
    assert "resuming under the plan re-made on drift" in second[0][1]
    assert f"resuming at step {SWITCH_AT}" in second[0][1]
    ckpt = switched["root"] / "ckpt"
    names = [n for n in load_manifest(ckpt, STEPS)["tensors"] if n.startswith("layers.")]
    got, _, _ = load_checkpoint(ckpt, names, STEPS)
    want, losses = reference(STEPS)
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"worst relative error {worst:.2e}"
    rows = [json.loads(line) for line in (switched["root"] / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert [logged[s] for s in range(1, STEPS + 1)] == pytest.approx(losses, rel=1e-5)

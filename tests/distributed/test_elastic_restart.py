"""A job restarted on fewer devices re-plans and goes on, as if nothing had changed (runtime.lifecycle.restart).

    phase 1   3 Gloo ranks, the planner's plan for n0:0..n0:2 (mlp-digits as a pipeline), steps 0 -> 3,
              checkpoint at step 3
    phase 2   2 ranks (n0:2 gone), the same plan file: every rank re-plans for n0:0, n0:1, the ranks
              compare their plans' digests, rank 0 writes CKPT/plans/plan-step3.json; steps 3 -> 6

In fp32 with BSP the weights after phase 2 are those of one process training the whole model for
6 steps on the same global batches (relative error <= 1e-5), and so are the losses of steps 4 to 6:
the optimizer state and the data order went through the change unharmed.

A world too small for the model is refused on every rank with one line naming the memory needed and
available; ``--replan off`` keeps the refusal of a world that is not the plan's.

Under torchrun itself (``--nnodes 1:2 --max-restarts 1``, c10d rendezvous, two agents on this host as
nodes a and b): node b dies after the first checkpoint, node a's agent restarts its rank, which
re-plans for a:0 alone and trains to the last step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_ranks import run_worker_ranks, single_process_mlp

import hetrain
from hetrain.cluster import parse_cluster
from hetrain.elastic import plan_digest
from hetrain.models.analytic import build_mlp_profile
from hetrain.plan import Plan, load_plan

#: a rank of ``hetrain train``, forked from the fork server (the ``fork_rank`` fixture)
TRAIN = ["-m", "hetrain.runtime.command"]
MLP = build_mlp_profile([64, 256, 256, 10], name="mlp-digits")
LR = 0.2
FIRST_STEPS, STEPS = 3, 6

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    (case,) = json.load(open(sys.argv[1]))
    data = build_datasets("synthetic", "mlp-digits", seed=0, synthetic_samples=256).train
    trainer = Trainer(resolve_model("mlp-digits"), load_plan(case["plan"]),
                      TrainConfig(timeout_s=60, checkpoint=CheckpointConfig(case["checkpoint_dir"]),
                                  logging=LoggingConfig(progress=False)),
                      optimizer_fn=build_optimizer_fn("sgd", case["lr"]))
    start = trainer.step
    history = trainer.fit(data, case["steps"], seed=0)
    replanned = trainer.job.replanned
    torch.save({"weights": trainer.state_dict(), "history": history, "start": start,
                "digest": None if replanned is None else replanned.digest,
                "devices": trainer.plan.devices_used}, f"{case['out']}/rank{trainer.rank}.pt")
    trainer.close()
""")


def cpu_cluster(devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "cpus", "node": [{"name": "n0", "devices": devices, "intra_link": "loopback", "nic": "1Gbit/s"}]}


def small(memory: str, count: int) -> dict[str, Any]:
    """``count`` devices of ``memory`` (a type of its own, so that mlp-digits needs a big one)."""
    return {"type": f"small-{memory}", "tflops": 0.1, "memory": memory, "memory_bandwidth": "20GB/s", "count": count}


def run_phase(root: Path, name: str, plan_file: Path, checkpoint_dir: Path, world: int, steps: int,
              nodes: str = "n0", local_ranks: list[int] | None = None) -> list[dict]:
    """``world`` ranks of the worker (``nodes``: HETRAIN_NODE, one name or one per rank); their saved parts."""
    out = root / name
    out.mkdir()
    case = {"plan": str(plan_file), "checkpoint_dir": str(checkpoint_dir), "steps": steps, "lr": LR,
            "out": str(out)}
    (out / "cases.json").write_text(json.dumps([case]))
    (out / "worker.py").write_text(WORKER)
    run_worker_ranks(out, nodes, local_ranks if local_ranks is not None else list(range(world)), timeout_s=180)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, the same global batches: weights after ``steps`` steps and the losses."""
    return single_process_mlp(steps, LR, synthetic_samples=256)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Phase 1 on 3 ranks, phase 2 on 2 (module docstring)."""
    root = tmp_path_factory.mktemp("elastic")
    plan = hetrain.plan(parse_cluster(cpu_cluster([{"type": "cpu", "count": 3}])), MLP, 16, optimizer="sgd")
    assert sorted(plan.devices_used) == ["n0:0", "n0:1", "n0:2"], plan.summary()  # n0:2's loss changes the world
    plan.save(root / "plan.json")
    ckpt = root / "ckpt"
    first = run_phase(root, "three", root / "plan.json", ckpt, 3, FIRST_STEPS)
    second = run_phase(root, "two", root / "plan.json", ckpt, 2, STEPS)
    return {"plan": plan, "first": first, "second": second, "ckpt": ckpt}


def test_every_rank_replans_alike_and_the_plan_is_written_beside_the_checkpoint(restarted: dict[str, Any]) -> None:
    assert all(part["digest"] is None for part in restarted["first"])  # the world was the plan's
    second = restarted["second"]
    written = load_plan(restarted["ckpt"] / "plans" / f"plan-step{FIRST_STEPS}.json")
    assert {part["digest"] for part in second} == {plan_digest(written)}
    assert sorted(written.devices_used) == ["n0:0", "n0:1"]
    assert all(part["devices"] == written.devices_used for part in second)
    assert written.global_batch == restarted["plan"].global_batch
    record = written.options["replan"]
    assert (record["lost"], record["added"], record["from_step"]) == (["n0:2"], [], FIRST_STEPS)
    assert written.prediction.samples_per_s > 0


def test_weights_after_the_restart_equal_single_process_training(restarted: dict[str, Any]) -> None:
    second = restarted["second"]
    assert [part["start"] for part in second] == [FIRST_STEPS, FIRST_STEPS]
    got: dict[str, torch.Tensor] = {}
    for part in second:
        got.update(part["weights"])
    want, losses = reference(STEPS)
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"worst relative error {worst:.2e}"
    first_losses = [h["loss"] for h in restarted["first"][0]["history"]]
    assert first_losses == pytest.approx(losses[:FIRST_STEPS], rel=1e-5)
    for part in second:
        assert [h["step"] for h in part["history"]] == list(range(FIRST_STEPS + 1, STEPS + 1))
        assert [h["loss"] for h in part["history"]] == pytest.approx(losses[FIRST_STEPS:], rel=1e-5)


def test_a_node_that_joins_gets_work_and_training_goes_on_unchanged(tmp_path, monkeypatch):
    """2 ranks on n0 to step 3, then 3 ranks: n0:0, n0:1 and n1:0, a node the plan's cluster lacks, whose type
    comes from HETRAIN_DEVICE_TYPE (a T4: far faster than the CPUs, so the new plan gives it work)."""
    plan = hetrain.plan(parse_cluster(cpu_cluster([{"type": "cpu", "count": 2}])), MLP, 16, optimizer="sgd")
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    run_phase(tmp_path, "two", tmp_path / "plan.json", ckpt, 2, FIRST_STEPS)
    monkeypatch.setenv("HETRAIN_DEVICE_TYPE", "T4")  # read for n1:0 only: n0's devices keep the cluster's cpu
    grown = run_phase(tmp_path, "three", tmp_path / "plan.json", ckpt, 3, STEPS, nodes="n0,n0,n1",
                      local_ranks=[0, 1, 0])
    written = load_plan(ckpt / "plans" / f"plan-step{FIRST_STEPS}.json")
    assert {part["digest"] for part in grown} == {plan_digest(written)}
    assert [(d.name, d.type_name) for d in written.cluster.devices] == [("n0:0", "cpu"), ("n0:1", "cpu"),
                                                                        ("n1:0", "T4")]
    record = written.options["replan"]
    assert (record["lost"], record["added"], record["assumed_links"]) == ([], ["n1:0"], ["n1"])
    assert "n1:0" in written.devices_used
    got: dict[str, torch.Tensor] = {}
    for part in grown:
        got.update(part["weights"])
    want, losses = reference(STEPS)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"worst relative error {worst:.2e}"
    used = [part for part in grown if part["history"]]
    assert used and all([h["loss"] for h in part["history"]] == pytest.approx(losses[FIRST_STEPS:], rel=1e-5)
                        for part in used)


def pipeline_on_small_devices(tmp_path: Path) -> Path:
    """The planner's plan for n0:0, n0:1 of 300 KB and n0:2 of 600 KB: mlp-digits' big layer needs n0:2."""
    plan: Plan = hetrain.plan(parse_cluster(cpu_cluster([small("300KB", 2), small("600KB", 1)])), MLP, 16,
                              optimizer="sgd")
    assert "n0:2" in plan.devices_used, plan.summary()
    plan.save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


def start_two_ranks(fork_rank, clean_env, port: int, args: list[str]) -> list:
    env = {**clean_env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "HETRAIN_NODE": "n0", "HETRAIN_DEVICE": "cpu"}
    return [fork_rank([*TRAIN, *args], {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]


def test_a_world_too_small_for_the_model_is_told_what_memory_it_lacks(tmp_path, fork_rank, clean_env, free_port):
    args = ["--plan", str(pipeline_on_small_devices(tmp_path)), "--model", "mlp-digits", "--data", "synthetic",
            "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--timeout-s", "30"]
    for p in start_two_ranks(fork_rank, clean_env, free_port(), args):
        _, stderr = p.communicate(timeout=90)
        assert p.returncode == 1, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("hetrain train: error:")]
        assert len(errors) == 1, stderr[-3000:]
        assert ("the 2 device(s) present (n0:0, n0:1; lost n0:2) cannot run the plan's model at global batch 16"
                in errors[0])
        assert "needs at least 682.4 KB" in errors[0] and "offers is 570.0 KB" in errors[0]
    assert not (tmp_path / "ckpt" / "plans").exists()


def test_replan_off_refuses_a_world_other_than_the_plans(tmp_path, fork_rank, clean_env, free_port):
    args = ["--plan", str(pipeline_on_small_devices(tmp_path)), "--model", "mlp-digits", "--data", "synthetic",
            "--steps", "2", "--replan", "off", "--timeout-s", "30"]
    for p in start_two_ranks(fork_rank, clean_env, free_port(), args):
        _, stderr = p.communicate(timeout=90)
        assert p.returncode == 1, stderr[-3000:]
        assert "the world does not match the plan" in stderr
        assert "no rank drives n0:2" in stderr


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _kill_node(agent: Any) -> None:
    """A node dies: its torchrun agent and the ranks it started (each in a session of its own) are killed at once."""
    for pid in [*_children(agent.pid), agent.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


#: the rendezvous waits 1 s for late nodes, and finds a dead node after 2 missed keep-alives of 1 s
RDZV_CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds a torchrun agent's ranks in /proc")
def test_torchrun_goes_on_with_a_new_plan_when_a_node_dies(tmp_path, spawn, clean_env, free_port):
    """Two nodes of one device under ``torchrun --nnodes 1:2 --max-restarts 1``; node b dies after the first
    checkpoint; node a's agent restarts its rank, which re-plans for a:0 alone and trains to the last step."""
    cluster = {"name": "two-nodes", "node": [
        {"name": n, "devices": [{"type": "cpu", "count": 1}], "intra_link": "loopback", "nic": "1Gbit/s"}
        for n in ("a", "b")]}
    plan = hetrain.plan(parse_cluster(cluster), MLP, 16, optimizer="sgd")
    assert sorted(plan.devices_used) == ["a:0", "b:0"], plan.summary()
    plan.save(tmp_path / "plan.json")
    ckpt, steps = tmp_path / "ckpt", 400
    port = free_port()
    env = {**clean_env, "HETRAIN_DEVICE": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    agents = {}
    for node, host in (("a", 1), ("b", 0)):  # a hosts the rendezvous store, so b is the one that may die
        agents[node] = spawn([
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
            "--rdzv-conf", f"is_host={host},{RDZV_CONF}",
            "-m", "hetrain", "train", "--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits",
            "--data", "synthetic", "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10",
            "--timeout-s", "20", "--no-progress"], {**env, "HETRAIN_NODE": node})
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step-00000010").is_dir():
            assert time.monotonic() < deadline and agents["a"].poll() is None, "no checkpoint of step 10"
            time.sleep(0.02)
        _kill_node(agents["b"])
        out, err = agents["a"].communicate(timeout=240)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                _kill_node(agent)
    assert agents["a"].returncode == 0, err[-4000:]
    (plan_file,) = (ckpt / "plans").iterdir()
    resumed = int(plan_file.stem.removeprefix("plan-step"))
    assert 10 <= resumed < steps
    assert "the world changed (lost b:0): re-planned for 1 device(s)" in out
    assert f"steps {resumed} -> {steps}" in out
    written = load_plan(plan_file)
    assert written.devices_used == ["a:0"] and written.options["replan"]["lost"] == ["b:0"]
    assert (ckpt / f"step-{steps:08d}").is_dir()

"""Gradient clipping by the global norm and the learning-rate schedule on 4 Gloo ranks, against one process.

One job of 4 processes runs each case with the Trainer API (the machinery of
``test_runtime_equivalence``); one process trains the whole model on the same
global batches, setting the schedule's rate each step and clipping with
``torch.nn.utils.clip_grad_norm_``. SGD with momentum, float32; relative error <= 1e-5.

    case        plan (gpt-tiny, 6 layers)                              schedule            clip
    two-vws     VW0 n0:0 [0,2) + n0:1 [2,6); VW1 n0:2 [0,4) + n0:3 [4,6)  cosine, warm-up 2   0.3
    pipeline    n0:0 [0,2) -> n0:1 [2,4) -> n0:2 [4,6), GPipe; n0:3 unused  linear, warm-up 1  0.3
                run to step 3 (a checkpoint), then a new Trainer resumes from it to step 5

In ``two-vws`` the layers [0, 2) and [4, 6) are held by both VWs: their gradients
count once in the global norm, or the norm would not be the single process's.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_equivalence import GPT, TWO_VWS, D, make_plan
from worker_ranks import run_worker_ranks

from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.runtime.step.lr_schedule import LrSchedule, lr_at
from hetrain.runtime.trainer import build_optimizer_fn

STEPS = 5
CLIP = 0.3  # below every step's norm in these runs (0.45 .. 1.1 unclipped): clipping is active
WORLD = 4

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    for case in json.load(open(sys.argv[1])):
        config = case["config"]
        data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **config).train
        history, starts = [], []
        for stop in case["stops"]:  # one Trainer per stop: each after the first resumes from the checkpoint
            s = case["schedule"]  # the decay ends at the run's last step: the last stop
            optim = OptimConfig(lr=s["lr"], lr_schedule=s["schedule"], warmup_steps=s["warmup_steps"],
                                min_lr=s["min_lr"], clip_grad_norm=case["clip"])
            trainer = Trainer(resolve_model("gpt-tiny", **config), load_plan(case["plan"]),
                              TrainConfig(steps=case["stops"][-1], timeout_s=60, optim=optim,
                                          checkpoint=CheckpointConfig(case["ckpt"]),
                                          logging=LoggingConfig(metrics_out=case["metrics"], progress=False)),
                              optimizer_fn=build_optimizer_fn("momentum", case["lr"]))
            starts.append(trainer.step)
            history += trainer.fit(data, stop, seed=0)
            weights = trainer.state_dict()
            trainer.close()
        torch.save({"weights": weights, "history": history, "starts": starts},
                   f"{case['out']}/rank{trainer.rank}.pt")
""")

CASES: dict[str, dict[str, Any]] = {
    "two-vws": {"plan": make_plan("gpt-tiny", TWO_VWS),
                "schedule": {"lr": 0.3, "schedule": "cosine", "warmup_steps": 2, "min_lr": 0.03}, "stops": [STEPS]},
    "pipeline": {"plan": make_plan("gpt-tiny", [(D[:3], [0, 2, 4, 6], 8, 4)], "gpipe"),
                 "schedule": {"lr": 0.4, "schedule": "linear", "warmup_steps": 1, "min_lr": 0.04,
                              "total_steps": STEPS},
                 "stops": [3, STEPS]},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run both cases in one 4-rank job; returns the specs by case name."""
    root = tmp_path_factory.mktemp("clip-lr")
    specs = {}
    for name, c in CASES.items():
        out = root / name
        out.mkdir()
        c["plan"].save(out / "plan.json")
        specs[name] = {"plan": str(out / "plan.json"), "config": GPT, "lr": c["schedule"]["lr"],
                       "schedule": c["schedule"], "clip": CLIP, "stops": c["stops"], "out": str(out),
                       "ckpt": str(out / "ckpt"), "metrics": str(out / "metrics.jsonl"),
                       "global_batch": c["plan"].global_batch}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)), timeout_s=240)
    return specs


def reference(spec: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float], list[float], list[float]]:
    """One process, the whole model: weights after STEPS steps, and each step's loss, rate and norm before clipping."""
    torch.manual_seed(123)  # nothing below may depend on the global generator
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("momentum", spec["lr"])(list(net.parameters()))
    schedule = LrSchedule(**spec["schedule"])
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **GPT).train
    losses, rates, norms = [], [], []
    for t, (x, y) in enumerate(iter_batches(data, spec["global_batch"], seed=0, steps=STEPS), start=1):
        rate = schedule.at(t, STEPS)
        for group in opt.param_groups:
            group["lr"] = rate
        opt.zero_grad()
        loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
        rates.append(rate)
    return net.state_dict(), losses, rates, norms


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_scheduled_training_equals_the_single_process(job: dict[str, dict[str, Any]], name: str) -> None:
    spec = job[name]
    plan = CASES[name]["plan"]
    parts = [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    want, losses, rates, norms = reference(spec)
    assert sum(n > CLIP for n in norms) >= 4, f"clipping was not active: norms {norms}"
    assert rates == [lr_at(t, **spec["schedule"] | {"total_steps": STEPS}) for t in range(1, STEPS + 1)]

    got: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part["weights"].items():
            if key in got:  # a layer held by several VWs: their replicas must agree
                torch.testing.assert_close(value, got[key], rtol=1e-6, atol=1e-7)
            got[key] = value
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"{name}: worst relative error {worst:.2e}"

    used = [parts[r] for r, d in enumerate(D) if d in plan.devices_used]
    assert len(used) == len(plan.devices_used)
    for part in used:  # every used rank: the global norm and the rate of every step, as the single process has them
        history = part["history"]
        assert [h["step"] for h in history] == list(range(1, STEPS + 1))
        assert [h["grad_norm"] for h in history] == pytest.approx(norms, rel=1e-5)
        assert [h["lr"] for h in history] == pytest.approx(rates, rel=1e-12)
        assert [h["loss"] for h in history] == pytest.approx(losses, rel=1e-5)
    rows: dict[int, dict[str, Any]] = {}
    for line in Path(spec["metrics"]).read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert [rows[t]["lr"] for t in sorted(rows)] == pytest.approx(rates, rel=1e-12)
    assert [rows[t]["grad_norm"] for t in sorted(rows)] == pytest.approx(norms, rel=1e-5)


def test_the_resumed_run_started_at_its_checkpoint(job: dict[str, dict[str, Any]]) -> None:
    """The pipeline case's second Trainer resumed at step 3 (so its rates of steps 4, 5 came from the step alone)."""
    parts = [torch.load(Path(job["pipeline"]["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    assert [p["starts"] for p in parts] == [[0, 3]] * WORLD
    assert parts[3]["history"] == [] and parts[3]["weights"] == {}  # n0:3 is unused: it idled


def test_the_train_command_schedules_and_clips(tmp_path: Path, spawn, clean_env) -> None:
    """``hetrain train --lr-schedule cosine --warmup-steps 1 --clip-grad-norm X`` on one process (no torchrun):
    its metrics rows carry the schedule's rates and the single process's norms."""
    plan = make_plan("gpt-tiny", [([D[0]], [0, 6], 8, 2)])  # the plan's optimizer: sgd
    plan.save(tmp_path / "plan.json")
    metrics = tmp_path / "metrics.jsonl"
    settings = [f"--set={k}={v}" for k, v in GPT.items()]
    p = spawn([sys.executable, "-m", "hetrain", "train", "--plan", str(tmp_path / "plan.json"), "--model", "gpt-tiny",
               "--data", "synthetic", *settings, "--steps", "4", "--lr", "0.5", "--lr-schedule", "cosine",
               "--warmup-steps", "1", "--min-lr", "0.05", "--clip-grad-norm", str(CLIP), "--metrics-out", str(metrics),
               "--timeout-s", "30", "--no-progress"], {**clean_env, "HETRAIN_NODE": "n0"})
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-4000:]
    assert f"sgd lr 0.5 cosine to 0.05, warm-up 1, clip {CLIP:g}" in stdout, stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    schedule = LrSchedule(0.5, "cosine", warmup_steps=1, min_lr=0.05)
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("sgd", 0.5)(list(net.parameters()))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, **GPT).train  # as the train command builds it
    norms = []
    for t, (x, y) in enumerate(iter_batches(data, 8, seed=0, steps=4), start=1):
        for group in opt.param_groups:
            group["lr"] = schedule.at(t, 4)
        opt.zero_grad()
        loss_fn("gpt-tiny")(net(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # W = 1, T = 4: 0.5, then 0.05 + 0.45 (1 + cos(π p)) / 2 at p = 1/3, 2/3, 1
    assert [r["lr"] for r in rows] == pytest.approx([0.5, 0.3875, 0.1625, 0.05], rel=1e-12)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-5)
    assert any(n > CLIP for n in norms)

"""A sharded job restarted on fewer devices re-plans, re-shards and goes on as one process would.

    phase 1   3 Gloo ranks on node n0 (n0:0 with 4 GB, n0:1 and n0:2 with 1 GB), the planner's plan for
              gpt-tiny (shrunk) with ZeRO-2 forced (``shard="optimizer+gradients"``): data parallel, each
              owner's share of the optimizer state and gradients in proportion to the memory it has left, so
              n0:0 holds the most; AdamW with weight decay, clipping by the global norm; steps 0 -> 4, a
              checkpoint at step 4 written by the owners of each range
    phase 2   2 ranks (n0:2 gone), the same plan file: every rank re-plans (``hetrain.elastic``) for n0:0 and
              n0:1 with the plan's own options, so again ZeRO-2, now over two owners with other shares; each
              rank reads the checkpoint's whole per-layer tensors and cuts its new ranges; steps 4 -> 10

In fp32 the weights after phase 2 are those of one process training the whole model for 10 steps on the
same global batches (``test_runtime_shard.reference``: whole model <= 1e-6 relative, each tensor <= 5e-5),
and so are the losses and gradient norms of every step: the AdamW moments went through the change of
shards unharmed. A moment lost or cut at the wrong element would move the weights by the rate, far more.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_equivalence import GPT, SMALL_BUCKETS
from test_runtime_shard import CLIP, LR, STEPS, WEIGHT_DECAY, reference
from worker_ranks import run_worker_ranks

import hetrain
from hetrain.cluster import parse_cluster
from hetrain.elastic import PresentDevice, plan_digest, replan
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan, load_plan
from hetrain.sync_layout import SyncOptions

FIRST = 4
WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.plan import load_plan
    from hetrain.models.user import resolve_model
    from hetrain.runtime import Trainer
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    (case,) = json.load(open(sys.argv[1]))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **case["config"]).train
    optim = OptimConfig(lr=case["lr"], weight_decay=case["weight_decay"], clip_grad_norm=case["clip"])
    trainer = Trainer(resolve_model("gpt-tiny", **case["config"]), load_plan(case["plan"]),
                      TrainConfig(steps=case["steps"], timeout_s=60, optim=optim,
                                  checkpoint=CheckpointConfig(case["ckpt"]), logging=LoggingConfig(progress=False)))
    start = trainer.step
    history = trainer.fit(data, case["steps"], seed=0)
    replanned = trainer.job.replanned
    torch.save({"weights": trainer.state_dict(), "history": history, "start": start,
                "digest": None if replanned is None else replanned.digest,
                "sharded": type(trainer.optimizer).__name__ if trainer.role.used else None},
               f"{case['out']}/rank{trainer.rank}.pt")
    trainer.close()
""")


def devices(memory: str, count: int) -> dict[str, Any]:
    return {"type": f"cpu-{memory}", "tflops": 0.1, "memory": memory, "memory_bandwidth": "20GB/s", "count": count}


CLUSTER = parse_cluster({"name": "cpus", "node": [{"name": "n0", "intra_link": "loopback", "nic": "1Gbit/s",
                                                    "devices": [devices("4GB", 1), devices("1GB", 2)]}]})


def make_plan() -> Plan:
    profile = build_profile("gpt-tiny", hidden=GPT["hidden"], heads=GPT["heads"], seq_len=GPT["seq_len"])
    return hetrain.plan(CLUSTER, profile, 12, optimizer="adam", strategy="dp", shard="optimizer+gradients",
                        sync_options=SyncOptions(**SMALL_BUCKETS))


def run_phase(root: Path, name: str, plan_file: Path, world: int, steps: int) -> list[dict[str, Any]]:
    out = root / name
    out.mkdir()
    case = {"plan": str(plan_file), "ckpt": str(root / "ckpt"), "steps": steps, "lr": LR, "clip": CLIP,
            "weight_decay": WEIGHT_DECAY, "config": GPT, "out": str(out)}
    (out / "cases.json").write_text(json.dumps([case]))
    (out / "worker.py").write_text(WORKER)
    run_worker_ranks(out, "n0", list(range(world)), timeout_s=240)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def shares(plan: Plan) -> list[dict[str, float]]:
    return [{o: seg.shard_of(o) for o in seg.owners} for seg in plan.segments() if seg.shard != "none"]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("elastic-shard")
    plan = make_plan()
    plan.save(root / "plan.json")
    first = run_phase(root, "three", root / "plan.json", 3, FIRST)
    second = run_phase(root, "two", root / "plan.json", 2, STEPS)
    return {"plan": plan, "first": first, "second": second, "ckpt": root / "ckpt"}


def test_the_plans_shard_unevenly_before_and_after_the_change() -> None:
    plan = make_plan()
    assert sorted(plan.devices_used) == ["n0:0", "n0:1", "n0:2"] and len(plan.virtual_workers) == 3, plan.summary()
    (before,) = shares(plan)
    assert before["n0:0"] > 1.5 * before["n0:1"] and before["n0:1"] == pytest.approx(before["n0:2"]), before
    after = replan(plan, [PresentDevice("n0:0", "cpu-4GB"), PresentDevice("n0:1", "cpu-1GB")], FIRST).plan
    (later,) = shares(after)
    assert set(later) == {"n0:0", "n0:1"} and later["n0:0"] > later["n0:1"], later
    assert sum(later.values()) == pytest.approx(1.0)


def test_every_rank_replans_to_the_same_sharded_plan(restarted: dict[str, Any]) -> None:
    assert all(part["digest"] is None for part in restarted["first"])
    written = load_plan(restarted["ckpt"] / "plans" / f"plan-step{FIRST}.json")
    assert {part["digest"] for part in restarted["second"]} == {plan_digest(written)}
    assert sorted(written.devices_used) == ["n0:0", "n0:1"] and shares(written), written.summary()
    assert {part["sharded"] for part in restarted["first"] + restarted["second"]} == {"ShardedOptimizer"}


def test_weights_after_the_restart_equal_single_process_training(restarted: dict[str, Any]) -> None:
    second = restarted["second"]
    assert [part["start"] for part in second] == [FIRST, FIRST]
    got: dict[str, torch.Tensor] = {}
    for part in second:
        for key, value in part["weights"].items():
            if key in got:
                assert torch.equal(value, got[key]), f"the owners' copies of {key} differ"
            got[key] = value
    want, losses, norms = reference(restarted["plan"].global_batch)
    assert min(norms) > CLIP, f"clipping was not active: norms {norms}"
    assert set(got) == set(want)
    off = sum(((got[k] - want[k]).norm() ** 2).item() for k in want) ** 0.5
    whole = off / sum((want[k].norm() ** 2).item() for k in want) ** 0.5
    assert whole <= 1e-6, f"the model is off by {whole:.2e} (relative)"
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 5e-5, f"a tensor is off by {worst:.2e} (relative)"
    rows = restarted["first"][0]["history"] + second[0]["history"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, loss, norm in zip(rows, losses, norms, strict=True):
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)

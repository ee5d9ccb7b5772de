"""Validation loss during training on 2 Gloo ranks: records appear and equal a single-process evaluation.

One job of 2 processes (one node, two devices) runs each case with its own Trainer,
gpt-tiny on the Shakespeare text, ``fit(..., val_data=held-out text, eval_every=2)``::

    case          plan                                         evaluated by
    pipe-bsp      one VW, two stages (layers [0, 3) and [3, 6))  forward through both ranks (activations sent)
    dp-local-sgd  two one-stage VWs, average every 3 steps       rank 0 alone (VW 0's replica)

Each rank saves its weights and val_history; the test rebuilds VW 0's whole model
from them in one process and evaluates the same fixed validation batches.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster
from hetrain.data.datasets import eval_batches
from hetrain.data.registry import build_datasets
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan

WORLD = 2
STEPS = 4
EVAL_EVERY = 2
EVAL_BATCHES = 2

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    train, val = build_datasets("shakespeare", "gpt-tiny")
    for case in json.load(open(sys.argv[1])):
        plan = load_plan(case["plan"])
        trainer = Trainer(resolve_model("gpt-tiny"), plan,
                          TrainConfig(timeout_s=60, logging=LoggingConfig(metrics_out=case["out"] + "/metrics.jsonl",
                                                                          progress=False, log_every=3)),
                          optimizer_fn=build_optimizer_fn("adamw", 3e-3))
        history = trainer.fit(train, case["steps"], seed=0, val_data=val, eval_every=case["eval_every"],
                              eval_batches=case["eval_batches"])
        torch.save({"weights": trainer.state_dict(), "val": trainer.val_history, "history": history},
                   f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def make_plan(sync: str, vws: list[tuple[list[str], list[int], int, int]], **options: int) -> Plan:
    profile = build_profile("gpt-tiny", tie_embeddings=False)
    return factories.make_plan(make_cluster({"n0": 2}, name="one-node"), profile, vws, sync=sync, optimizer="adam",
                               **options)


CASES: dict[str, Plan] = {
    "pipe-bsp": make_plan("bsp", [(["n0:0", "n0:1"], [0, 3, 6], 4, 2)]),
    "dp-local-sgd": make_plan("local-sgd", [(["n0:0"], [0, 6], 3, 1), (["n0:1"], [0, 6], 2, 1)], period=3),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    specs, outs = [], {}
    for name, plan in CASES.items():
        out = root / name
        out.mkdir()
        plan.save(out / "plan.json")
        specs.append({"plan": str(out / "plan.json"), "out": str(out), "steps": STEPS, "eval_every": EVAL_EVERY,
                      "eval_batches": EVAL_BATCHES})
        outs[name] = out
    (root / "cases.json").write_text(json.dumps(specs))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)))
    return outs


def single_process_val_loss(weights: dict[str, torch.Tensor] | None, global_batch: int) -> float:
    """The mean loss of the fixed validation batches under ``weights`` (None: the initial weights), in one process."""
    net = LayerRange(build_layers("gpt-tiny", seed=0))
    if weights is not None:
        net.load_state_dict(weights)
    _, val = build_datasets("shakespeare", "gpt-tiny")
    loss = loss_fn("gpt-tiny")
    with torch.no_grad():
        values = [float(loss(net(x), y)) for x, y in eval_batches(val, global_batch, EVAL_BATCHES)]
    return sum(values) / len(values)


@pytest.mark.parametrize("name", list(CASES))
def test_val_loss_records_equal_a_single_process_evaluation(job: dict[str, Path], name: str) -> None:
    plan = CASES[name]
    parts = [torch.load(job[name] / f"rank{r}.pt") for r in range(WORLD)]
    for part in parts:  # every used rank holds the same figures (its own times)
        assert [(r["step"], r["val_loss"]) for r in part["val"]] == [(r["step"], r["val_loss"]) for r in
                                                                     parts[0]["val"]]
        assert [r["step"] for r in part["val"]] == [0, 2, 4]
    val = parts[0]["val"]
    assert all(r["val_samples"] == EVAL_BATCHES * plan.global_batch and r["eval_s"] > 0 for r in val)
    elapsed = [r["elapsed_s"] for r in val]
    assert elapsed[0] == 0.0 and elapsed == sorted(elapsed)
    # training time at an evaluation is the step's elapsed time, which leaves evaluations out
    by_step = {r["step"]: r["elapsed_s"] for r in parts[0]["history"]}
    assert [by_step[s] for s in (2, 4)] == elapsed[1:]

    # VW 0's whole model: the union of its stages' weights
    vw0 = set(plan.virtual_workers[0].devices)
    ranks = [r for r, d in enumerate(["n0:0", "n0:1"]) if d in vw0]
    weights = {k: v for r in ranks for k, v in parts[r]["weights"].items()}
    assert val[0]["val_loss"] == pytest.approx(single_process_val_loss(None, plan.global_batch), rel=1e-5)
    assert val[-1]["val_loss"] == pytest.approx(single_process_val_loss(weights, plan.global_batch), rel=1e-5)
    assert val[-1]["val_loss"] < val[0]["val_loss"]  # it trained

    lines = [json.loads(line) for line in (job[name] / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in lines if "val_loss" in r] == [r["val_loss"] for r in val]
    assert sum("loss" in r for r in lines) == STEPS


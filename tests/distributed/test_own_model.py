"""A user's own model, from its file to a trained model: profile, plan, train on two ranks (docs/own-model.md).

    hetrain profile --model examples/own_model/model.py:build --data examples/own_model/model.py:dataset -o p.json
    hetrain plan --cluster two-cpus.toml --profile p.json --global-batch 32 --strategy pp -o plan.json
    hetrain train --plan plan.json --model .../model.py:build --data .../model.py:dataset   (two ranks)

The pipeline cuts the ``nn.Sequential`` between two Gloo ranks; its loss must fall, and its
weights after the last step must be those of the same ``nn.Sequential`` trained in this
process on the same global batches (``torch.manual_seed(seed); build()``, the plan's optimizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_jobs import ROOT, TWO_CPUS, hetrain, step_rows, train_ranks

torch = pytest.importorskip("torch")

from hetrain.data.datasets import iter_batches  # noqa: E402
from hetrain.data.user import load_user_datasets  # noqa: E402
from hetrain.models.layers import LayerRange  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402
from hetrain.plan import load_plan  # noqa: E402
from hetrain.runtime.state.checkpoint import load_checkpoint  # noqa: E402
from hetrain.runtime.trainer import build_optimizer_fn  # noqa: E402

MODEL = f"{ROOT}/examples/own_model/model.py:build"
DATA = f"{ROOT}/examples/own_model/model.py:dataset"
STEPS, SEED, LR = 20, 3, 0.01


def reference(plan_optimizer: str, global_batch: int) -> dict[str, torch.Tensor]:
    """The same model trained in one process on the same global batches."""
    source = resolve_model(MODEL)
    net = LayerRange(source.build_layers(seed=SEED))
    opt = build_optimizer_fn(plan_optimizer, LR)(list(net.parameters()))
    for x, y in iter_batches(load_user_datasets(DATA).train, global_batch, seed=0, steps=STEPS):
        opt.zero_grad()
        source.loss_fn(net(x), y).backward()
        opt.step()
    return net.state_dict()


@pytest.mark.timeout(300)
def test_own_model_profiles_plans_and_trains_as_one_process_would(tmp_path: Path, clean_env) -> None:
    (tmp_path / "two-cpus.toml").write_text(TWO_CPUS)
    hetrain(["profile", "--model", MODEL, "--data", DATA, "-o", "p.json", "--micro-batch", "4,8", "--repeats", "2"],
            tmp_path)
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["name"] == MODEL and len(profile["layers"]) == 5
    hetrain(["plan", "--cluster", "two-cpus.toml", "--profile", "p.json", "--global-batch", "32", "--strategy", "pp",
             "--max-tp", "1", "-o", "plan.json"], tmp_path)
    plan = load_plan(tmp_path / "plan.json")
    assert [len(vw.stages) for vw in plan.virtual_workers] == [2]  # the Sequential cut over both ranks

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    stdout = train_ranks({**clean_env, "HETRAIN_NODE": "n0"}, [
        "--plan", str(tmp_path / "plan.json"), "--model", MODEL, "--data", DATA, "--steps", str(STEPS), "--seed",
        str(SEED), "--lr", str(LR), "--log-every", "1", "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics),
        "--timeout-s", "60", "--no-progress"])
    assert f"hetrain train: {MODEL} on {DATA}" in stdout, stdout

    losses = [r["loss"] for r in step_rows(metrics)]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses

    want = reference(plan.optimizer, plan.global_batch)
    got, _, meta = load_checkpoint(ckpt, list(want))
    assert meta["step"] == STEPS
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-4, f"worst relative error {worst:.2e}"

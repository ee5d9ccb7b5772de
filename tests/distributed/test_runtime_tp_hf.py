"""Transformers models on TP stages (their blocks in module form, ``hetrain.models.hf_blocks``), on 4 Gloo ranks:
equal to one process training the traced layers.

One job of 4 processes runs each case with the Trainer API; each rank saves its stage's weights (whole:
``Trainer.state_dict`` gathers the shards), its losses and its gradient norms. Float32; relative error <= 1e-5.

    case           plan (a tiny Llama or Qwen2 from its config: embed, block1, block2, head)
    llama-clip     one pipeline: [0, 2) on TP (n0:0, n0:1), [2, 4) on TP (n0:2, n0:3); clipped by the global norm
    qwen2          the same plan; Qwen2's q, k, v biases split with their weights
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster, make_profile
from hetrain.models.layers import LayerRange
from hetrain.models.user import resolve_model
from hetrain.plan import Plan, Stage, VirtualWorker
from hetrain.runtime.trainer import build_optimizer_fn
from hf_families import FAMILIES, VOCAB

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

STEPS, BATCH, T, LR = 3, 8, 8, 0.5
WORLD = 4
D = [f"n0:{k}" for k in range(WORLD)]
CONFIGS = {"llama-clip": FAMILIES["llama"], "qwen2": {**FAMILIES["qwen2"], "tie_word_embeddings": False}}
CLIP = {"llama-clip": 0.05}

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.plan import load_plan
    from hetrain.models.user import resolve_model
    from hetrain.runtime import Trainer
    from hetrain.runtime.config import LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    for case in json.load(open(sys.argv[1])):
        batches = torch.load(case["batches"])
        train = TrainConfig(timeout_s=60, logging=LoggingConfig(progress=False),
                            optim=OptimConfig(lr=case["lr"], clip_grad_norm=case["clip"]))
        trainer = Trainer(resolve_model(case["model"]), load_plan(case["plan"]), train)
        history = trainer.fit(batches, len(batches))
        torch.save({"weights": trainer.state_dict(), "history": history, "tp": trainer.role.tp,
                    "split": sorted(n for n, p in trainer.module.named_parameters()
                                    if type(p).__name__ == "DTensor" and not p.placements[0].is_replicate())},
                   f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def tp(first: int, end: int, *devices: str) -> Stage:
    return Stage(devices[0], first, end, tp_group=tuple(devices))


def plan_of(spec: str) -> Plan:
    vw = VirtualWorker((tp(0, 2, D[0], D[1]), tp(2, 4, D[2], D[3])), BATCH, 2)
    return factories.make_plan(make_cluster({"n0": WORLD}), make_profile(4, times={}), [vw], model=spec)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of token windows: inputs and their next tokens."""
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, T + 1), generator=torch.Generator().manual_seed(5))
    return [(w[:, :-1], w[:, 1:]) for w in ids]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp-hf")
    torch.save(batches(), root / "batches.pt")
    specs = {}
    for name, config in CONFIGS.items():
        out = root / name
        (out / "model").mkdir(parents=True)
        (out / "model" / "config.json").write_text(json.dumps(config))
        spec = f"hf:{out / 'model'}"
        plan_of(spec).save(out / "plan.json")
        specs[name] = {"model": spec, "plan": str(out / "plan.json"), "lr": LR, "clip": CLIP.get(name),
                       "out": str(out), "batches": str(root / "batches.pt")}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    for spec in specs.values():  # traced here once and kept (HETRAIN_CACHE_DIR), as ``hetrain profile`` keeps
        # it for ``hetrain train``: the 4 ranks load it (checked against the model's forward) instead of each
        # tracing both models at once, about 10 s of CPU a trace
        resolve_model(spec["model"]).build_layers(seed=0)
    run_worker_ranks(root, "n0", list(range(WORLD)), timeout_s=400)
    return specs


def reference(spec: str, clip: float | None) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the traced layers (the cut checked against the model's forward), the same global batches: the
    weights after STEPS steps, the losses and the gradients' global norms."""
    source = resolve_model(spec)
    net = LayerRange(source.build_layers(seed=0))
    opt = build_optimizer_fn("sgd", LR)(list(net.parameters()))
    losses, norms = [], []
    for x, y in batches():
        opt.zero_grad()
        loss = source.loss_fn(net(x), y)
        loss.backward()
        limit = clip if clip is not None else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), limit).item())
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses, norms


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_transformers_model_on_tp_stages_trains_as_one_process(job: dict[str, dict[str, Any]], name: str) -> None:
    spec = job[name]
    parts = [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    got: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part["weights"].items():
            if key in got:  # the two members of a TP group: their gathered copies agree
                torch.testing.assert_close(value, got[key], rtol=1e-6, atol=1e-7)
            got[key] = value
    want, losses, norms = reference(spec["model"], spec["clip"])
    if spec["clip"] is not None:  # clipping acts at every step; the TP run's norm counts each split parameter once
        assert min(norms) > spec["clip"]
        for part in parts:
            assert [h["grad_norm"] for h in part["history"]] == pytest.approx(norms, rel=1e-5)
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"{name}: worst relative error {worst:.2e}"
    for part in parts:  # the blocks' projections are split (Qwen2's q, k, v biases with them); norms, embedding,
        # head are not
        assert part["tp"] == 2
        assert part["split"] and all(".self_attn." in n or ".mlp." in n for n in part["split"]), part["split"]
        assert any(n.endswith("mlp.down_proj.weight") for n in part["split"])
        assert any(n.endswith("q_proj.bias") for n in part["split"]) == (name == "qwen2")
        assert [h["loss"] for h in part["history"]] == pytest.approx(losses, rel=1e-5)

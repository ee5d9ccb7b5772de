"""Stages on TP groups (torch's DTensor TP, ``hetrain.runtime.tp``), on 4 Gloo ranks: equal to one process.

One job of 4 processes runs every case in turn with the Trainer API; each rank saves its stage's weights
(whole: ``Trainer.state_dict`` gathers the shards) and its losses; the test compares them with one process
training the whole model on the same global batches. Float32; relative error <= 1e-5.

    case          plan (gpt-tiny, shrunk: 6 layers, 2 heads)
    pp-tp2-tp2    one pipeline: [0, 3) on TP (n0:0, n0:1), [3, 6) on TP (n0:2, n0:3)
    pp-tp2-1      one pipeline: [0, 3) on TP (n0:0, n0:1), [3, 6) on n0:2 alone; n0:3 idles
    recompute     pp-tp2-tp2, stage 0 recomputing layers 1 and 2 in backward
    bf16          pp-tp2-tp2 under bf16 autocast (against the fp32 process, within bf16's rounding)
    dp-tp2        two VWs of one TP-2 stage each, bsp, clipping by the global norm
    save-tp       pp-tp2-tp2 for 2 steps, checkpointed; then load-flat resumes it on one device per stage
    save-flat     two stages of one device for 2 steps, checkpointed; then load-tp resumes it on TP groups
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
from factories import make_cluster
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan, Stage, VirtualWorker
from hetrain.runtime.tp import TPError, check_tp
from hetrain.runtime.trainer import build_optimizer_fn

pytestmark = pytest.mark.slow

STEPS = 3
GPT = {"hidden": 32, "heads": 2, "seq_len": 16}
WORLD = 4
D = [f"n0:{k}" for k in range(WORLD)]

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.plan import load_plan
    from hetrain.models.user import resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    for case in json.load(open(sys.argv[1])):
        model, config = case["model"], case["config"]
        data = build_datasets("synthetic", model, seed=0, synthetic_samples=256, **config).train
        train = TrainConfig(timeout_s=60, logging=LoggingConfig(progress=False),
                            optim=OptimConfig(lr=case["lr"], clip_grad_norm=case.get("clip")),
                            checkpoint=CheckpointConfig(checkpoint_dir=case.get("checkpoint_dir")))
        trainer = Trainer(resolve_model(model, **config), load_plan(case["plan"]), train)
        history = trainer.fit(data, case["steps"], seed=0)
        torch.save({"weights": trainer.state_dict(), "history": history, "used": trainer.role.used,
                    "norms": [h.get("grad_norm") for h in history],
                    "split": sorted(n for n, p in trainer.module.named_parameters()
                                    if type(p).__name__ == "DTensor" and not p.placements[0].is_replicate())
                    if trainer.role.used else [], "tp": trainer.role.tp},
                   f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def tp(first: int, end: int, *devices: str) -> Stage:
    """A stage of layers [first, end) on ``devices`` (a TP group of them where more than one)."""
    return Stage(devices[0], first, end, tp_group=tuple(devices) if len(devices) > 1 else ())


def plan_of(vws: list[VirtualWorker], precision: str = "fp32", **options: Any) -> Plan:
    profile = build_profile("gpt-tiny", **GPT, precision=precision)
    return factories.make_plan(make_cluster({"n0": WORLD}), profile, vws, **options)


PP_TP = VirtualWorker((tp(0, 3, D[0], D[1]), tp(3, 6, D[2], D[3])), 8, 2)
PP_FLAT = VirtualWorker((tp(0, 3, D[0]), tp(3, 6, D[2])), 8, 2)
#: stage 0 recomputes two of its layers in backward (every rank of its group alike)
PP_RECOMPUTE = VirtualWorker((Stage(D[0], 0, 3, recompute=(1, 2), tp_group=(D[0], D[1])), tp(3, 6, D[2], D[3])), 8, 2)
CASES: dict[str, dict[str, Any]] = {
    "pp-tp2-tp2": {"plan": plan_of([PP_TP])},
    "pp-tp2-1": {"plan": plan_of([VirtualWorker((tp(0, 3, D[0], D[1]), tp(3, 6, D[2])), 8, 4)], schedule="gpipe")},
    "dp-tp2": {"plan": plan_of([VirtualWorker((tp(0, 6, D[0], D[1]),), 5, 2),
                                VirtualWorker((tp(0, 6, D[2], D[3]),), 3, 1)]), "clip": 0.05},
    "recompute": {"plan": plan_of([PP_RECOMPUTE])},
    "bf16": {"plan": plan_of([PP_TP], precision="bf16")},
    "save-tp": {"plan": plan_of([PP_TP]), "steps": 2, "checkpoint": "a"},
    "load-flat": {"plan": plan_of([PP_FLAT]), "checkpoint": "a"},
    "save-flat": {"plan": plan_of([PP_FLAT]), "steps": 2, "checkpoint": "b"},
    "load-tp": {"plan": plan_of([PP_TP]), "checkpoint": "b"},
}


def _case(name: str, root: Path) -> dict[str, Any]:
    c = CASES[name]
    out = root / name
    out.mkdir()
    c["plan"].save(out / "plan.json")
    spec = {"plan": str(out / "plan.json"), "model": "gpt-tiny", "config": GPT, "lr": 0.5,
            "steps": c.get("steps", STEPS), "out": str(out), "clip": c.get("clip")}
    if "checkpoint" in c:
        spec["checkpoint_dir"] = str(root / f"ckpt-{c['checkpoint']}")
    return spec


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")
    specs = {name: _case(name, root) for name in CASES}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)), timeout_s=300)
    return specs


def reference(global_batch: int, clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, the same global batches: weights after STEPS steps and the losses."""
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("sgd", 0.5)(list(net.parameters()))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **GPT).train
    losses = []
    for x, y in iter_batches(data, global_batch, seed=0, steps=STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


@pytest.mark.parametrize("name", ["pp-tp2-tp2", "pp-tp2-1", "dp-tp2", "recompute", "load-flat", "load-tp"])
def test_tp_stages_train_as_one_process(job: dict[str, Any], name: str) -> None:
    spec = job[name]
    plan: Plan = CASES[name]["plan"]
    parts = [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    got: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part["weights"].items():
            if key in got:  # a layer held by several ranks (TP members, VWs): their copies agree
                torch.testing.assert_close(value, got[key], rtol=1e-6, atol=1e-7)
            got[key] = value
    want, losses = reference(plan.global_batch, CASES[name].get("clip"))
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"{name}: worst relative error {worst:.2e}"
    for part in parts:  # a TP stage's blocks are split by their rule (QKV, proj, MLP weights and the
        # column-parallel biases), the embedding and head are not
        if part["tp"] > 1:
            assert part["split"] and all(".attn." in n or ".mlp." in n for n in part["split"]), part["split"]
            assert any(n.endswith("attn.qkv.weight") for n in part["split"])
    first = 2 if name.startswith("load") else 0  # a resumed run's steps: after the checkpoint's
    for part in parts:
        if part["used"]:
            assert [h["loss"] for h in part["history"]] == pytest.approx(losses[first:], rel=1e-5)


def test_a_bf16_tp_pipeline_trains_as_one_fp32_process_within_bf16s_precision(job: dict[str, Any]) -> None:
    """Under bf16 autocast every rank of a group casts alike: the losses follow the fp32 single process within
    bf16's rounding (8 bits of mantissa), and the TP members' whole weights agree."""
    parts = [torch.load(Path(job["bf16"]["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    _, losses = reference(8)
    last = [h["loss"] for h in parts[2]["history"]]
    assert last == pytest.approx(losses, rel=2e-2) and last != pytest.approx(losses, rel=1e-6)  # bf16, not fp32
    for a, b in ((parts[0], parts[1]), (parts[2], parts[3])):
        for key, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][key], rtol=0, atol=0)


def test_clipping_counts_each_parameter_once(job: dict[str, Any]) -> None:
    """The global norm of the TP run is the one-process norm: split shards summed, whole parameters once."""
    parts = [torch.load(Path(job["dp-tp2"]["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **GPT).train
    x, y = next(iter(iter_batches(data, 8, seed=0, steps=1)))
    loss_fn("gpt-tiny")(net(x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    assert norm > 0.05  # the threshold clips
    for part in parts:
        assert part["norms"][0] == pytest.approx(float(norm), rel=1e-5)


def test_unsupported_sync_mode_and_block_type_are_refused() -> None:
    plan = plan_of([VirtualWorker((tp(0, 6, D[0], D[1]),), 5, 2), VirtualWorker((tp(0, 6, D[2], D[3]),), 3, 1)])
    with pytest.raises(TPError, match=r"^sync mode wsp does not run TP stages yet \(stage 0 of VW0 runs TP 2\); "
                                      r"plan with --max-tp 1 or --sync bsp$"):
        check_tp(plan.with_sync("wsp"))
    check_tp(plan)  # bsp: runs

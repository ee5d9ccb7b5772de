"""Mixed precision on 4 Gloo ranks: bf16 training tracks one process's bf16, and fp16's loss scaler agrees.

bf16 (``hetrain.amp``): a hybrid plan of gpt-tiny (two VWs of two stages, unequal
mini-batches and cuts; and again cut alike, so that DDP's reducer sums every segment)
trains 6 steps under autocast with clipping; one process trains the whole model
under autocast on the same global batches. bf16 rounds differently with other
micro-batches and with activations sent in bf16 between stages, so the two agree to
bf16's precision, not to fp32's: each step's loss within 1% and the weights within
2%, where fp32 training of the same plan is 1e-5 away (``test_runtime_clip_lr``).
The run is checked to be bf16 at all: its losses are further from fp32 training than
rounding of fp32 would make them, and its stages sent bfloat16 activations.

fp16's overflow verdict (``runtime.step.loss_scale.LossScaling``) is one all-reduce: an
inf on one rank skips the step on every rank and halves the scale everywhere.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from typing import Any

import pytest
import torch
from test_runtime_equivalence import GPT, TWO_BY_TWO, TWO_VWS, make_plan
from worker_ranks import run_worker_ranks

from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.runtime.trainer import build_optimizer_fn

STEPS = 8
LR = 0.5
CLIP = 1.0
WORLD = 4

WORKER = textwrap.dedent("""
    import json, sys, torch
    import torch.distributed as dist
    from hetrain.amp import LossScaler
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from hetrain.runtime.step.loss_scale import LossScaling

    torch.set_num_threads(1)
    case = json.load(open(sys.argv[1]))
    config = case["config"]
    data = build_datasets("shakespeare", "gpt-tiny", seed=0, **config).train
    trainer = Trainer(resolve_model("gpt-tiny", **config), load_plan(case["plan"]),
                      TrainConfig(timeout_s=60, optim=OptimConfig(lr=case["lr"], clip_grad_norm=case["clip"]),
                                  logging=LoggingConfig(progress=False)),
                      optimizer_fn=build_optimizer_fn("momentum", case["lr"]))
    history = trainer.fit(data, case["steps"], seed=0)
    sent = []
    if trainer.job.stage is not None:
        sent = [str(dtype) for _, parts in trainer.job.stage.transport._sent_specs.values() for dtype, _ in parts]
    weights = trainer.state_dict()

    # fp16's verdict, on the job's work group: rank 1 overflows at the first step only
    class Buffers:
        def __init__(self, flat):
            self.buffers = {0: [(flat, [])]}
        def step_grads(self):
            return [flat for entries in self.buffers.values() for flat, _ in entries]
    class Seeds:
        grad_scale = 0.0
    verdicts, scales, grads = [], [], []
    if trainer.job.stage is not None:
        seeds = Seeds()
        flat = torch.zeros(4)
        guard = LossScaling(LossScaler(init_scale=1024.0, growth_interval=2), Buffers(flat), trainer.work_group,
                            len(trainer.used_ranks), trainer.job.wait, torch.device("cpu"), seeds)
        for step in range(3):
            flat.fill_(512.0)
            if step == 0 and trainer.rank == 1:
                flat[2] = float("inf")
            verdicts.append(guard(step))
            scales.append(seeds.grad_scale)
            grads.append(flat[0].item())
    trainer.close()
    torch.save({"weights": weights, "history": history, "sent": sent, "verdicts": verdicts, "scales": scales,
                "grads": grads}, f"{case['out']}/rank{trainer.rank}.pt")
""")


# two-vws: VWs cut apart, hetrain's own buckets; 2x2: cut alike, every segment summed by DDP's reducer
@pytest.fixture(scope="module", params=["two-vws", "2x2"])
def job(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bf16")
    plan = make_plan("gpt-tiny", TWO_VWS if request.param == "two-vws" else TWO_BY_TWO)
    plan = replace(plan, profile=replace(plan.profile, precision="bf16"))
    plan.save(root / "plan.json")
    spec = {"plan": str(root / "plan.json"), "config": GPT, "lr": LR, "clip": CLIP, "steps": STEPS,
            "out": str(root), "global_batch": plan.global_batch}
    (root / "cases.json").write_text(json.dumps(spec))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)), timeout_s=240)
    return {**spec, "parts": [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]}


def reference(global_batch: int, precision: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, ``precision`` by autocast: the weights after STEPS steps and each step's loss."""
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("momentum", LR)(list(net.parameters()))
    data = build_datasets("shakespeare", "gpt-tiny", seed=0, **GPT).train
    losses = []
    for x, y in iter_batches(data, global_batch, seed=0, steps=STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def test_bf16_training_tracks_the_single_process(job: dict[str, Any]) -> None:
    want, losses = reference(job["global_batch"], "bf16")
    want32, _ = reference(job["global_batch"], "fp32")
    got: dict[str, torch.Tensor] = {}
    for part in job["parts"]:
        got.update(part["weights"])
        assert part["history"], "every rank of this plan is used"
        ours = [h["loss"] for h in part["history"]]
        assert ours == pytest.approx(losses, rel=1e-2)
    ours = [h["loss"] for h in job["parts"][0]["history"]]
    assert ours[-1] < ours[0] * 0.9, f"the loss did not fall: {ours}"
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 2e-2, f"worst relative weight error {worst:.2e}"
    # it ran in bf16: far further from fp32 training than fp32 runs of a plan are from it (1e-5)
    worst32 = max(((got[k] - want32[k]).norm() / want32[k].norm()).item() for k in want)
    assert worst32 > 1e-3, f"the weights are within {worst32:.1e} of fp32 training: was autocast on?"
    print(f"bf16 weights against one bf16 process: {worst:.1e}, against fp32 training: {worst32:.1e}")
    for part in job["parts"]:
        assert all(w.dtype == torch.float32 for w in part["weights"].values()), "fp32 master weights"


def test_stages_send_bf16_activations(job: dict[str, Any]) -> None:
    """The first stage of each VW sends its fp32 hidden states in bfloat16 (half the bytes on the link)."""
    firsts = [job["parts"][0], job["parts"][2]]  # n0:0 and n0:2 start the two VWs
    for part in firsts:
        assert part["sent"] and set(part["sent"]) == {"torch.bfloat16"}, part["sent"]


def test_the_fp16_overflow_verdict_is_the_same_on_every_rank(job: dict[str, Any]) -> None:
    for part in job["parts"]:
        # step 0: rank 1's inf skips the step everywhere and halves the scale; then two good steps double it
        assert part["verdicts"] == [False, True, True]
        assert part["scales"] == [512.0, 512.0, 1024.0]
        # the gradients are divided by the scale the backward started from: 512 / 1024, then 512 / 512
        assert part["grads"] == [0.5, 1.0, 1.0]

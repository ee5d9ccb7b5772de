"""Pure data parallelism on 2 Gloo ranks, its one segment summed by DDP's reducer, equals single-process training.

Each VW is one stage of the whole model, so the plan's one segment is a whole stage
on both owners and ``runtime.sync.reducer`` hands it to DistributedDataParallel's
reducer (``GradientSync.reducers``). VW0 runs its mini-batch of 6 in 2 micro-batches
(the first backward accumulates, the last one syncs), VW1 its 4 in one. Three SGD
steps; per-step losses and the final weights against one process on the same global
batches, relative error <= 1e-6 in fp32; with ``reduce_dtype = "bf16"`` within bf16's
rounding (and not within fp32's: the hook did round). With gradient clipping by the
global norm too (clipping reads the flat buffers the reducer's sums are copied into).

    case        buckets (gpt-tiny, 6 layers)          reduce   clip
    fp32        [4, 6), [2, 4), [0, 2): 3 buckets     fp32     -
    bf16        the same                              bf16     -
    clip        the same                              fp32     0.05
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
from hetrain.plan import Plan
from hetrain.runtime.sync.reducer import reducer_segments
from hetrain.runtime.trainer import build_optimizer_fn

STEPS = 3
LR = 0.5
GPT = {"hidden": 32, "heads": 2, "seq_len": 16}
BUCKETS = {"first_bucket_bytes": 20_000, "bucket_bytes": 60_000}  # gpt-tiny's: layers [4, 6), [2, 4), [0, 2)

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.plan import load_plan
    from hetrain.models.user import resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    for case in json.load(open(sys.argv[1])):
        data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **case["config"]).train
        trainer = Trainer(resolve_model("gpt-tiny", **case["config"]), load_plan(case["plan"]),
                          TrainConfig(timeout_s=60, logging=LoggingConfig(progress=False),
                                      optim=OptimConfig(lr=case["lr"], clip_grad_norm=case["clip"])),
                          optimizer_fn=build_optimizer_fn("sgd", case["lr"]))
        history = trainer.fit(data, 1, seed=0)
        first = trainer.sync.calls["ddp"]
        history += trainer.fit(data, case["steps"], seed=0)
        stage = trainer.module
        layer_of = {id(p): k for k in range(stage.first, stage.end) for p in stage[k].parameters()}
        buckets = [sorted({layer_of[id(p)] for p in b.parameters()})
                   for r in trainer.sync.reducers.values() for b in r.ddp.reducer._get_zeros_like_grad_buckets()]
        torch.save({"weights": trainer.state_dict(), "losses": [h["loss"] for h in history],
                    "calls": dict(trainer.sync.calls), "first_calls": first, "reducers": sorted(trainer.sync.reducers),
                    "buckets": buckets, "wire_bytes": trainer.sync.wire_bytes,
                    "numel": sum(p.numel() for p in trainer.module.parameters()),
                    # the reducer's buckets are the gradients: every .grad a view of one of the stage's flat buffers
                    "flat_numel": sum(f.numel() for entries in trainer.sync.buffers.values() for f, _ in entries),
                    "grads_in_flats": all(any(p.grad._base is f for entries in trainer.sync.buffers.values()
                                              for f, _ in entries) for p in trainer.module.parameters())},
                   f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def dp_plan(reduce_dtype: str = "fp32") -> Plan:
    profile = build_profile("gpt-tiny", **GPT)
    return factories.make_plan(make_cluster({"n0": 2}), profile, [(["n0:0"], [0, 6], 6, 2), (["n0:1"], [0, 6], 4, 1)],
                               reduce_dtype=reduce_dtype, **BUCKETS)


CASES: dict[str, dict[str, Any]] = {
    "fp32": {"plan": dp_plan()},
    "bf16": {"plan": dp_plan("bf16"), "tolerance": 2e-2},
    "clip": {"plan": dp_plan(), "clip": 0.05},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ddp")
    specs = {}
    for name, c in CASES.items():
        out = root / name
        out.mkdir()
        c["plan"].save(out / "plan.json")
        specs[name] = {"plan": str(out / "plan.json"), "config": GPT, "lr": LR, "clip": c.get("clip"),
                       "steps": STEPS, "out": str(out)}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", [0, 1])
    return specs


def reference(clip: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, the same global batches of 10: weights after the steps and the losses."""
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("sgd", LR)(list(net.parameters()))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **GPT).train
    losses = []
    for x, y in iter_batches(data, 10, seed=0, steps=STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def test_the_dp_plans_one_segment_goes_to_ddps_reducer() -> None:
    plan = CASES["fp32"]["plan"]
    assert reducer_segments(plan) == {0}
    assert [(b.first_layer, b.end_layer) for b in plan.segments()[0].buckets] == [(4, 6), (2, 4), (0, 2)]


@pytest.mark.parametrize("name", list(CASES))
def test_dp_through_ddps_reducer_equals_single_process_training(job: dict[str, dict[str, Any]], name: str) -> None:
    spec, plan = job[name], CASES[name]["plan"]
    parts = [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(2)]
    want, losses = reference(spec["clip"])
    tolerance = CASES[name].get("tolerance", 1e-6)
    for part in parts:
        worst = max(((part["weights"][k] - want[k]).norm() / want[k].norm()).item() for k in want)
        assert worst <= tolerance, f"{name}: worst relative error {worst:.2e}"
        if plan.sync_options.reduce_dtype == "bf16":
            assert worst > 1e-5, f"{name}: weights within fp32's error ({worst:.1e}): were the sums rounded?"
        assert part["losses"] == pytest.approx(losses, rel=min(tolerance, 1e-3) if tolerance > 1e-6 else 1e-6)
    torch.testing.assert_close(parts[0]["weights"], parts[1]["weights"], rtol=0, atol=0)  # the replicas agree
    for part in parts:  # DDP's reducer summed every step's gradients; hetrain's own buckets none
        assert part["reducers"] == [0]
        assert part["calls"]["ring"] == part["calls"]["hierarchical"] == 0
        assert part["first_calls"] >= 1
        # from the second step on, the reducer's buckets are the plan's (re-cut once, in the gradients' order)
        assert part["buckets"] == [[4, 5], [2, 3], [0, 1]]
        assert part["calls"]["ddp"] - part["first_calls"] == (STEPS - 1) * 3
        wire = {"fp32": 4, "bf16": 2}[plan.sync_options.reduce_dtype]
        assert part["wire_bytes"] == STEPS * part["numel"] * wire
        # one copy of the gradients: the reducer's buckets, which clipping and the optimizer read as .grad
        assert part["flat_numel"] == part["numel"] and part["grads_in_flats"]


UNUSED_WORKER = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    from hetrain.data.registry import build_datasets
    from hetrain.errors import RunError
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.plan import load_plan
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import LoggingConfig, TrainConfig

    torch.set_num_threads(1)
    case = json.load(open(sys.argv[1]))
    mlp = resolve_model("mlp-digits")

    def layers(first, end):  # layer 1 gets a parameter its forward never uses
        out = mlp.build_layers(first, end)
        for k, layer in zip(range(first, end), out):
            if k == 1:
                layer.register_parameter("unused", nn.Parameter(torch.zeros(3)))
        out[0] = Gated(out[0]) if first == 0 else out[0]
        return out

    class Gated(nn.Module):  # a gate the batch takes or not, as a token reaches an MoE expert or not
        def __init__(self, inner):
            super().__init__()
            self.inner, self.gate = inner, nn.Parameter(torch.ones(1))

        def forward(self, x):
            y = self.inner(x)
            return y * self.gate if bool(x.flatten(1)[:, 0].sum() > x.flatten(1)[:, 1].sum()) else y

    model = ModelSource.of_layers(layers, mlp.loss_fn, mlp.num_layers)
    trainer = Trainer(model, load_plan(case["plan"]), TrainConfig(timeout_s=5, logging=LoggingConfig(progress=False)),
                      optimizer_fn=build_optimizer_fn("sgd", 0.1))
    data = build_datasets("synthetic", "mlp-digits", seed=0, synthetic_samples=64).train
    try:
        trainer.fit(data, 6, seed=0)
        message = None
    except RunError as e:
        message = str(e)
    weights = {k: v.flatten().tolist() for k, v in trainer.state_dict().items()}
    json.dump({"message": message, "weights": weights}, open(f"{case['out']}/rank{trainer.rank}.json", "w"))
    trainer.close()
""")


def test_a_parameter_without_gradient_gets_a_zero_sum_as_on_hetrains_own_path(tmp_path: Path) -> None:
    """DDP's reducer waits for every parameter of its segment; one the last backward does not reach (here a gate
    that some batches take and others not, as a token reaches an MoE expert or not, and a parameter no forward
    uses) is marked ready with a zero gradient, since the reducer walks the graph from the backward's roots
    (find_unused_parameters): training goes on, the replicas agree, the gate learns, the unused stays."""
    from factories import mlp_digits_profile

    plan = factories.make_plan(make_cluster({"n0": 2}), mlp_digits_profile(),
                               [(["n0:0"], [0, 3], 8, 1), (["n0:1"], [0, 3], 8, 1)])
    assert reducer_segments(plan) == {0}
    plan.save(tmp_path / "plan.json")
    (tmp_path / "cases.json").write_text(json.dumps({"plan": str(tmp_path / "plan.json"), "out": str(tmp_path)}))
    (tmp_path / "worker.py").write_text(UNUSED_WORKER)
    run_worker_ranks(tmp_path, "n0", [0, 1])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["message"] is None, r["message"]
    weights = ranks[0]["weights"]
    assert weights == ranks[1]["weights"]  # every bucket was summed: the replicas agree
    assert [weights[k] for k in weights if k.endswith(".unused")] == [[0.0, 0.0, 0.0]]
    assert [k for k in weights if k.endswith(".gate")] and all(
        weights[k] != [1.0] for k in weights if k.endswith(".gate"))  # some batches took it

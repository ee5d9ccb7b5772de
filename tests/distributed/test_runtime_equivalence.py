"""Plans run on 4 Gloo ranks give, after three optimizer steps, the weights of single-process training.

One job of 4 processes (RANK/WORLD_SIZE set as torchrun sets them) runs every
case below in turn with the Trainer API, each with its own Trainer (its own
process groups); each rank saves its stage's weights, and the test compares
them with one process training the whole model on the same global batches.
Float32; relative error (Frobenius norm of the difference over the norm) <= 1e-5.
Synthetic data throughout (the real sets would add seconds of imports to every rank).
Gradient buckets of ~20-60 kB (``SMALL_BUCKETS``), so that a segment's all-reduce runs in two
or three buckets overlapped with the last backward; ``adamw`` keeps the default sizes (one bucket).

    case          plan (gpt-tiny has 6 layers, mlp-digits 3)
    dp-uneven     4 VWs of one stage, mini-batches 5, 3, 2, 2 (VW0 in 2 micro-batches)
    pp4-gpipe     one pipeline of 4 stages, GPipe, 4 micro-batches
    pp4-1f1b      one pipeline of 4 stages, 1F1B, 6 uneven micro-batches (2,2,2,2,1,1)
    pp4-eager     the same under 1F1B-eager (one more warm-up forward on every stage but the last)
    pp3-mlp       mlp-digits on 3 stages, 1F1B
    two-vws       VW0 [0,2)+[2,6), mini-batch 6 in 3; VW1 [0,4)+[4,6), mini-batch 4 in 2
    2x2           VW0 [0,2)+[2,6), mini-batch 6 in 3; VW1 the same cut, mini-batch 4 in 2: every segment a whole
                  stage on each owner, all-reduced by DDP's reducer (``runtime.sync.reducer``), as dp-uneven's
    2x2-bf16      2x2, its gradients all-reduced in bf16 by the reducer's hook
    dp-exact      dp-uneven, its buckets cut at their size inside layers (``bucket_cut`` exact)
    two-vws-exact two-vws, the same
    two-vws-bf16  two-vws-exact, its gradients all-reduced in bf16 (``reduce_dtype``): relative error <= 2e-2,
                  bf16's rounding of the sums, and half the bytes on the wire
    recompute     VW0 of 2 stages with recompute sets, VW1 one stage recomputing; n0:3 unused (idles)
    adamw         mlp-digits on two VWs cut differently, AdamW with weight decay

pp4-1f1b, pp3-mlp and two-vws post their receives at the RECVs (sync option
``early_receives`` never); the others one ahead of them (the default, ``runtime.step.p2p``).
"""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster, mlp_digits_profile
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan
from hetrain.runtime.sync.reducer import reducer_segments
from hetrain.runtime.trainer import build_optimizer_fn
from hetrain.schedule import ActionKind, build_schedule
from hetrain.simulator import simulate
from hetrain.timeline import compare, load_timeline

STEPS = 3
GPT = {"hidden": 32, "heads": 2, "seq_len": 16}  # gpt-tiny, shrunk: 6 layers still
# gpt-tiny's buckets: layers [4, 6), [2, 4), [0, 2); mlp-digits': [1, 3), [0, 1)
SMALL_BUCKETS = {"first_bucket_bytes": 20_000, "bucket_bytes": 60_000}
EXACT = {**SMALL_BUCKETS, "bucket_cut": "exact"}
# receives posted at their RECVs, as torch.distributed.pipelining does (the default posts them one ahead)
AT_RECV = {**SMALL_BUCKETS, "early_receives": "never"}
WORLD = 4

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    from hetrain.runtime.step.losses import LossSums
    from hetrain.schedule import ActionKind

    flushes = []  # per flush of the losses: whether the rank was then at an F action
    real_flush = LossSums.flush
    def flush(self):
        doing = trainer.health.doing
        flushes.append(isinstance(doing, tuple) and getattr(doing[1], "kind", None) is ActionKind.F)
        return real_flush(self)
    LossSums.flush = flush

    torch.set_num_threads(1)
    for case in json.load(open(sys.argv[1])):
        flushes.clear()
        model, config = case["model"], case["config"]
        data = build_datasets(case["data"], model, seed=0, synthetic_samples=256, **config).train
        trainer = Trainer(resolve_model(model, **config), load_plan(case["plan"]),
                          TrainConfig(timeout_s=60, logging=LoggingConfig(metrics_out=case.get("metrics"),
                                                                          timeline_out=case.get("timeline"),
                                                                          progress=False)),
                          optimizer_fn=build_optimizer_fn(case["optimizer"], case["lr"],
                                                          weight_decay=case["weight_decay"]))
        history = trainer.fit(data, case["steps"], seed=0)
        torch.save({"weights": trainer.state_dict(), "history": history, "used": trainer.role.used,
                    "early": trainer.sync.posted_early if trainer.role.used else 0, "flushes": list(flushes),
                    "ddp": (dict(trainer.sync.calls, reducers=sorted(trainer.sync.reducers))
                            if trainer.role.used else {}),
                    "early_receives": trainer.job.stage.executor.early_posts if trainer.role.used else 0,
                    "wire_bytes": trainer.sync.wire_bytes if trainer.role.used else 0,
                    "shared_numel": sum(f.numel() for s, entries in trainer.sync.buffers.items()
                                        if trainer.plan.segments()[s].shared for f, _ in entries)
                    if trainer.role.used else 0},
                   f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def make_plan(model: str, vws: list[tuple[list[str], list[int], int, int]], schedule: str = "1f1b",
              recompute: dict[str, tuple[int, ...]] | None = None,
              options: dict[str, Any] | None = SMALL_BUCKETS) -> Plan:
    """``vws``: (devices, layer boundaries, mini-batch, micro-batches) per VW, on node n0 of 4 CPU devices."""
    profile = (mlp_digits_profile() if model == "mlp-digits"
               else build_profile(model, hidden=GPT["hidden"], heads=GPT["heads"], seq_len=GPT["seq_len"]))
    return factories.make_plan(make_cluster({"n0": WORLD}), profile, vws, schedule=schedule, recompute=recompute,
                               **(options or {}))


D = [f"n0:{k}" for k in range(WORLD)]
TWO_VWS = [([D[0], D[1]], [0, 2, 6], 6, 3), ([D[2], D[3]], [0, 4, 6], 4, 2)]
TWO_BY_TWO = [([D[0], D[1]], [0, 2, 6], 6, 3), ([D[2], D[3]], [0, 2, 6], 4, 2)]
CASES: dict[str, dict[str, Any]] = {
    "dp-uneven": {"plan": make_plan("gpt-tiny", [([D[0]], [0, 6], 5, 2), ([D[1]], [0, 6], 3, 1),
                                                 ([D[2]], [0, 6], 2, 1), ([D[3]], [0, 6], 2, 2)])},
    "pp4-gpipe": {"plan": make_plan("gpt-tiny", [(D, [0, 2, 3, 4, 6], 8, 4)], "gpipe"), "timeline": True},
    "pp4-1f1b": {"plan": make_plan("gpt-tiny", [(D, [0, 1, 3, 5, 6], 10, 6)], "1f1b", options=AT_RECV)},
    "pp4-eager": {"plan": make_plan("gpt-tiny", [(D, [0, 1, 3, 5, 6], 10, 6)], "1f1b-eager")},
    "pp3-mlp": {"plan": make_plan("mlp-digits", [(D[:3], [0, 1, 2, 3], 16, 4)], options=AT_RECV),
                "model": "mlp-digits", "lr": 0.2},
    "two-vws": {"plan": make_plan("gpt-tiny", TWO_VWS, options=AT_RECV)},
    "2x2": {"plan": make_plan("gpt-tiny", TWO_BY_TWO)},
    "2x2-bf16": {"plan": make_plan("gpt-tiny", TWO_BY_TWO, options={**SMALL_BUCKETS, "reduce_dtype": "bf16"}),
                 "tolerance": 2e-2},
    # buckets cut at their size inside layers and parameters (bucket_cut "exact", as DistributedDataParallel)
    "dp-exact": {"plan": make_plan("gpt-tiny", [([D[0]], [0, 6], 5, 2), ([D[1]], [0, 6], 3, 1),
                                                ([D[2]], [0, 6], 2, 1), ([D[3]], [0, 6], 2, 2)], options=EXACT)},
    "two-vws-exact": {"plan": make_plan("gpt-tiny", TWO_VWS, options=EXACT)},
    # gradients all-reduced in bf16 (sync option reduce_dtype): within bf16's rounding of fp32 training (a bias
    # that starts at 0 is only its summed gradients: 2^-9 per rounding; test_runtime_hierarchical)
    "two-vws-bf16": {"plan": make_plan("gpt-tiny", TWO_VWS, options={**EXACT, "reduce_dtype": "bf16"}),
                     "tolerance": 2e-2},
    "recompute": {"plan": make_plan("gpt-tiny", [([D[0], D[1]], [0, 3, 6], 6, 3), ([D[2]], [0, 6], 3, 3)],
                                    recompute={D[0]: (0, 2), D[1]: (3, 4, 5), D[2]: (1, 2, 3)})},
    # AdamW on mlp-digits: in gpt-tiny the key bias has a zero gradient (softmax ignores a shift), made of
    # rounding noise only, which Adam's normalisation turns into full-size steps that no two summation orders share
    "adamw": {"plan": make_plan("mlp-digits", [([D[0], D[1]], [0, 1, 3], 10, 2), ([D[2], D[3]], [0, 2, 3], 6, 3)],
                                options=None),
              "model": "mlp-digits", "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1},
}


def _case(name: str, root: Path) -> dict[str, Any]:
    c = CASES[name]
    out = root / name
    out.mkdir()
    c["plan"].save(out / "plan.json")
    model = c.get("model", "gpt-tiny")
    spec = {"plan": str(out / "plan.json"), "model": model, "config": GPT if model == "gpt-tiny" else {},
            "data": c.get("data", "synthetic"), "optimizer": c.get("optimizer", "sgd"), "lr": c.get("lr", 0.5),
            "weight_decay": c.get("weight_decay", 0.0), "steps": STEPS, "out": str(out),
            "metrics": str(out / "metrics.jsonl")}
    if c.get("timeline"):
        spec["timeline"] = str(out / "timeline.json")
    return spec


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every case in one 4-rank job; returns the specs by case name."""

    root = tmp_path_factory.mktemp("runtime")
    specs = {name: _case(name, root) for name in CASES}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)))
    return specs


def reference(spec: dict[str, Any], global_batch: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, the same global batches: weights after the steps and the losses."""
    model, config = spec["model"], spec["config"]
    torch.manual_seed(123)  # nothing below may depend on the global generator
    net = LayerRange(build_layers(model, seed=0, **config))
    opt = build_optimizer_fn(spec["optimizer"], spec["lr"], weight_decay=spec["weight_decay"])(list(net.parameters()))
    data = build_datasets(spec["data"], model, seed=0, synthetic_samples=256, **config).train
    losses = []
    for x, y in iter_batches(data, global_batch, seed=0, steps=spec["steps"]):
        opt.zero_grad()
        loss = loss_fn(model)(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def test_the_plans_all_reduce_in_several_buckets() -> None:
    plan = CASES["dp-uneven"]["plan"]
    assert [(b.first_layer, b.end_layer) for b in plan.segments()[0].buckets] == [(4, 6), (2, 4), (0, 2)]
    starts = [str(a) for a in build_schedule(plan)[D[0]] if a.kind is ActionKind.ALLREDUCE_START]
    assert starts == [f"ALLREDUCE_START seg0 bucket{b}" for b in range(3)]
    assert [len(seg.buckets) for seg in CASES["adamw"]["plan"].segments()] == [1, 1, 1]


def test_the_exact_plans_cut_buckets_inside_layers_and_parameters() -> None:
    plan = CASES["dp-exact"]["plan"]
    buckets = plan.segments()[0].buckets
    assert len(buckets) >= 3 and buckets[0].param_bytes == SMALL_BUCKETS["first_bucket_bytes"]
    bounds = [b.bounds[0] for b in buckets[:-1]]
    assert all(x != int(x) for x in bounds)  # every bound inside a layer
    # and inside a parameter of the real layers: some parameter has elements on both sides of a bound
    layers = build_layers("gpt-tiny", seed=0, **GPT)
    inside = 0
    for x in bounds:
        k = int(x)
        sizes = [p.numel() for p in layers[k].parameters()]
        at = round((x - k) * sum(sizes))
        inside += any(end - n < at < end for end, n in zip(itertools.accumulate(sizes), sizes, strict=True))
    assert inside >= 2
    for name in ("two-vws-exact",):
        assert any(b.span is not None for seg in CASES[name]["plan"].segments() for b in seg.buckets)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_after_three_steps_equal_single_process_training(job: dict[str, Any], name: str) -> None:
    spec = job[name]
    plan: Plan = CASES[name]["plan"]
    parts = [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]
    got: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part["weights"].items():
            if key in got:  # a layer held by several VWs: their replicas must agree
                torch.testing.assert_close(value, got[key], rtol=1e-6, atol=1e-7)
            got[key] = value
    want, losses = reference(spec, plan.global_batch)
    assert set(got) == set(want)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    tolerance = CASES[name].get("tolerance", 1e-5)
    assert worst <= tolerance, f"{name}: worst relative error {worst:.2e}"
    wire = {"fp32": 4, "bf16": 2}[plan.sync_options.reduce_dtype]
    for part in parts:  # each shared gradient went out once per step, in the plan's reduce_dtype
        assert part["wire_bytes"] == STEPS * part["shared_numel"] * wire, (name, part["wire_bytes"])
    if plan.sync_options.reduce_dtype == "bf16":
        assert worst > 1e-5, f"{name}: weights within fp32's error ({worst:.1e}): were the sums rounded?"
        print(f"{name}: worst relative weight error {worst:.1e}")
    moved = min(((want[k] - w0).norm() / w0.norm()).item()
                for k, w0 in LayerRange(build_layers(spec["model"], seed=0, **spec["config"])).state_dict().items()
                if w0.is_floating_point() and w0.norm() > 0)
    assert moved > 0, "the reference did not train"
    used = [p for p in parts if p["used"]]
    assert len(used) == len(plan.devices_used)
    schedule = build_schedule(plan)
    whole = reducer_segments(plan)  # segments that are one whole stage on every owner: DDP's reducer sums them
    for r, part in enumerate(parts):  # every bucket's all-reduce was posted from the backward, not at its START
        if part["used"]:
            starts = [a for a in schedule[D[r]] if a.kind is ActionKind.ALLREDUCE_START]
            own = sum(a.segment not in whole for a in starts)
            assert part["early"] == STEPS * own, (D[r], part["early"], own)
            mine = sorted({a.segment for a in starts} & whole)
            assert part["ddp"]["reducers"] == mine, (D[r], part["ddp"])
            # the reducer ran at least one bucket per step, and hetrain's own path none of its segments
            assert (part["ddp"]["ddp"] >= STEPS) == bool(mine), (D[r], part["ddp"])
            assert part["ddp"]["ring"] == STEPS * own, (D[r], part["ddp"])
    early = plan.sync_options.early_receives == "always"
    for r, part in enumerate(parts):  # receives posted ahead where the plan says so, and only there: each stage
        # with a neighbour posts all but its first receive of each direction ahead (the first waits for a header)
        if part["used"]:
            receives = sum(a.kind in (ActionKind.RECV_F, ActionKind.RECV_B) for a in schedule[D[r]])
            assert (part["early_receives"] > 0) == (early and receives > 0), (D[r], part["early_receives"])
            assert part["early_receives"] <= STEPS * receives
    for part in used:  # the losses are summed from the last step's forward on, not after the step: at the end
        # of fit the sum has run during the backward (one flush at the F, one reading it after the step)
        assert part["flushes"] == [True, False], part["flushes"]
    for part in used:  # every used rank knows the global loss of every step
        assert [h["step"] for h in part["history"]] == [1, 2, 3]
        assert [h["loss"] for h in part["history"]] == pytest.approx(losses, rel=min(tolerance, 1e-3))
    rows = [json.loads(line) for line in Path(spec["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the reporting rank's bytes handed to its gradient all-reduces, each step: its shared gradients once
    assert {r["allreduce_bytes"] for r in rows} <= {p["shared_numel"] * wire for p in parts}
    assert len({r["allreduce_bytes"] for r in rows}) == 1
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 for r in rows)


def test_an_unused_rank_idles_and_holds_nothing(job: dict[str, Any]) -> None:
    idle = torch.load(Path(job["recompute"]["out"]) / "rank3.pt")
    assert idle == {"weights": {}, "history": [], "used": False, "early": 0, "flushes": [], "early_receives": 0,
                    "wire_bytes": 0, "shared_numel": 0, "ddp": {}}


def test_the_measured_timeline_lines_up_with_the_simulated_one(job: dict[str, Any]) -> None:
    plan: Plan = CASES["pp4-gpipe"]["plan"]
    measured = load_timeline(job["pp4-gpipe"]["timeline"])
    assert measured.source == "measured" and measured.meta["step"] == STEPS - 1
    assert list(measured.devices) == D
    m = plan.virtual_workers[0].micro_batches
    for j, dev in enumerate(D):
        events = measured.devices[dev]
        assert [e.label for e in events if e.kind == "forward"] == [f"{j}F{i}" for i in range(m)]
        assert [e.label for e in events if e.kind == "backward"] == [f"{j}B{i}" for i in range(m)]
        assert [e.kind for e in events][-1] == "optimizer"
        assert all(e.end_s >= e.start_s >= 0 for e in events)
        assert sum(e.kind == "recv" for e in events) == (m if j in (0, WORLD - 1) else 2 * m)
    for a, b in itertools.pairwise(D):  # activations one way, gradients the other
        assert {e.kind for e in measured.links[f"{a}->{b}"]} == {"send_f"}
        assert {e.kind for e in measured.links[f"{b}->{a}"]} == {"send_b"}
    rows = {(r.device, r.kind): r for r in compare(simulate(plan).timeline, measured).rows}
    for dev in D:
        assert rows[(dev, "forward")].predicted_count == rows[(dev, "forward")].measured_count == m
        assert rows[(dev, "iteration")].measured_s > 0

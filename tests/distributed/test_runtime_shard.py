"""ZeRO-1 and ZeRO-2 with uneven shards on 3 Gloo ranks, against one process; checkpoints across shard layouts.

One job of 3 processes runs each case with the Trainer API (the machinery of
``test_runtime_equivalence``): gpt-tiny (6 layers, shrunk), AdamW with weight decay,
clipping by the global norm (active every step), float32, 10 steps; one process trains
the whole model on the same global batches with ``clip_grad_norm_``. Relative error
(Frobenius norm of the difference over the norm) of the whole model <= 1e-6, and of every
tensor <= 5e-5: the attention's key bias has a gradient that is zero but for rounding (a softmax
does not see a constant added to its scores), which AdamW scales up to steps of the rate, so a
sum in another order moves it by ~1e-5 of its norm in an unsharded bsp run alike.

    case      plan                                                             shard                weights
    zero1     3 VWs of one stage, mini-batches 6 (in 2), 4, 2                 optimizer            1:2:1
    zero2     VW0 n0:0 [0,6); VW1 n0:1 [0,3) + n0:2 [3,6) (segments           optimizer+gradients  3:1:2
              [0,3) {n0:0,n0:1} and [3,6) {n0:0,n0:2} split stages)
    mixed     zero2's, segment [0,3) ZeRO-2 and [3,6) not sharded             per segment          3:1:2
    resume    a checkpoint at every change of plan: none (steps 1-3) -> zero1 3:1:0 ... (4-6)
              -> zero2 1:2:1 (7-8) -> none (9-10)
    bf16-*    zero2's plan under bf16 autocast, sharded and not (fp32 master weights, gradients and
              state either way): the two runs agree to 5e-4 of the model's norm, against 1.2e-3 between
              bf16 and fp32 training. Not closer: the sums' other order flips bf16 roundings of the
              activations, and AdamW turns the key bias's rounding-only gradient into steps of the rate
              (two thirds of the difference is in the qkv biases)

Gradient buckets of ~20-60 kB, so that a bucket's bounds and the shards' fall at different
elements. Each rank also reports its parameters', gradients' and optimizer state's bytes,
measured from the tensors after the last step, which must be the memory model's
(``cost.estimate_weight_memory`` at the rank's shares) within 5%.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_equivalence import GPT, SMALL_BUCKETS
from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster, mlp_digits_profile
from hetrain.cost import estimate_weight_memory, zero2_transient_bytes
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.errors import InputError
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan
from hetrain.runtime.sync.shard import check_shard
from hetrain.runtime.trainer import build_optimizer_fn

STEPS = 10
WORLD = 3
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 0.05  # CLIP below every step's norm: clipping is active throughout
D = [f"n0:{k}" for k in range(WORLD)]

WORKER = textwrap.dedent("""
    import json, sys, torch
    from hetrain.data.registry import build_datasets
    from hetrain.plan import load_plan
    from hetrain.models.user import resolve_model
    from hetrain.runtime import Trainer
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from hetrain.runtime.sync.shard import ShardedOptimizer, measure_weight_bytes

    torch.set_num_threads(1)


    def watch_gradient_bytes(trainer):
        # the most bytes of gradients alive at once during the backwards (each storage once): the parameters'
        # .grad, this rank's summed ranges and the packed buckets in flight, measured from the tensors after
        # every gradient's accumulation, and around each ZeRO-2 bucket's packing (while it holds both the
        # bucket's .grad and its temporary)
        shards = trainer.optimizer.shards
        params = list(trainer.module.parameters()) + [sh.param for sh in shards.entries()]
        peak = [0]

        def alive(extra=()):
            seen = {}
            for t in [p.grad for p in params] + shards.temporaries() + list(extra):
                if t is not None:
                    st = t.untyped_storage()
                    seen[(st.data_ptr(), id(st) if st.data_ptr() == 0 else 0)] = st.nbytes()
            peak[0] = max(peak[0], sum(seen.values()))

        post = shards.post

        def watched_post(key, wire_dtype, what):
            alive()  # the bucket's gradients, and the one in flight
            held = [p.grad for p in params]  # alive until the packed temporary exists
            out = post(key, wire_dtype, what)
            alive(held)
            return out

        shards.post = watched_post
        for p in trainer.module.parameters():  # after GradientSync's hooks: once a complete bucket is posted
            p.register_post_accumulate_grad_hook(lambda _: alive())
        return peak


    for case in json.load(open(sys.argv[1])):
        data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **case["config"]).train
        history, starts, layouts = [], [], []
        for plan_path, stop in zip(case["plans"], case["stops"]):  # each Trainer after the first resumes
            optim = OptimConfig(lr=case["lr"], weight_decay=case["weight_decay"], clip_grad_norm=case["clip"])
            trainer = Trainer(resolve_model("gpt-tiny", **case["config"]), load_plan(plan_path),
                              TrainConfig(steps=case["stops"][-1], timeout_s=60, optim=optim,
                                          checkpoint=CheckpointConfig(case["ckpt"]),
                                          logging=LoggingConfig(progress=False)))
            starts.append(trainer.step)
            peak = [0]
            if case.get("peak") and trainer.role.used:
                peak = watch_gradient_bytes(trainer)
            history += trainer.fit(data, stop, seed=0)
            weights = trainer.state_dict()
            memory, shares = None, None
            if trainer.role.used:
                opt, module, device = trainer.optimizer, trainer.module, trainer.role.device
                memory = measure_weight_bytes(module, opt)
                numel = {}  # layer -> its elements
                for name, p in module.named_parameters():
                    k = int(name.split(".")[1])
                    numel[k] = numel.get(k, 0) + p.numel()
                total = sum(numel.values())
                state = grad = 0.0
                for seg in trainer.plan.segments():
                    n = sum(numel.get(k, 0) for k in range(seg.first_layer, seg.end_layer))
                    if n:
                        state += seg.shard_of(device) * n / total
                        grad += (seg.shard_of(device) if seg.shard == "optimizer+gradients" else 1.0) * n / total
                shares = {"state": state, "grad": grad, "param_bytes": 4 * total,
                          "sharded": isinstance(opt, ShardedOptimizer)}
            ranges = (sum(sh.param.numel() * sh.param.element_size() for sh in trainer.optimizer.shards.entries())
                      if case.get("peak") and trainer.role.used else 0)
            layouts.append({"memory": memory, "shares": shares, "peak": peak[0], "range_bytes": ranges,
                            "largest_layer_bytes": 4 * max(numel.values()) if memory is not None else 0,
                            "early": trainer.sync.posted_early if trainer.role.used else 0})
            trainer.close()
        torch.save({"weights": weights, "history": history, "starts": starts, "layouts": layouts},
                   f"{case['out']}/rank{trainer.rank}.pt")
""")


def make_plan(vws: list[tuple[list[str], list[int], int, int]], shard: str, weights: dict[str, float],
              precision: str = "fp32", buckets: dict[str, Any] = SMALL_BUCKETS,
              segment_shards: tuple[str, ...] = ()) -> Plan:
    """gpt-tiny (shrunk) on node n0 of 3 CPU devices, AdamW, bsp, small buckets, sharded by ``weights`` (each
    segment as ``segment_shards`` says, where given)."""
    profile = build_profile("gpt-tiny", hidden=GPT["hidden"], heads=GPT["heads"], seq_len=GPT["seq_len"])
    profile = replace(profile, precision=precision)
    plan = factories.make_plan(make_cluster({"n0": WORLD}), profile, vws, optimizer="adam", shard=shard,
                               **buckets)
    return replace(plan, shard_weights=weights, segment_shards=segment_shards) if shard != "none" else plan


DP3 = [([D[0]], [0, 6], 6, 2), ([D[1]], [0, 6], 4, 1), ([D[2]], [0, 6], 2, 1)]
HYBRID = [([D[0]], [0, 6], 6, 2), ([D[1], D[2]], [0, 3, 6], 6, 2)]
ONE_MB = [([D[0]], [0, 6], 4, 1), ([D[1]], [0, 6], 2, 1), ([D[2]], [0, 6], 2, 1)]  # one micro-batch per iteration
W121 = {D[0]: 1, D[1]: 2, D[2]: 1}
# ~10 kB buckets cut inside the layers (gpt-tiny's blocks hold ~51 kB, its largest parameter 16 kB): 23 buckets,
# and gradients that cross a bucket's bound
TINY_BUCKETS = {"first_bucket_bytes": 10_000, "bucket_bytes": 10_000, "bucket_cut": "exact"}
CASES: dict[str, dict[str, Any]] = {
    "zero1": {"plans": [make_plan(DP3, "optimizer", W121)], "stops": [STEPS]},
    "zero2": {"plans": [make_plan(HYBRID, "optimizer+gradients", {D[0]: 3, D[1]: 1, D[2]: 2})], "stops": [STEPS]},
    # n0:0's stage is in both segments: ZeRO-2 in [0, 3), none in [3, 6)
    "mixed": {"plans": [make_plan(HYBRID, "optimizer+gradients", {D[0]: 3, D[1]: 1, D[2]: 2},
                                  segment_shards=("optimizer+gradients", "none"))], "stops": [STEPS]},
    "zero2-1mb": {"plans": [make_plan(ONE_MB, "optimizer+gradients", W121, buckets=TINY_BUCKETS)], "stops": [STEPS],
                  "peak": True},
    "resume": {"plans": [make_plan(DP3, "none", {}), make_plan(DP3, "optimizer", {D[0]: 3, D[1]: 1, D[2]: 0}),
                         make_plan(HYBRID, "optimizer+gradients", W121), make_plan(DP3, "none", {})],
               "stops": [3, 6, 8, STEPS]},
    "bf16-none": {"plans": [make_plan(HYBRID, "none", {}, "bf16")], "stops": [STEPS]},
    "bf16-zero2": {"plans": [make_plan(HYBRID, "optimizer+gradients", {D[0]: 3, D[1]: 1, D[2]: 2}, "bf16")],
                   "stops": [STEPS]},
}
FP32 = ["zero1", "zero2", "zero2-1mb", "mixed", "resume"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run every case in one 3-rank job; returns the specs by case name."""
    root = tmp_path_factory.mktemp("shard")
    specs = {}
    for name, c in CASES.items():
        out = root / name
        out.mkdir()
        paths = []
        for k, plan in enumerate(c["plans"]):
            plan.save(out / f"plan{k}.json")
            paths.append(str(out / f"plan{k}.json"))
        specs[name] = {"plans": paths, "stops": c["stops"], "config": GPT, "lr": LR, "weight_decay": WEIGHT_DECAY,
                       "clip": CLIP, "out": str(out), "ckpt": str(out / "ckpt"),
                       "global_batch": c["plans"][0].global_batch, "peak": c.get("peak", False)}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, "n0", list(range(WORLD)), timeout_s=300)
    return specs


def reference(global_batch: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the whole model: the weights after STEPS steps, each step's loss and norm before clipping."""
    torch.manual_seed(123)  # nothing below may depend on the global generator
    net = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = build_optimizer_fn("adam", LR, weight_decay=WEIGHT_DECAY)(list(net.parameters()))
    data = build_datasets("synthetic", "gpt-tiny", seed=0, synthetic_samples=256, **GPT).train
    losses, norms = [], []
    for x, y in iter_batches(data, global_batch, seed=0, steps=STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt-tiny")(net(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses, norms


def _parts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", FP32)
def test_sharded_training_equals_the_single_process(job: dict[str, dict[str, Any]], name: str) -> None:
    spec = job[name]
    parts = _parts(spec)
    want, losses, norms = reference(spec["global_batch"])
    assert min(norms) > CLIP, f"clipping was not active: norms {norms}"
    got: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part["weights"].items():
            if key in got:  # a layer held by several owners: every owner gathered every range
                assert torch.equal(value, got[key]), f"{name}: the owners' copies of {key} differ"
            got[key] = value
    assert set(got) == set(want)
    off = sum(((got[k] - want[k]).norm() ** 2).item() for k in want) ** 0.5
    whole = off / sum((want[k].norm() ** 2).item() for k in want) ** 0.5
    assert whole <= 1e-6, f"{name}: the model is off by {whole:.2e} (relative)"
    errors = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 5e-5, f"{name}: {worst} is off by {errors[worst]:.2e} (relative)"
    history = parts[0]["history"]
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    for row, loss, norm in zip(history, losses, norms, strict=True):
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)
    if name == "resume":
        assert parts[0]["starts"] == [0, 3, 6, 8]


@pytest.mark.parametrize("name", [*FP32, "bf16-zero2"])
def test_memory_of_each_rank_is_the_models(job: dict[str, dict[str, Any]], name: str) -> None:
    """Parameters, gradients and AdamW's state, measured from the tensors after the last step of each plan, are
    the memory model's at the rank's shares (within 5%), and are uneven where the shards are."""
    checked = 0
    state_bytes = []
    for rank, part in enumerate(_parts(job[name])):
        for k, layout in enumerate(part["layouts"]):
            memory, shares = layout["memory"], layout["shares"]
            if memory is None:
                continue
            pb = shares["param_bytes"]
            # fp32 parameters, gradients and state under any precision (hetrain.amp); autocast's 16-bit copy
            # of the weights lives only during an iteration, and is not a parameter's storage
            want = estimate_weight_memory(pb, 4, "adam", shares["state"], shares["grad"])
            have = memory["params"] + memory["grads"] + memory["state"]
            where = f"{name}, plan {k}, rank {rank} (state share {shares['state']:.3f}, grad {shares['grad']:.3f})"
            assert have == pytest.approx(want, rel=0.05), f"{where}: measured {have} B, the model {want:.0f} B"
            assert memory["params"] == pytest.approx(pb, rel=0.05), where
            assert memory["grads"] == pytest.approx(pb * shares["grad"], rel=0.05, abs=64), where
            assert memory["state"] == pytest.approx(2 * pb * shares["state"], rel=0.05, abs=64), where
            if k == len(part["layouts"]) - 1:
                state_bytes.append(memory["state"])
            checked += 1
    assert checked >= WORLD
    if name != "resume":  # uneven shards: the ranks' state differs
        assert len(set(state_bytes)) > 1, state_bytes


def test_zero2_frees_the_whole_gradients(job: dict[str, dict[str, Any]]) -> None:
    """Under ZeRO-2 a rank keeps less than its stage's gradients between iterations; under ZeRO-1 all of them."""
    z2 = [p["layouts"][0] for p in _parts(job["zero2"])]
    assert all(m["memory"]["grads"] < 0.8 * m["shares"]["param_bytes"] for m in z2)
    z1 = [p["layouts"][0] for p in _parts(job["zero1"])]
    assert all(m["memory"]["grads"] == m["shares"]["param_bytes"] for m in z1)


def test_zero2_gradients_are_transient_in_the_backward(job: dict[str, dict[str, Any]]) -> None:
    """With one micro-batch per iteration a ZeRO-2 rank never holds its stage's gradients whole: at every moment
    of the backward (measured from the tensors) it holds its own range plus at most the memory model's transient,
    two buckets or the largest layer, which is less than the gradients it does not keep."""
    plan = CASES["zero2-1mb"]["plans"][0]
    bucket_bytes = plan.sync_options.bucket_bytes
    for rank, part in enumerate(_parts(job["zero2-1mb"])):
        layout = part["layouts"][0]
        pb, share = layout["shares"]["param_bytes"], layout["shares"]["grad"]
        mine = layout["range_bytes"]  # the gradients it keeps: its range
        largest = layout["largest_layer_bytes"]
        tight = mine + zero2_transient_bytes(pb, largest, share, bucket_bytes)
        where = f"rank {rank} (share {share:.2f}): peak {layout['peak']} B of gradients"
        assert tight < pb, f"{where}: the bound {tight:.0f} B would let the gradients be kept whole ({pb:.0f} B)"
        assert mine < layout["peak"] <= tight, f"{where}, its range {mine} B, at most {tight:.0f} B"
        assert layout["peak"] <= mine + zero2_transient_bytes(pb, largest, share), where


def test_bf16_sharded_training_equals_unsharded(job: dict[str, dict[str, Any]]) -> None:
    """Under bf16 autocast the sharded run steps the fp32 master weights as the unsharded run of the same plan does."""
    def weights(name: str) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for part in _parts(job[name]):
            got.update(part["weights"])
        return got

    sharded, unsharded = weights("bf16-zero2"), weights("bf16-none")
    assert all(v.dtype == torch.float32 for v in sharded.values())
    off = sum(((sharded[k] - unsharded[k]).norm() ** 2).item() for k in unsharded) ** 0.5
    whole = off / sum((unsharded[k].norm() ** 2).item() for k in unsharded) ** 0.5
    assert whole <= 5e-4, f"bf16: the sharded run is off the unsharded one by {whole:.2e} (relative)"
    want, _, _ = reference(job["bf16-none"]["global_batch"])
    off32 = sum(((unsharded[k] - want[k]).norm() ** 2).item() for k in want) ** 0.5
    assert off32 > 2 * off, "the bf16 runs are as close to fp32 training as to each other: did they run in bf16?"


def test_reduces_overlap_the_backward(job: dict[str, dict[str, Any]]) -> None:
    """The buckets of sharded segments are reduced to their owners from the backward, as unsharded ones are."""
    for name in ("zero1", "zero2", "zero2-1mb", "mixed"):
        assert all(p["layouts"][0]["early"] > 0 for p in _parts(job[name])), name


def test_sharding_a_model_that_ties_weights_is_refused() -> None:
    """A tie sums its copies' gradients before the step; a sharded owner holds its range of the sums only."""
    plan = CASES["zero1"]["plans"][0]
    check_shard(plan, ())
    check_shard(CASES["resume"]["plans"][0], (((0, "wte.weight"), (5, "head.weight")),))  # unsharded: fine
    with pytest.raises(InputError, match=r"shard=optimizer: the model ties weights .* use shard=none"):
        check_shard(plan, (((0, "wte.weight"), (5, "head.weight")),))


def test_a_stuck_owner_is_named_by_the_other_within_the_timeout(tmp_path, fork_rank, clean_env, free_port) -> None:
    """Every wait of the reduces, the weight gather and the state gather is bounded and names the owners: an owner
    that hangs (SIGSTOP) mid-training is named by the other within the timeout."""
    timeout_s = 3.0
    plan = factories.make_plan(make_cluster({"n0": 2}), mlp_digits_profile(),
                               [(["n0:0"], [0, 3], 8, 1), (["n0:1"], [0, 3], 8, 1)], shard="optimizer+gradients")
    replace(plan, shard_weights={"n0:0": 3, "n0:1": 1}).save(tmp_path / "plan.json")
    args = ["-m", "hetrain.runtime.command", "--plan", str(tmp_path / "plan.json"),
            "--model", "mlp-digits", "--data", "synthetic", "--steps", "1000000", "--no-progress",
            "--metrics-out", str(tmp_path / "metrics.jsonl"), "--timeout-s", str(timeout_s)]
    env = {**clean_env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "HETRAIN_NODE": "n0"}
    ranks = [fork_rank(args, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    deadline = time.monotonic() + 60
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # training is under way
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    stopped_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGSTOP)
    try:
        _, stderr = ranks[0].communicate(timeout=timeout_s + 20)
        assert ranks[0].returncode == 1, stderr[-3000:]
        assert time.monotonic() - stopped_at < timeout_s + 10
        assert "rank 1 (n0:1)" in stderr and "within 3 s" in stderr, stderr[-3000:]
    finally:
        os.kill(ranks[1].pid, signal.SIGCONT)

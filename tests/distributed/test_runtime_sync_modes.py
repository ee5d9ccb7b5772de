"""Sync modes on 4 Gloo ranks (two nodes of two devices): WSP, local SGD, hybrid-ps, DASO.

One job of 4 processes runs every case in turn, each with its own Trainer::

    case            plan                                              checked against
    wsp-d0          mlp-digits, two pipelines cut differently, D = 0  single-process SGD: the same weights (BSP's)
                    (each segment's server in two shards, one per node: the default placement, sharded)
    wsp-d0-dp       linreg, 4 one-stage VWs, D = 0, two shards        the bsp case's weights
    hybrid-ps-d0    the same, hybrid-ps, aggregate 1, D = 0           the bsp case's weights
    wsp-d1-slow     linreg, 4 one-stage VWs, D = 1, n1:1 slowed       no rank more than D = 1 wave ahead
                    (server on one host, round-robin; the other PS cases use the default, sharded)
    local-sgd       linreg, 4 one-stage VWs, average every 4 steps    BSP's loss on the convex problem
    hybrid-ps       linreg, all-reduce in the node, PS between nodes  BSP's loss
    daso            linreg, local every step, global every 4 steps    BSP's loss
    *-ckpt          wsp, hybrid-ps, daso: checkpoint, resume          the shards' weights, DASO's k restored
    wsp-ckpt-one    wsp sharded: checkpoint; resume on one host       the same weights, under another sharding

``linreg`` is one Linear(8 -> 1) layer under mean squared error on fixed
synthetic data: convex, so every mode should get near BSP's loss in a few dozen steps.
A second test kills a worker of a parameter-server shard and expects the shard's
host to name it instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.analytic import build_mlp_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn
from hetrain.plan import Plan
from hetrain.runtime.state.checkpoint import load_checkpoint, load_manifest
from hetrain.runtime.sync.daso import DasoRate
from hetrain.runtime.trainer import build_optimizer_fn
from hetrain.schedule import COMPUTE_KINDS, P2P_KINDS, advance_sync_state, build_schedule, initial_sync_state
from hetrain.simulator import build_schedules, simulate

WORLD = 4
NODES = "n0,n0,n1,n1"
D = ["n0:0", "n0:1", "n1:0", "n1:1"]
LINREG_STEPS = 40

WORKER = textwrap.dedent("""
    import json, sys, time, torch
    from torch import nn
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)

    def linreg_data(steps, batch):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 8, generator=g)
        y = x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8 + 0.1 * torch.randn(256, 1, generator=g)
        for s in range(steps):
            idx = torch.randperm(256, generator=torch.Generator().manual_seed(100 + s))[:batch]
            yield x[idx], y[idx]

    def linreg_layers(first, end):
        torch.manual_seed(0)
        return [nn.Linear(8, 1)]

    def deep_linreg_layers(first, end):  # the same two layers on every stage, whatever its cut
        torch.manual_seed(0)
        return [nn.Linear(8, 8), nn.Linear(8, 1)][first:end]

    for case in json.load(open(sys.argv[1])):
        plan = load_plan(case["plan"])
        if case["model"] == "linreg":
            model = ModelSource.of_layers(linreg_layers, nn.functional.mse_loss, 1)
            data = linreg_data(case["steps"], plan.global_batch)
        elif case["model"] == "deep-linreg":
            model = ModelSource.of_layers(deep_linreg_layers, nn.functional.mse_loss, 2)
            data = linreg_data(case["steps"], plan.global_batch)
        else:
            data = build_datasets("synthetic", case["model"], seed=0, synthetic_samples=256).train
            model = resolve_model(case["model"])
        ckpt = case["out"] + "/ckpt" if case.get("resume_to") else None
        def build(plan=plan):
            t = Trainer(model, plan, TrainConfig(timeout_s=60, checkpoint=CheckpointConfig(ckpt),
                                                 logging=LoggingConfig(progress=False)),
                        optimizer_fn=build_optimizer_fn("sgd", case["lr"]))
            if t.role.device == case.get("slow"):
                t.module.register_forward_hook(lambda *a: time.sleep(0.03))
            return t
        trainer = build()
        history = trainer.fit(data, case["steps"], seed=0)
        result = {"weights": trainer.state_dict(), "history": history, "stats": trainer.sync_stats,
                  "carries": sorted((f"{s}:{k}", sh.hosting) for (s, k), sh in trainer.modes.shards.items())
                  if trainer.modes is not None else []}
        def shards(trainer):  # "s:k" -> (lo, hi, the global weights of that range) of each shard the rank hosts
            return {f"{s}:{k}": (sh.lo, sh.hi, sh.weights.clone()) for (s, k), sh in trainer.modes.shards.items()
                    if sh.hosting}  # not the relays, which pass another node's sums on
        if case.get("resume_to"):  # a second Trainer resumes from the checkpoint the first wrote at its end
            result["shards"] = shards(trainer)
            trainer.close()
            trainer = build(load_plan(case["resume_plan"]) if case.get("resume_plan") else plan)
            result["resumed"] = {"step": trainer.step, "period": trainer.daso_period,
                                 "shards": shards(trainer),
                                 "base": {s: b.clone() for s, b in trainer.modes.base.items()}}
            data = linreg_data(case["resume_to"], plan.global_batch)
            result["resumed"]["history"] = trainer.fit(data, case["resume_to"], seed=0)
        torch.save(result, f"{case['out']}/rank{trainer.rank}.pt")
        trainer.close()
""")


def cluster() -> Any:
    return make_cluster({"n0": 2, "n1": 2}, name="two-nodes")


def make_plan(model: str, sync: str, vws: list[tuple[list[str], list[int], int, int]],
              **options: int | str) -> Plan:
    widths = {"mlp-digits": [64, 256, 256, 10], "deep-linreg": [8, 8, 1]}.get(model, [8, 1])
    profile = build_mlp_profile(widths, name=model)
    return factories.make_plan(cluster(), profile, vws, sync=sync, **options)


DP4 = [([d], [0, 1], 8, 1) for d in D]
PP2 = [([D[0], D[2]], [0, 1, 2], 8, 2), ([D[1], D[3]], [0, 1, 2], 8, 2)]  # two 2-stage pipelines across the nodes
CASES: dict[str, dict[str, Any]] = {
    "wsp-d0": {"plan": make_plan("mlp-digits", "wsp", [([D[0], D[1]], [0, 1, 3], 10, 2),
                                                       ([D[2], D[3]], [0, 2, 3], 6, 3)], staleness=0),
               "model": "mlp-digits", "lr": 0.2, "steps": 3},
    "wsp-d0-dp": {"plan": make_plan("linreg", "wsp", DP4, staleness=0)},
    "hybrid-ps-d0": {"plan": make_plan("linreg", "hybrid-ps", DP4, aggregate=1, staleness=0)},
    "wsp-d1-slow": {"plan": make_plan("linreg", "wsp", DP4, staleness=1, placement="round-robin"), "slow": D[3],
                    "steps": 12},
    "bsp": {"plan": make_plan("linreg", "bsp", DP4)},
    "local-sgd": {"plan": make_plan("linreg", "local-sgd", DP4, period=4)},
    "hybrid-ps": {"plan": make_plan("linreg", "hybrid-ps", DP4, aggregate=2, staleness=1)},
    "daso": {"plan": make_plan("linreg", "daso", DP4, period=4, warmup=2, cooldown=2)},
    # every segment owned by stages of two pipelines: one shard per segment, staleness D > 0
    "bsp-pp": {"plan": make_plan("deep-linreg", "bsp", PP2), "model": "deep-linreg"},
    "wsp-d1-pp": {"plan": make_plan("deep-linreg", "wsp", PP2, staleness=1), "model": "deep-linreg"},
    "wsp-d2-pp": {"plan": make_plan("deep-linreg", "wsp", PP2, staleness=2), "model": "deep-linreg"},
    # checkpoint at the end of a first run, resume it in a second Trainer
    "wsp-ckpt": {"plan": make_plan("linreg", "wsp", DP4, staleness=1), "slow": D[3], "steps": 5, "resume_to": 8},
    "hybrid-ps-ckpt": {"plan": make_plan("linreg", "hybrid-ps", DP4, aggregate=3, staleness=1), "steps": 7,
                       "resume_to": 9},
    "wsp-ckpt-one": {"plan": make_plan("linreg", "wsp", DP4, staleness=1), "steps": 5, "resume_to": 8,
                     "resume_plan": make_plan("linreg", "wsp", DP4, staleness=1, placement="local")},
    "daso-ckpt": {"plan": make_plan("linreg", "daso", DP4, period=2, warmup=1, cooldown=0), "steps": 30,
                  "resume_to": 32},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sync_modes")
    specs = {}
    for name, c in CASES.items():
        out = root / name
        out.mkdir()
        c["plan"].save(out / "plan.json")
        if "resume_plan" in c:
            c["resume_plan"].save(out / "resume_plan.json")
        specs[name] = {"plan": str(out / "plan.json"), "model": c.get("model", "linreg"), "lr": c.get("lr", 0.1),
                       "steps": c.get("steps", LINREG_STEPS), "out": str(out), "slow": c.get("slow"),
                       "resume_to": c.get("resume_to"),
                       "resume_plan": str(out / "resume_plan.json") if "resume_plan" in c else None}
    (root / "cases.json").write_text(json.dumps(list(specs.values())))
    (root / "worker.py").write_text(WORKER)
    run_worker_ranks(root, NODES, [r % 2 for r in range(WORLD)])
    return specs


def parts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [torch.load(Path(spec["out"]) / f"rank{r}.pt") for r in range(WORLD)]


def test_wsp_with_no_staleness_gives_bsp_weights(job: dict[str, Any]) -> None:
    spec = job["wsp-d0"]
    got: dict[str, torch.Tensor] = {}
    for part in parts(spec):
        for key, value in part["weights"].items():
            if key in got:  # the replicas of a layer agree: all hold the global weights
                torch.testing.assert_close(value, got[key], rtol=1e-6, atol=1e-7)
            got[key] = value
    torch.manual_seed(123)
    net = LayerRange(build_layers("mlp-digits", seed=0))
    opt = build_optimizer_fn("sgd", spec["lr"])(list(net.parameters()))
    data = build_datasets("synthetic", "mlp-digits", seed=0, synthetic_samples=256).train
    losses = []
    for x, y in iter_batches(data, 16, seed=0, steps=spec["steps"]):
        opt.zero_grad()
        loss = loss_fn("mlp-digits")(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    want = net.state_dict()
    for part in parts(spec):  # the reported loss is the global batch's mean, as under BSP
        assert [h["loss"] for h in part["history"]] == pytest.approx(losses, rel=1e-5)
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst <= 1e-5, f"worst relative error {worst:.2e}"


def test_the_wsp_and_hybrid_ps_servers_are_sharded_over_both_nodes() -> None:
    for case in ("wsp-d0", "wsp-d0-dp", "hybrid-ps-d0", "wsp-ckpt", "hybrid-ps-ckpt"):
        for seg in CASES[case]["plan"].segments():
            nodes = {x.host.split(":")[0] for x in seg.ps_shards}
            assert nodes == {"n0", "n1"} and [x.fraction for x in seg.ps_shards] == [0.5, 0.5], (case, seg)


@pytest.mark.parametrize("case", ["wsp-d0-dp", "hybrid-ps-d0"])
def test_sharded_servers_with_no_staleness_give_bsp_weights(job: dict[str, Any], case: str) -> None:
    """Four one-stage VWs over two nodes, each segment's server in a shard per node: with D = 0 (and hybrid-ps
    pushing every iteration) every rank ends each step on the weights BSP's SGD gives, step for step."""
    bsp = parts(job["bsp"])
    # per shard one host, and on the other node a relay that sums that node's two updates and crosses once
    carried = sorted(c for part in parts(job[case]) for c in part["carries"])
    assert carried == [("0:0", False), ("0:0", True), ("0:1", False), ("0:1", True)], carried
    for part, want in zip(parts(job[case]), bsp, strict=True):
        assert [h["loss"] for h in part["history"]] == pytest.approx([h["loss"] for h in want["history"]],
                                                                      rel=1e-5, abs=1e-7)
        for key, value in want["weights"].items():
            torch.testing.assert_close(part["weights"][key], value, rtol=1e-5, atol=1e-6)


def test_no_worker_runs_more_than_d_waves_ahead(job: dict[str, Any]) -> None:
    stats = [p["stats"] for p in parts(job["wsp-d1-slow"])]
    assert all(s["waves"] == 12 and s["lead_checks"] == 12 for s in stats), stats
    assert max(s["max_lead_waves"] for s in stats) <= 1, stats
    assert max(s["max_lead_waves"] for s in stats) == 1, f"no worker ran ahead of the slowed one: {stats}"


def linreg_loss(weights: dict[str, torch.Tensor]) -> float:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8 + 0.1 * torch.randn(256, 1, generator=g)
    pred = x @ weights["layers.0.weight"].T + weights["layers.0.bias"]
    return float(torch.nn.functional.mse_loss(pred, y))


@pytest.mark.parametrize("mode", ["local-sgd", "hybrid-ps", "daso"])
def test_mode_reaches_bsp_loss_on_a_convex_problem(job: dict[str, Any], mode: str) -> None:
    bsp = linreg_loss(parts(job["bsp"])[0]["weights"])
    start = linreg_loss({"layers.0.weight": torch.zeros(1, 8), "layers.0.bias": torch.zeros(1)})
    got = [linreg_loss(p["weights"]) for p in parts(job[mode])]
    assert bsp < 0.1 * start
    assert max(got) <= 1.25 * bsp + 0.005, f"{mode}: losses {got} against BSP's {bsp:.4f}"


def deep_linreg_loss(weights: dict[str, torch.Tensor]) -> float:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8 + 0.1 * torch.randn(256, 1, generator=g)
    hidden = x @ weights["layers.0.weight"].T + weights["layers.0.bias"]
    return float(torch.nn.functional.mse_loss(hidden @ weights["layers.1.weight"].T + weights["layers.1.bias"], y))


def merged(spec: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Each VW's full weights: its stages' parts put together (VW k on ranks k and k + 2 in ``PP2``)."""
    got = parts(spec)
    return [{**got[k]["weights"], **got[k + 2]["weights"]} for k in range(2)]


@pytest.mark.parametrize("case", ["wsp-d1-pp", "wsp-d2-pp"])
def test_wsp_on_pipelines_reaches_bsp_loss(job: dict[str, Any], case: str) -> None:
    """Two 2-stage pipelines, each segment's owners are stages: with D = 1 or 2 each stage still pushes its
    wave's update once and pulls the global weights, so a two-layer linear regression gets near BSP's loss."""
    bsp = [deep_linreg_loss(w) for w in merged(job["bsp-pp"])]
    torch.manual_seed(0)  # the workers' initial layers
    initial = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    start = deep_linreg_loss({f"layers.{k}": v.detach() for k, v in initial.state_dict().items()})
    got = [deep_linreg_loss(w) for w in merged(job[case])]
    assert max(bsp) < 0.1 * start, f"BSP did not learn: {bsp} from {start:.4f}"
    assert max(got) <= 1.25 * max(bsp) + 0.005, f"{case}: losses {got} against BSP's {bsp}"


FAIL_WORKER = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from hetrain.models.user import ModelSource
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from hetrain.runtime.config import LoggingConfig, TrainConfig

    torch.set_num_threads(1)
    def data():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    trainer = Trainer(ModelSource.of_layers(lambda a, b: [nn.Linear(8, 1)], nn.functional.mse_loss, 1),
                      load_plan(sys.argv[1]), TrainConfig(timeout_s=float(sys.argv[2]),
                                                          logging=LoggingConfig(progress=False)),
                      optimizer_fn=build_optimizer_fn("sgd", 0.1))
    if trainer.rank == 1:
        trainer.module.register_forward_hook(lambda m, i, o: os._exit(3) if trainer.step == 3 else None)
    trainer.fit(data(), 1000)
""")


def test_a_shard_whose_worker_disappears_names_it(tmp_path: Path, fork_rank: Any, clean_env: dict[str, str],
                                                  free_port: Any) -> None:
    plan = make_plan("linreg", "wsp", [([D[0]], [0, 1], 4, 1), ([D[1]], [0, 1], 4, 1)], staleness=0)
    plan.save(tmp_path / "plan.json")
    (tmp_path / "worker.py").write_text(FAIL_WORKER)
    port = free_port()
    env = {**clean_env, "HETRAIN_NODE": "n0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}
    timeout_s = 5.0
    ranks = [fork_rank([str(tmp_path / "worker.py"), str(tmp_path / "plan.json"), str(timeout_s)],
                   {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    started = time.monotonic()
    _, err = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode != 0
    assert time.monotonic() - started < 40
    assert "parameter-server shard 0 of segment 0" in err, err[-3000:]
    assert "n0:1" in err, err[-3000:]


@pytest.mark.parametrize("case", ["wsp-ckpt", "hybrid-ps-ckpt", "wsp-ckpt-one"])
def test_parameter_server_weights_survive_a_checkpoint(job: dict[str, Any], case: str) -> None:
    spec = job[case]
    step = CASES[case]["steps"]
    ckpt = Path(spec["out"]) / "ckpt"
    held = load_manifest(ckpt, step)["tensors"]
    names = ["ps.layers.0.weight", "ps.layers.0.bias"]
    assert all(n in held for n in names), sorted(held)
    saved, _, _ = load_checkpoint(ckpt, names, step)
    saved_flat = torch.cat([saved[n].reshape(-1) for n in names])
    results = parts(spec)

    # the shards, one per node, together hold the saved weights: each its range
    hosted = sorted((v for r in results for v in r["shards"].values()), key=lambda x: x[0])
    assert [(lo, hi) for lo, hi, _ in hosted] == [(0, 4), (4, 9)]
    for lo, hi, weights in hosted:
        torch.testing.assert_close(weights, saved_flat[lo:hi], rtol=0, atol=0)
    # resumed under the same plan, or one whose server is on one host: the shards and every owner's base
    # (what its next push is measured from) hold the saved weights
    resumed = sorted((v for r in results for v in r["resumed"]["shards"].values()), key=lambda x: x[0])
    assert [(lo, hi) for lo, hi, _ in resumed] == ([(0, 9)] if case == "wsp-ckpt-one" else [(0, 4), (4, 9)])
    for lo, hi, weights in resumed:
        torch.testing.assert_close(weights, saved_flat[lo:hi], rtol=0, atol=0)
    for r in results:
        assert r["resumed"]["step"] == step
        for weights in r["resumed"]["base"].values():
            torch.testing.assert_close(weights, saved_flat, rtol=0, atol=0)
        assert [h["step"] for h in r["resumed"]["history"]] == list(range(step + 1, CASES[case]["resume_to"] + 1))
    # a checkpoint completes every wave in flight: the saved local weights are the global ones
    local, _, _ = load_checkpoint(ckpt, ["layers.0.weight", "layers.0.bias"], step)
    torch.testing.assert_close(torch.cat([local["layers.0.weight"].reshape(-1), local["layers.0.bias"]]),
                               saved_flat, rtol=1e-6, atol=1e-7)


def test_daso_period_adapts_and_survives_a_checkpoint(job: dict[str, Any]) -> None:
    spec = job["daso-ckpt"]
    results = parts(spec)
    periods = {r["stats"]["period"] for r in results}
    assert len(periods) == 1, periods  # every rank saw the same losses and chose the same k
    assert periods != {2}, "the loss of a convex problem plateaued in 30 steps, yet k never changed"
    meta = load_manifest(Path(spec["out"]) / "ckpt", CASES["daso-ckpt"]["steps"])["meta"]
    assert meta["daso"]["period"] == periods.pop() and meta["daso"]["changes"] >= 1
    assert {r["resumed"]["period"] for r in results} == {meta["daso"]["period"]}


def test_daso_rate_halves_k_on_a_plateau_and_cycles_back() -> None:
    rate = DasoRate(8, threshold=0.01, patience=2)
    falling = [rate.observe(10.0 * 0.9 ** i) for i in range(10)]
    assert falling == [8] * 10  # the loss keeps improving by 10 % a merge: k stays
    # a plateau: the first 1.0 still improves; after two merges without a 1 % gain k halves, and the test
    # starts over; from 1, k goes back to the maximum (2 x the initial k)
    seen = [rate.observe(1.0) for _ in range(12)]
    assert seen == [8, 8, 4, 4, 4, 2, 2, 2, 1, 1, 1, 16], seen
    assert rate.changes == 4
    again = DasoRate(8)
    again.load_state_dict(json.loads(json.dumps(rate.state_dict())))
    assert again.state_dict() == rate.state_dict()
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        DasoRate(0)


def sync_tails(schedules: list[Any], device: str) -> list[list[str]]:
    """Per iteration, the sync actions of ``device`` (the actions that are neither compute nor transfers)."""
    return [[str(a) for a in s[device] if a.kind not in COMPUTE_KINDS and a.kind not in P2P_KINDS] for s in schedules]


@pytest.mark.parametrize("case", ["bsp", "wsp-d1-slow", "local-sgd", "hybrid-ps", "daso", "bsp-pp", "wsp-d1-pp"])
def test_the_trainer_runs_the_sync_actions_the_simulator_replays(job: dict[str, Any], case: str) -> None:
    """Both advance one sync state (``schedule.advance_sync_state``): per iteration, every rank's sync actions
    (what its metrics rows record) are the ones the simulator replays for its device over the same run."""
    spec, plan = job[case], CASES[case]["plan"]
    steps = spec["steps"]
    n = min(steps, 20)
    assert n == (12 if case == "wsp-d1-slow" else 20)
    replayed = build_schedules(plan, steps)  # what simulate(plan, iterations=steps) replays
    assert simulate(plan, iterations=steps).timeline.meta["iterations"] == steps
    for r, part in enumerate(parts(spec)):
        ran = [row["sync_actions"] for row in part["history"]]
        assert len(ran) == steps and ran[:n] == sync_tails(replayed, D[r])[:n], (case, D[r])
        if plan.sync != "daso":
            assert ran == sync_tails(replayed, D[r]), (case, D[r])
            continue
        # DASO adapts k to the loss, which the simulator does not know: the first 20 iterations ran the plan's
        # k, and every later one is the state machine's under the k the trainer had then
        periods = [row["daso_period"] for row in part["history"]]
        assert periods[:n] == [plan.sync_options.period] * n
        state, walked = initial_sync_state(plan), []
        for k in periods:
            state = dataclasses.replace(state, period=k)
            walked.append(build_schedule(plan, state, steps))
            state = advance_sync_state(plan, state, steps)
        assert ran == sync_tails(walked, D[r])
        tails = [" ".join(t) for t in ran]
        assert any("AVERAGE_START" in t for t in tails) and any("AVERAGE_MERGE" in t for t in tails)

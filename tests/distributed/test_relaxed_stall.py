"""A relaxed sync mode carries on through a short stall of one VW, as far as its bound allows (docs/sync.md).

Two Gloo ranks, two VWs of one device each (mlp-digits, data parallel). Rank 1's data loader stalls once,
for a few seconds, before the batch of step index ``STALL_AT`` (0-based: the iteration it has not started).
Each rank records when it started each step (when it took its batch). During the stall rank 0:

    wsp, D = 2          computes waves STALL_AT .. STALL_AT + D - 1 and starts STALL_AT + D, whose PULL needs
                        the stalled VW's wave STALL_AT: it waits there, exactly D waves ahead (HetPipe's bound)
    local-sgd, k = 4    computes until the next average (every k-th iteration) and waits in it
    any mode            a stall longer than --timeout-s stops the job with an error naming the stalled peer

After the stall both ranks finish. Under local-sgd the losses equal a run without the stall (its averages
block: a stall changes when, not what); under wsp a VW takes the newest global weights on hand, so the
numbers depend on timing, stall or not.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from worker_ranks import free_port, rank_env, start_ranks, wait_ranks

import hetrain
from factories import make_cluster, mlp_digits_profile
from hetrain.sync_layout import SyncOptions

MLP = mlp_digits_profile()
STALL_AT, STEPS = 6, 20

WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    from hetrain.data.datasets import iter_batches
    from hetrain.data.registry import build_datasets
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource, resolve_model
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    torch.set_num_threads(1)
    (case,) = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    data = build_datasets("synthetic", "mlp-digits", seed=0, synthetic_samples=256).train
    starts, stalled = [], []

    def batches():  # the global batches, from a loader that stalls once on rank 1 (and is slow on rank 0)
        for i, batch in enumerate(iter_batches(data, 16, seed=0)):
            if rank == 0 and case["stall_at"] <= i < case["stall_at"] + case["slow_steps"]:
                time.sleep(case["slow_s"])
            if rank == 1 and i == case["stall_at"] and case["stall_s"] > 0:
                stalled.append(time.time())
                time.sleep(case["stall_s"])
                stalled.append(time.time())
            starts.append(time.time())
            yield batch

    trainer = Trainer(resolve_model("mlp-digits"), load_plan(case["plan"]),
                      TrainConfig(timeout_s=case["timeout_s"], logging=LoggingConfig(progress=False, log_every=10)),
                      optimizer_fn=build_optimizer_fn("sgd", 0.1))
    error, history = None, []
    try:
        history = trainer.fit(batches(), case["steps"])
    except Exception as e:
        error = str(e)
    with open(f"{case['out']}/rank{rank}.json", "w") as f:
        json.dump({"starts": starts, "stalled": stalled, "error": error, "losses": [h["loss"] for h in history],
                   "stats": trainer.sync_stats}, f)
    sys.stdout.flush(); sys.stderr.flush()
    if error is None:  # rank 0 holds the store (torchrun's agent would): it waits until the peer is done with it
        import torch.distributed as dist
        try:
            dist.barrier()
        except Exception:
            pass
    os._exit(0 if error is None else 1)   # a job with a failed peer cannot tear down its process group cleanly
""")


def relaxed_plan(root: Path, mode: str, options: SyncOptions) -> Path:
    plan = hetrain.plan(make_cluster({"n0": 2}), MLP, 16, optimizer="sgd", strategy="dp", sync=mode,
                        sync_options=options)
    assert len(plan.virtual_workers) == 2 and plan.sync == mode, plan.summary()
    plan.save(root / f"plan-{mode}.json")
    return root / f"plan-{mode}.json"


def run_ranks(root: Path, plan: Path, stall_s: float, timeout_s: float, slow_steps: int = 0,
              slow_s: float = 0.0) -> tuple[list[int], list[dict[str, Any]]]:
    """Both ranks of the worker; their exit codes and what they recorded. Rank 1 stalls ``stall_s`` before step
    index STALL_AT; rank 0's loader takes ``slow_s`` for each of its ``slow_steps`` steps from STALL_AT."""
    out = root / f"run-{plan.stem}-{stall_s:g}-{timeout_s:g}-{slow_steps}"
    out.mkdir()
    case = {"plan": str(plan), "stall_at": STALL_AT, "stall_s": stall_s, "timeout_s": timeout_s, "steps": STEPS,
            "out": str(out), "slow_steps": slow_steps, "slow_s": slow_s}
    (out / "cases.json").write_text(json.dumps([case]))
    (out / "worker.py").write_text(WORKER)
    env = rank_env("n0", 2, free_port(), HETRAIN_DEVICE="cpu")
    ranks = start_ranks(out / "worker.py", [str(out / "cases.json")],
                        [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)], out)
    return wait_ranks(ranks, 120), [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def last_started_in_stall(parts: list[dict[str, Any]]) -> int:
    """The last step index rank 0 started before rank 1's stall ended."""
    _, end = parts[1]["stalled"]
    return max(i for i, t in enumerate(parts[0]["starts"]) if t < end)


@pytest.mark.parametrize(("mode", "options", "bound"), [
    ("wsp", SyncOptions(staleness=2), STALL_AT + 2),  # waves STALL_AT, STALL_AT + 1 done; waits in STALL_AT + 2
    ("local-sgd", SyncOptions(period=4), 7),  # up to the average at the end of iteration index 7 ((7 + 1) % 4 == 0)
])
def test_a_relaxed_mode_carries_on_up_to_its_bound_and_no_further(tmp_path, mode, options, bound) -> None:
    plan = relaxed_plan(tmp_path, mode, options)
    codes, parts = run_ranks(tmp_path, plan, stall_s=3.0, timeout_s=30.0)
    assert codes == [0, 0], [p["error"] for p in parts]
    assert last_started_in_stall(parts) == bound
    assert len(parts[0]["losses"]) == STEPS  # and on to the end once the stall is over
    if mode == "wsp":
        assert parts[0]["stats"]["max_lead_waves"] <= options.staleness
    else:  # blocking averages: the stall changes when, not what
        _, calm = run_ranks(tmp_path, plan, stall_s=0.0, timeout_s=30.0)
        assert parts[0]["losses"] == pytest.approx(calm[0]["losses"], rel=1e-6)


def test_the_timeout_counts_from_when_a_vw_must_wait_not_from_when_it_ran_ahead(tmp_path) -> None:
    """wsp, D = 4, --timeout-s 3: rank 1 stalls 4 s; rank 0 spends about 2 s on its 4 waves ahead (a slow
    loader), then waits about 2 s at its PULL: within the timeout, though its first wave ahead was pushed 4 s
    before the stalled VW answered."""
    plan = relaxed_plan(tmp_path, "wsp", SyncOptions(staleness=4))
    codes, parts = run_ranks(tmp_path, plan, stall_s=4.0, timeout_s=3.0, slow_steps=4, slow_s=0.5)
    assert codes == [0, 0], [p["error"] for p in parts]
    assert last_started_in_stall(parts) == STALL_AT + 4
    assert len(parts[0]["losses"]) == STEPS


def test_a_stall_beyond_the_timeout_stops_the_job_naming_the_stalled_peer(tmp_path) -> None:
    plan = relaxed_plan(tmp_path, "wsp", SyncOptions(staleness=2))
    codes, parts = run_ranks(tmp_path, plan, stall_s=8.0, timeout_s=2.0)
    assert codes[0] != 0
    error = parts[0]["error"]
    assert "n0:1" in error and "2 s" in error, error

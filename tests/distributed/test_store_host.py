"""The rank that serves the job's store (rank 0 without torchrun's agent store) must not leave before its peers
have read what they need from it: a process that exits takes its store with it.

Every test here makes rank 1 look at the store only every 0.5 s, as a rank starved of CPU does, and rank 0
exit the moment its call returns: before the fix, rank 1 then lost the store (seen in CI, at a job's last
checkpoint, with the ranks of a 4-rank job competing for 2 cores).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from worker_ranks import run_worker_ranks

import factories
from factories import make_cluster, mlp_digits_profile

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import hetrain.distributed.barrier as barrier
    from hetrain.data.registry import build_datasets
    from hetrain.models.user import resolve_model
    from hetrain.plan import load_plan
    from hetrain.runtime import Trainer, build_optimizer_fn
    from hetrain.runtime.config import CheckpointConfig, LoggingConfig, TrainConfig

    torch.set_num_threads(1)
    case = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    if rank == 1:  # a rank starved of CPU: it looks at the store every 0.5 s
        poll = barrier.poll
        def slow_poll(*args, **kwargs):
            time.sleep(0.5)
            return poll(*args, **kwargs)
        barrier.poll = slow_poll
    data = build_datasets("synthetic", "mlp-digits", seed=0, synthetic_samples=64).train
    trainer = Trainer(resolve_model("mlp-digits"), load_plan(case["plan"]),
                      TrainConfig(timeout_s=30, checkpoint=CheckpointConfig(case["ckpt"]),
                                  logging=LoggingConfig(progress=False)),
                      optimizer_fn=build_optimizer_fn("sgd", 0.1))
    history = trainer.fit(data, 2, seed=0)
    print(json.dumps({"rank": rank, "used": trainer.role.used, "steps": len(history)}), flush=True)
    os._exit(0)  # at once: no close, no destroy_process_group; rank 0's store goes with it
""")


def test_an_unused_rank_reads_the_end_of_training_before_the_store_host_leaves(tmp_path: Path) -> None:
    """Rank 0 trains alone and checkpoints at the end; rank 1 is unused, joining the checkpoint and waiting
    for the news that training is done, both from rank 0's store."""
    plan = factories.make_plan(make_cluster({"n0": 2}), mlp_digits_profile(), [(["n0:0"], [0, 3], 8, 1)])
    plan.save(tmp_path / "plan.json")
    (tmp_path / "case.json").write_text(json.dumps({"plan": str(tmp_path / "plan.json"),
                                                    "ckpt": str(tmp_path / "ckpt")}))
    (tmp_path / "worker.py").write_text(WORKER)
    run_worker_ranks(tmp_path, "n0", [0, 1], timeout_s=90, args=[str(tmp_path / "case.json")])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002"]

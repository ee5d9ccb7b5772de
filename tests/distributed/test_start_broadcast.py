"""Replicas start from the same weights even where the build function is not deterministic.

DistributedDataParallel broadcasts rank 0's weights at its start; hetrain builds each layer from its own
seed, so its reference models need no broadcast, but a user's build function may draw from a generator
of its own (seeded by the process id, here). Two ranks of pure data parallelism, each building layer 0
with other weights: after the Trainer is built, both hold the lowest-ranked owner's.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from worker_ranks import run_worker_ranks

from factories import make_cluster, make_plan, mlp_digits_profile, replicas

WORKER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch import nn
    from hetrain.plan import load_plan
    from hetrain.models.user import ModelSource
    from hetrain.runtime.config import TrainConfig
    from hetrain.runtime.trainer import Trainer, build_optimizer_fn

    root = Path(sys.argv[1]).parent
    rank = int(os.environ["RANK"])

    def layers_fn(first, end):
        layers = [nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)][first:end]
        with torch.no_grad():  # not from the layer's seed: another draw on every rank
            layers[0].weight.add_(torch.randn(layers[0].weight.shape,
                                              generator=torch.Generator().manual_seed(1000 + rank)))
        return layers

    trainer = Trainer(ModelSource.of_layers(layers_fn, nn.functional.cross_entropy, 3), load_plan(root / "plan.json"),
                      TrainConfig(timeout_s=30), optimizer_fn=build_optimizer_fn("sgd", 0.1))
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.module.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(everyone, flat)
    (root / f"rank{rank}.json").write_text(json.dumps({"equal": bool(torch.equal(everyone[0], everyone[1])),
                                                        "norm": float(flat.norm())}))
    trainer.close()
""")


def test_data_parallel_replicas_start_from_the_first_owners_weights(tmp_path: Path) -> None:
    make_plan(make_cluster({"n0": 2}, nic=None), mlp_digits_profile(), replicas(("n0:0", "n0:1"), 3, 8)).save(
        tmp_path / "plan.json")
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "cases.json").write_text("{}")
    run_worker_ranks(tmp_path, "n0", [0, 1], timeout_s=90)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["equal"] for r in results), results
    assert results[0]["norm"] == results[1]["norm"]

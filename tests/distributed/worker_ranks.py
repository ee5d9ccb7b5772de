"""Launch one worker script as N ranks on this host and check they all succeed.

Shared by the multi-rank runtime tests; every rank gets its own process group of
processes, killed if it outlives the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch


def run_worker_ranks(root: Path, nodes: str, local_ranks: Sequence[int], timeout_s: float = 120) -> None:
    """Run ``root/worker.py root/cases.json`` as ``len(local_ranks)`` Gloo ranks; assert every rank exits 0.

    ``nodes`` is HETRAIN_NODE: one node name, or a comma list indexed by rank.
    """
    world = len(local_ranks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HETRAIN_NODE=nodes, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, str(root / "worker.py"), str(root / "cases.json")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(local)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r, local in enumerate(local_ranks)]
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        kill_groups(procs)
    for r, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-4000:]}"


def kill_groups(procs: Sequence[subprocess.Popen]) -> None:
    """Kill the process group of every one of ``procs`` still running (each started with
    ``start_new_session=True``), and reap it."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def single_process_mlp(steps: int, lr: float, **dataset_options: object) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference of the restart tests: mlp-digits in one process, SGD at ``lr``, batches of 16 of the seeded
    synthetic data (``dataset_options`` for ``build_datasets``), as the distributed job sees them: the weights
    after ``steps`` steps and every step's loss."""
    from hetrain.data.datasets import iter_batches
    from hetrain.data.registry import build_datasets
    from hetrain.models.layers import LayerRange
    from hetrain.models.registry import build_layers, loss_fn
    from hetrain.runtime.trainer import build_optimizer_fn

    net = LayerRange(build_layers("mlp-digits", seed=0))
    opt = build_optimizer_fn("sgd", lr)(list(net.parameters()))
    data = build_datasets("synthetic", "mlp-digits", seed=0, **dataset_options).train
    losses = []
    for x, y in iter_batches(data, 16, seed=0, steps=steps):
        opt.zero_grad()
        loss = loss_fn("mlp-digits")(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(net.state_dict()), losses

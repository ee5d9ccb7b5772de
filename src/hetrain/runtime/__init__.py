"""The runtime: run a Plan with torch.distributed under torchrun.

- ``roles``: which device (and so which stage) each rank drives.
- ``p2p``: activations and gradients between neighbouring stages.
- ``sync``: each segment's gradients all-reduced among its owners.
- ``executor``: one rank's Actions of an iteration, as ``hetrain.schedule`` generates them.
- ``metrics``: the measured Timeline, JSONL metrics, TensorBoard, progress bar.
- ``checkpoint``: atomic per-layer checkpoints with global names, loadable under any plan.
- ``job``: a rank's start-up: join, roles, the job's process groups in one order, its stage.
- ``batches``: global batches and this VW's micro-batches of them.
- ``losses``: the steps' losses summed over the used ranks, in batches, asynchronously.
- ``stage_state``: a stage's share of a checkpoint, and its resume.
- ``lr_schedule``: the learning rate of each step (warm-up, constant / cosine / linear decay); no torch.
- ``clip``: gradient clipping by the global norm over the whole model, at STEP (bsp).
- ``tied``: tied weights' copies on several layers, their gradients summed at STEP.
- ``idle``: ranks the plan leaves unused: they join checkpoint writes only.
- ``host_memory``: glibc's malloc kept from returning freed host memory to the kernel between steps.
- ``trainer``: ``Trainer(...).fit(data, steps)``: any model given as a list of layers.
- ``command``: ``run_train_command`` (``hetrain train``; ``python -m hetrain.runtime.command``).

Device choice, heartbeats, the job store and every wait with a timeout are ``hetrain.distributed``'s.

Importing this package imports no torch; the names below load their module on first use.

Example:
    >>> from hetrain.runtime import Trainer, build_optimizer_fn     # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trainer": "trainer", "build_optimizer_fn": "trainer", "init_distributed": "job",
    "run_train_command": "command", "add_train_arguments": "command", "run_from_args": "command",
    "PeerError": "p2p", "RoleError": "roles", "Role": "roles", "build_roles": "roles", "match_hosts": "roles",
    "StageModule": "executor", "Executor": "executor", "merge_timeline": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrain.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrain.runtime.{_EXPORTS[name]}"), name)

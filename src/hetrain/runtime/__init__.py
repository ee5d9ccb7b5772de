"""The runtime: run a Plan with torch.distributed under torchrun.

- ``trainer``: ``Trainer(...).fit(data, steps)``: the step loop (``_step`` returns a ``StepRecord``,
  ``_after_step`` logs, checkpoints, evaluates and watches for drift), any model given as a list of layers.
- ``command``: the ``train`` command (``hetrain train``; ``python -m hetrain.runtime.command``).
- ``step/``: one step on one rank: ``executor`` (the Actions), ``actions`` (which Actions each iteration runs),
  ``p2p``, ``batches``, ``losses``, ``hooks`` (the pre-step hooks in their order: ``tied``, ``loss_scale``,
  ``clip``), ``record`` (``StepRecord``, what a step produced), ``lr_schedule``, ``evaluate``.
- ``sync/``: data parallelism across VWs: ``allreduce`` (segments' gradients), ``modes`` (the relaxed modes),
  ``daso`` (DASO's adaptive period).
- ``state/``: ``checkpoint``, ``resume`` (the newest intact checkpoint, the same on every rank), ``stage_state``
  (a stage's share and its resume), ``export``.
- ``lifecycle/``: ``job`` (start-up), ``roles``, ``restart`` (a changed world), ``drift_watch``, ``idle``,
  ``host_memory``.
- ``report/``: ``metrics`` (Timeline, JSONL, TensorBoard, progress bar).

Device choice, heartbeats, the job store and every wait with a timeout are ``hetrain.distributed``'s.

Importing this package imports no torch; the names below load their module on first use.

Example:
    >>> from hetrain.runtime import Trainer, build_optimizer_fn     # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trainer": "trainer", "build_optimizer_fn": "trainer", "init_distributed": "lifecycle.job",
    "run_train": "command", "TrainConfig": "config",
    "PeerError": "step.p2p", "RoleError": "lifecycle.roles", "Role": "lifecycle.roles",
    "build_roles": "lifecycle.roles", "match_hosts": "lifecycle.roles",
    "StageModule": "step.executor", "Executor": "step.executor", "merge_timeline": "report.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrain.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrain.runtime.{_EXPORTS[name]}"), name)

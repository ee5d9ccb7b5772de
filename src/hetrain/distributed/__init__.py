"""Coordination of a job's ranks under torchrun: one way to wait, to meet, and to name a peer.

- ``device``: which device and backend a rank takes (``HETRAIN_DEVICE``).
- ``work``: ``wait_work``, the one wait for a torch.distributed operation, with a
  timeout and an error (``WaitError``, a ``PeerError``) that names the peers.
- ``store``: ``JobStore``, keys of this torchrun attempt only; errors ranks post by rank.
- ``barrier``: ``Barrier``, that names the ranks that did not arrive or went silent.
- ``health``: heartbeats and ``Health``, so that a failed wait says what every peer was doing.

The runtime, checkpoints and discovery (``hetrain discover``) coordinate through
this package; it imports neither of them. Every wait has a timeout and names the
peer it waited for (DESIGN.md decision 9).

Importing this package imports no torch; the names below load their module on first use.

Example:
    >>> from hetrain.distributed import wait_work                  # doctest: +SKIP
    >>> wait_work(dist.all_reduce(x, async_op=True), "the loss all-reduce", [0, 1], 30.0)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeviceError": "device", "choose_device": "device",
    "PeerError": "work", "WaitError": "work", "wait_work": "work", "completed_within": "work",
    "JobStore": "store", "StoreError": "store", "attempt_store": "store",
    "Barrier": "barrier", "BarrierError": "barrier",
    "Health": "health", "Heartbeat": "health",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetrain.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetrain.distributed.{_EXPORTS[name]}"), name)

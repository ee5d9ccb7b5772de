"""Validation loss during training: a forward-only pass of held-out batches through the first VW's pipeline.

Every VW holds the whole model (cut into its stages), so one VW suffices; the
first (VW 0) evaluates. Under ``bsp`` every VW holds the same weights; under the
other sync modes the VWs' replicas drift apart between syncs, and the figure is
VW 0's current weights (docs/sync.md, "Validation loss")::

    VW 0   stage 0: x ─ forward ─► send ─► stage 1: recv ─ forward ─► ... ─► last stage: loss of each batch
    every used rank: one all-reduce of the mean loss (VW 0's last stage adds it; the others add 0)

The batches are the same at every evaluation (``hetrain.data.datasets.eval_batches``:
evenly spaced samples of the validation set), so successive figures compare the
weights, not the samples. Activations travel as pickled objects (any tensor or
tuple of tensors a stage returns) over the group of the used ranks, whose
timeout bounds every wait; a failure names the peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain import amp
from hetrain.distributed.health import Health
from hetrain.runtime.lifecycle.roles import Role

Batch = tuple[Any, Any]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def evaluate_stage(role: Role, module: nn.Module | None, loss_fn: Callable[[Any, Any], torch.Tensor],
                   batches: Sequence[Batch], group: Any, health: Health, device: torch.device,
                   timeout_s: float, precision: str = "fp32") -> float | None:
    """This rank's part of one evaluation: forward-only, under ``torch.no_grad`` and ``module.eval()``,
    in the plan's ``precision`` (autocast, as training's forward: ``hetrain.amp``).

    Returns the mean loss over ``batches`` on VW 0's last stage, None on every other
    rank (ranks of other VWs do nothing here).

    Raises:
        PeerError: an activation was not received or sent within the group's timeout.
    """
    if role.vw != 0 or module is None:
        return None
    was_training = module.training
    module.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        with torch.no_grad(), amp.autocast(device, precision):
            for b, (x, y) in enumerate(batches):
                if role.is_first:
                    h = module(_to(x, device))
                else:
                    assert role.prev_rank is not None
                    box: list[Any] = [None]
                    try:
                        dist.recv_object_list(box, src=role.prev_rank, group=group)
                    except RuntimeError as e:
                        raise health.peer_error(f"validation batch {b}: no activations from "
                                                f"{health.name(role.prev_rank)} within {timeout_s:g} s",
                                                [role.prev_rank], e) from None
                    h = module(_to(box[0], device))
                if role.is_last:
                    total += float(loss_fn(h, _to(y, device)))
                else:
                    assert role.next_rank is not None
                    try:
                        dist.send_object_list([_to(h, torch.device("cpu"))], dst=role.next_rank, group=group)
                    except RuntimeError as e:
                        raise health.peer_error(f"validation batch {b}: sending activations to "
                                                f"{health.name(role.next_rank)} failed or timed out "
                                                f"({timeout_s:g} s)", [role.next_rank], e) from None
    finally:
        module.train(was_training)
    return float(total) / len(batches) if role.is_last else None

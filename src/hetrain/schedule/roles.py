"""Where each device sits in the plan, as the validator sees it, and what tells two actions apart."""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.plan import Plan
from hetrain.schedule.actions import Action, BucketSync, Compute, SegmentSync, Transfer


@dataclass(frozen=True)
class StageRole:
    """Where a device sits in the plan, as the schedule sees it: VW ``vw``, stage ``j`` of ``p``, ``m``
    micro-batches, its neighbours in the pipeline (the runtime's ``Role`` is a rank's part of the plan)."""

    vw: int
    j: int
    p: int
    m: int
    prev: str | None
    next: str | None
    vw_devices: tuple[str, ...]


def device_roles(plan: Plan) -> dict[str, StageRole]:
    """Every device of ``plan`` -> its StageRole."""
    out = {}
    for v, vw in enumerate(plan.virtual_workers):
        devs = tuple(vw.devices)
        p = len(devs)
        for j, dev in enumerate(devs):
            out[dev] = StageRole(v, j, p, vw.micro_batches, devs[j - 1] if j > 0 else None,
                                  devs[j + 1] if j < p - 1 else None, devs)
    return out


def action_ident(a: Action) -> object:
    """What tells two actions of one kind on one device apart: the micro-batch, the segment, or (segment, bucket)."""
    if isinstance(a, (Compute, Transfer)):
        return a.micro_batch
    if isinstance(a, SegmentSync):
        return a.segment
    if isinstance(a, BucketSync):
        return (a.segment, a.bucket)
    return None

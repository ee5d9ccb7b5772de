"""Synchronous data parallelism across VWs: each segment's gradients all-reduced among its owners.

``Plan.segments()`` cuts the layers where the set of devices holding them
changes; segment ``s`` is reduced among exactly its owners, so VWs may
partition the model differently::

    VW0   n0:0 [0..2)        n0:1 [2..6)
    VW1   n0:2 [0..4)                   n0:3 [4..6)
    seg   0: [0..2) {n0:0, n0:2}   1: [2..4) {n0:1, n0:2}   2: [4..6) {n0:1, n0:3}

One process group per distinct owner set, created in segment order on every
rank (``new_group`` is collective over the whole job). A rank's gradients live
in one flat buffer per (segment, dtype) that the parameters' ``.grad`` are views
of, so an all-reduce needs no copy. The losses are scaled by samples / global
batch, so the SUM over owners is the global batch's mean gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.plan import Plan
from hetrain.runtime.health import Health


def build_segment_groups(plan: Plan, rank_of: Mapping[str, int], timeout_s: float) -> dict[tuple[str, ...], Any]:
    """A process group per owner set of more than one device, for the owner sets this rank is in.

    Must run on every rank of the job, in the same order (it does: segment order).
    """
    me = dist.get_rank()
    groups: dict[tuple[str, ...], Any] = {}
    made: set[tuple[str, ...]] = set()
    for seg in plan.segments():
        if len(seg.owners) < 2 or seg.owners in made:
            continue
        made.add(seg.owners)
        ranks = sorted(rank_of[d] for d in seg.owners)
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        if me in ranks:
            groups[seg.owners] = group
    return groups


class GradientSync:
    """Flat gradient buffers of one stage, per segment, and their all-reduce among the segment's owners.

    Args:
        plan: the plan.
        layers: this stage's layers by global index.
        groups: from ``build_segment_groups``.
        rank_of: device -> rank (for messages).
        health: names peers in errors.
        timeout_s: the longest one all-reduce may take.
    """

    def __init__(self, plan: Plan, layers: Mapping[int, nn.Module], groups: Mapping[tuple[str, ...], Any],
                 rank_of: Mapping[str, int], health: Health, timeout_s: float) -> None:
        self.health = health
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.segments = plan.segments()
        self.rank_of = dict(rank_of)
        self.groups = dict(groups)
        # segment index -> [(flat buffer, [(param, its .grad: a view of the buffer)])], one entry per dtype
        self.buffers: dict[int, list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]]] = {}
        for s, seg in enumerate(self.segments):
            params = [p for k in range(seg.first_layer, seg.end_layer) if k in layers
                      for p in layers[k].parameters() if p.requires_grad]
            if not any(k in layers for k in range(seg.first_layer, seg.end_layer)):
                continue
            by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            entries = []
            for (dtype, device), ps in by_dtype.items():
                flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
                placed, offset = [], 0
                for p in ps:
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
                    placed.append((p, p.grad))
                    offset += p.numel()
                entries.append((flat, placed))
            self.buffers[s] = entries

    def zero(self) -> None:
        """Zero every gradient of the stage (in place: ``.grad`` stay views of the buffers)."""
        for entries in self.buffers.values():
            for flat, placed in entries:
                flat.zero_()
                self._repoint(placed, keep_value=False)

    @staticmethod
    def _repoint(placed: Sequence[tuple[nn.Parameter, torch.Tensor]], keep_value: bool = True) -> None:
        """Make every ``.grad`` its view of the flat buffer again where something replaced it (copying its value).

        Autograd accumulates into an existing ``.grad`` in place, so this finds nothing to do
        unless other code (an optimizer's ``zero_grad(set_to_none=True)``, say) replaced one.
        """
        for p, view in placed:
            g = p.grad
            if g is not view:
                if g is not None and keep_value:
                    view.copy_(g)
                p.grad = view

    def allreduce(self, s: int, what: object) -> None:
        """SUM-all-reduce segment ``s``'s gradients among its owners; waits, at most ``timeout_s``."""
        seg = self.segments[s]
        group = self.groups[seg.owners]
        works = []
        for flat, placed in self.buffers.get(s, []):
            self._repoint(placed)
            works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
        peers = sorted(self.rank_of[d] for d in seg.owners)
        for w in works:
            try:
                done = w.wait(timeout=self.timeout)
            except RuntimeError as e:
                raise self.health.peer_error(self._failure(s, what, e), peers, e) from None
            if done is False:
                raise self.health.peer_error(self._failure(s, what, None), peers)

    def _failure(self, s: int, what: object, e: BaseException | None) -> str:
        owners = ", ".join(self.health.name(self.rank_of[d]) for d in self.segments[s].owners)
        text = str(e).lower() if e is not None else "timed out"
        if "timed out" in text or "timeout" in text:
            return f"{what} among {owners} did not finish within {self.timeout_s:g} s"
        return f"{what} among {owners} failed: a peer failed or closed its connection"

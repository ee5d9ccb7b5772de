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

Where the cost model (``cost.estimate_allreduce`` on the segment's gradient
bytes, as the simulator costs it) picks ``"hierarchical"`` for an owner set, the
all-reduce runs in three phases instead of one flat all-reduce: ``reduce`` (SUM)
to a leader per node (its lowest-ranked owner), ``all_reduce`` among the
leaders, ``broadcast`` from each leader to its node. Each NIC then carries one
node's buffer between nodes, not one per owner on the node. Gloo has no
reduce-scatter, so the intra-node phases are a reduce and a broadcast of the
whole buffer rather than the cost model's reduce-scatter and all-gather; the
bytes each NIC moves between nodes are the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.cost import allreduce_shape, estimate_allreduce
from hetrain.plan import Plan, Segment
from hetrain.runtime.health import Health


@dataclass(frozen=True)
class Hierarchy:
    """This rank's part in the hierarchical all-reduce of one owner set.

    Attributes:
        leader: the global rank of this rank's node leader (its node's lowest-ranked owner).
        node_ranks: the owners on this rank's node (global ranks, sorted).
        node_group: the group of ``node_ranks`` (None when this rank is alone on its node).
        leaders: every node's leader (global ranks, sorted).
        leaders_group: the group of ``leaders`` (None unless this rank is a leader).
    """

    leader: int
    node_ranks: tuple[int, ...]
    node_group: Any
    leaders: tuple[int, ...]
    leaders_group: Any


class SegmentGroups(dict[tuple[str, ...], Any]):
    """Owner set -> its flat process group; ``hierarchical``: owner set -> ``Hierarchy``.

    ``hierarchical`` holds only the owner sets the cost model all-reduces hierarchically.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hierarchical: dict[tuple[str, ...], Hierarchy] = {}


def segment_algorithm(plan: Plan, seg: Segment) -> str:
    """``"ring"`` or ``"hierarchical"``: what the cost model (and the simulator) picks for the segment's all-reduce."""
    index = {d.name: d.index for d in plan.cluster.devices}
    return estimate_allreduce(seg.param_bytes, allreduce_shape(plan.cluster, [index[o] for o in seg.owners]))[1]


def build_segment_groups(plan: Plan, rank_of: Mapping[str, int], timeout_s: float) -> SegmentGroups:
    """A process group per owner set of more than one device, for the owner sets this rank is in.

    Where the cost model picks the hierarchical all-reduce for an owner set, also a
    group per node holding more than one of its owners (in the cluster's node
    order) and one of the node leaders, right after the owner set's own group.
    Must run on every rank of the job, in the same order (it does: segment order).
    """
    me = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    node_of = {d.name: d.node for d in plan.cluster.devices}
    node_order = {n.name: k for k, n in enumerate(plan.cluster.nodes)}
    groups = SegmentGroups()
    made: set[tuple[str, ...]] = set()
    for seg in plan.segments():
        if len(seg.owners) < 2 or seg.owners in made:
            continue
        made.add(seg.owners)
        ranks = sorted(rank_of[d] for d in seg.owners)
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            groups[seg.owners] = group
        if segment_algorithm(plan, seg) != "hierarchical":
            continue
        by_node: dict[str, list[int]] = {}
        for d in seg.owners:
            by_node.setdefault(node_of[d], []).append(rank_of[d])
        nodes = sorted(by_node, key=lambda n: node_order[n])
        mine: Hierarchy | None = None
        node_groups: dict[str, Any] = {}
        for n in nodes:
            members = sorted(by_node[n])
            if len(members) > 1:
                node_groups[n] = dist.new_group(members, timeout=timeout)
        leaders = tuple(sorted(min(by_node[n]) for n in nodes))
        leaders_group = dist.new_group(list(leaders), timeout=timeout)
        for n in nodes:
            members = sorted(by_node[n])
            if me in members:
                mine = Hierarchy(members[0], tuple(members), node_groups.get(n),
                                 leaders, leaders_group if me == members[0] else None)
        if mine is not None:
            groups.hierarchical[seg.owners] = mine
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
        # owner set -> this rank's part in its hierarchical all-reduce, where the cost model picks that
        self.hierarchical: dict[tuple[str, ...], Hierarchy] = dict(getattr(groups, "hierarchical", {}))
        self.calls = {"ring": 0, "hierarchical": 0}  # all-reduces run, by algorithm
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
        """SUM-all-reduce segment ``s``'s gradients among its owners; waits, at most ``timeout_s``.

        Hierarchical (reduce to node leaders, all-reduce among them, broadcast) where
        ``build_segment_groups`` made groups for it, else one flat all-reduce.
        """
        seg = self.segments[s]
        flats = []
        for flat, placed in self.buffers.get(s, []):
            self._repoint(placed)
            flats.append(flat)
        peers = sorted(self.rank_of[d] for d in seg.owners)
        h = self.hierarchical.get(seg.owners)
        if h is None:
            group = self.groups[seg.owners]
            self._wait_all([dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats],
                           s, what, peers)
            self.calls["ring"] += 1
            return
        if h.node_group is not None:
            self._wait_all([dist.reduce(f, dst=h.leader, op=dist.ReduceOp.SUM, group=h.node_group, async_op=True)
                            for f in flats], s, what, list(h.node_ranks))
        if h.leaders_group is not None:
            self._wait_all([dist.all_reduce(f, op=dist.ReduceOp.SUM, group=h.leaders_group, async_op=True)
                            for f in flats], s, what, list(h.leaders))
        if h.node_group is not None:
            self._wait_all([dist.broadcast(f, src=h.leader, group=h.node_group, async_op=True) for f in flats],
                           s, what, list(h.node_ranks))
        self.calls["hierarchical"] += 1

    def _wait_all(self, works: Sequence[Any], s: int, what: object, peers: Sequence[int]) -> None:
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

"""Link resources: what each transfer and each all-reduce phase occupies, and for how long.

Resources are named and numbered on first use::

    same node:    n0:0 ──(resource "n0:0->n0:1")──► n0:1        one per ordered pair
    across nodes: a:0 ──► ("a NIC out") ═══ network ═══ ("b NIC in") ──► b:1

A resource carries one transfer at a time, in the order transfers ask for it
(FIFO; ``occupy``). All transfers leaving one node share its NIC out, all
entering it share its NIC in (full duplex). A parameter-server phase runs in
the background: the phases queue among themselves (``occupy_each`` on
``shared_until``), and a transfer or an all-reduce that meets one shares the
link with it, half each (``share``), rather than waiting for its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hetrain.cluster import Cluster
from hetrain.cost import (
    LinkKey,
    allreduce_shape,
    estimate_allreduce,
    estimate_hierarchical_allreduce_time,
    estimate_ps_loads,
    estimate_ring_allreduce_time,
)
from hetrain.timeline import Event


class Phase(NamedTuple):
    """One phase of a collective: it holds ``links`` for ``duration_s``; ``name`` says which phase, ``kind`` what
    the links' timeline rows call it."""

    duration_s: float
    links: tuple[int, ...]
    name: str
    kind: str = "allreduce"
    holds_s: tuple[float, ...] | None = None  # per link, how long the phase holds it (None: ``duration_s`` each)


class LinkResources:
    """Named link resources, each free from ``free_at[r]``; FIFO in the order of requests.

    ``events[r]`` collects what resource ``r`` carried (the timeline's link rows).
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.free_at: list[float] = []
        self.events: list[list[Event]] = []
        # (algorithm, ring order) -> the resources of each phase (``allreduce_phases``): a segment's buckets share them
        self.phase_links: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], ...]] = {}

    def id(self, name: str) -> int:
        """The number of resource ``name``, added (free from t = 0) on first use."""
        r = self.ids.get(name)
        if r is None:
            r = self.ids[name] = len(self.names)
            self.names.append(name)
            self.free_at.append(0.0)
            self.events.append([])
        return r


def occupy(free_at: list[float], links: Sequence[int], t: float, duration_s: float) -> tuple[float, float]:
    """Reserve resources ``links`` for ``duration_s`` from the first moment at or after ``t``
    when all are free (one transfer per direction at a time); returns (start, end)."""
    start = t
    for r in links:
        if free_at[r] > start:
            start = free_at[r]
    end = start + duration_s
    for r in links:
        free_at[r] = end
    return start, end


def occupy_each(free_at: list[float], links: Sequence[int], t: float,
                holds_s: Sequence[float]) -> list[tuple[float, float]]:
    """Reserve each of ``links`` for its own ``holds_s[i]``, from the first moment at or after ``t`` when that
    link is free; returns each link's (start, end).

    A parameter-server phase is many collectives posted at once, each moving its bytes as soon as the
    resources it crosses let it: a NIC whose other direction, or whose own queue, is still busy with an
    earlier wave delays only its own part of the phase, not the parts on free links. Waiting for every link
    to be free at once would serialise a wave's pushes behind the previous wave's pulls on the host's NIC
    (they share the node's NIC out and in, in opposite shares), which the runtime, whose reduces and
    broadcasts run in their own threads and groups on a full-duplex NIC, does not do: on cloud-mixed under
    wsp that put the replay at 1.6x the closed form (benchmarks/closed_form_modes.py)."""
    spans = []
    for r, hold_s in zip(links, holds_s, strict=True):
        start = max(t, free_at[r])
        free_at[r] = start + hold_s
        spans.append((start, start + hold_s))
    return spans


def share(shared_until: list[float], links: Sequence[int], start: float, duration_s: float) -> tuple[float, list[int]]:
    """A transfer of ``duration_s`` from ``start`` on ``links``, some of which a parameter-server phase holds in
    the background until ``shared_until[r]``: while both run, each gets half the link (TCP's fair share, as
    the runtime's p2p and its shards' collectives, in groups and threads of their own, get on one NIC), so the
    transfer takes ``min(duration, left)`` longer and so does the phase on that link. Returns the transfer's
    end and the links whose phase it delayed (their ``shared_until`` moved on).

        link r:  phase ████████████░░░░         left = shared_until[r] - start
                 transfer     ▒▒▒▒▒▒            both at half rate: each later by min(duration, left)
    """
    longer_s, delayed = 0.0, []
    for r in links:
        left = shared_until[r] - start
        if left > 0:
            both = duration_s if duration_s < left else left
            shared_until[r] += both
            delayed.append(r)
            longer_s = max(longer_s, both)
    return start + duration_s + longer_s, delayed


def edge_links(cluster: Cluster, a: int, b: int, res: LinkResources) -> tuple[int, ...]:
    """The resources a transfer from device index ``a`` to ``b`` occupies."""
    da, db = cluster.devices[a], cluster.devices[b]
    if da.node == db.node:
        return (res.id(f"{da.name}->{db.name}"),)
    return (res.id(f"{da.node} NIC out"), res.id(f"{db.node} NIC in"))


def ring_links(cluster: Cluster, order: Sequence[int], res: LinkResources) -> tuple[int, ...]:
    """The resources of a ring over device indices ``order`` (each once, in ring order)."""
    if len(order) < 2:
        return ()
    ids = [r for k in range(len(order)) for r in edge_links(cluster, order[k], order[(k + 1) % len(order)], res)]
    return tuple(dict.fromkeys(ids))


def allreduce_phases(cluster: Cluster, owners: Sequence[int], num_bytes: float,
                     res: LinkResources, algorithm: str) -> list[Phase]:
    """Each phase of one all-reduce of ``num_bytes`` among device indices ``owners`` by ``algorithm`` (the
    plan's ``"ring"`` or ``"hierarchical"``); the phases' seconds add up to ``estimate_allreduce``'s.

    A flat ring runs as reduce-scatter then all-gather over its ring's links; the
    hierarchical scheme as intra-node reduce-scatter, inter-node all-reduce over
    the NICs, intra-node all-gather.
    """
    shape = allreduce_shape(cluster, owners)
    total, algorithm = estimate_allreduce(num_bytes, shape, algorithm)
    if total <= 0:
        return []
    links = res.phase_links.get((algorithm, shape.order))
    if links is None:  # numbered on first use, as each transfer's; later all-reduces of the same ring look them up
        links = res.phase_links[(algorithm, shape.order)] = _phase_links(cluster, shape.order, res, algorithm)
    if algorithm == "ring":
        ring = links[0]
        return [Phase(total / 2, ring, "reduce-scatter"), Phase(total / 2, ring, "all-gather")]
    # hierarchical: 2 * intra + inter (estimate_hierarchical_allreduce_time)
    inter = estimate_ring_allreduce_time(num_bytes, shape.nodes, shape.inter_bandwidth_bytes_per_s,
                                         shape.inter_latency_s)
    intra = (estimate_hierarchical_allreduce_time(num_bytes, shape) - inter) / 2
    intra_ids, nic_ids = links
    return [Phase(intra, intra_ids, "intra-node reduce-scatter"), Phase(inter, nic_ids, "inter-node all-reduce"),
            Phase(intra, intra_ids, "intra-node all-gather")]


def _phase_links(cluster: Cluster, order: Sequence[int], res: LinkResources,
                 algorithm: str) -> tuple[tuple[int, ...], ...]:
    """The resources of an all-reduce over the ring ``order``: (the ring's) for ``"ring"``; (every node's
    own ring's, every node's NIC out and in) for ``"hierarchical"``."""
    if algorithm == "ring":
        return (ring_links(cluster, order, res),)
    by_node: dict[str, list[int]] = {}
    for d in order:
        by_node.setdefault(cluster.devices[d].node, []).append(d)
    intra_ids = tuple(r for members in by_node.values() for r in ring_links(cluster, members, res))
    nic_ids = tuple(r for node in by_node for r in (res.id(f"{node} NIC out"), res.id(f"{node} NIC in")))
    return intra_ids, nic_ids


def ps_phases(cluster: Cluster, owners: Sequence[int], shards: Sequence[tuple[int, float]], num_bytes: float,
              res: LinkResources) -> list[Phase]:
    """One wave of a segment's parameter-server exchange (``cost.estimate_ps_loads``) as two phases: the
    owners' pushes to the shards, then the shards' weights back, each holding every resource it loads for the
    busiest one's seconds. The replay's transfers are one at a time per resource, in the order asked for; the
    pushes of many owners to many shards go at once (the runtime posts them together and the network shares
    its NICs among them), so they are one phase rather than a queue of transfers. Each resource is held for its
    own load only, so that a fast intra-node link is not held as long as the busiest NIC."""
    push, pull = estimate_ps_loads(cluster, owners, shards, num_bytes)
    return [Phase(max(load.values()), tuple(res.id(_resource_name(cluster, key)) for key in load), name, name,
                  tuple(load.values())) for load, name in ((push, "push"), (pull, "pull")) if load]


def _resource_name(cluster: Cluster, key: LinkKey) -> str:
    """The resource name of a ``cost.LinkKey`` (``edge_links``' names)."""
    if key[0] == "pair":
        return f"{cluster.devices[int(key[1])].name}->{cluster.devices[int(key[2])].name}"
    return f"{key[1]} NIC {key[0]}"

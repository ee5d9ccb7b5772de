"""Cost of synchronous data parallelism across VWs that partition the model differently.

Layers are grouped into segments with the same owner devices; each segment's
gradients are all-reduced among exactly its owners. Segments with disjoint
owners run at once; a device runs its segments one after another, so the
closed form is the largest per-device sum (the simulator adds link contention
and overlap with backward)::

    VW0: d0 [0..4)  d1 [4..8)        segment [0..3) owners {d0, d2}
    VW1: d2 [0..3)  d3 [3..8)        segment [3..4) owners {d0, d3}
                                     segment [4..8) owners {d1, d3}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hetrain.cluster import Cluster
from hetrain.cost import estimate_allreduce_time, estimate_p2p_time
from hetrain.profile import ModelProfile

Layout = Sequence[tuple[int, int, int]]  # (device index, first layer, end layer) per stage


def build_segments(num_layers: int, layouts: Sequence[Layout]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first, end, owner device indices) for runs of layers with the same owners."""
    owners: list[list[int]] = [[] for _ in range(num_layers)]
    for layout in layouts:
        for d, k, l in layout:
            for i in range(k, l):
                owners[i].append(d)
    keys = [tuple(sorted(o)) for o in owners]
    out = []
    start = 0
    for i in range(1, num_layers + 1):
        if i == num_layers or keys[i] != keys[start]:
            out.append((start, i, keys[start]))
            start = i
    return out


def estimate_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout]) -> float:
    """Seconds of BSP gradient all-reduce: the busiest device's sum over its segments."""
    per_device: dict[int, float] = {}
    for first, end, owners in build_segments(profile.num_layers, layouts):
        if len(owners) < 2:
            continue
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        t = estimate_allreduce_time(cluster, owners, num_bytes)
        for d in owners:
            per_device[d] = per_device.get(d, 0.0) + t
    return max(per_device.values(), default=0.0)


def estimate_local_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout]) -> float:
    """Seconds of the node-local gradient all-reduce of ``hybrid-ps`` and ``daso``: each segment among its
    owners on one node; the busiest device's sum."""
    per_device: dict[int, float] = {}
    for first, end, owners in build_segments(profile.num_layers, layouts):
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        by_node: dict[str, list[int]] = {}
        for d in owners:
            by_node.setdefault(cluster.devices[d].node, []).append(d)
        for members in by_node.values():
            if len(members) > 1:
                t = estimate_allreduce_time(cluster, members, num_bytes)
                for d in members:
                    per_device[d] = per_device.get(d, 0.0) + t
    return max(per_device.values(), default=0.0)


def estimate_ps_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout]) -> float:
    """Seconds one wave's pushes and pulls keep the busiest parameter-server host's links busy.

    Segment s's shard is on owner ``owners[s % len(owners)]`` (``schedule.ps_host``); every
    other owner pushes the segment's bytes to it and pulls them back: ``2 (latency + bytes / bandwidth)``
    each, one after another on the host's link.
    """
    per_host: dict[int, float] = {}
    for s, (first, end, owners) in enumerate(build_segments(profile.num_layers, layouts)):
        if len(owners) < 2:
            continue
        host = owners[s % len(owners)]
        num_bytes = sum(profile.layers[i].param_bytes for i in range(first, end))
        t = sum(2 * estimate_p2p_time(num_bytes, cluster.link(d, host)) for d in owners if d != host)
        per_host[host] = per_host.get(host, 0.0) + t
    return max(per_host.values(), default=0.0)


def estimate_mode_sync_time(cluster: Cluster, profile: ModelProfile, layouts: Sequence[Layout], mode: str,
                            options: Mapping[str, Any], compute_s: float) -> float:
    """Seconds of synchronisation per iteration under sync mode ``mode`` (closed forms; docs/sync.md).

    ``compute_s`` is the iteration's pipeline and optimizer time, what asynchronous traffic can hide behind.
    With ``S`` the BSP all-reduce, ``L`` the node-local all-reduce, ``P`` one wave's push and pull traffic::

        bsp        S
        local-sgd  S / k                              (parameters averaged every k iterations, blocking)
        daso       L + max(0, S - (k - 1) compute) / k   (global average every k, hidden behind k - 1 iterations)
        hybrid-ps  L + max(0, P - D compute) / a      (one push per a iterations, D waves of slack)
        wsp        max(0, P - D compute)              (one push per wave, D waves of slack)

    Warm-up and cool-down iterations of DASO (blocking) are not counted: they are a fixed cost per run.
    """
    k = int(options.get("period", 4))
    a = int(options.get("aggregate", 4))
    stale = int(options.get("staleness", 1))
    if mode == "bsp":
        return estimate_sync_time(cluster, profile, layouts)
    if mode == "local-sgd":
        return estimate_sync_time(cluster, profile, layouts) / k
    if mode == "daso":
        glob = estimate_sync_time(cluster, profile, layouts)
        return estimate_local_sync_time(cluster, profile, layouts) + max(0.0, glob - (k - 1) * compute_s) / k
    if mode == "hybrid-ps":
        ps = estimate_ps_time(cluster, profile, layouts)
        return estimate_local_sync_time(cluster, profile, layouts) + max(0.0, ps - stale * compute_s) / a
    if mode == "wsp":
        return max(0.0, estimate_ps_time(cluster, profile, layouts) - stale * compute_s)
    raise ValueError(f"unknown sync mode {mode!r}")

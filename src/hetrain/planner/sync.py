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

from collections.abc import Sequence

from hetrain.cluster import Cluster
from hetrain.cost import estimate_allreduce_time
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

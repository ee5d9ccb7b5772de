"""Virtual-worker formation: which devices pipeline together.

A formation splits the cluster's devices into virtual workers (VWs). The
search tries several families and lets the cost model choose:

    dp          every device its own VW (pure data parallelism)
    pp          one VW of all devices (pure pipeline)
    node        one VW per node (HetPipe's NP policy)
    spread-k    k VWs (k a power of two), each device type dealt round-robin over them, so every VW
                gets an equal share of every type (HetPipe's ED policy)
    paired      nodes paired fastest-with-slowest, one VW per pair (HetPipe's HD
                idea: mix fast and slow so VWs are equally strong)
    split-r     every node split into r VWs (pipelines stay on fast intra-node links)
    contig-k    devices in node order cut into k consecutive groups
    set-*       every set partition, when the cluster is small (<= 6 devices)

Picture, 2 nodes x 2 types (A fast, B slow)::

    node:     [A A] [B B]          spread-2: [A B] [A B]
    split-2:  [A] [A] [B] [B]      paired:   [A A B B]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hetrain.cluster import Cluster

Group = tuple[int, ...]


@dataclass(frozen=True)
class Formation:
    """A named split of device indices into VWs."""

    name: str
    vws: tuple[Group, ...]

    @property
    def strategy(self) -> str:
        if all(len(g) == 1 for g in self.vws):
            return "dp"
        if len(self.vws) == 1:
            return "pp"
        return "hybrid"

    def key(self) -> tuple[Group, ...]:
        return tuple(sorted(tuple(sorted(g)) for g in self.vws))


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]
        yield [[first], *part]


def _node_speed(cluster: Cluster, n: int, precision: str) -> float:
    return sum(d.peak_flops(precision) for d in cluster.nodes[n].devices)


def _counts(n: int) -> list[int]:
    """Candidate VW counts: powers of two up to n, and n."""
    out = {1, n}
    k = 2
    while k < n:
        out.add(k)
        k *= 2
    return sorted(x for x in out if 1 <= x <= n)


def build_formations(cluster: Cluster, num_layers: int, strategy: str = "auto", precision: str = "fp32",
                     exhaustive_devices: int = 6) -> list[Formation]:
    """Candidate formations for ``strategy`` (``auto``, ``dp``, ``pp`` or ``hybrid``).

    Formations with a VW of more devices than layers are left out (every stage
    holds at least one layer).
    """
    devs = [d.index for d in cluster.devices]
    n = len(devs)
    out: dict[tuple[Group, ...], Formation] = {}

    def add(name: str, groups: list[list[int]]) -> None:
        groups = [g for g in groups if g]
        if not groups or any(len(g) > num_layers for g in groups):
            return
        f = Formation(name, tuple(tuple(g) for g in groups))
        out.setdefault(f.key(), f)

    if strategy in ("auto", "dp"):
        add("dp", [[d] for d in devs])
    if strategy in ("auto", "pp"):
        add("pp", [devs])
    if strategy in ("auto", "hybrid"):
        by_node = [[d.index for d in node.devices] for node in cluster.nodes]
        add("node", by_node)
        for r in (2, 3, 4, 8):
            if any(len(g) >= r for g in by_node):
                add(f"split-{r}", [g[i::r] for g in by_node for i in range(r)])
        order = sorted(range(len(cluster.nodes)), key=lambda k: -_node_speed(cluster, k, precision))
        pairs = [by_node[order[i]] + by_node[order[-1 - i]] for i in range(len(order) // 2)]
        if len(order) % 2:
            pairs.append(by_node[order[len(order) // 2]])
        add("paired", pairs)
        by_type: dict[str, list[int]] = {}
        for d in cluster.devices:
            by_type.setdefault(d.type_name, []).append(d.index)
        for k in _counts(n):
            groups: list[list[int]] = [[] for _ in range(k)]
            slot = 0
            for members in by_type.values():
                for idx in members:
                    groups[slot % k].append(idx)
                    slot += 1
            add(f"spread-{k}", [sorted(g) for g in groups])
            size, extra = divmod(n, k)
            start = 0
            contiguous = []
            for i in range(k):
                end = start + size + (1 if i < extra else 0)
                contiguous.append(devs[start:end])
                start = end
            add(f"contig-{k}", contiguous)
        if n <= exhaustive_devices:
            for part in _set_partitions(devs):
                add("set-" + "|".join(",".join(map(str, g)) for g in part), part)
    if strategy == "pp" and not out:
        return []
    return list(out.values())

"""Many devices named in a few words: counted by type, and by runs of alike nodes.

A plan on 4096 devices that leaves 1,024 unused, or a refusal naming the devices short of memory, would list
each device by name; these say the same compactly::

    count_by_type(devices)            8 x V100-32GB, 4 x T4
    describe_devices(cluster, names)  n12..n139 (128 nodes): 8 x V100-32GB each; n140: devices 0-3, 4 x T4

Nodes are grouped where consecutive in the cluster's order and alike: the same count of each device type
named, at the same positions in the node. Pure Python, no torch.

Example:
    >>> from hetrain.cluster import parse_cluster
    >>> c = parse_cluster({"node": [{"name": f"n{k}", "nic": "25Gbit/s", "devices": [{"type": "V100-32GB",
    ...                                                                            "count": 8}]} for k in range(4)]})
    >>> describe_devices(c, [d.name for d in c.devices if d.node != "n0"])
    'n1..n3 (3 nodes): 8 x V100-32GB each'
"""

from __future__ import annotations

from collections.abc import Iterable

from hetrain.cluster import Cluster, Device

#: entries ``describe_devices`` writes before it sums up the rest ("... and 5 more groups of nodes")
MAX_ENTRIES = 8


def count_by_type(devices: Iterable[Device]) -> str:
    """``"8 x V100-32GB, 4 x T4"``: the devices counted by type, in the order the types first appear."""
    counts: dict[str, int] = {}
    for d in devices:
        counts[d.type_name] = counts.get(d.type_name, 0) + 1
    return ", ".join(f"{n} x {t}" for t, n in counts.items())


def _positions(positions: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3, 6)`` as ``"0-3, 6"``."""
    runs: list[list[int]] = []
    for k in positions:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def describe_devices(cluster: Cluster, names: Iterable[str]) -> str:
    """The devices ``names`` of ``cluster`` by runs of alike nodes: ``"n12..n139 (128 nodes): 8 x V100-32GB each"``,
    a node with only some of its devices named saying which (``"n3: devices 0-3, 4 x T4"``); at most
    ``MAX_ENTRIES`` entries, then how many more."""
    named = set(names)
    runs: list[tuple[list[int], tuple[int, ...], str]] = []  # (node indices, positions named, counts by type)
    for k, node in enumerate(cluster.nodes):
        positions = tuple(j for j, d in enumerate(node.devices) if d.name in named)
        if not positions:
            continue
        counts = count_by_type(node.devices[j] for j in positions)
        if runs and runs[-1][1:] == (positions, counts) and runs[-1][0][-1] == k - 1:
            runs[-1][0].append(k)
        else:
            runs.append(([k], positions, counts))
    entries = []
    for nodes, positions, counts in runs:
        first, last = cluster.nodes[nodes[0]], cluster.nodes[nodes[-1]]
        span = first.name if len(nodes) == 1 else f"{first.name}..{last.name} ({len(nodes)} nodes)"
        which = "" if len(positions) == len(first.devices) else f"devices {_positions(positions)}, "
        entries.append(f"{span}: {which}{counts}{' each' if len(nodes) > 1 else ''}")
    if len(entries) > MAX_ENTRIES:
        entries = [*entries[:MAX_ENTRIES], f"and {len(entries) - MAX_ENTRIES} more groups of nodes"]
    return "; ".join(entries)

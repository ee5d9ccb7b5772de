"""``hetrain.device_groups``: many devices named in a few words, and the plan summary's unused devices with it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import hetrain
from hetrain.cluster import Cluster, parse_cluster
from hetrain.device_groups import MAX_ENTRIES, count_by_type, describe_devices
from hetrain.models.analytic import build_mlp_profile
from hetrain.planner.search import cluster_without


def _cluster(nodes: list[tuple[str, list[tuple[str, int]]]]) -> Cluster:
    spec: list[dict[str, Any]] = [{"name": name, "nic": "25Gbit/s",
                                   "devices": [{"type": t, "count": k} for t, k in devices]}
                                  for name, devices in nodes]
    return parse_cluster({"name": "groups", "node": spec})


def test_whole_alike_nodes_in_a_row_are_one_entry() -> None:
    c = _cluster([(f"n{k}", [("A100-80GB" if k < 12 else "V100-32GB", 8)]) for k in range(140)])
    unused = [d.name for d in c.devices if d.node not in {f"n{k}" for k in range(12)}]
    assert describe_devices(c, unused) == "n12..n139 (128 nodes): 8 x V100-32GB each"
    assert describe_devices(c, ["n3:0", "n3:1", "n3:2", "n3:3", "n3:4", "n3:5", "n3:6", "n3:7"]) == \
        "n3: 8 x A100-80GB"


def test_nodes_named_in_part_say_which_devices_and_a_gap_breaks_a_run() -> None:
    c = _cluster([("a", [("T4", 4), ("V100-16GB", 4)]), ("b", [("T4", 4), ("V100-16GB", 4)]),
                  ("c", [("T4", 8)]), ("d", [("T4", 4), ("V100-16GB", 4)])])
    assert describe_devices(c, ["a:4", "a:5", "a:6", "a:7", "b:4", "b:5", "b:6", "b:7", "d:4", "d:5", "d:6", "d:7"]) \
        == "a..b (2 nodes): devices 4-7, 4 x V100-16GB each; d: devices 4-7, 4 x V100-16GB"
    assert describe_devices(c, ["a:0", "a:1", "a:5"]) == "a: devices 0, 1, 5, 2 x T4, 1 x V100-16GB"
    assert count_by_type(c.devices[:6]) == "4 x T4, 2 x V100-16GB"


def test_too_many_groups_are_summed_up() -> None:
    c = _cluster([(f"n{k}", [("T4" if k % 2 else "L4", 2)]) for k in range(20)])
    text = describe_devices(c, [d.name for d in c.devices])
    assert text.count(";") == MAX_ENTRIES and text.endswith(f"and {20 - MAX_ENTRIES} more groups of nodes")


def test_a_plan_that_leaves_nodes_out_lists_its_unused_devices_by_node_and_type() -> None:
    """A plan made without 7 of 8 nodes, as the planner's left-out plans are (``cluster_without``, then the whole
    cluster put back): the summary names the other 56 devices in one short line, not one by one."""
    c = _cluster([(f"n{k}", [("T4", 8)]) for k in range(8)])
    alone = cluster_without(c, frozenset(f"n{k}" for k in range(1, 8)))
    made = replace(hetrain.plan(alone, build_mlp_profile([256, 256, 256, 256, 10]), 32, time_budget_s=1.0),
                   cluster=c)
    unused = made.unused_devices
    assert len(unused) >= 56
    line = next(x for x in made.summary().splitlines() if x.startswith("  unused: "))
    assert line == f"  unused: {len(unused)} devices — {describe_devices(c, unused)}"
    assert line.endswith("n1..n7 (7 nodes): 8 x T4 each") and len(line) < 100, line

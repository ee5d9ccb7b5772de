"""The cluster the planner sees after discovery: discovered links in the nominal cluster, quota stalls added."""

from __future__ import annotations

import copy

import pytest

from e2e_cluster import CLUSTER
from hetrain.cluster import parse_cluster
from hetrain.cluster_fixups import quota_stall_by_node, with_discovered_links, with_measured_links


def test_measured_links_replace_the_nominal_ones() -> None:
    discovered = {"node": [{"name": "fast", "intra_link": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
                            "nic": {"bandwidth_bytes_per_s": 1.2e7, "latency_s": 2e-4}}],
                  "link": [{"nodes": ["fast", "slow"], "bandwidth_bytes_per_s": 1.2e7, "latency_s": 2e-4}]}
    # with idle fillers (the default) the discovery met the stall as training does: the measured latency stands
    filled = with_measured_links({**CLUSTER, "emulation": {"cpu_scale": 0.5}}, discovered)
    assert filled["link"] == discovered["link"]
    assert filled["node"][0]["intra_link"] == discovered["node"][0]["intra_link"]
    merged = with_measured_links({**CLUSTER, "emulation": {"cpu_scale": 0.5, "fill_idle": False}}, discovered)
    # without: shares 0.25 and 0.125 at a 10 ms period: quotas 2.5 and 1.25 ms, stalls (10 - q) / 2 = 3.75 and
    # 4.375 ms, added at each throttled end of a link
    fast, slow = 3.75e-3, 4.375e-3
    assert merged["node"][0]["nic"] == {"bandwidth_bytes_per_s": 1.2e7, "latency_s": pytest.approx(2e-4 + fast)}
    assert merged["node"][0]["intra_link"]["latency_s"] == pytest.approx(1e-5 + 2 * fast)
    assert merged["node"][1]["nic"] == "100Mbit/s" and "emulation" not in merged
    assert merged["link"][0]["latency_s"] == pytest.approx(2e-4 + fast + slow)
    c = parse_cluster(merged)
    assert c.link(c.device("fast:0").index, c.device("slow:0").index).bandwidth_bytes_per_s == 1.2e7
    unthrottled = with_measured_links({**CLUSTER, "node": [{**n, "devices": [{"type": "cpu", "count": 2}]}
                                                           for n in CLUSTER["node"]]}, discovered)
    assert unthrottled["link"] == discovered["link"]  # no share, no stall


def test_discovered_links_on_a_small_cluster_add_the_latency_per_node_end() -> None:
    nominal = {**CLUSTER, "emulation": {"cpu_scale": 0.5}}
    before = copy.deepcopy(nominal)
    discovered = {"node": [{"name": "slow", "intra_link": {"bandwidth_bytes_per_s": 4e9, "latency_s": 0.001},
                            "nic": {"bandwidth_bytes_per_s": 1e7, "latency_s": 0.002}},
                           {"name": "gone", "nic": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.001}}]}
    out = with_discovered_links(nominal, discovered, {"slow": 0.25, "fast": 0.5})
    assert nominal == before  # the input is left alone
    fast, slow = out["node"]
    assert fast == CLUSTER["node"][0]  # not discovered: nominal links, no latency added
    assert slow["intra_link"] == {"bandwidth_bytes_per_s": 4e9, "latency_s": 0.001 + 2 * 0.25}  # two ends
    assert slow["nic"] == {"bandwidth_bytes_per_s": 1e7, "latency_s": 0.002 + 0.25}  # one end
    assert "link" not in out and "emulation" not in out and [n["name"] for n in out["node"]] == ["fast", "slow"]
    c = parse_cluster(out)
    assert c.link(c.device("slow:0").index, c.device("fast:1").index).bandwidth_bytes_per_s == 1e7
    assert with_discovered_links(nominal, discovered)["node"][1]["nic"]["latency_s"] == 0.002  # nothing extra


def test_quota_stall_per_node_is_that_of_its_most_throttled_device_and_zero_with_fillers() -> None:
    mixed = {**CLUSTER, "node": [{**CLUSTER["node"][0], "devices": [{"type": "cpu", "cpu_share": 0.5},
                                                                    {"type": "cpu", "cpu_share": 0.2}]},
                                 CLUSTER["node"][1]]}
    # period 10 ms: share 0.2 -> quota 2 ms, stall (10 - 2) / 2 = 4 ms; share 0.25 -> 3.75 ms
    assert quota_stall_by_node({**mixed, "emulation": {"fill_idle": False}}) == {
        "fast": pytest.approx(4e-3), "slow": pytest.approx(3.75e-3)}
    assert quota_stall_by_node(mixed) == {"fast": 0.0, "slow": 0.0}  # fillers: discovery met the stall

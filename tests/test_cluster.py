"""Cluster files: parsing, link lookup, validation errors and round trips."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from hetrain.catalog import (
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    DEVICE_TYPES,
    LINK_PRESETS,
)
from hetrain.cluster import Cluster, ClusterError, Link, load_cluster, parse_cluster, parse_device_type

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

TWO_NODES = """
name = "lab"

[[node]]
name = "fast"
devices = ["A100-40GB", "A100-40GB"]
intra_link = "nvlink3"
nic = { bandwidth = "100Gbit/s", latency = "3us" }

[[node]]
name = "old"
devices = [{ type = "T4", count = 3 }]
nic = "10Gbit/s"
"""


def cluster_of(text: str) -> Cluster:
    return parse_cluster(tomllib.loads(text))


def node(name: str, devices: list[Any], nic: Any = "10Gbit/s", **extra: Any) -> dict[str, Any]:
    return {"name": name, "devices": devices, "nic": nic, **extra}


# --- parsing ------------------------------------------------------------------


def test_devices_are_numbered_node_by_node() -> None:
    c = cluster_of(TWO_NODES)
    assert c.name == "lab"
    assert c.num_devices == 5
    assert [d.name for d in c.devices] == ["fast:0", "fast:1", "old:0", "old:1", "old:2"]
    assert [d.index for d in c.devices] == list(range(5))
    assert [d.node for d in c.devices] == ["fast", "fast", "old", "old", "old"]
    assert list(c.node_index) == [0, 0, 1, 1, 1]
    assert c.device("old:2").type_name == "T4"


def test_catalog_figures_are_copied_onto_devices() -> None:
    d = cluster_of(TWO_NODES).devices[0]
    a100 = DEVICE_TYPES["A100-40GB"]
    assert d.type_name == "A100-40GB"
    assert d.peak_fp32_flops == a100.peak_fp32_flops
    assert d.peak_fp16_flops == a100.peak_fp16_flops == d.peak_flops("bf16")
    assert d.memory_bytes == a100.memory_bytes
    assert d.memory_bandwidth_bytes_per_s == a100.memory_bandwidth_bytes_per_s
    assert d.cpu_share is None


def test_alias_is_stored_under_the_catalog_name() -> None:
    c = parse_cluster({"node": [node("n", ["Quadro P4000", "a100"])]})
    assert [d.type_name for d in c.devices] == ["P4000", "A100-40GB"]


def test_count_repeats_a_device() -> None:
    c = parse_cluster({"node": [node("n", [{"type": "H100", "count": 8}, "L4"])]})
    assert [d.type_name for d in c.devices] == ["H100"] * 8 + ["L4"]
    assert c.devices[8].name == "n:8"


def test_intra_node_link_is_the_nodes_intra_link() -> None:
    c = cluster_of(TWO_NODES)
    nvlink3 = LINK_PRESETS["nvlink3"]
    assert c.link(0, 1) == Link(nvlink3.bandwidth_bytes_per_s, nvlink3.latency_s)


def test_intra_link_defaults_to_pcie3() -> None:
    c = cluster_of(TWO_NODES)
    pcie3 = LINK_PRESETS["pcie3"]
    assert c.link(2, 3) == Link(pcie3.bandwidth_bytes_per_s, pcie3.latency_s)
    assert c.node_link(1, 1) == c.link(2, 4)


def test_inter_node_default_is_slower_nic_and_larger_latency() -> None:
    c = cluster_of(TWO_NODES)
    # fast: 100 Gbit/s, 3 us; old: 10 Gbit/s, default inter-node latency.
    link = c.link(0, 2)
    assert link.bandwidth_bytes_per_s == pytest.approx(10e9 / 8)
    assert link.latency_s == pytest.approx(max(3e-6, DEFAULT_INTER_NODE_LATENCY_S))
    assert c.link(4, 1) == link  # symmetric
    assert c.node_link(0, 1) == link


def test_larger_latency_wins_even_on_the_faster_nic() -> None:
    c = parse_cluster({"node": [
        node("a", ["T4"], nic={"bandwidth": "100Gbit/s", "latency": "80us"}),
        node("b", ["T4"], nic={"bandwidth": "10Gbit/s", "latency": "5us"}),
    ]})
    assert c.link(0, 1) == Link(10e9 / 8, 80e-6)


def test_collective_latency_is_a_collectives_step_and_defaults_to_the_latency() -> None:
    c = parse_cluster({"node": [
        node("a", ["T4", "T4"], intra_link={"bandwidth": "16GB/s", "latency": "2ms", "collective_latency": "300us"},
             nic={"bandwidth": "10Gbit/s", "latency": "5ms", "collective_latency_s": 4e-4}),
        node("b", ["T4"], nic={"bandwidth": "10Gbit/s", "latency": "6ms"}),
        node("c", ["T4"], nic={"bandwidth": "10Gbit/s", "latency": "1ms"}),
    ], "link": [{"nodes": ["b", "c"], "bandwidth": "1Gbit/s", "latency": "7ms", "collective_latency": "1ms"}]})
    intra = c.node_link(0, 0)
    assert (intra.latency_s, intra.collective_latency_s, intra.step_latency_s) == (2e-3, 3e-4, 3e-4)
    # a NIC pair: the larger point-to-point latency, and the larger step where either NIC gives one
    ab = c.node_link(0, 1)
    assert (ab.latency_s, ab.collective_latency_s) == (6e-3, 6e-3)  # b's step is its latency, 6 ms
    ac = c.node_link(0, 2)
    assert (ac.latency_s, ac.collective_latency_s) == (5e-3, 1e-3)
    assert c.node_link(1, 2) == Link(1e9 / 8, 7e-3, 1e-3)  # the [[link]]
    plain = c.node_link(1, 1)
    assert plain.collective_latency_s is None and plain.step_latency_s == plain.latency_s
    # what the all-reduce model takes: the steps' latencies
    from hetrain.cost import allreduce_shape

    shape = allreduce_shape(c, [0, 1, 2, 3])
    assert shape.intra_latency_s == 3e-4 and shape.inter_latency_s == pytest.approx(6e-3)
    assert allreduce_shape(c, [0, 1]).intra_latency_s == 3e-4
    again = parse_cluster(json.loads(json.dumps(c.to_dict())))
    assert again.node_link(0, 0) == intra and again.node_link(1, 2) == c.node_link(1, 2)
    with pytest.raises(ClusterError, match="node 'a': nic: collective_latency: '-1ms' is negative"):
        parse_cluster({"node": [node("a", ["T4"], nic={"bandwidth": "1Gbit/s", "collective_latency": "-1ms"})]})


def test_link_override_wins_over_nics() -> None:
    text = TWO_NODES + """
[[link]]
nodes = ["old", "fast"]
bandwidth = "1Gbit/s"
latency = "50us"
"""
    c = cluster_of(text)
    assert c.link(0, 2) == Link(1e9 / 8, 50e-6)
    assert c.link(2, 0) == Link(1e9 / 8, 50e-6)
    assert c.link(0, 1).bandwidth_bytes_per_s == pytest.approx(300e9)  # intra untouched
    assert len(c.node_links) == 1


def test_link_override_may_name_a_preset_and_only_some_pairs() -> None:
    c = parse_cluster({
        "node": [node("a", ["T4"]), node("b", ["T4"]), node("c", ["T4"])],
        "link": [{"nodes": ["a", "b"], "preset": "ib-hdr"}],
    })
    hdr = LINK_PRESETS["ib-hdr"]
    assert c.link(0, 1) == Link(hdr.bandwidth_bytes_per_s, hdr.latency_s)
    assert c.link(0, 2).bandwidth_bytes_per_s == pytest.approx(1.25e9)
    assert c.link(1, 2).bandwidth_bytes_per_s == pytest.approx(1.25e9)


def test_link_override_without_latency_gets_the_inter_node_default() -> None:
    c = parse_cluster({
        "node": [node("a", ["T4"]), node("b", ["T4"])],
        "link": [{"nodes": ["a", "b"], "bandwidth": "40Gbit/s"}],
    })
    assert c.link(0, 1) == Link(5e9, DEFAULT_INTER_NODE_LATENCY_S)


def test_bandwidth_only_links_get_default_latencies() -> None:
    c = parse_cluster({"node": [node("a", ["T4", "T4"], intra_link="20GB/s"), node("b", ["T4"])]})
    assert c.link(0, 1) == Link(20e9, DEFAULT_INTRA_NODE_LATENCY_S)
    assert c.link(0, 2) == Link(1.25e9, DEFAULT_INTER_NODE_LATENCY_S)


def test_single_node_may_omit_the_nic() -> None:
    c = parse_cluster({"node": [{"name": "solo", "devices": ["A10", "A10"]}]})
    assert c.num_devices == 2


def test_link_matrices() -> None:
    c = cluster_of(TWO_NODES)
    assert c.bandwidth_bytes_per_s.shape == (5, 5)
    assert math.isinf(c.bandwidth_bytes_per_s[3, 3])
    assert c.latency_s[3, 3] == 0.0
    with pytest.raises(ClusterError, match="no link from device old:1 to itself"):
        c.link(3, 3)


def test_inline_device_overrides_catalog_figures() -> None:
    spec = {"type": "RTX2060", "tflops": 6.45, "memory": "6GB", "memory_bandwidth": "336GB/s"}
    d = parse_cluster({"node": [node("n", [spec])]}).devices[0]
    assert d.type_name == "RTX2060"
    assert d.peak_fp32_flops == pytest.approx(6.45e12)
    assert d.memory_bytes == pytest.approx(6e9)  # decimal GB, as written, not the catalog's 6 GiB
    assert d.memory_bandwidth_bytes_per_s == pytest.approx(336e9)
    assert d.peak_fp16_flops == DEVICE_TYPES["RTX2060"].peak_fp16_flops  # not given: kept


def test_fully_custom_device_type() -> None:
    spec = {"type": "MI250X", "tflops": 47.9, "tflops_fp16": 383.0, "memory": "128GB",
            "memory_bandwidth": "3.2TB/s", "count": 2}
    c = parse_cluster({"node": [node("amd", [spec])]})
    assert c.num_devices == 2
    d = c.devices[1]
    assert d.type_name == "MI250X"
    assert d.peak_fp32_flops == pytest.approx(47.9e12)
    assert d.peak_fp16_flops == pytest.approx(383e12)
    assert d.memory_bytes == pytest.approx(128e9)
    assert d.memory_bandwidth_bytes_per_s == pytest.approx(3.2e12)


def test_custom_device_without_fp16_rate_uses_fp32_rate() -> None:
    spec = {"type": "FPGA", "tflops": 2.0, "memory": "8GiB", "memory_bandwidth": "100GB/s"}
    d = parse_cluster({"node": [node("n", [spec])]}).devices[0]
    assert d.peak_fp16_flops == d.peak_fp32_flops == pytest.approx(2e12)


def test_custom_device_in_plain_si_keys() -> None:
    spec = {"type": "X", "peak_fp32_flops": 1e13, "memory_bytes": 8e9, "memory_bandwidth_bytes_per_s": 5e11}
    d = parse_cluster({"node": [node("n", [spec])]}).devices[0]
    assert (d.peak_fp32_flops, d.memory_bytes, d.memory_bandwidth_bytes_per_s) == (1e13, 8e9, 5e11)


def test_cpu_share_for_emulation() -> None:
    c = parse_cluster({"node": [node("fast", [{"type": "cpu", "cpu_share": 1.0, "count": 2}]),
                                node("slow", [{"type": "cpu", "cpu_share": 0.4}])]})
    assert [d.cpu_share for d in c.devices] == [1.0, 1.0, 0.4]
    assert c.devices[0].type_name == "cpu"


def test_summary_lists_nodes_and_counts() -> None:
    text = cluster_of(TWO_NODES).summary()
    assert "cluster lab: 2 nodes, 5 devices" in text
    assert "3x T4" in text and "10 Gbit/s" in text


# --- round trips ----------------------------------------------------------------


def test_to_dict_round_trips_through_parse_cluster() -> None:
    text = TWO_NODES + """
[[node]]
name = "custom"
devices = [{ type = "MI250X", tflops = 47.9, memory = "128GB", memory_bandwidth = "3.2TB/s" },
           { type = "cpu", cpu_share = 0.5 }]
nic = "ib-hdr"

[[link]]
nodes = ["old", "custom"]
bandwidth = "1Gbit/s"
"""
    c = cluster_of(text)
    again = parse_cluster(c.to_dict())
    assert again == c
    assert again.name == "lab"
    assert (again.bandwidth_bytes_per_s == c.bandwidth_bytes_per_s).all()
    assert (again.latency_s == c.latency_s).all()
    # and through JSON, as it is embedded in plan.json
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_to_dict_is_plain_si() -> None:
    d = cluster_of(TWO_NODES).to_dict()
    assert d["node"][0]["intra_link"] == {"bandwidth_bytes_per_s": 300e9, "latency_s": 2e-6}
    assert d["node"][1]["devices"][0]["type"] == "T4"
    assert d["link"] == []


# --- files ------------------------------------------------------------------------


def test_load_cluster_names_the_cluster_after_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mylab.toml"
    path.write_text('[[node]]\nname = "n"\ndevices = ["T4"]\n')
    assert load_cluster(path).name == "mylab"


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('[[node]]\nname = "n"\ndevices = ["T4"\n')
    with pytest.raises(ClusterError, match=r"broken\.toml: not valid TOML"):
        load_cluster(path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"cannot read cluster file .*nowhere\.toml"):
        load_cluster(tmp_path / "nowhere.toml")


def test_invalid_field_in_a_file_names_the_file_and_node(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text('[[node]]\nname = "n"\ndevices = ["A100-40G"]\n')
    with pytest.raises(ClusterError, match=r"lab\.toml: node 'n' device #0: unknown device type 'A100-40G'"):
        load_cluster(path)


# --- errors -----------------------------------------------------------------------


def test_unknown_device_type_suggests_near_names() -> None:
    with pytest.raises(ClusterError, match=r"unknown device type 'A100-40G'; did you mean 'A100-40GB'") as info:
        parse_cluster({"node": [node("n", ["A100-40G"])]})
    assert "tflops, memory and memory_bandwidth" in str(info.value)


def test_custom_device_missing_a_figure_is_refused() -> None:
    spec = {"type": "MI250X", "tflops": 47.9, "memory": "128GB"}  # no memory_bandwidth
    with pytest.raises(ClusterError,
                       match=r"custom device type 'MI250X' \(not in the catalog\) is missing memory_bandwidth"):
        parse_cluster({"node": [node("n", [spec])]})


@pytest.mark.parametrize("nic", ["10", 10])
def test_missing_unit_on_a_nic(nic: object) -> None:
    with pytest.raises(ClusterError, match=r"node 'a': nic: '?10'? has no unit.*'10Gbit/s'"):
        parse_cluster({"node": [node("a", ["T4"], nic=nic), node("b", ["T4"])]})


def test_missing_unit_on_a_link_bandwidth() -> None:
    with pytest.raises(ClusterError, match=r"link \['a', 'b'\]: bandwidth: '25' has no unit"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "b"], "bandwidth": "25"}]})


def test_missing_unit_on_memory() -> None:
    spec = {"type": "T4", "memory": 16}
    with pytest.raises(ClusterError, match=r"node 'n' device #0: memory: 16 has no unit.*'16GB'"):
        parse_cluster({"node": [node("n", [spec])]})


def test_unknown_unit() -> None:
    with pytest.raises(ClusterError, match=r"node 'a': nic: unknown unit 'Gb/s' in '10Gb/s'; known units"):
        parse_cluster({"node": [node("a", ["T4"], nic="10Gb/s"), node("b", ["T4"])]})
    with pytest.raises(ClusterError, match=r"unknown unit 'gigs' in '16gigs'"):
        parse_cluster({"node": [node("n", [{"type": "T4", "memory": "16gigs"}])]})


def test_unknown_preset_name() -> None:
    with pytest.raises(ClusterError, match=r"intra_link: unknown link preset 'nvlink9'.*'10Gbit/s'"):
        parse_cluster({"node": [node("n", ["T4"], intra_link="nvlink9")]})


@pytest.mark.parametrize(
    ("bandwidth", "message"),
    [("0Gbit/s", r"node 'a': nic: bandwidth must be positive, got '0Gbit/s'"),
     ("-10Gbit/s", r"node 'a': nic: '-10Gbit/s' is negative")],
)
def test_zero_or_negative_nic_bandwidth(bandwidth: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_cluster({"node": [node("a", ["T4"], nic=bandwidth), node("b", ["T4"])]})


@pytest.mark.parametrize(
    ("bandwidth", "message"),
    [("0GB/s", r"link \['a', 'b'\]: bandwidth must be positive, got '0GB/s'"),
     ("-1GB/s", r"link \['a', 'b'\]: bandwidth: '-1GB/s' is negative")],
)
def test_zero_or_negative_link_bandwidth(bandwidth: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "b"], "bandwidth": bandwidth}]})


def test_zero_bandwidth_in_si_form() -> None:
    with pytest.raises(ClusterError, match=r"bandwidth must be positive, got 0"):
        parse_cluster({"node": [node("a", ["T4"], intra_link={"bandwidth_bytes_per_s": 0})]})


@pytest.mark.parametrize(
    ("memory", "message"),
    [("0GB", r"node 'n' device #0: memory must be positive, got '0GB'"),
     ("-16GB", r"node 'n' device #0: memory: '-16GB' is negative")],
)
def test_zero_or_negative_memory(memory: str, message: str) -> None:
    spec = {"type": "T4", "memory": memory}
    with pytest.raises(ClusterError, match=message):
        parse_cluster({"node": [node("n", [spec])]})


def test_negative_latency() -> None:
    with pytest.raises(ClusterError, match=r"latency: '-5us' is negative"):
        parse_cluster({"node": [node("a", ["T4"], nic={"bandwidth": "10Gbit/s", "latency": "-5us"}),
                                node("b", ["T4"])]})


def test_non_positive_tflops() -> None:
    spec = {"type": "T4", "tflops": -8.1}
    with pytest.raises(ClusterError, match=r"tflops must be a positive number, got -8.1"):
        parse_cluster({"node": [node("n", [spec])]})


def test_duplicate_node_names() -> None:
    with pytest.raises(ClusterError, match=r"duplicate node names: gpu; node names must be unique"):
        parse_cluster({"node": [node("gpu", ["T4"]), node("cpu", ["cpu"]), node("gpu", ["L4"])]})


def test_link_naming_an_unknown_node() -> None:
    with pytest.raises(ClusterError, match=r"\[\[link\]\] \['a', 'zz'\] names unknown node 'zz'; nodes are: a, b"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "zz"], "bandwidth": "1Gbit/s"}]})


def test_link_joining_a_node_to_itself() -> None:
    with pytest.raises(ClusterError, match=r"joins a node to itself; use intra_link"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "a"], "bandwidth": "1Gbit/s"}]})


def test_link_needs_exactly_two_nodes() -> None:
    with pytest.raises(ClusterError, match=r"link #0: 'nodes' must name exactly two nodes, got \['a'\]"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a"], "bandwidth": "1Gbit/s"}]})


def test_two_links_for_one_pair() -> None:
    with pytest.raises(ClusterError, match=r"link #1: nodes \['b', 'a'\] already have a \[\[link\]\]"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "b"], "bandwidth": "1Gbit/s"},
                                {"nodes": ["b", "a"], "bandwidth": "2Gbit/s"}]})


@pytest.mark.parametrize("data", [{}, {"node": []}, {"name": "empty"}])
def test_empty_cluster(data: dict[str, Any]) -> None:
    with pytest.raises(ClusterError, match=r"the cluster is empty: add at least one \[\[node\]\]"):
        parse_cluster(data)


def test_empty_cluster_object() -> None:
    with pytest.raises(ClusterError, match=r"cluster 'x' has no nodes"):
        Cluster("x", ())


def test_single_node_table_instead_of_array() -> None:
    with pytest.raises(ClusterError, match=r"write each node as \[\[node\]\]"):
        cluster_of('[node]\nname = "n"\ndevices = ["T4"]\n')


def test_node_without_devices() -> None:
    with pytest.raises(ClusterError, match=r"node 'n': 'devices' must be a non-empty list"):
        parse_cluster({"node": [{"name": "n", "devices": []}]})


def test_missing_nic_with_several_nodes() -> None:
    with pytest.raises(ClusterError, match=r"node 'b': missing 'nic'"):
        parse_cluster({"node": [node("a", ["T4"]), {"name": "b", "devices": ["T4"]}]})


def test_unknown_top_level_key() -> None:
    with pytest.raises(ClusterError, match=r"unknown top-level keys \['nodes'\]"):
        parse_cluster({"nodes": [node("a", ["T4"])]})


def test_unknown_node_key() -> None:
    with pytest.raises(ClusterError, match=r"node 'a': unknown keys \['gpus'\]"):
        parse_cluster({"node": [node("a", ["T4"], gpus=4)]})


def test_unknown_device_key() -> None:
    with pytest.raises(ClusterError, match=r"node 'a' device #0: unknown device keys \['memory_gb'\]"):
        parse_cluster({"node": [node("a", [{"type": "T4", "memory_gb": 16}])]})


def test_unknown_link_key() -> None:
    with pytest.raises(ClusterError, match=r"link \['a', 'b'\]: unknown keys \['speed'\]"):
        parse_cluster({"node": [node("a", ["T4"]), node("b", ["T4"])],
                       "link": [{"nodes": ["a", "b"], "speed": "1Gbit/s"}]})


def test_device_table_needs_a_type() -> None:
    with pytest.raises(ClusterError, match=r"device table needs a 'type'"):
        parse_cluster({"node": [node("a", [{"count": 2}])]})


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_bad_count(count: object) -> None:
    with pytest.raises(ClusterError, match=rf"count must be a positive integer, got {count!r}"):
        parse_cluster({"node": [node("a", [{"type": "T4", "count": count}])]})


@pytest.mark.parametrize("share", [0, -0.5, 100])
def test_bad_cpu_share(share: float) -> None:
    with pytest.raises(ClusterError, match=rf"cpu_share must be a number in \(0, 64\], got {share!r}"):
        parse_cluster({"node": [node("a", [{"type": "cpu", "cpu_share": share}])]})


def test_unknown_device_name_lookup() -> None:
    with pytest.raises(ClusterError, match=r"no device 'fast:9' in cluster 'lab'; devices are fast:0"):
        cluster_of(TWO_NODES).device("fast:9")


def test_a_device_spec_is_a_cluster_files_device_entry() -> None:
    """``--device-spec``: a catalog name (quoted or not) or an inline table, with the cluster file's checks."""
    a10g = parse_device_type("A10G")
    assert (a10g.name, a10g.peak_fp16_flops, a10g.source) == ("A10G", DEVICE_TYPES["A10G"].peak_fp16_flops,
                                                              "--device-spec")
    assert parse_device_type('"a10g"') == a10g
    custom = parse_device_type('{ type = "P40x", tflops = 12, tflops_fp16 = 12.5, memory = "24GB", '
                               'memory_bandwidth = "346GB/s" }', "--device-spec")
    assert (custom.peak_fp32_flops, custom.peak_fp16_flops, custom.memory_bytes,
            custom.memory_bandwidth_bytes_per_s) == (12e12, 12.5e12, 24e9, 346e9)
    with pytest.raises(ClusterError, match=r"^--device-spec '\{ type = P40x \}': neither a type name in quotes nor a "
                                           r"TOML inline table .*; for example \{ type = \"P40\", tflops = 10\.0"):
        parse_device_type("{ type = P40x }")
    with pytest.raises(ClusterError, match=r"'P40x' \(not in the catalog\) is missing memory_bandwidth"):
        parse_device_type('{ type = "P40x", tflops = 12, memory = "24GB" }')

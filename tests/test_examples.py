"""Every example cluster file loads, with the devices and links it claims."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.catalog import DEFAULT_INTER_NODE_LATENCY_S, LINK_PRESETS
from hetrain.cluster import Cluster, load_cluster

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def load(name: str) -> Cluster:
    return load_cluster(CLUSTERS / f"{name}.toml")


def types_of(c: Cluster) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d in c.devices:
        counts[d.type_name] = counts.get(d.type_name, 0) + 1
    return counts


@pytest.mark.parametrize("path", sorted(CLUSTERS.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_loads_and_round_trips(path: Path) -> None:
    c = load_cluster(path)
    assert c.name == path.stem
    assert c.num_devices > 0
    assert Cluster.from_dict(c.to_dict()) == c


def test_the_expected_examples_exist() -> None:
    names = {p.stem for p in CLUSTERS.glob("*.toml")}
    assert {"hetpipe", "pipetorch", "cloud-mixed", "gpu256", "small-hetero"} <= names


def test_hetpipe() -> None:
    c = load("hetpipe")
    assert c.num_devices == 16
    assert [n.name for n in c.nodes] == ["titanv", "titanrtx", "rtx2060", "p4000"]
    assert types_of(c) == {"TITAN-V": 4, "TITAN-RTX": 4, "RTX2060": 4, "P4000": 4}
    # 56 Gbit/s FDR InfiniBand between nodes, PCIe 3.0 inside.
    assert c.link(c.device("titanv:0").index, c.device("p4000:3").index).bandwidth_bytes_per_s == pytest.approx(7e9)
    assert c.link(0, 1).bandwidth_bytes_per_s == LINK_PRESETS["pcie3"].bandwidth_bytes_per_s


def test_pipetorch_has_one_slow_pair() -> None:
    c = load("pipetorch")
    assert c.num_devices == 8
    assert all(len(n.devices) == 2 for n in c.nodes)
    assert len(types_of(c)) == len(c.nodes)  # one type per node, all different
    slow = c.link(c.device("c:0").index, c.device("d:1").index)
    assert slow.bandwidth_bytes_per_s == pytest.approx(1e9 / 8)
    assert slow.latency_s == pytest.approx(50e-6)
    assert c.link(c.device("a:0").index, c.device("d:0").index).bandwidth_bytes_per_s == pytest.approx(1.25e9)


def test_cloud_mixed() -> None:
    c = load("cloud-mixed")
    assert c.num_devices == 20
    assert types_of(c) == {"A100-40GB": 8, "V100-16GB": 4, "T4": 8}
    a100, v100, t4 = (c.device(n).index for n in ("a100:0", "v100:0", "t4-1:0"))
    assert c.link(a100, v100).bandwidth_bytes_per_s == pytest.approx(25e9 / 8)  # slower NIC
    assert c.link(a100, t4).bandwidth_bytes_per_s == pytest.approx(10e9 / 8)
    assert c.link(a100, a100 + 1).bandwidth_bytes_per_s == LINK_PRESETS["nvlink3"].bandwidth_bytes_per_s


def test_gpu256() -> None:
    c = load("gpu256")
    assert c.num_devices == 256
    assert len(c.nodes) == 32
    assert types_of(c) == {"A100-80GB": 128, "V100-32GB": 64, "T4": 64}
    a, b = c.device("a100-00:0").index, c.device("a100-15:7").index
    assert c.link(a, b).bandwidth_bytes_per_s == LINK_PRESETS["ib-hdr"].bandwidth_bytes_per_s
    assert c.link(a, c.device("t4-07:0").index).bandwidth_bytes_per_s == LINK_PRESETS["25gbe"].bandwidth_bytes_per_s


def test_small_hetero() -> None:
    c = load("small-hetero")
    assert c.num_devices == 4
    assert [d.cpu_share for d in c.devices] == [1.0, 1.0, 0.4, 0.4]
    assert {d.type_name for d in c.devices} == {"cpu"}
    inter = c.link(c.device("fast:0").index, c.device("slow:1").index)
    assert inter.bandwidth_bytes_per_s == pytest.approx(100e6 / 8)
    assert inter.latency_s == DEFAULT_INTER_NODE_LATENCY_S
    assert c.link(0, 1).bandwidth_bytes_per_s == LINK_PRESETS["loopback"].bandwidth_bytes_per_s

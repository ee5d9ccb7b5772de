"""The catalog: device types and link presets, each figure with a cited source."""

from __future__ import annotations

import re

import pytest

from hetrain import catalog
from hetrain.catalog import (
    DEVICE_ALIASES,
    DEVICE_TYPES,
    LINK_PRESETS,
    lookup_device_type,
    lookup_link_preset,
)

REQUIRED_TYPES = [
    "V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100", "H200", "L4", "T4", "A10",
    "RTX2060", "RTX2080", "RTX3090", "RTX4090", "TITAN-V", "TITAN-RTX", "P4000", "cpu",
    # cards users own that profiles of fit-time-model named (issue 36)
    "A10G", "L40S", "RTX-A6000", "H100-PCIe", "H100-NVL", "P40", "P100", "V100-PCIe-16GB", "V100-PCIe-32GB",
]
REQUIRED_PRESETS = [
    "pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4",
    "10gbe", "25gbe", "100gbe", "ib-edr", "ib-hdr", "ib-ndr",
]


def _source_keys() -> set[str]:
    doc = catalog.__doc__ or ""
    return set(re.findall(r"^\s*\[([A-Za-z0-9]+)\]", doc, flags=re.MULTILINE))


def test_catalog_has_the_required_device_types() -> None:
    assert len(DEVICE_TYPES) >= 15
    missing = [t for t in REQUIRED_TYPES if t not in DEVICE_TYPES]
    assert not missing


@pytest.mark.parametrize("name", REQUIRED_TYPES)
def test_every_device_type_cites_a_source_and_has_sane_figures(name: str) -> None:
    t = DEVICE_TYPES[name]
    assert t.name == name
    assert t.source in _source_keys(), f"{name}: source [{t.source}] is not in catalog's docstring"
    assert t.peak_fp32_flops > 0
    assert t.peak_fp16_flops >= t.peak_fp32_flops
    assert t.memory_bytes > 0
    assert t.memory_bandwidth_bytes_per_s > 0


@pytest.mark.parametrize("name", [*REQUIRED_PRESETS, "loopback"])
def test_every_link_preset_cites_a_source(name: str) -> None:
    p = LINK_PRESETS[name]
    assert p.source in _source_keys(), f"{name}: source [{p.source}] is not in catalog's docstring"
    assert p.bandwidth_bytes_per_s > 0
    assert p.latency_s > 0


def test_published_figures() -> None:
    a100 = DEVICE_TYPES["A100-40GB"]
    assert a100.peak_fp32_flops == pytest.approx(19.5e12)
    assert a100.peak_fp16_flops == pytest.approx(312e12)
    assert a100.memory_bytes == 40 * 2**30
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(1555e9)
    assert DEVICE_TYPES["V100-32GB"].memory_bytes == 2 * DEVICE_TYPES["V100-16GB"].memory_bytes
    assert DEVICE_TYPES["RTX2060"].peak_fp32_flops == pytest.approx(6.45e12)
    # Pascal has no tensor cores: half precision runs no faster than fp32.
    p4000 = DEVICE_TYPES["P4000"]
    assert p4000.peak_fp16_flops == p4000.peak_fp32_flops


#: (type, fp32, fp16, bf16 TFLOPS, memory GiB, bandwidth GB/s) as the sources in catalog's docstring give them
NEWER_FIGURES = [
    ("A10G", 35.0, 70.0, 70.0, 24, 600), ("L40S", 91.6, 362.05, 362.05, 48, 864),
    ("RTX-A6000", 38.7, 154.85, 154.85, 48, 768), ("H100-PCIe", 51.0, 756.5, 756.5, 80, 2000),
    ("H100-NVL", 60.0, 835.5, 835.5, 94, 3900), ("P40", 12.0, 12.0, 12.0, 24, 346),
    ("P100", 9.3, 18.7, 9.3, 16, 732), ("V100-PCIe-16GB", 14.0, 112.0, 14.0, 16, 900),
]


@pytest.mark.parametrize(("name", "fp32", "fp16", "bf16", "memory_gib", "bandwidth_gb_s"), NEWER_FIGURES)
def test_newer_cards_figures(name: str, fp32: float, fp16: float, bf16: float, memory_gib: float,
                             bandwidth_gb_s: float) -> None:
    t = lookup_device_type(name)
    got = (t.peak_flops("fp32") / 1e12, t.peak_flops("fp16") / 1e12, t.peak_flops("bf16") / 1e12,
           t.memory_bytes / 2**30, t.memory_bandwidth_bytes_per_s / 1e9)
    assert got == pytest.approx((fp32, fp16, bf16, memory_gib, bandwidth_gb_s), rel=1e-12)


def test_newer_cards_parse_in_a_cluster_file() -> None:
    from hetrain.cluster import parse_cluster

    names = [n for n, *_ in NEWER_FIGURES]
    cluster = parse_cluster({"node": [{"name": "n", "devices": [{"type": n} for n in names],
                                       "intra_link": "pcie4"}]})
    assert [d.type_name for d in cluster.devices] == names
    assert [d.peak_fp16_flops for d in cluster.devices] == [lookup_device_type(n).peak_fp16_flops for n in names]


def test_peak_flops_by_precision() -> None:
    t4 = DEVICE_TYPES["T4"]
    assert t4.peak_flops("fp32") == t4.peak_fp32_flops
    assert t4.peak_flops("fp16") == t4.peak_fp16_flops
    assert t4.peak_flops("bf16") == t4.peak_fp32_flops  # Turing: no bf16 tensor cores


def test_link_preset_figures() -> None:
    assert LINK_PRESETS["pcie3"].bandwidth_bytes_per_s == pytest.approx(15.75e9)
    assert LINK_PRESETS["pcie5"].bandwidth_bytes_per_s == pytest.approx(4 * LINK_PRESETS["pcie3"].bandwidth_bytes_per_s)
    assert LINK_PRESETS["nvlink3"].bandwidth_bytes_per_s == pytest.approx(300e9)
    assert LINK_PRESETS["10gbe"].bandwidth_bytes_per_s == pytest.approx(1.25e9)
    assert LINK_PRESETS["ib-hdr"].bandwidth_bytes_per_s == pytest.approx(25e9)
    hdr, ndr = LINK_PRESETS["ib-hdr"], LINK_PRESETS["ib-ndr"]
    assert ndr.bandwidth_bytes_per_s == pytest.approx(2 * hdr.bandwidth_bytes_per_s)
    # Ethernet over TCP has more latency than InfiniBand.
    assert LINK_PRESETS["100gbe"].latency_s > LINK_PRESETS["ib-edr"].latency_s


def test_default_latencies() -> None:
    assert 0 < catalog.DEFAULT_INTRA_NODE_LATENCY_S < catalog.DEFAULT_INTER_NODE_LATENCY_S


@pytest.mark.parametrize(
    ("written", "name"),
    [("A100-40GB", "A100-40GB"), ("a100-40gb", "A100-40GB"), ("A100", "A100-40GB"), ("V100", "V100-16GB"),
     ("TITAN V", "TITAN-V"), ("titanrtx", "TITAN-RTX"), ("Quadro P4000", "P4000"), ("CPU", "cpu"),
     ("RTX-2060", "RTX2060"), ("RTX A6000", "RTX-A6000"), ("H100 NVL", "H100-NVL"), ("h100 pcie", "H100-PCIe"),
     ("V100 PCIe", "V100-PCIe-16GB"), ("Tesla P40", "P40"), ("a10g", "A10G")],
)
def test_lookup_accepts_aliases_and_any_case(written: str, name: str) -> None:
    assert lookup_device_type(written).name == name


def test_every_alias_points_to_a_catalog_type() -> None:
    assert all(target in DEVICE_TYPES for target in DEVICE_ALIASES.values())


def _message(error: pytest.ExceptionInfo[KeyError]) -> str:
    # str(KeyError) is the repr of its argument; the message itself is args[0].
    return str(error.value.args[0])


def test_unknown_device_type_suggests_near_names() -> None:
    with pytest.raises(KeyError) as info:
        lookup_device_type("A100-40G")
    assert re.search(r"unknown device type 'A100-40G'; did you mean 'A100-40GB'", _message(info))
    with pytest.raises(KeyError) as info:
        lookup_device_type("P400")
    assert "did you mean 'P4000'" in _message(info)


def test_unknown_device_type_lists_catalog_and_inline_form() -> None:
    with pytest.raises(KeyError) as info:
        lookup_device_type("MI250X")
    message = _message(info)
    assert "Known types:" in message and "H100" in message
    assert "tflops" in message and "memory_bandwidth" in message


def test_link_preset_lookup_is_forgiving_about_case_and_separators() -> None:
    assert lookup_link_preset("NVLink3").name == "nvlink3"
    assert lookup_link_preset("IB_HDR").name == "ib-hdr"
    assert lookup_link_preset("10GbE").name == "10gbe"


def test_unknown_link_preset_suggests_near_names() -> None:
    with pytest.raises(KeyError) as info:
        lookup_link_preset("nvlink5")
    assert re.search(r"unknown link preset 'nvlink5'; did you mean .*'nvlink4'.*Known presets: pcie3", _message(info))

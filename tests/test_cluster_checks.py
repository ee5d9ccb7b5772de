"""Cluster files with non-finite figures, custom devices short of a figure, bf16 on Volta/Turing,
and --sync-option values the chosen sync mode does not read."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.catalog import lookup_device_type
from hetrain.cluster import ClusterError, load_cluster, parse_cluster
from hetrain.sync_layout import SyncLayoutError, SyncOptions, check_mode_options


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("line", "field", "value"), [
    ('devices = [{ type = "A100", memory = "1e400GB" }, "A100"]', "memory", "1e400GB"),
    ('devices = [{ type = "A100", memory_bandwidth = "1e400GB/s" }]', "memory_bandwidth", "1e400GB/s"),
    ('devices = [{ type = "A100", tflops = inf }]', "tflops", "inf"),
    ('devices = ["A100"]\nnic = "1e400Gbit/s"', "nic", "1e400Gbit/s"),
    ('devices = ["A100"]\nintra_link = { bandwidth = "1e400GB/s" }', "bandwidth", "1e400GB/s"),
])
def test_non_finite_figures_are_refused(tmp_path: Path, line: str, field: str, value: str) -> None:
    path = _write(tmp_path, f"[[node]]\n{line}\n")
    with pytest.raises(ClusterError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and field in msg and value in msg


def test_custom_device_names_the_missing_field_in_its_own_table(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[node]]\ndevices = [{type="Foo", tflops=10, memory="8GB"}]\n')
    with pytest.raises(ClusterError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert "missing memory_bandwidth" in msg
    assert '{ type = "Foo", tflops = 10, memory = "8GB", memory_bandwidth = "500GB/s" }' in msg


@pytest.mark.parametrize("name", ["V100-16GB", "V100-32GB", "T4", "RTX2060", "RTX2080", "RTX2080Ti",
                                  "TITAN-V", "TITAN-RTX"])
def test_volta_and_turing_run_bf16_at_their_fp32_rate(name: str) -> None:
    t = lookup_device_type(name)
    assert t.peak_flops("bf16") == t.peak_fp32_flops < t.peak_flops("fp16")
    device = parse_cluster({"node": [{"devices": [name]}]}).devices[0]
    assert device.peak_flops("bf16") == t.peak_fp32_flops
    again = parse_cluster(parse_cluster({"node": [{"devices": [name]}]}).to_dict()).devices[0]
    assert again.peak_flops("bf16") == t.peak_fp32_flops


@pytest.mark.parametrize("name", ["A100-40GB", "H100", "RTX3090", "L4"])
def test_ampere_and_later_run_bf16_at_the_fp16_rate(name: str) -> None:
    t = lookup_device_type(name)
    assert t.peak_flops("bf16") == t.peak_flops("fp16") > t.peak_fp32_flops
    assert "peak_bf16_flops" not in parse_cluster({"node": [{"devices": [name]}]}).to_dict()["node"][0]["devices"][0]


def test_custom_bf16_rate() -> None:
    spec = {"type": "Foo", "tflops": 10, "tflops_fp16": 80, "tflops_bf16": 40, "memory": "8GB",
            "memory_bandwidth": "500GB/s"}
    assert parse_cluster({"node": [{"devices": [spec]}]}).devices[0].peak_flops("bf16") == 40e12


@pytest.mark.parametrize(("mode", "item"), [("bsp", "staleness=3"), ("bsp", "period=8"), ("wsp", "period=8"),
                                            ("daso", "placement=round-robin"), ("local-sgd", "bucket_bytes=1e6")])
def test_an_option_the_mode_does_not_read_is_refused(mode: str, item: str) -> None:
    where = f"--sync {mode} with --sync-option"
    with pytest.raises(SyncLayoutError) as e:
        check_mode_options(mode, SyncOptions.from_items([item]), where)
    key = item.partition("=")[0]
    assert where in str(e.value) and key in str(e.value) and mode in str(e.value)


def test_options_the_mode_reads_and_auto_are_accepted() -> None:
    for mode, item in [("wsp", "staleness=3"), ("hybrid-ps", "aggregate=2"), ("daso", "warmup=1"),
                       ("bsp", "bucket_cut=exact"), ("local-sgd", "transfers=blocking"), ("auto", "staleness=3")]:
        check_mode_options(mode, SyncOptions.from_items([item]), "--sync-option")
    with pytest.raises(SyncLayoutError, match="staleness=3"):  # under reduce_dtype bf16, auto considers bsp alone
        check_mode_options("auto", SyncOptions.from_items(["reduce_dtype=bf16", "staleness=3"]), "--sync-option")
    # a plan's stored options (every option, defaults included) load under every mode
    for mode in ("bsp", "wsp", "hybrid-ps", "daso", "local-sgd"):
        stored = SyncOptions.from_mapping(SyncOptions(staleness=3).to_dict(), "sync.options")
        check_mode_options(mode, stored, "sync.options")
    assert "given" not in SyncOptions.from_items(["staleness=3"]).to_dict()

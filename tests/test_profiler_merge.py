"""One profile from per-device profiles: relabelled to the device type, median per type, types merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetrain.errors import RunError
from hetrain.profile import parse_profile, relabel_profile
from hetrain.profiler.merge import merge_node_profiles, node_profile_path

CLUSTER = {
    "name": "two-types",
    "node": [
        {"name": "fast", "devices": [{"type": "cpu-fast", "tflops": 0.012, "memory": "4GB",
                                      "memory_bandwidth": "10GB/s", "count": 2}], "intra_link": "loopback",
         "nic": "1Gbit/s"},
        {"name": "slow", "devices": [{"type": "cpu-slow", "tflops": 0.0048, "memory": "4GB",
                                      "memory_bandwidth": "4GB/s"}], "intra_link": "loopback",
         "nic": "100Mbit/s"},
    ],
}


def _cpu_profile(forward_s: float) -> dict[str, Any]:
    """A one-layer profile as a CPU process writes it: measured as type ``cpu``."""
    return {"name": "m", "input_bytes_per_sample": 8, "layers": [
        {"name": "a", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
         "forward_flops_per_sample": 10, "measured": {"cpu": [{"micro_batch": 2, "forward_s": forward_s,
                                                                "backward_s": 2 * forward_s}]}}],
            "measured_on": {"cpu": {"peak_flops": 1e9, "memory_bandwidth_bytes_per_s": 1e9}}}


def test_relabel_files_measurements_under_the_device_type() -> None:
    raw = {"name": "m", "input_bytes_per_sample": 8, "layers": [
        {"name": "a", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
         "forward_flops_per_sample": 10, "measured": {"cpu": [{"micro_batch": 2, "forward_s": 0.1,
                                                                "backward_s": 0.2}]}}],
           "measured_on": {"cpu": {"peak_flops": 1e9, "memory_bandwidth_bytes_per_s": 1e9}}}
    p = relabel_profile(parse_profile(raw), "cpu-slow", (2e9, 3e9))
    assert p.layers[0].measurements("cpu-slow")[0].forward_s == 0.1
    assert p.layers[0].measurements("cpu") == ()
    f = p.figures_of("cpu-slow")
    assert f is not None and (f.peak_flops, f.memory_bandwidth_bytes_per_s) == (2e9, 3e9)


def test_relabel_without_figures_keeps_the_measured_ones_under_the_new_type() -> None:
    p = relabel_profile(parse_profile(_cpu_profile(0.1)), "cpu-fast")
    assert [t for t, _ in p.measured_on] == ["cpu-fast"]
    f = p.figures_of("cpu-fast")
    assert f is not None and (f.peak_flops, f.memory_bandwidth_bytes_per_s) == (1e9, 1e9)


def test_merge_takes_the_median_per_device_type_under_that_types_figures(tmp_path: Path) -> None:
    for (node, k), forward_s in {("fast", 0): 0.1, ("fast", 1): 0.3, ("slow", 0): 0.7}.items():
        parse_profile(_cpu_profile(forward_s)).save(node_profile_path(tmp_path, node, k))
    assert node_profile_path(tmp_path, "fast", 1) == tmp_path / "profile-node-fast-1.json"
    merged = merge_node_profiles(CLUSTER, tmp_path)
    (layer,) = merged.layers
    assert layer.measurements("cpu") == ()
    assert [m.forward_s for m in layer.measurements("cpu-fast")] == [pytest.approx(0.2)]  # median of 0.1, 0.3
    assert [m.backward_s for m in layer.measurements("cpu-slow")] == [pytest.approx(1.4)]
    fast, slow = merged.figures_of("cpu-fast"), merged.figures_of("cpu-slow")
    assert fast is not None and fast.peak_flops == pytest.approx(0.012e12)
    assert slow is not None and slow.memory_bandwidth_bytes_per_s == pytest.approx(4e9)


def test_merge_names_the_device_whose_profile_is_missing(tmp_path: Path) -> None:
    parse_profile(_cpu_profile(0.1)).save(node_profile_path(tmp_path, "fast", 0))
    parse_profile(_cpu_profile(0.1)).save(node_profile_path(tmp_path, "slow", 0))
    with pytest.raises(RunError, match=r"no profile for device 'fast:1' \(.*profile-node-fast-1\.json\)"):
        merge_node_profiles(CLUSTER, tmp_path)


def test_merging_keeps_every_types_fixed_costs() -> None:
    from hetrain.profile_combine import merge_profiles

    a = parse_profile({**_cpu_profile(0.1), "action_overhead_s": {"cpu": 0.001},
                       "iteration_overhead_s": {"cpu": 0.02}})
    slow = _cpu_profile(0.2)
    slow["layers"][0]["measured"] = {"cpu-slow": slow["layers"][0]["measured"]["cpu"]}
    b = parse_profile({**slow, "iteration_overhead_s": {"cpu-slow": 0.05}})
    both = merge_profiles([a, b])
    assert both.iteration_overhead_of("cpu") == 0.02 and both.iteration_overhead_of("cpu-slow") == 0.05
    assert both.action_overhead_of("cpu") == 0.001 and both.action_overhead_of("cpu-slow") == 0.0
    assert both.to_dict()["iteration_overhead_s"] == {"cpu": 0.02, "cpu-slow": 0.05}

"""The runtime's memory footprint in the memory model, and the margin a plan leaves on every device."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hetrain.catalog import CUDA_FOOTPRINT, NO_FOOTPRINT, default_footprint
from hetrain.cluster import parse_cluster
from hetrain.cost import MEMORY_MARGIN_FRACTION, estimate_device_memory, runtime_footprint, tensor_budget
from hetrain.models.analytic import build_profile
from hetrain.planner import plan
from hetrain.profile import ProfileError, load_profile, parse_profile
from hetrain.simulator import simulate

GB = 1e9


def _cluster(gpu: str = "T4", count: int = 2):
    return parse_cluster({"name": "c", "node": [{"name": "n0", "devices": [{"type": gpu, "count": count}],
                                                   "intra_link": "pcie3", "nic": "10Gbit/s"}]})


def test_the_catalog_gives_gpus_the_cuda_footprint_and_cpus_none() -> None:
    assert default_footprint("A100-40GB") is CUDA_FOOTPRINT and default_footprint("RTX-3090") is CUDA_FOOTPRINT
    assert default_footprint("cpu") is NO_FOOTPRINT and default_footprint("my-emulated-type") is NO_FOOTPRINT
    assert CUDA_FOOTPRINT.fixed_bytes > 0.5 * GB and CUDA_FOOTPRINT.source
    assert CUDA_FOOTPRINT.device_bytes(10 * GB) == pytest.approx(0.9 * GB + 1.05 * 10 * GB)


def test_a_measured_footprint_overrides_the_catalog_and_round_trips(tmp_path: Path) -> None:
    profile = replace(build_profile("gpt2-small"), memory_footprint=(("T4", 1.5 * GB, 0.1),))
    t4 = _cluster().devices[0]
    assert runtime_footprint(profile, t4).fixed_bytes == 1.5 * GB
    assert estimate_device_memory(profile, t4, 4 * GB) == pytest.approx(1.5 * GB + 1.1 * 4 * GB)
    assert tensor_budget(profile, t4) == pytest.approx(((1 - MEMORY_MARGIN_FRACTION) * t4.memory_bytes - 1.5 * GB)
                                                       / 1.1)
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").memory_footprint == (("T4", 1.5 * GB, 0.1),)
    bad = profile.to_dict()
    bad["memory_footprint"] = {"T4": {"fixed_bytes": -1, "allocator_fraction": 0.1}}
    with pytest.raises(ProfileError, match=r"memory_footprint\['T4'\].fixed_bytes.*-1"):
        parse_profile(bad)


def test_plans_count_the_footprint_and_leave_the_margin() -> None:
    """Every device's predicted peak is its tensors plus the footprint, and at most 95% of its memory; a
    footprint that eats the room of the activations makes the planner recompute or cut the model finer."""
    cluster = _cluster("T4", 4)
    profile = build_profile("gpt2-xl", precision="fp16")  # 1.6e9 parameters on four 16 GB T4s: tight
    lean = replace(profile, memory_footprint=(("T4", 0.0, 0.0),))
    heavy = replace(profile, memory_footprint=(("T4", 4 * GB, 0.1),))
    plans = {name: plan(cluster, p, 16, strategy="pp") for name, p in (("lean", lean), ("heavy", heavy))}
    for name, p in plans.items():
        for m in p.prediction.memory:
            assert m.peak_bytes <= (1 - MEMORY_MARGIN_FRACTION) * m.capacity_bytes * (1 + 1e-9), (name, m)
        stage_bytes = {s.device: s.predicted_memory_bytes for vw in p.virtual_workers for s in vw.stages}
        fp = runtime_footprint(p.profile, cluster.devices[0])
        for m in p.prediction.memory:
            assert m.peak_bytes == pytest.approx(fp.device_bytes(stage_bytes[m.device]), rel=1e-9)
    # the heavy footprint leaves less room for activations: more recomputation, or smaller micro-batches
    recomputed = {name: sum(len(s.recompute) for vw in p.virtual_workers for s in vw.stages)
                  for name, p in plans.items()}
    assert recomputed["heavy"] > recomputed["lean"], recomputed
    assert plans["heavy"].prediction.samples_per_s < plans["lean"].prediction.samples_per_s
    # the simulator reports the same device peak as the closed form
    sim = simulate(plans["heavy"])
    for m in plans["heavy"].prediction.memory:
        assert sim.devices[m.device].peak_memory_bytes == pytest.approx(m.peak_bytes, rel=1e-6)


def test_the_plan_summary_prints_the_margin_per_device() -> None:
    p = plan(_cluster("T4", 2), build_profile("gpt2-small", precision="fp16"), 8, strategy="dp")
    text = p.summary()
    for m in p.prediction.memory:
        free = m.capacity_bytes - m.peak_bytes
        assert f"({free / m.capacity_bytes:.0%})" in text
    assert text.count("margin") == len(p.prediction.memory)

"""The noise common to all layers of a device type: measured by the profiler, carried by the profile, merged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hetrain.fit import estimate_common_spread
from hetrain.profile import ProfileError, load_profile, parse_profile, relabel_profile
from hetrain.profile_combine import average_profiles, merge_profiles
from hetrain.profiler.layers import measure_layers


def _layers() -> list[nn.Module]:
    return [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)]


def test_common_spread_is_what_the_sum_strays_beyond_its_independent_parts() -> None:
    # 4 parts of 0.25 s, each with a spread of 0.01 s: independent, the sum strays by sqrt(4) * 0.01 = 0.02
    assert estimate_common_spread(0.02, [0.01] * 4, 1.0) == pytest.approx(0.0)
    assert estimate_common_spread(0.015, [0.01] * 4, 1.0) == 0.0  # less than independent parts: none
    # all four move together by 1% of their time: the sum by 0.04 = sqrt(0.02^2 + (c * 1.0)^2) with c ~ 3.5%
    assert estimate_common_spread(0.04, [0.01] * 4, 1.0) == pytest.approx(math.sqrt(0.04 ** 2 - 4e-4))
    assert estimate_common_spread(0.1, [], 0.0) == 0.0
    assert estimate_common_spread(5.0, [], 1.0) == 1.0  # clipped


def _raw(common: object = None, times: tuple[float, float] = (0.1, 0.1)) -> dict[str, object]:
    layer = [{"name": f"l{i}", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
              "forward_flops_per_sample": 10, "measured": {"cpu": [{"micro_batch": 2, "forward_s": t,
                                                                    "backward_s": 2 * t}]}}
             for i, t in enumerate(times)]
    return {"name": "m", "input_bytes_per_sample": 8, "layers": layer,
            **({} if common is None else {"common_spread": common})}


def test_old_profiles_load_without_it_and_bad_figures_are_named(tmp_path: Path) -> None:
    old = parse_profile(_raw())
    assert old.common_spread == () and old.common_spread_of("cpu") == 0.0
    assert "common_spread" not in old.to_dict()
    new = parse_profile(_raw({"cpu": 0.04}))
    assert new.common_spread_of("cpu") == 0.04
    path = tmp_path / "p.json"
    new.save(path)
    assert json.loads(path.read_text())["common_spread"] == {"cpu": 0.04}
    assert load_profile(path).common_spread == (("cpu", 0.04),)
    with pytest.raises(ProfileError, match=r"common_spread\['cpu'\] must be a fraction of the time in \[0, 1\], "
                                           r"got -0\.1"):
        parse_profile(_raw({"cpu": -0.1}))
    with pytest.raises(ProfileError, match=r"common_spread must be an object \{device type: fraction\}, got 3"):
        parse_profile(_raw(3))
    path.write_text(json.dumps(_raw({"cpu": "x"})))
    with pytest.raises(ProfileError, match=rf"{path.name}: common_spread\['cpu'\] .* got 'x'"):
        load_profile(path)


def test_a_real_profile_measures_the_whole_model_per_repeat_and_records_its_common_spread() -> None:
    m = measure_layers(_layers(), torch.randn(1, 32), (1, 4), repeats=4, warmup=1, optimizers=())
    assert len(m.model_times_s) == 4 and all(t > 0 for t in m.model_times_s)
    common = m.common_spread()
    assert common is not None and 0 <= common <= 1
    assert m.to_profile().common_spread == (("cpu", common),)
    assert f"common to all layers: {100 * common:.1f}%" in m.table()
    # in blocks of calls (a device under a CPU quota) too
    blocks = measure_layers(_layers(), torch.randn(1, 32), (2,), repeats=3, warmup=0, min_time_s=0.005,
                            optimizers=())
    assert len(blocks.model_times_s) == 3 and blocks.common_spread() is not None
    # one repeat: nothing to tell, nothing written
    once = measure_layers(_layers(), torch.randn(1, 32), (2,), repeats=1, warmup=0, optimizers=())
    assert once.model_times_s == () and once.common_spread() is None
    assert once.to_profile().common_spread == ()


def test_devices_of_a_type_apart_by_a_common_shift_give_the_type_a_common_spread() -> None:
    # two devices of one type, one 10% slower in every layer: a shift common to all layers
    a = parse_profile(_raw(times=(0.10, 0.10, 0.10, 0.10)))
    b = parse_profile(_raw(times=(0.11, 0.11, 0.11, 0.11)))
    merged = average_profiles([a, b])
    # whole model 1.2 s and 1.32 s (forward + backward): spread 0.06 / 1.349; each layer's 0.015 / 1.349
    expected = math.sqrt((0.06 / 1.349) ** 2 - 4 * (0.015 / 1.349) ** 2) / 1.26
    assert merged.common_spread_of("cpu") == pytest.approx(expected)
    # the same sum reached by layers that differ the other way: independent, no common shift
    c = parse_profile(_raw(times=(0.11, 0.10, 0.11, 0.10)))
    d = parse_profile(_raw(times=(0.10, 0.11, 0.10, 0.11)))
    assert average_profiles([c, d]).common_spread_of("cpu") == 0.0
    # the devices' own figures count too: the larger of their median and the one between them
    own = [parse_profile(_raw({"cpu": c}, (0.1, 0.1, 0.1, 0.1))) for c in (0.2, 0.1)]
    assert average_profiles(own).common_spread_of("cpu") == pytest.approx(0.15)
    # relabelled and merged as merge_node_profiles does: each type keeps its own
    fast = relabel_profile(parse_profile(_raw({"cpu": 0.02})), "cpu-a")
    slow = relabel_profile(parse_profile(_raw({"cpu": 0.07})), "cpu-b")
    both = merge_profiles([fast, slow])
    assert (both.common_spread_of("cpu-a"), both.common_spread_of("cpu-b")) == (0.02, 0.07)

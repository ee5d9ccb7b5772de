"""The spread of each layer time over the profiler's repeats: measured, written, read back, merged."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch
from torch import nn

from hetrain.profile import Measurement, ProfileError, load_profile, parse_profile, relabel_profile
from hetrain.profile_combine import average_profiles, merge_profiles
from hetrain.profiler.layers import estimate_spread, measure_layers, profile_layers


def _layers() -> list[nn.Module]:
    return [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)]


def test_estimate_spread_is_the_interquartile_range_over_1_349() -> None:
    assert estimate_spread([1.0]) is None
    assert estimate_spread([]) is None
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")  # 2 and 4
    assert estimate_spread(values) == pytest.approx((q3 - q1) / 1.349)
    # one outlier does not move it: the IQR of the five is the same
    assert estimate_spread([1.0, 2.0, 3.0, 4.0, 500.0]) == pytest.approx(estimate_spread(values))
    assert estimate_spread([2.0, 2.0, 2.0]) == 0.0


def test_a_real_profile_records_the_spread_and_reads_it_back(tmp_path: Path) -> None:
    profile = profile_layers(_layers(), torch.randn(1, 32), micro_batches=(1, 4), repeats=5, warmup=1)
    for layer in profile.layers:
        ms = layer.measurements("cpu")
        assert [m.micro_batch for m in ms] == [1, 4]
        for m in ms:
            assert m.forward_spread_s is not None and m.forward_spread_s >= 0
            assert m.backward_spread_s is not None and m.backward_spread_s >= 0
    path = tmp_path / "profile.json"
    profile.save(path)
    raw = json.loads(path.read_text())
    assert {"forward_spread_s", "backward_spread_s"} <= set(raw["layers"][0]["measured"]["cpu"][0])
    assert load_profile(path).layers == profile.layers
    # one repeat: nothing to tell, nothing written
    once = measure_layers(_layers(), torch.randn(1, 32), (2,), repeats=1, warmup=0, optimizers=())
    assert once.layers[0].spreads_s == ((None, None),)
    one = once.to_profile().layers[0].measurements("cpu")[0]
    assert (one.forward_spread_s, one.backward_spread_s) == (None, None)
    assert "forward_spread_s" not in one.to_dict()


def test_blocks_of_calls_record_their_spread_too() -> None:
    m = measure_layers(_layers()[:1], torch.randn(1, 32), (2,), repeats=3, warmup=0, min_time_s=0.005,
                       optimizers=())
    (fwd, bwd), = m.layers[0].spreads_s
    assert fwd is not None and fwd >= 0 and bwd is not None and bwd >= 0


def _raw(measured: dict[str, object]) -> dict[str, object]:
    return {"name": "m", "input_bytes_per_sample": 8, "layers": [
        {"name": "a", "param_bytes": 4, "output_bytes_per_sample": 4, "saved_bytes_per_sample": 4,
         "forward_flops_per_sample": 10, "measured": {"cpu": [measured]}}]}


def test_old_profiles_read_as_spread_unknown_and_bad_spreads_are_named() -> None:
    old = parse_profile(_raw({"micro_batch": 2, "forward_s": 0.1, "backward_s": 0.2}))
    m = old.layers[0].measurements("cpu")[0]
    assert (m.forward_spread_s, m.backward_spread_s) == (None, None)
    with pytest.raises(ProfileError, match=r"layers\[0\]\.measured\['cpu'\]\[0\]\.forward_spread_s"):
        parse_profile(_raw({"micro_batch": 2, "forward_s": 0.1, "backward_s": 0.2, "forward_spread_s": -1}))
    with pytest.raises(ProfileError, match="backward_spread_s"):
        parse_profile(_raw({"micro_batch": 2, "forward_s": 0.1, "backward_s": 0.2, "backward_spread_s": "x"}))
    with pytest.raises(ProfileError, match=r"forward_spread_s must be a finite number of seconds >= 0, got -0\.5"):
        Measurement(1, 0.1, 0.2, "measured", -0.5)


def _one_layer(forward_s: float, spread_s: float | None):
    return parse_profile(_raw({"micro_batch": 2, "forward_s": forward_s, "backward_s": 2 * forward_s,
                               **({} if spread_s is None else {"forward_spread_s": spread_s,
                                                               "backward_spread_s": 2 * spread_s})}))


def test_merged_and_averaged_profiles_keep_the_spread() -> None:
    # several devices of one type: the larger of their own spread and the spread between their medians
    devices = [_one_layer(f, 0.001) for f in (0.10, 0.11, 0.12)]
    m = average_profiles(devices).layers[0].measurements("cpu")[0]
    assert m.forward_s == pytest.approx(0.11)
    assert m.forward_spread_s == pytest.approx((0.115 - 0.105) / 1.349)  # between devices: larger
    close = [_one_layer(f, 0.05) for f in (0.10, 0.11)]
    assert average_profiles(close).layers[0].measurements("cpu")[0].forward_spread_s == pytest.approx(0.05)
    # one device, unknown spread: unknown still
    assert average_profiles([_one_layer(0.1, None)]).layers[0].measurements("cpu")[0].forward_spread_s is None
    # types merged (relabelled through JSON as merge_node_profiles does): each keeps its own
    a = relabel_profile(_one_layer(0.1, 0.01), "cpu-a")
    b = relabel_profile(_one_layer(0.3, 0.02), "cpu-b")
    both = merge_profiles([a, b]).layers[0]
    assert both.measurements("cpu-a")[0].forward_spread_s == pytest.approx(0.01)
    assert both.measurements("cpu-b")[0].backward_spread_s == pytest.approx(0.04)
    assert dataclasses.replace(both.measurements("cpu-b")[0], forward_spread_s=None).to_dict() == {
        "micro_batch": 2, "forward_s": 0.3, "backward_s": 0.6, "backward_spread_s": 0.04}

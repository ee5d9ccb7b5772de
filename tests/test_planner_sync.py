"""The planner costs every sync mode and reports each one's prediction in the plan."""

from __future__ import annotations

import pytest

from hetrain.cluster import parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import SYNC_MODES
from hetrain.planner import plan


def cloud():  # type: ignore[no-untyped-def]
    return parse_cluster({"node": [
        {"name": "fast", "devices": [{"type": "A100-40GB", "count": 2}], "intra_link": "nvlink3", "nic": "10Gbit/s"},
        {"name": "old", "devices": [{"type": "V100-16GB", "count": 2}], "intra_link": "pcie3", "nic": "10Gbit/s"},
    ]})


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_every_mode_is_costed_and_recorded(mode: str) -> None:
    p = plan(cloud(), build_profile("resnet50"), 128, strategy="dp", sync=mode, simulate_top_k=1,
             sync_options=(("period", 4), ("staleness", 1)))
    assert p.sync == mode and p.options["period"] == 4
    table = p.options["sync_predictions"]
    assert set(table) == set(SYNC_MODES)
    assert p.prediction.sync_s == pytest.approx(table[mode]["sync_s"])
    assert p.prediction.simulated_iteration_s is not None and p.prediction.simulated_iteration_s > 0


def test_relaxed_modes_predict_less_sync_than_bsp_on_a_slow_network() -> None:
    p = plan(cloud(), build_profile("resnet50"), 128, strategy="dp", simulate_top_k=0,
             sync_options=(("period", 4), ("aggregate", 4)))
    table = p.options["sync_predictions"]
    assert table["bsp"]["sync_s"] > 0
    assert table["local-sgd"]["sync_s"] == pytest.approx(table["bsp"]["sync_s"] / 4)
    for mode in ("local-sgd", "daso", "hybrid-ps"):
        assert table[mode]["samples_per_s"] > table["bsp"]["samples_per_s"], mode

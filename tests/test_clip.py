"""Gradient clipping's refusals, before any process group: a bad threshold, and a sync mode other than bsp.

(That the clipped norm and weights equal one process's: tests/distributed/test_runtime_clip_lr.py.)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from hetrain.cluster import load_cluster
from hetrain.errors import InputError
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan
from hetrain.planner import plan as build_plan

pytest.importorskip("torch")

from hetrain.models.user import resolve_model
from hetrain.runtime.config import OptimConfig, TrainConfig
from hetrain.runtime.step.clip import check_clip
from hetrain.runtime.trainer import Trainer

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "small-hetero.toml"


@pytest.fixture(scope="module")
def bsp_plan() -> Plan:
    return build_plan(load_cluster(CLUSTER), build_profile("mlp"), 16, simulate_top_k=0)


def test_no_clipping_and_a_positive_threshold_under_bsp_pass(bsp_plan: Plan) -> None:
    assert bsp_plan.sync == "bsp"
    check_clip(bsp_plan, None)
    check_clip(bsp_plan, 0.5)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_threshold_that_is_not_a_finite_positive_number_is_refused(bsp_plan: Plan, value: float) -> None:
    with pytest.raises(InputError, match=f"clipping norm must be a finite number > 0, got {value}"):
        check_clip(bsp_plan, value)


@pytest.mark.parametrize("mode", ["wsp", "hybrid-ps", "daso", "local-sgd"])
def test_clipping_under_another_sync_mode_is_refused_by_the_trainer_before_any_process_group(
        bsp_plan: Plan, mode: str) -> None:
    plan = dataclasses.replace(bsp_plan, sync=mode)  # type: ignore[arg-type]
    check_clip(plan, None)  # no clipping: any mode
    with pytest.raises(InputError, match=f"needs the bsp sync mode; the plan's is '{mode}'"):
        Trainer(resolve_model("mlp"), plan, TrainConfig(optim=OptimConfig(clip_grad_norm=1.0)))

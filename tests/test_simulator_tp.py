"""The simulator costs a plan of TP stages as the planner sees it: one rank per group, a k-th of the node's network.

The plans are measured runs converted to TP stages (tests/data/sailor, ``hetrain.imports.sailor``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hetrain.cluster import tp_cluster
from hetrain.cost import tp_rank_profile
from hetrain.imports.sailor import convert_plan, load_sailor_data
from hetrain.plan import Plan
from hetrain.simulator import simulate

DATA = Path(__file__).resolve().parent / "data" / "sailor"


def planner_view(plan: Plan) -> Plan:
    """The plan as the planner made it at TP k: on ``tp_cluster`` and one rank's profile, stages on group leads."""
    k = plan.max_tp
    vws = tuple(replace(vw, stages=tuple(replace(s, tp_group=()) for s in vw.stages)) for vw in plan.virtual_workers)
    return replace(plan, cluster=tp_cluster(plan.cluster, k), profile=tp_rank_profile(plan.profile, k),
                   virtual_workers=vws)


@pytest.mark.parametrize("plan_id", ["clariden/OPT-350/N2/N2_D1", "superseded/mit/N4/N4_D2@37ded10"])
def test_a_plan_of_tp_stages_simulates_as_the_planners_view_of_it(plan_id: str) -> None:
    """Pipeline transfers (the GH200 plan) and gradient rings across nodes (the Titan-RTX / RTX-2080 plan): each
    rank moves its k-th over a k-th of the NIC, so a group moves the whole at the node's bandwidth."""
    data = load_sailor_data(DATA)
    plan = convert_plan(next(p for p in data.plans if p["id"] == plan_id), data).plan
    assert plan.max_tp == 4
    assert simulate(plan).iteration_s == pytest.approx(simulate(planner_view(plan)).iteration_s, rel=1e-12)

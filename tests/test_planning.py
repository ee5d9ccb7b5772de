"""``hetrain.planning``: the planner wired to the simulator once, and the pure families a plan is compared with."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

import hetrain
from hetrain.cli import main
from hetrain.cluster import load_cluster, parse_cluster
from hetrain.models.analytic import build_mlp_profile, build_profile
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planner.budget import PlannerReport
from hetrain.planner.search import REPORT_KEY
from hetrain.planning import (
    PLAN_SHARE,
    PLANNER_KEY,
    FamiliesBeside,
    plan_and_compare,
    plan_families,
    plan_with_simulator,
)
from hetrain.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "small-hetero.toml"


def test_hetrain_plan_is_the_planner_with_the_simulator() -> None:
    assert hetrain.plan is plan_with_simulator
    made = hetrain.plan(load_cluster(CLUSTER), build_profile("mlp"), 16, simulate_top_k=2, time_budget_s=None)
    assert made.prediction.simulated_iteration_s == pytest.approx(simulate(made).iteration_s)
    assert made.options[PLANNER_KEY]["simulate_top_k"] == 2 and "sync_options" not in made.options[PLANNER_KEY]


def test_options_and_keywords_together_replace_the_options_fields() -> None:
    cluster, profile = load_cluster(CLUSTER), build_profile("mlp")
    made = plan_with_simulator(cluster, profile, 16, PlannerOptions(strategy="pp"), simulate_top_k=0)
    assert made.strategy == "pp" and made.prediction.simulated_iteration_s is None
    assert made.options[PLANNER_KEY]["strategy"] == "pp"


def test_the_families_are_dp_then_pp_planned_with_the_options_given() -> None:
    cluster, profile = load_cluster(CLUSTER), build_profile("mlp")
    dp, pp = plan_families(cluster, profile, 16, PlannerOptions(simulate_top_k=1, optimizer="sgd",
                                                                 global_batch_choices=(8, 32)))
    assert (dp.strategy, dp.label, pp.strategy, pp.label) == ("dp", "pure data parallelism", "pp", "pure pipeline")
    assert dp.required().strategy == "dp" and all(len(vw.stages) == 1 for vw in dp.required().virtual_workers)
    assert pp.required().strategy == "pp" and len(pp.required().virtual_workers) == 1
    for family in (dp, pp):
        plan = family.required()
        assert plan.optimizer == "sgd" and plan.global_batch == 16  # no other global batch tried
        assert plan.prediction.simulated_iteration_s is not None


def test_a_family_that_fits_nowhere_says_why_and_raises_when_required() -> None:
    """One layer larger than any device: no pure data-parallel replica fits; a pipeline may still."""
    tiny = parse_cluster({"name": "tiny", "node": [{"name": "n0", "devices": [
        {"type": "cpu", "memory": "64MB", "tflops": 0.01, "memory_bandwidth": "10GB/s", "count": 2}]}]})
    profile = build_mlp_profile([4096, 4096, 4096, 10], name="wide")
    families = plan_families(tiny, profile, 8, PlannerOptions(simulate_top_k=0, optimizer="sgd"))
    dp = families[0]
    assert dp.plan is None and isinstance(dp.error, PlannerError)
    with pytest.raises(PlannerError):
        dp.required()


def test_the_plan_and_its_families_share_one_time_budget_and_the_plan_records_the_whole() -> None:
    """``hetrain plan``'s planning: the plan in PLAN_SHARE of the budget, the families in what is left, each half
    of it at most; every row simulated; the plan records the whole budget, which a re-plan is given."""
    compared = plan_and_compare(load_cluster(CLUSTER), build_profile("mlp"), 16, PlannerOptions(time_budget_s=4.0),
                                beside=False)
    best, (dp, pp) = compared.plan, compared.families
    assert not compared.beside
    assert best.options[PLANNER_KEY]["time_budget_s"] == 4.0
    assert PlannerReport.from_dict(best.options[REPORT_KEY]).time_budget_s == 4.0
    left = 4.0 - compared.plan_s
    assert dp.required().options[PLANNER_KEY]["time_budget_s"] <= left / 2 + 1e-9
    assert pp.required().options[PLANNER_KEY]["time_budget_s"] <= left
    assert all(p.prediction.simulated_iteration_s for p in (best, dp.required(), pp.required()))
    assert compared.took_s == compared.plan_s + compared.families_s


def test_the_families_planned_beside_the_plan_are_those_planned_after_it() -> None:
    """Beside the plan, in a forked process, the families are planned with the same options (no budget here, so
    the same work): the same plans, whose cluster and profile are the caller's own objects, not copies."""
    cluster, profile = load_cluster(CLUSTER), build_profile("mlp")
    opts = PlannerOptions(time_budget_s=None, simulate_top_k=2)
    after = plan_and_compare(cluster, profile, 16, opts, beside=False)
    ahead = plan_and_compare(cluster, profile, 16, opts, beside=True)
    assert ahead.beside and not after.beside and ahead.plan.to_dict() == after.plan.to_dict()
    assert [f.required().to_dict() for f in ahead.families] == [f.required().to_dict() for f in after.families]
    assert all(f.required().cluster is cluster and f.required().profile is profile for f in ahead.families)
    timed = plan_and_compare(cluster, profile, 16, PlannerOptions(time_budget_s=4.0), beside=True)
    assert timed.beside and timed.took_s == timed.plan_s + timed.families_s
    # beside the plan the families share the rest of the budget from the start, each half of it at most
    assert timed.families[0].required().options[PLANNER_KEY]["time_budget_s"] <= (1 - PLAN_SHARE) * 4.0 / 2 + 1e-9


def test_a_family_process_that_fails_or_does_not_answer_is_none_and_reaped() -> None:
    """Where the child fails (here a global batch that is no number) or has not answered in time, ``result`` is None
    (the caller plans the families itself) and ``stop`` leaves no child behind."""
    cluster, profile = load_cluster(CLUSTER), build_profile("mlp")
    broken = FamiliesBeside.start(cluster, profile, "many", PlannerOptions())  # type: ignore[arg-type]
    assert broken is not None
    pid = broken.pid
    assert broken.result(60.0) is None
    broken.stop()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert gc.get_freeze_count() == 0  # the objects frozen over the child's life are the collector's again
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        slow = FamiliesBeside.start(cluster, profile, 16, PlannerOptions(time_budget_s=None))
        assert slow is not None
        pid = slow.pid
        assert slow.result(0.0) is None
        slow.stop()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_hetrain_plan_past_its_budget_simulates_every_row_and_says_what_it_took(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "mlp", "--global-batch", "16",
                 "--time-budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "predicted against the pure families on the same cluster (simulated):" in out  # every row simulated
    over = [line for line in out.splitlines() if line.startswith("time budget 0 s: took ")]
    assert len(over) == 1 and "(the plan " in over[0] and "the chosen plan's simulation alone " in over[0] \
        and "; the comparison rows " in over[0], over
    planner = next(line for line in out.splitlines() if line.startswith("planner: "))
    assert "(time budget 0 s; simulation stopped by the time budget; the chosen plan simulated past it in " in planner

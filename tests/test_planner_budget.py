"""The planner within a time budget: parsing --time-budget, the clock's estimates, and the report's counts.

The counts are one search's: the plans here pin ``leave_out`` off (the planning without a node, which shares
the budget, is tested in test_planner.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

import hetrain
from hetrain.cli import main
from hetrain.commands.plan_inputs import parse_time_budget
from hetrain.cost import estimate_1f1b_period, estimate_stage_memory, in_flight, tensor_budget, tp_rank_profile
from hetrain.errors import InputError
from hetrain.plan import Plan, load_plan
from hetrain.planner import PlannerOptions, plan, search
from hetrain.planner.budget import (
    ESTIMATE_HEADROOM,
    PlannerReport,
    TimeBudget,
    format_budget_overrun,
    format_planner_report,
    simulation_size,
)
from hetrain.planner.search import REPORT_KEY, SIMULATE_AT_LEAST, _as_schedule, candidate_plans

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "pipetorch.toml"  # 8 devices: 7 candidates for gpt2-small at 64


def _instance() -> tuple[hetrain.Cluster, hetrain.ModelProfile]:
    return hetrain.load_cluster(CLUSTER), hetrain.build_profile("gpt2-small")


def _counting(score: Callable[[Plan], float]) -> tuple[Callable[[Plan], float], list[Plan]]:
    calls: list[Plan] = []

    def counted(p: Plan) -> float:
        calls.append(p)
        return score(p)
    return counted, calls


def _report(p: Plan) -> PlannerReport:
    return PlannerReport.from_dict(p.options[REPORT_KEY])


@pytest.mark.parametrize(("text", "seconds"), [("10s", 10.0), ("10", 10.0), ("1.5s", 1.5), ("2m", 120.0),
                                               ("2min", 120.0), (" 0.25 s ", 0.25), ("0", 0.0), ("none", None)])
def test_time_budget_reads_seconds_and_minutes(text: str, seconds: float | None) -> None:
    assert parse_time_budget(text) == seconds


@pytest.mark.parametrize("text", ["3x", "ten", "", "-1s", "5ms", "2h", "inf", "nan", "100000s"])
def test_a_bad_time_budget_names_the_flag_and_the_value(text: str) -> None:
    with pytest.raises(InputError) as refused:
        parse_time_budget(text)
    message = str(refused.value)
    assert message.startswith(f"--time-budget {text!r}:") and "\n" not in message


def test_planner_options_refuse_a_negative_budget_or_top_k() -> None:
    with pytest.raises(ValueError, match="time_budget_s must be a finite number of seconds >= 0 or None, got -1"):
        PlannerOptions(time_budget_s=-1.0)
    with pytest.raises(ValueError, match="simulate_top_k must be >= 0 or None, got -2"):
        PlannerOptions(simulate_top_k=-2)


def test_the_clock_lets_the_first_simulation_start_then_estimates_by_plan_size() -> None:
    now = [100.0]
    budget = TimeBudget(10.0, clock=lambda: now[0])
    p = candidate_plans(*_instance(), 64, 1)[0]
    assert budget.fits([p])  # nothing measured yet: the first one runs while any budget is left
    now[0] += 8.5  # the search took 8.5 s

    def takes_half_a_second(plan_: Plan) -> float:
        now[0] += 0.5
        return 1.0
    budget.timed(takes_half_a_second)(p)
    assert budget.simulations == 1 and budget.elapsed_s() == pytest.approx(9.0)
    assert budget.estimate_s([p]) == pytest.approx(0.5)
    assert budget.seconds_per_size == pytest.approx(0.5 / simulation_size(p))
    assert ESTIMATE_HEADROOM == 1.5
    assert budget.fits([p]) and not budget.fits([p, p])  # 1 s left: one more fits (0.75 s), two do not (1.5 s)
    now[0] += 0.6
    assert not budget.fits([p])  # 0.4 s left: the 0.5 s estimate fits bare, not with its headroom
    now[0] += 0.5
    assert budget.left_s() < 0 and not budget.fits([p]) and not budget.fits([])
    assert TimeBudget(None).fits([p] * 1000)


def test_a_budget_too_small_for_any_simulation_still_simulates_the_chosen_plan() -> None:
    """A plan the simulator has not checked is not a plan: with no budget left after the search, the closed
    forms' best is simulated all the same (one simulation, counted, its seconds recorded), and nothing else."""
    cluster, profile = _instance()
    counted, calls = _counting(hetrain.simulated_iteration_s)
    tiny = plan(cluster, profile, 64, leave_out=False, score=counted, time_budget_s=0.0)
    assert len(calls) == 1 and calls[0].virtual_workers == tiny.virtual_workers
    assert tiny.prediction.simulated_iteration_s == pytest.approx(hetrain.simulate(tiny).iteration_s)
    report = _report(tiny)
    assert report.past_budget_s is not None and report.past_budget_s > 0
    assert report == PlannerReport(7, 1, 1, 1, "time budget", 0.0, report.past_budget_s)  # the best screened
    assert "; the chosen plan simulated past it in " in format_planner_report(report)
    closed = plan(cluster, profile, 64, leave_out=False, simulate_top_k=0, refine_top_k=1,
                  time_budget_s=0.0)  # nothing past it, and no simulation asked for: the closed forms' best alone
    assert closed.prediction.simulated_iteration_s is None and REPORT_KEY in closed.options
    assert tiny.to_dict() == {**closed.to_dict(), "options": tiny.to_dict()["options"],
                              "prediction": tiny.to_dict()["prediction"]}  # the closed forms' best, simulated
    assert "past_budget_s" not in _report(closed).to_dict()  # recorded only where set: the same file each run


def test_hetrain_plan_simulates_its_chosen_plan_on_every_path_under_a_zero_budget() -> None:
    """``hetrain.plan`` with its defaults (the plan without a node, sharding, every TP degree): the plan returned
    is simulated, and under ``--sync auto`` the mode the closed forms chose is simulated too."""
    cluster, profile = _instance()
    for sync in ("bsp", "auto"):
        made = hetrain.plan(cluster, profile, 64, sync=sync, time_budget_s=0.0)
        assert made.prediction.simulated_iteration_s == pytest.approx(hetrain.simulate(made).iteration_s), sync
        assert _report(made).past_budget_s is not None, sync


@pytest.mark.slow  # plans and simulates many candidates
def test_a_large_budget_simulates_the_best_few() -> None:
    cluster, profile = _instance()
    counted, calls = _counting(hetrain.simulated_iteration_s)
    large = plan(cluster, profile, 64, leave_out=False, score=counted, time_budget_s=None)
    report = _report(large)
    assert report.simulated >= SIMULATE_AT_LEAST + 1 and report.simulations == len(calls) == report.simulated
    assert report.stopped_by in ("closed form", "all candidates") and large.prediction.simulated_iteration_s
    assert report.screened == 7 and report.searched >= 3  # the top 3, and those past them that may still win
    # every candidate the planner simulated is one of the search's, or the best one's reverse
    assert report.simulated <= len(search(cluster, profile, 64, PlannerOptions())) + 1


@pytest.mark.slow  # plans and simulates many candidates
def test_simulate_top_k_given_is_an_upper_bound() -> None:
    cluster, profile = _instance()
    counted, calls = _counting(hetrain.simulated_iteration_s)
    p = plan(cluster, profile, 64, leave_out=False, score=counted, simulate_top_k=2, time_budget_s=None)
    report = _report(p)
    # the best 2, and the best one's reverse where it has one; each of those two also under 1F1B-eager and
    # GPipe where they fit (schedule auto; here 1F1B-eager only: GPipe holds more than these GPUs have)
    assert report.simulated == len(calls) == 5
    assert sum(c.schedule == "1f1b" for c in calls) == 3 and sum(c.schedule == "1f1b-eager" for c in calls) == 2
    assert report.stopped_by == "simulate_top_k"
    every = plan(cluster, profile, 64, leave_out=False, score=hetrain.simulated_iteration_s, simulate_top_k=50,
                 time_budget_s=None)
    assert _report(every).stopped_by == "all candidates" and _report(every).simulated == 10  # 7, the reverse, 2
    only = plan(cluster, profile, 64, leave_out=False, score=hetrain.simulated_iteration_s, simulate_top_k=50,
                time_budget_s=None, schedule="1f1b")
    assert _report(only).simulated == 8  # 7 and the reverse


@pytest.mark.slow  # plans and simulates many candidates
def test_a_budget_that_runs_out_stops_before_the_next_simulation_and_overruns_by_at_most_one() -> None:
    """A scoring function that takes 0.2 s per thousand actions of the plan (0.7 s for all 8 candidates): the
    planner stops where the next estimate no longer fits, and exceeds the budget by no more than the one
    simulation it let start."""
    cluster, profile = _instance()
    per_size_s = 2e-4

    def slow_score(p: Plan) -> float:
        time.sleep(per_size_s * simulation_size(p))
        return hetrain.simulated_iteration_s(p)
    unlimited = plan(cluster, profile, 64, leave_out=False, score=slow_score, simulate_top_k=50, time_budget_s=None)
    start = time.perf_counter()
    search(cluster, profile, 64, PlannerOptions())
    search_s = time.perf_counter() - start
    one_simulation_s = 0.0  # the dearest simulation, the sleep and the simulator's own time
    for p in candidate_plans(cluster, profile, 64, 8):
        start = time.perf_counter()
        slow_score(p)
        one_simulation_s = max(one_simulation_s, time.perf_counter() - start)
    budget_s = 2 * search_s + 0.3  # the search (twice, for a busy machine), then about 0.3 s of simulations
    start = time.perf_counter()
    cut = plan(cluster, profile, 64, leave_out=False, score=slow_score, simulate_top_k=50, time_budget_s=budget_s)
    took_s = time.perf_counter() - start
    report = _report(cut)
    assert report.stopped_by == "time budget"
    assert 1 <= report.simulated < _report(unlimited).simulated
    assert took_s <= budget_s + 2 * one_simulation_s  # one simulation over, and as much for a busy machine
    assert cut.prediction.simulated_iteration_s is not None


@pytest.mark.slow  # plans and simulates many candidates
def test_sync_auto_counts_the_simulations_of_every_mode_where_they_fit() -> None:
    cluster, profile = _instance()
    counted, calls = _counting(hetrain.simulated_iteration_s)
    p = plan(cluster, profile, 64, leave_out=False, score=counted, sync="auto", time_budget_s=None)
    report = _report(p)
    assert report.simulations == len(calls) == report.simulated + 5  # and the 5 sync modes of the chosen plan
    assert p.options["sync_choice"]["modes"][0]["simulated"]
    calls.clear()
    p = plan(cluster, profile, 64, leave_out=False, score=counted, sync="auto", time_budget_s=0.0)
    assert not p.options["sync_choice"]["modes"][0]["simulated"]  # the closed forms chose the mode
    # bsp's plan simulated past the budget, and the chosen mode's where it is another (bsp's reused)
    assert len(calls) == _report(p).simulations == (1 if p.sync == "bsp" else 2)
    assert p.prediction.simulated_iteration_s == pytest.approx(hetrain.simulate(p).iteration_s)


def test_the_report_reads_as_the_issue_asks() -> None:
    text = format_planner_report(PlannerReport(18432, 40, 12, 12, "time budget", 10.0), 9.1)
    assert text.startswith("screened 18,432, searched 40, simulated 12 in 9.1 s (time budget 10 s;")
    assert "13 simulations" in format_planner_report(PlannerReport(7, 3, 4, 13, "closed form", None))


def test_a_budget_not_met_is_one_line_with_what_it_took() -> None:
    assert format_budget_overrun(10.0, 8.1, 4.2, 2.1) == \
        "time budget 10 s: took 12.3 s (the plan 8.1 s, the chosen plan's simulation alone 2.1 s; the comparison " \
        "rows 4.2 s)"
    assert format_budget_overrun(10.0, 12.0, 0.5) == "time budget 10 s: took 12.5 s (the plan 12.0 s; the " \
        "comparison rows 0.5 s)"
    assert format_budget_overrun(10.0, 6.0, 3.9) == "" and format_budget_overrun(None, 60.0, 60.0) == ""
    report = PlannerReport(7, 1, 1, 1, "time budget", 0.0, 0.25)
    assert PlannerReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_candidate_plans_are_the_search_in_its_order() -> None:
    cluster, profile = _instance()
    plans = candidate_plans(cluster, profile, 64, 50)
    found = search(cluster, profile, 64, PlannerOptions())
    assert len(plans) == len(found) == 7
    assert [p.prediction.iteration_s for p in plans] == [c.iteration_s for c in found]
    assert all(p.prediction.simulated_iteration_s is None for p in plans)


@pytest.mark.slow  # plans and simulates many candidates
def test_hetrain_plan_prints_and_records_what_the_planner_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "--time-budget", "1m", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    # every planning's candidates: the whole cluster's 7, and those planned without a node (leave_out)
    line = next(x for x in text.splitlines() if x.startswith("planner: screened "))
    assert int(line.split("screened ")[1].split(",")[0]) >= 7, line
    assert int(line.split("searched ")[1].split(",")[0]) >= 3 and ", simulated " in line
    assert "(time budget 60 s;" in line
    saved = load_plan(out)
    assert _report(saved).time_budget_s == 60.0 and saved.options["planner"]["time_budget_s"] == 60.0
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "--time-budget", "abc"]) == 2
    err = capsys.readouterr().err
    assert err == "hetrain plan: error: --time-budget 'abc': expected seconds or minutes such as 10s, 1.5s, 2m, " \
                  "or none for no limit\n"


@pytest.mark.slow  # plans and simulates many candidates
def test_hetrain_plan_json_carries_the_planning_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "--time-budget", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["planning_s"] > 0
    report = PlannerReport.from_dict(data["plan"]["options"][REPORT_KEY])
    assert report.time_budget_s is None and report.stopped_by in ("closed form", "all candidates")


@pytest.mark.slow  # plans and simulates many candidates
def test_a_candidate_past_the_top_three_that_may_still_win_is_searched() -> None:
    """Screening partitions are upper bounds: spread-2 screens at about 0.99 s an iteration with gradients
    all-reduced in bf16, past the top three (best 0.63 s, contig-2), and searches to 0.43 s. The planner searches
    every candidate whose optimistic score beats the best found, within half the budget: with none left for it
    (budget 0: the best screened candidate alone is searched) the plan is slower than the fp32 plan; with it,
    spread-2, at least as fast as in fp32."""
    from hetrain.planner.search import _optimistic_score, _search
    from hetrain.sync_layout import SyncOptions

    cluster, profile = _instance()
    bf16 = SyncOptions(reduce_dtype="bf16")
    opts = PlannerOptions(sync_options=bf16, simulate_top_k=0)
    found, screened, searched = _search(cluster, profile, 64, opts)
    assert screened == 7 and searched > 3
    assert all(_optimistic_score(profile, c, opts) <= c.score(opts) for c in found)  # optimistic indeed
    cut_short = plan(cluster, profile, 64, leave_out=False, sync_options=bf16, simulate_top_k=0, time_budget_s=0.0)
    full = plan(cluster, profile, 64, leave_out=False, sync_options=bf16, simulate_top_k=0)
    fp32 = plan(cluster, profile, 64, leave_out=False, simulate_top_k=0)
    assert cut_short.formation != "spread-2" and cut_short.prediction.samples_per_s < fp32.prediction.samples_per_s
    assert full.formation == "spread-2" and full.prediction.samples_per_s >= fp32.prediction.samples_per_s
    assert _report(full).searched > 3 and _report(cut_short).searched == 1


@pytest.mark.slow  # plans and simulates many candidates
def test_schedule_auto_replays_the_best_under_more_activations_where_they_fit_and_keeps_the_fastest() -> None:
    counted, calls = _counting(hetrain.simulated_iteration_s)
    cluster, medium = hetrain.load_cluster(ROOT / "examples" / "clusters" / "cloud-mixed.toml"), \
        hetrain.build_profile("gpt2-medium")
    # one pipeline over the 20 devices, 32 micro-batches: 1F1B's round trips cost it, GPipe's activations fit
    p = plan(cluster, medium, 32, strategy="pp", score=counted, time_budget_s=None)
    assert p.schedule == "gpipe"
    assert {"1f1b", "1f1b-eager", "gpipe"} <= {c.schedule for c in calls}
    assert p.prediction.simulated_iteration_s < 0.95 * hetrain.simulated_iteration_s(replace(p, schedule="1f1b"))
    _assert_fits(p, cluster, medium)
    assert plan(cluster, medium, 32, strategy="pp", schedule="1f1b").schedule == "1f1b"  # asked for: kept
    # gpt2-small at 64 on pipetorch.toml: under GPipe a stage would hold more than its GPU has, so it is never
    # replayed; one micro-batch more on every stage but the last fits, and is faster
    small_cluster, small = _instance()
    calls.clear()
    eager = plan(small_cluster, small, 64, leave_out=False, score=counted, time_budget_s=None)
    assert eager.schedule == "1f1b-eager"
    assert {c.schedule for c in calls} == {"1f1b", "1f1b-eager"}
    assert eager.prediction.simulated_iteration_s < hetrain.simulated_iteration_s(replace(eager, schedule="1f1b"))
    _assert_fits(eager, small_cluster, small)


def _assert_fits(p: Plan, cluster: hetrain.Cluster, profile: hetrain.ModelProfile) -> None:
    """Every stage of ``p`` holds what its schedule keeps in flight, within its device's tensor budget."""
    for vw in p.virtual_workers:
        for j, stage in enumerate(vw.stages):
            kept = in_flight(p.schedule, vw.micro_batches, len(vw.stages), j)
            assert kept > in_flight("1f1b", vw.micro_batches, len(vw.stages), j) or j == len(vw.stages) - 1
            rank = tp_rank_profile(profile, stage.tp)  # on a TP group: what one rank holds
            assert stage.predicted_memory_bytes == pytest.approx(estimate_stage_memory(
                rank, stage.first_layer, stage.end_layer, stage.recompute, vw.micro_batch_size, kept, "adam"))
            assert stage.predicted_memory_bytes <= tensor_budget(profile, cluster.device(stage.device))


def test_hetrain_plan_takes_the_eager_schedule_and_a_simulation_of_its_file_holds_one_more(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "16",
                 "--strategy", "pp", "--schedule", "1f1b-eager", "-o", str(out)]) == 0
    assert "schedule 1f1b-eager" in capsys.readouterr().out
    saved = load_plan(out)
    assert saved.schedule == "1f1b-eager"
    p = len(saved.virtual_workers[0].stages)
    held = [d.max_in_flight for d in (hetrain.simulate(saved).devices[s.device]
                                      for s in saved.virtual_workers[0].stages)]
    assert held == [in_flight("1f1b-eager", saved.virtual_workers[0].micro_batches, p, j) for j in range(p)]
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "16",
              "--schedule", "1f1b-lazy"])
    assert stopped.value.code == 2
    assert "invalid choice: '1f1b-lazy' (choose from 'auto', 'gpipe', '1f1b', '1f1b-eager')" in \
        capsys.readouterr().err


def test_schedule_auto_prices_each_candidate_by_the_faster_of_1f1b_and_eager_and_keeps_that_form() -> None:
    """Under ``auto`` a candidate partitioned for 1F1B is priced by 1F1B-eager's closed form where eager fits and
    is faster (its cycles through the last stage turn once per micro-batch more, ``cost.estimate_1f1b_period``),
    and keeps that schedule and that form; a variant replayed under another schedule is priced by its own form
    (GPipe: the slowest stage or transfer), not the candidate's."""
    cluster, profile = _instance()
    opts = PlannerOptions(leave_out=False, time_budget_s=None)
    found = search(cluster, profile, 64, opts)
    assert "1f1b-eager" in {c.schedule for c in found}
    for c in found:
        for r in c.parts:
            assert r.max_s == pytest.approx(estimate_1f1b_period(r.stage_s, r.link_s, r.m, c.schedule))
        other = "1f1b" if c.schedule == "1f1b-eager" else "1f1b-eager"
        variant = _as_schedule(cluster, profile, c, opts, other)
        assert c.schedule == "1f1b" or variant is not None  # 1F1B holds less: it always fits where eager does
        if variant is not None:  # the one kept is the faster form (a tie keeps 1F1B, which holds less)
            assert c.score(opts) <= variant.score(opts) and (c.score(opts) < variant.score(opts)
                                                             or c.schedule == "1f1b")
        gpipe = _as_schedule(cluster, profile, c, opts, "gpipe")
        if gpipe is not None:
            assert gpipe.schedule == "gpipe"
            assert [r.max_s for r in gpipe.parts] == [max(r.stage_s + r.link_s) for r in gpipe.parts]
    best = search(cluster, profile, 64, opts)[0]
    p = plan(cluster, profile, 64, leave_out=False, simulate_top_k=0, time_budget_s=None)
    assert (p.schedule, p.prediction.iteration_s) == (best.schedule, pytest.approx(best.iteration_s))

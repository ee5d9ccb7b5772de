"""The overhead per action: profile field, simulator, planner, and its calibration from a run's metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from factories import make_plan, replicas
from hetrain.calibrate import (
    CalibrationError,
    fit_action_overhead,
    measured_iteration_s,
    measured_step_times_s,
    run_calibrate_command,
    with_action_overhead,
)
from hetrain.cluster import Cluster, parse_cluster
from hetrain.cost import estimate_pipeline_time
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan
from hetrain.planner import plan
from hetrain.planner.partition import partition
from hetrain.profile import LayerProfile, Measurement, ModelProfile, ProfileError, load_profile, parse_profile
from hetrain.profile_combine import merge_profiles
from hetrain.simulator import simulate

A100 = "A100-40GB"
V100 = "V100-16GB"


def one_node(count: int) -> Cluster:
    fast = {"bandwidth_bytes_per_s": 1e30, "latency_s": 0.0}
    return parse_cluster({"name": "flat", "node": [{"name": "n0", "devices": [{"type": A100, "count": count}],
                                                    "intra_link": fast, "nic": fast}]})


def uniform_profile(p: int, t_f: float, t_b: float, b: int, overhead_s: float = 0.0) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{j}", 0.0, 1e3, 1e4, 1e9, ((A100, (Measurement(b, t_f, t_b),)),))
                   for j in range(p))
    return ModelProfile("uniform", layers, 1e3, action_overhead_s=((A100, overhead_s),) if overhead_s else ())


def pipeline_plan(p: int, m: int, b: int, profile: ModelProfile, schedule: str = "1f1b") -> Plan:
    return make_plan(one_node(p), profile, [([f"n0:{j}" for j in range(p)], list(range(p + 1)), m * b, m)],
                     schedule=schedule)


# --- the profile field --------------------------------------------------------------


def test_round_trip_lookup_and_default() -> None:
    p = uniform_profile(2, 0.1, 0.2, 1, overhead_s=0.003)
    again = parse_profile(json.loads(json.dumps(p.to_dict())))
    assert again.action_overhead_s == ((A100, 0.003),)
    assert again.action_overhead_of(A100) == 0.003 and again.action_overhead_of(V100) == 0.0
    assert "action_overhead_s" not in uniform_profile(2, 0.1, 0.2, 1).to_dict()  # old profiles write unchanged


@pytest.mark.parametrize(("raw", "message"), [
    ({A100: -0.001}, "action_overhead_s['A100-40GB'] must be a finite number of seconds >= 0, got -0.001"),
    ({A100: "3ms"}, "action_overhead_s['A100-40GB'] must be a finite number of seconds >= 0, got '3ms'"),
    ({A100: float("inf")}, "action_overhead_s['A100-40GB'] must be a finite number"),
    ([0.003], "action_overhead_s must be an object {device type: seconds}, got [0.003]"),
])
def test_bad_overheads_are_refused_with_the_type(raw: object, message: str) -> None:
    data = uniform_profile(2, 0.1, 0.2, 1).to_dict()
    data["action_overhead_s"] = raw
    with pytest.raises(ProfileError) as e:
        parse_profile(data)
    assert message in str(e.value)


def test_merge_keeps_each_types_overhead_later_wins() -> None:
    a = dataclasses.replace(uniform_profile(2, 0.1, 0.2, 1), action_overhead_s=((A100, 0.001), (V100, 0.002)))
    b = dataclasses.replace(uniform_profile(2, 0.1, 0.2, 1), action_overhead_s=((A100, 0.004),))
    merged = merge_profiles([a, b])
    assert merged.action_overhead_of(A100) == 0.004 and merged.action_overhead_of(V100) == 0.002
    replaced = with_action_overhead(a, 0.005, [V100, "T4"])
    assert dict(replaced.action_overhead_s) == {A100: 0.001, V100: 0.005, "T4": 0.005}


# --- the simulator and the planner charge it per action --------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-eager"])
@pytest.mark.parametrize(("p", "m"), [(4, 6), (1, 5), (3, 1)])
def test_every_forward_and_backward_pays_the_overhead(schedule: str, p: int, m: int) -> None:
    t_f, t_b, o = 0.3, 0.7, 0.05
    result = simulate(pipeline_plan(p, m, 2, uniform_profile(p, t_f, t_b, 2, o), schedule))
    expected = (m + p - 1) * (t_f + t_b + 2 * o)
    assert result.iteration_s == pytest.approx(expected, rel=1e-9)
    assert result.iteration_s == pytest.approx(estimate_pipeline_time([t_f + t_b + 2 * o] * p, m), rel=1e-9)
    forwards = [e for e in result.timeline.devices["n0:0"] if e.kind == "forward"]
    assert all(e.end_s - e.start_s == pytest.approx(t_f + o) for e in forwards)


def test_the_partition_holds_the_overhead_in_each_stage() -> None:
    profile = uniform_profile(4, 0.3, 0.7, 2, overhead_s=0.05)
    cluster = one_node(2)
    r = partition(cluster, profile, cluster.devices, b=2, m=4, schedule="1f1b", optimizer="sgd")
    assert r is not None and r.cuts == (0, 2, 4)
    assert r.forward_s == pytest.approx((0.65, 0.65)) and r.backward_s == pytest.approx((1.45, 1.45))
    assert r.stage_s == pytest.approx((2.1, 2.1))


def test_a_large_overhead_makes_the_planner_take_fewer_larger_micro_batches() -> None:
    cluster = parse_cluster({"name": "two", "node": [
        {"name": "a", "devices": [{"type": A100, "count": 2}], "intra_link": "nvlink3", "nic": "100Gbit/s"}]})
    profile = build_profile("gpt-tiny")
    free = plan(cluster, profile, 64, strategy="pp", micro_batch_sizes=(1, 2, 4, 8, 16, 32), simulate_top_k=0)
    step = free.prediction.iteration_s
    costly = plan(cluster, with_action_overhead(profile, step, [A100]), 64, strategy="pp",
                  micro_batch_sizes=(1, 2, 4, 8, 16, 32), simulate_top_k=0)
    assert costly.virtual_workers[0].micro_batches < free.virtual_workers[0].micro_batches
    # the closed form holds the overhead: one iteration costs at least 2 x overhead x micro-batches
    assert costly.prediction.iteration_s >= 2 * step * costly.virtual_workers[0].micro_batches


# --- calibration -------------------------------------------------------------------


def test_the_fit_recovers_the_overhead_behind_a_measurement() -> None:
    bare = pipeline_plan(3, 8, 2, uniform_profile(3, 0.01, 0.02, 2))
    measured = simulate(dataclasses.replace(bare, profile=with_action_overhead(bare.profile, 0.0025, [A100]))
                        ).iteration_s
    found = fit_action_overhead(bare, measured)
    assert found.overhead_s == pytest.approx(0.0025, abs=2e-6)
    assert found.simulated_before_s == pytest.approx(10 * 0.03)
    assert found.simulated_after_s == pytest.approx(measured, rel=1e-4)
    assert "simulated 300 ms without overhead (-14.3%), 350 ms with 2.5 ms per forward and backward" in found.summary()
    # a run no slower than the bare prediction shows no overhead
    assert fit_action_overhead(bare, 0.9 * found.simulated_before_s).overhead_s == 0.0


def test_the_steps_quartiles_give_the_overheads_spread() -> None:
    bare = pipeline_plan(3, 8, 2, uniform_profile(3, 0.01, 0.02, 2))

    def measured(o: float) -> float:
        return simulate(dataclasses.replace(bare, profile=with_action_overhead(bare.profile, o, [A100]))).iteration_s

    # steps whose overheads are 1, 2, 3 and 4 ms: the simulation is linear in the overhead, so the steps'
    # quartiles (positions 1.25 and 3.75 of 4) are those of 1.25 and 3.75 ms, 2.5 ms apart
    steps = [measured(o) for o in (0.004, 0.001, 0.003, 0.002)]
    found = fit_action_overhead(bare, sum(steps) / len(steps), steps_s=steps)
    assert found.overhead_s == pytest.approx(0.0025, abs=2e-6)
    assert found.spread_s == pytest.approx(0.0025 / 1.349, abs=3e-6)
    assert "+- 1.85 ms from step to step" in found.summary()
    # fewer than 4 steps tell nothing of the spread; no steps, none either
    assert fit_action_overhead(bare, steps[0], steps_s=steps[:3]).spread_s == 0.0
    assert fit_action_overhead(bare, steps[0]).spread_s == 0.0 and "from step to step" not in fit_action_overhead(
        bare, steps[0]).summary()
    # steps no slower than the bare prediction imply no overhead: their spread is what the others imply
    fast = found.simulated_before_s * 0.9
    assert fit_action_overhead(bare, steps[0], steps_s=[fast, fast, fast, fast]).spread_s == 0.0
    with pytest.raises(CalibrationError, match="must be a positive number of seconds, got nan"):
        fit_action_overhead(bare, steps[0], steps_s=[*steps, float("nan")])


def test_the_overheads_spread_is_a_profile_field() -> None:
    p = with_action_overhead(uniform_profile(2, 0.1, 0.2, 1), 0.003, [A100, V100], spread_s=0.001)
    again = parse_profile(json.loads(json.dumps(p.to_dict())))
    assert dict(again.action_overhead_spread_s) == {A100: 0.001, V100: 0.001}
    assert again.action_overhead_spread_of(A100) == 0.001 and again.action_overhead_spread_of("T4") == 0.0
    # a later calibration with no spread clears the types it calibrates, and keeps the others'
    cleared = with_action_overhead(again, 0.002, [A100], spread_s=0.0)
    assert dict(cleared.action_overhead_spread_s) == {V100: 0.001}
    assert "action_overhead_spread_s" not in uniform_profile(2, 0.1, 0.2, 1).to_dict()
    data = p.to_dict()
    data["action_overhead_spread_s"] = {A100: -1}
    with pytest.raises(ProfileError, match=r"action_overhead_spread_s\['A100-40GB'\] must be a finite number of "
                                           r"seconds >= 0, got -1"):
        parse_profile(data)
    assert merge_profiles([p, uniform_profile(2, 0.1, 0.2, 1)]).action_overhead_spread_of(V100) == 0.001


def test_the_fit_refuses_a_measurement_that_is_no_time() -> None:
    bare = pipeline_plan(2, 2, 1, uniform_profile(2, 0.01, 0.02, 1))
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        with pytest.raises(CalibrationError, match=f"must be a positive number of seconds, got {bad}"):
            fit_action_overhead(bare, bad)


def write_metrics(path: Path, step_times: list[float]) -> None:
    lines = [json.dumps({"run": "description"})] + [json.dumps({"step": k, "step_time_s": t, "loss": 1.0})
                                                    for k, t in enumerate(step_times)]
    path.write_text("\n".join(lines) + "\n")


def test_measured_iteration_leaves_out_the_warm_up(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    write_metrics(path, [9.0, 9.0, 1.0, 2.0, 3.0])
    assert measured_iteration_s(path, 2) == pytest.approx(2.0)
    assert measured_step_times_s(path, 2) == [1.0, 2.0, 3.0]
    with pytest.raises(CalibrationError, match="has 5 step\\(s\\), none after the 5 warm-up step\\(s\\)"):
        measured_iteration_s(path, 5)
    with pytest.raises(CalibrationError, match="warmup must be >= 0 steps, got -1"):
        measured_iteration_s(path, -1)
    path.write_text('{"step": 0, "step_time_s": 1.0}\n{"step": 1,\n')
    with pytest.raises(CalibrationError, match=r"m\.jsonl:2: not a JSON line"):
        measured_iteration_s(path, 0)
    with pytest.raises(CalibrationError, match="cannot read metrics"):
        measured_iteration_s(tmp_path / "missing.jsonl", 0)


def test_the_command_writes_the_calibrated_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = pipeline_plan(2, 4, 2, uniform_profile(2, 0.01, 0.02, 2))
    bare.save(tmp_path / "plan.json")
    measured = simulate(dataclasses.replace(bare, profile=with_action_overhead(bare.profile, 0.004, [A100])))
    write_metrics(tmp_path / "m.jsonl", [1.0] + [measured.iteration_s] * 4)  # alike: no spread written
    out = tmp_path / "calibrated.json"
    assert run_calibrate_command(str(tmp_path / "plan.json"), str(tmp_path / "m.jsonl"), 1, str(out)) == 0
    text = capsys.readouterr().out
    assert "with 4 ms per forward and backward" in text and f"wrote {out}" in text
    assert load_profile(out).action_overhead_of(A100) == pytest.approx(0.004, abs=2e-6)
    assert load_profile(out).action_overhead_spread_s == ()
    # steps that differ: the profile carries the overhead's spread too
    write_metrics(tmp_path / "m2.jsonl", [1.0] + [measured.iteration_s * f for f in (0.98, 1.0, 1.02, 1.04)])
    assert run_calibrate_command(str(tmp_path / "plan.json"), str(tmp_path / "m2.jsonl"), 1, str(out)) == 0
    assert "from step to step" in capsys.readouterr().out
    assert load_profile(out).action_overhead_spread_of(A100) > 0
    assert run_calibrate_command(str(tmp_path / "plan.json"), str(tmp_path / "m.jsonl"), 9, None) == 2  # bad input
    assert "none after the 9 warm-up step(s)" in capsys.readouterr().err
    # the same through the hetrain command
    from hetrain.cli import main

    assert main(["calibrate", str(tmp_path / "plan.json"), str(tmp_path / "m.jsonl"), "--warmup", "1"]) == 0
    assert "with 4 ms per forward and backward" in capsys.readouterr().out
    assert main(["calibrate", str(tmp_path / "missing.json"), str(tmp_path / "m.jsonl")]) == 2  # bad input
    assert "hetrain calibrate:" in capsys.readouterr().err


# --- metrics are of the plan they calibrate -----------------------------------------------------------------

def data_parallel_plan(b: int, profile: ModelProfile) -> Plan:
    """Two VWs of one stage each (one per device), ``b`` samples each: the same global batch as
    ``pipeline_plan(2, m, 2 * b // m, ...)``."""
    return make_plan(one_node(2), profile, replicas(("n0:0", "n0:1"), profile.num_layers, b))


def write_run_metrics(path: Path, plan: Plan, step_times: list[float], fingerprint: str | None = None) -> None:
    """Step rows of a run of ``plan`` as the runtime writes them (``runtime.report.metrics.MetricsLog``, the trainer's
    fields): samples/s of the global batch, and the sync actions that ended the reporting device's step."""
    pytest.importorskip("torch")
    from hetrain.runtime.report.metrics import MetricsLog
    from hetrain.schedule import build_sync_actions

    log = MetricsLog(path, None, False, len(step_times), 0, plan_fingerprint=fingerprint)
    actions = [str(a) for a in build_sync_actions(plan, plan.devices_used[-1])]
    for k, t in enumerate(step_times):
        log.log({"step": k + 1, "loss": 4.0, "samples_per_s": plan.global_batch / t, "step_time_s": t,
                 "elapsed_s": t * (k + 1), "sync_actions": actions, "lr": 1e-3, "allreduce_bytes": 0})
    log.close()


def test_metrics_of_another_plan_are_refused_naming_both_files(tmp_path: Path, capsys) -> None:
    """Rows without a fingerprint (older runs) are told apart by what they record: here a pipeline's steps end
    with STEP alone, a data-parallel plan's with its all-reduces."""
    from hetrain.cli import main

    profile = uniform_profile(2, 0.01, 0.02, 2)
    pipeline, data_parallel = pipeline_plan(2, 4, 2, profile), data_parallel_plan(4, profile)
    assert pipeline.global_batch == data_parallel.global_batch == 8
    pipeline.save(tmp_path / "pp.json")
    data_parallel.save(tmp_path / "dp.json")
    write_run_metrics(tmp_path / "pp.jsonl", pipeline, [0.1, 0.05, 0.05, 0.05, 0.05])
    assert main(["calibrate", str(tmp_path / "dp.json"), str(tmp_path / "pp.jsonl")]) == 2  # bad input
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{tmp_path / 'pp.jsonl'}:1 was recorded training another plan than {tmp_path / 'dp.json'}" in err
    assert "['STEP']" in err
    assert main(["calibrate", str(tmp_path / "pp.json"), str(tmp_path / "pp.jsonl")]) == 0  # its own plan
    # a run of another global batch
    bigger = pipeline_plan(2, 4, 4, profile)
    write_run_metrics(tmp_path / "big.jsonl", bigger, [0.1, 0.05, 0.05, 0.05, 0.05])
    assert main(["calibrate", str(tmp_path / "pp.json"), str(tmp_path / "big.jsonl")]) == 2  # bad input
    assert "its steps are of 16 samples, the plan's global batch is 8" in capsys.readouterr().err


def test_the_plan_fingerprint_tells_apart_what_the_rows_cannot(tmp_path: Path, capsys) -> None:
    """Two pipelines of the same batch and sync actions, 4 or 8 micro-batches: the runtime's fingerprint tells."""
    from hetrain.plan import PLAN_FINGERPRINT_KEY, plan_fingerprint

    profile = uniform_profile(2, 0.01, 0.02, 1)
    four, eight = pipeline_plan(2, 4, 2, profile), pipeline_plan(2, 8, 1, profile)
    four.save(tmp_path / "four.json")
    eight.save(tmp_path / "eight.json")
    write_run_metrics(tmp_path / "eight.jsonl", eight, [0.1, 0.05, 0.05, 0.05, 0.05], plan_fingerprint(eight))
    rows = [json.loads(line) for line in (tmp_path / "eight.jsonl").read_text().splitlines()]
    assert {r[PLAN_FINGERPRINT_KEY] for r in rows} == {plan_fingerprint(eight)}
    assert run_calibrate_command(str(tmp_path / "four.json"), str(tmp_path / "eight.jsonl"), 1, None) == 2  # bad input
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "four.json") in err and str(tmp_path / "eight.jsonl") in err
    assert f"plan fingerprint '{plan_fingerprint(eight)}'" in err
    assert run_calibrate_command(str(tmp_path / "eight.json"), str(tmp_path / "eight.jsonl"), 1, None) == 0
    # what runs makes the fingerprint; the predictions do not
    again = dataclasses.replace(eight, prediction=dataclasses.replace(eight.prediction, iteration_s=1.0,
                                                                      samples_per_s=8.0, pipeline_s=1.0))
    assert plan_fingerprint(again) == plan_fingerprint(eight) != plan_fingerprint(four)
    assert plan_fingerprint(eight.with_sync("wsp")) != plan_fingerprint(eight)


@pytest.mark.parametrize("mode", ["bsp", "wsp", "hybrid-ps", "daso", "local-sgd"])
def test_every_step_of_every_mode_is_recognised_as_its_plans(mode: str) -> None:
    """The sync actions each device ends each step with, as the trainer builds them (DASO's period halved as it
    adapts), are all the plan's: a long run of its own plan is never refused."""
    from hetrain.calibrate import check_metrics_of_plan
    from hetrain.schedule import advance_sync_state, build_sync_actions, initial_sync_state
    from hetrain.sync_layout import SyncOptions

    profile = uniform_profile(2, 0.01, 0.02, 2)
    plan = data_parallel_plan(4, profile).with_sync(mode, SyncOptions(period=4, aggregate=3, warmup=2, cooldown=3))
    steps = 40
    rows: list[tuple[int, dict]] = []
    state = initial_sync_state(plan)
    for step in range(steps):
        state = dataclasses.replace(state, period=4 if step < 15 else 2 if step < 25 else 1)  # DasoRate halving
        for device in plan.devices_used:
            actions = [str(a) for a in build_sync_actions(plan, device, state, steps)]
            rows.append((len(rows) + 1, {"samples_per_s": 8 / 0.05, "step_time_s": 0.05, "sync_actions": actions}))
        state = advance_sync_state(plan, state, steps)
    check_metrics_of_plan(plan, "plan.json", "metrics.jsonl", rows)
    if mode == "daso":  # warm-up, starts, merges, cool-down: every kind of step was there
        assert len({tuple(r["sync_actions"]) for _, r in rows}) >= 4

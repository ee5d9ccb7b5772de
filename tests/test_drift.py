"""Re-plan on drift (hetrain.drift): the detector's window, threshold and cooldown, the slowed plan, the decision,
and which plan a restart takes (runtime.lifecycle.restart.adopt_drift_plan)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import hetrain
import hetrain.elastic
from hetrain.cluster import parse_cluster
from hetrain.cost import estimate_layer_time
from hetrain.drift import (
    DRIFT_KIND,
    Drift,
    DriftDetector,
    DriftError,
    DriftOptions,
    SwitchCost,
    base_digest_of,
    decide_drift,
    drift_factors_of,
    parse_force,
    predicted_compute_s,
    slowed_plan,
)
from hetrain.elastic import ReplanError, plan_digest
from hetrain.models.analytic import build_mlp_profile
from hetrain.plan import Plan, load_plan

MLP = build_mlp_profile([64, 256, 256, 10], name="mlp-digits")
PREDICTED = {"a": 0.010, "b": 0.020}


def cpus(count: int) -> dict[str, object]:
    return {"name": "cpus", "node": [{"name": "n0", "devices": [{"type": "cpu", "count": count}],
                                      "intra_link": "loopback", "nic": "1Gbit/s"}]}


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The planner's plan for three CPUs, global batch 48: every device works."""
    made = hetrain.plan(parse_cluster(cpus(3)), MLP, 48, optimizer="sgd")
    assert sorted(made.devices_used) == ["n0:0", "n0:1", "n0:2"], made.summary()
    return made


def feed(det: DriftDetector, first: int, steps: int, slow_b: float = 1.0, model_error: float = 1.0) -> list[Drift]:
    """``steps`` steps from ``first``: a at its prediction, b ``slow_b`` times slower; both off the cost model by
    ``model_error``. Returns the drifts seen."""
    out = []
    for s in range(first, first + steps):
        got = det.observe(s, {"a": PREDICTED["a"] * model_error, "b": PREDICTED["b"] * model_error * slow_b})
        if got is not None:
            out.append(got)
    return out


def test_a_drift_fires_after_the_window_of_steps_in_a_row_and_not_before() -> None:
    opts = DriftOptions(threshold=0.3, window_steps=5, cooldown_steps=100, warmup_steps=2)
    det = DriftDetector(PREDICTED, opts)
    assert feed(det, 1, 2 + 5) == []  # warm-up, then the baseline
    assert feed(det, 8, 4, slow_b=1.5) == []  # 4 of 5
    (drift,) = feed(det, 12, 1, slow_b=1.5)
    assert drift.step == 12 and drift.factors == {"b": pytest.approx(1.5)} and not drift.forced
    assert drift.window["a"] == pytest.approx(1.0)


def test_the_models_own_error_is_not_drift() -> None:
    """Both devices 40% slower than the cost model says, from the start: the baseline holds it."""
    det = DriftDetector(PREDICTED, DriftOptions(window_steps=5, warmup_steps=0))
    assert feed(det, 1, 50, model_error=1.4) == []


def test_below_the_threshold_or_broken_runs_do_not_fire() -> None:
    det = DriftDetector(PREDICTED, DriftOptions(threshold=0.3, window_steps=5, warmup_steps=0))
    feed(det, 1, 5)
    assert feed(det, 6, 30, slow_b=1.25) == []  # sustained, but under 30%
    for s in range(36, 66):  # 30% slower four steps in five: never five in a row
        assert det.observe(s, {"a": 0.01, "b": 0.02 * (1.0 if s % 5 == 0 else 1.5)}) is None


def test_noise_does_not_fire_over_500_steps() -> None:
    """Each step +-15% of jitter, and a 3x spike on one step in twenty: no drift."""
    rng = random.Random(0)
    det = DriftDetector(PREDICTED, DriftOptions())
    for s in range(1, 501):
        spike = 3.0 if rng.random() < 0.05 else 1.0
        measured = {d: p * rng.uniform(0.85, 1.15) * (spike if d == "b" else 1.0) for d, p in PREDICTED.items()}
        assert det.observe(s, measured) is None, s


def test_a_device_that_recovers_drifts_the_other_way() -> None:
    det = DriftDetector(PREDICTED, DriftOptions(window_steps=4, warmup_steps=0))
    feed(det, 1, 4, slow_b=3.0)  # its baseline: slow
    (drift,) = feed(det, 5, 4)
    assert drift.factors == {"b": pytest.approx(1 / 3)}


def test_the_cooldown_holds_after_a_decision_and_after_a_drift_plan_takes_over() -> None:
    opts = DriftOptions(window_steps=3, cooldown_steps=20, warmup_steps=0)
    det = DriftDetector(PREDICTED, opts)
    feed(det, 1, 3)
    (drift,) = feed(det, 4, 3, slow_b=2.0)
    det.decided(drift.step)  # a skip: the drift goes on
    assert feed(det, 7, 19, slow_b=2.0) == []  # steps 7..25: within 20 steps of step 6
    assert [d.step for d in feed(det, 26, 1, slow_b=2.0)] == [26]
    taken_over = DriftDetector(PREDICTED, opts, last_decision_step=100)
    feed(taken_over, 101, 3)
    assert feed(taken_over, 104, 16, slow_b=2.0) == [] and len(feed(taken_over, 120, 1, slow_b=2.0)) == 1


def test_a_device_without_work_is_not_watched_and_a_missing_figure_changes_nothing() -> None:
    det = DriftDetector({"a": 0.01, "idle": 0.0}, DriftOptions(window_steps=2, warmup_steps=0))
    assert set(det.tracks) == {"a"}
    for s in range(1, 10):
        assert det.observe(s, {"a": 0.01}) is None


def test_options_out_of_range_are_named() -> None:
    with pytest.raises(DriftError, match="threshold must be a number > 0, got 0"):
        DriftOptions(threshold=0)
    with pytest.raises(DriftError, match="window_steps must be >= 1, got 0"):
        DriftOptions(window_steps=0)
    with pytest.raises(DriftError, match="cooldown_steps must be >= 0, got -1"):
        DriftOptions(cooldown_steps=-1)
    assert parse_force("40:n0:1=3,n1:0=2.5") == (40, (("n0:1", 3.0), ("n1:0", 2.5)))
    with pytest.raises(DriftError, match=r"--force-drift n0:1=3: expected STEP:DEVICE=FACTOR"):
        parse_force("n0:1=3")


def test_predicted_compute_is_the_stages_forward_and_backward_per_step(plan: Plan) -> None:
    got = predicted_compute_s(plan)
    for vw in plan.virtual_workers:
        for s in vw.stages:
            assert got[s.device] == pytest.approx(vw.micro_batches * (s.predicted_forward_s + s.predicted_backward_s))


def test_a_slowed_device_is_a_type_of_its_own_with_its_times_scaled(plan: Plan) -> None:
    slowed = slowed_plan(plan, {"n0:1": 3.0})
    dev, old = slowed.cluster.device("n0:1"), plan.cluster.device("n0:1")
    assert dev.type_name == "cpu@n0:1" and slowed.cluster.device("n0:0").type_name == "cpu"
    assert (dev.memory_bytes, dev.peak_fp32_flops) == (old.memory_bytes, old.peak_fp32_flops)
    for i in range(MLP.num_layers):
        for b in (1, 4, 16, 32, 48, *(m for vw in plan.virtual_workers for m in vw.micro_batch_sizes)):
            fw, bw = estimate_layer_time(slowed.profile, i, dev, b)
            want_f, want_b = estimate_layer_time(plan.profile, i, old, b)
            assert (fw, bw) == (pytest.approx(3 * want_f), pytest.approx(3 * want_b))
    again = slowed_plan(slowed, {"n0:1": 2.0})  # compounds
    f6, _ = estimate_layer_time(again.profile, 1, again.cluster.device("n0:1"), 16)
    assert f6 == pytest.approx(6 * estimate_layer_time(plan.profile, 1, old, 16)[0])
    assert plan_digest(slowed_plan(plan, {"n0:1": 3.0})) == plan_digest(slowed)
    with pytest.raises(ReplanError, match="drift on n9:0: not a device of the plan's cluster 'cpus'"):
        slowed_plan(plan, {"n9:0": 2.0})


def test_the_drift_plan_is_the_same_every_time_and_says_what_it_was_made_for(plan: Plan) -> None:
    drift = Drift(60, {"n0:1": 4.0}, {"n0:0": 1.0, "n0:1": 4.0, "n0:2": 1.0})
    cost = SwitchCost(checkpoint_s=0.5, startup_s=8.0, warmup_s=0.2)
    one = decide_drift(plan, drift, 60, 100_000, 0.004, cost)
    two = decide_drift(plan, drift, 60, 100_000, 0.004, cost)
    assert one.replanned is not None and two.replanned is not None
    assert one.replanned.digest == two.replanned.digest == plan_digest(one.replanned.plan)
    new = one.replanned.plan
    assert new.global_batch == plan.global_batch and new.sync == plan.sync
    record = new.options["replan"]
    assert record["kind"] == DRIFT_KIND and record["from_step"] == 60 and record["slowdown"] == {"n0:1": 4.0}
    assert record["base_digest"] == plan_digest(plan) == base_digest_of(new)
    assert drift_factors_of(new) == {"n0:1": 4.0} and drift_factors_of(plan) == {}
    f = one.figures
    assert f["new_s"] < f["current_s"] and f["remaining_steps"] == 100_000 - 60
    assert f["gain_s"] == pytest.approx((f["current_s"] - f["new_s"]) * f["remaining_steps"] * f["scale"])
    assert f["scale"] == pytest.approx(0.004 / f["current_s"])
    assert one.switch and "gain" in one.reason and "switch cost 13.7 s" in one.reason
    # the slowdown compounds across drift plans, and the base plan stays plan.json's
    later = decide_drift(new, Drift(200, {"n0:1": 0.5}, {}), 200, 100_000, 0.004, cost)
    assert later.replanned is not None
    assert drift_factors_of(later.replanned.plan) == {"n0:1": pytest.approx(2.0)}
    assert base_digest_of(later.replanned.plan) == plan_digest(plan)


def test_a_switch_that_cannot_pay_for_itself_is_skipped_and_a_drill_switches_anyway(plan: Plan) -> None:
    drift = Drift(60, {"n0:1": 4.0}, {})
    cost = SwitchCost(checkpoint_s=0.5, startup_s=8.0, warmup_s=0.2)
    few = decide_drift(plan, drift, 60, 80, 0.004, cost)  # 20 steps left: milliseconds to gain
    assert not few.switch and few.reason.startswith("not worth it:")
    assert few.figures["gain_s"] < cost.total_s
    drill = decide_drift(plan, Drift(60, {"n0:1": 4.0}, {}, forced=True), 60, 80, 0.004, cost)
    assert drill.switch and drill.reason.startswith("forced:")
    mild = decide_drift(plan, Drift(60, {"n0:2": 1.01}, {}), 60, 10**9, 0.004, cost)
    assert not mild.switch  # the planner gives the same plan back, or the gain is nothing


def write_plan(plan: Plan, ckpt: Path, step: int) -> None:
    """``plan`` beside a real (one-process) checkpoint of ``step``."""
    import torch

    from hetrain.runtime.state.checkpoint import save_checkpoint

    save_checkpoint(ckpt, step, {"layers.0.weight": torch.zeros(1)}, {}, {"step": step})
    (ckpt / "plans").mkdir(parents=True, exist_ok=True)
    plan.save(ckpt / "plans" / f"plan-step{step}.json")


def test_a_restart_takes_the_newest_drift_plan_of_its_plan_while_the_world_is_its_world(plan: Plan,
                                                                                       tmp_path: Path) -> None:
    from hetrain.runtime.lifecycle.restart import adopt_drift_plan

    decision = decide_drift(plan, Drift(4, {"n0:1": 4.0}, {}, forced=True), 4, 100, 0.004, SwitchCost(0, 0, 0))
    assert decision.replanned is not None
    drifted = decision.replanned.plan
    ckpt = tmp_path / "ckpt"
    write_plan(drifted, ckpt, 4)
    world = ["n0:0", "n0:1", "n0:2"]
    got = adopt_drift_plan(plan, world, ckpt, 4)
    assert got is not None and got.digest == plan_digest(load_plan(ckpt / "plans" / "plan-step4.json"))
    assert adopt_drift_plan(plan, ["n0:0", "n0:1"], ckpt, 4) is None  # the world changed: plan.json's way
    other = hetrain.plan(parse_cluster(cpus(3)), MLP, 32, optimizer="sgd")
    assert adopt_drift_plan(other, world, ckpt, 4) is None  # another plan.json
    assert adopt_drift_plan(plan, world, None, 4) is None
    assert adopt_drift_plan(plan, world, ckpt, 3) is None  # resumed from before the switch: not yet made
    assert adopt_drift_plan(plan, world, ckpt, None) is None  # no checkpoint to resume from
    world_plan = hetrain.elastic.replan(plan, [hetrain.elastic.PresentDevice(d, "cpu") for d in world[:2]], 8).plan
    write_plan(world_plan, ckpt, 8)  # a newer plan made for a changed world: the drift plan is history
    assert adopt_drift_plan(plan, world, ckpt, 8) is None
    assert adopt_drift_plan(plan, world, ckpt, 4) is not None  # resumed from step 4 (step 8 damaged, say)


def test_hetrain_train_refuses_a_drill_it_cannot_run_and_a_drill_it_cannot_read(plan: Plan, tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    from hetrain.runtime.command import main

    plan.save(tmp_path / "plan.json")
    base = ["--plan", str(tmp_path / "plan.json"), "--model", "mlp-digits", "--data", "synthetic"]
    assert main([*base, "--force-drift", "3:n0:1=2", "--replan", "world"]) == 2
    assert ("--force-drift 3:n0:1=2: a drift switch needs --replan auto (got world) and a --checkpoint-dir "
            "(got none)") in capsys.readouterr().err
    assert main([*base, "--force-drift", "n0:1", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    assert "--force-drift n0:1: expected STEP:DEVICE=FACTOR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # argparse's own refusal
        main([*base, "--drift-threshold", "0", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert stopped.value.code == 2
    assert "--drift-threshold: expected a finite number > 0, got '0'" in capsys.readouterr().err

"""``hetrain compare`` per iteration: a relaxed sync mode's simulated timeline holds a cycle of iterations, a
measured one the one recorded step; each side is divided by its own count. ``hetrain simulate --timeline``
says where it wrote the timeline and how many iterations it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.plan import load_plan
from hetrain.simulator import simulate
from hetrain.timeline import SYNC_COUNT_NOTE, Event, Timeline, TimelineError, compare, load_timeline

CLUSTER = """\
[[node]]
name = "n0"
devices = [{ type = "cpu", count = 2 }]
"""


def one_step(scale: float = 1.0) -> dict[str, list[Event]]:
    """One iteration of one device: forward, backward, a blocking sync, the step (times scaled)."""
    s = scale
    return {"n0:0": [Event(0.0, 1.0 * s, "forward", "0F0", 0), Event(1.0 * s, 3.0 * s, "backward", "0B0", 0),
                     Event(3.0 * s, 3.5 * s, "sync", "ALLREDUCE_WAIT seg0 bucket0"),
                     Event(3.5 * s, 4.0 * s, "optimizer", "STEP")]}


def cycle(n: int) -> Timeline:
    """``n`` back-to-back copies of ``one_step``, as the simulator writes a relaxed mode's cycle."""
    events = [Event(e.start_s + 4.0 * k, e.end_s + 4.0 * k, e.kind, e.label, e.micro_batch)
              for k in range(n) for e in one_step()["n0:0"]]
    return Timeline(devices={"n0:0": events}, meta={"iterations": n})


def test_a_cycle_of_iterations_is_compared_per_iteration_with_one_step() -> None:
    measured = Timeline(devices=one_step(1.25), source="measured")  # no "iterations": one step
    table = compare(cycle(12), measured)
    assert (table.predicted_iterations, table.measured_iterations) == (12, 1)
    rows = {r.kind: r for r in table.rows}
    for kind, seconds in (("forward", 1.0), ("backward", 2.0), ("sync", 0.5), ("optimizer", 0.5),
                          ("iteration", 4.0)):
        r = rows[kind]
        assert (r.predicted_count, r.measured_count) == (1, 1), r
        assert r.predicted_s == pytest.approx(seconds) and r.measured_s == pytest.approx(1.25 * seconds)
        assert r.relative_error == pytest.approx(-0.2)  # not the +860% of 12 iterations against one step
    text = str(table)
    assert text.splitlines()[0] == ("per iteration: predicted totals / 12 simulated iterations, measured totals / "
                                    "1 recorded step")
    assert "-20.0%" in text and SYNC_COUNT_NOTE not in text  # the counts agree: no note


def test_counts_per_iteration_may_be_fractional_and_sync_counts_are_explained() -> None:
    predicted = cycle(3)
    predicted.devices["n0:0"] = [e for k, e in enumerate(predicted.devices["n0:0"]) if not (e.kind == "sync" and k < 4)]
    measured = Timeline(devices=one_step(), source="measured")
    measured.devices["n0:0"].insert(2, Event(3.0, 3.0001, "sync", "ALLREDUCE_START seg0 bucket0"))
    sync = next(r for r in compare(predicted, measured).rows if r.kind == "sync")
    assert sync.predicted_count == pytest.approx(2 / 3) and sync.measured_count == 2
    assert sync.predicted_s == pytest.approx(1.0 / 3)
    text = str(compare(predicted, measured))
    assert "  0.67      2" in text and text.splitlines()[-1] == SYNC_COUNT_NOTE


@pytest.mark.parametrize("bad", [0, -2, 1.5, "12", True])
def test_a_timeline_whose_iterations_are_not_a_count_is_refused_naming_the_file(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "t.json"
    data = cycle(2).to_dict()
    data["meta"]["iterations"] = bad
    path.write_text(json.dumps(data))
    with pytest.raises(TimelineError) as e:
        load_timeline(path)
    assert str(e.value) == (f"{path}: timeline meta 'iterations' must be a whole number >= 1 (the iterations it "
                            f"holds), got {json.dumps(bad)}")


def test_simulate_says_where_the_timeline_went_and_compare_divides_by_its_iterations(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_text(CLUSTER)
    plan_file, predicted, measured = tmp_path / "wsp.json", tmp_path / "tl.json", tmp_path / "meas.json"
    assert main(["plan", "--cluster", str(tmp_path / "c.toml"), "--model", "gpt-tiny", "--global-batch", "8",
                 "--sync", "wsp", "--time-budget", "1s", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan_file), "--timeline", str(predicted)]) == 0
    out = capsys.readouterr().out
    n = load_timeline(predicted).iterations
    assert n >= 12
    assert out.splitlines()[-1] == f"timeline: {predicted} ({n} simulated iterations; hetrain compare divides by them)"
    assert main(["simulate", str(plan_file), "--timeline", str(predicted), "--json"]) == 0
    assert "timeline:" not in capsys.readouterr().out  # stdout stays the JSON metrics
    # the recorded step stands in as one replayed iteration of the same plan, written as the runtime writes it
    step = simulate(load_plan(plan_file), iterations=1).timeline
    Timeline(step.devices, step.links, step.memory, "measured", {"step": 5}).save(measured)
    assert main(["compare", str(predicted), str(measured)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"per iteration: predicted totals / {n} simulated iterations, measured totals / "
                                   "1 recorded step")
    forward = [line.split() for line in out.splitlines() if " forward " in line]
    assert len(forward) == 2 and all(row[2:4] == ["1", "1"] for row in forward), out
    for row in forward:  # every iteration of a cycle computes what one iteration does
        assert float(row[4]) == pytest.approx(float(row[5]), rel=1e-3), out


def test_bsp_timeline_is_one_iteration_and_its_line_says_no_more(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_text(CLUSTER)
    plan_file, predicted = tmp_path / "bsp.json", tmp_path / "tl.json"
    assert main(["plan", "--cluster", str(tmp_path / "c.toml"), "--model", "gpt-tiny", "--global-batch", "8",
                 "--time-budget", "1s", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan_file), "--timeline", str(predicted)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"timeline: {predicted}"
    assert load_timeline(predicted).iterations == 1

"""Timelines: JSON round trip, Chrome trace, Gantt picture, predicted vs measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hetrain.timeline import Event, Timeline, TimelineError, compare, load_timeline, parse_timeline


def small_timeline(scale: float = 1.0, source: str = "simulated") -> Timeline:
    """Two devices, one link: a 2-stage pipeline of one micro-batch."""
    s = scale
    return Timeline(
        devices={
            "n0:0": [Event(0.0, 1.0 * s, "forward", "0F0", 0), Event(1.0 * s, 3.5 * s, "recv", "RECV_B 1->0 mb0", 0),
                     Event(3.5 * s, 5.5 * s, "backward", "0B0", 0), Event(5.5 * s, 5.6 * s, "optimizer", "STEP")],
            "n0:1": [Event(1.1 * s, 1.6 * s, "forward", "1F0", 0), Event(1.6 * s, 3.4 * s, "backward", "1B0", 0)],
        },
        links={"n0:0->n0:1": [Event(1.0 * s, 1.1 * s, "send_f", "SEND_F 0->1 mb0 n0:0->n0:1", 0)],
               "n0:1->n0:0": [Event(3.4 * s, 3.5 * s, "send_b", "SEND_B 1->0 mb0 n0:1->n0:0", 0)]},
        memory={"n0:0": [(0.0, 1e9), (1.0 * s, 1.5e9), (5.5 * s, 1e9)], "n0:1": [(0.0, 2e9)]},
        source=source,
        meta={"schedule": "gpipe"},
    )


def test_json_round_trip(tmp_path: Path) -> None:
    t = small_timeline()
    assert parse_timeline(json.loads(json.dumps(t.to_dict()))) == t
    t.save(tmp_path / "t.json")
    assert load_timeline(tmp_path / "t.json") == t
    assert t.to_dict()["event_fields"] == ["start_s", "end_s", "kind", "label", "micro_batch"]


def test_bad_timeline_files(tmp_path: Path) -> None:
    with pytest.raises(TimelineError, match="cannot read"):
        load_timeline(tmp_path / "nope.json")
    with pytest.raises(TimelineError, match="an event is"):
        parse_timeline({"devices": {"n0:0": [[0.0, "x"]]}})
    with pytest.raises(TimelineError, match="format_version"):
        parse_timeline({"format_version": 99})
    # the metrics of `hetrain simulate --json` are not a timeline: said, with what to run instead
    with pytest.raises(TimelineError, match=r"'devices' must map names to lists, got a list: .*--timeline FILE"):
        parse_timeline({"iteration_s": 0.2, "devices": [{"device": "n0:0"}]})


def test_span_busy_and_idle() -> None:
    t = small_timeline()
    assert t.span_s == pytest.approx(5.6)
    assert t.time_in("n0:1", ("forward", "backward")) == pytest.approx(2.3)
    idle = t.idle_intervals("n0:1")
    assert idle == [(0.0, 1.1), (3.4, pytest.approx(5.6))]


def test_chrome_trace_has_a_track_per_device_and_link(tmp_path: Path) -> None:
    t = small_timeline()
    path = tmp_path / "trace.json"
    t.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(1, "n0:0"), (1, "n0:1"), (2, "n0:0->n0:1"), (2, "n0:1->n0:0")}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 6 + 2
    f0 = next(e for e in slices if e["name"] == "0B0")
    assert f0["ts"] == pytest.approx(3.5e6) and f0["dur"] == pytest.approx(2e6) and f0["cat"] == "backward"
    assert f0["args"]["micro_batch"] == 0
    assert sum(e["ph"] == "C" for e in events) == 4  # memory counters


def test_gantt_png(tmp_path: Path) -> None:
    path = tmp_path / "gantt.png"
    small_timeline().save_gantt(path, title="two stages")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_predicted_and_measured() -> None:
    predicted, measured = small_timeline(), small_timeline(scale=1.1, source="measured")
    table = compare(predicted, measured)
    fwd = next(r for r in table.rows if r.device == "n0:0" and r.kind == "forward")
    assert (fwd.predicted_count, fwd.measured_count) == (1, 1)
    assert fwd.relative_error == pytest.approx(1 / 1.1 - 1)
    it = next(r for r in table.rows if r.device == "n0:1" and r.kind == "iteration")
    assert it.measured_s == pytest.approx(3.4 * 1.1)
    assert {r.kind for r in table.rows if r.device == "n0:0"} == {"forward", "recv", "backward", "optimizer",
                                                                  "iteration"}
    text = str(table)
    assert text.splitlines()[0] == ("per iteration: predicted totals / 1 simulated iteration, measured totals / "
                                    "1 recorded step")
    assert text.splitlines()[1].split() == ["device", "kind", "n", "pred", "n", "meas", "predicted", "measured",
                                            "error"]
    assert "-9.1%" in text
    # a kind the runtime did not record has no measured time to compare with
    measured.devices["n0:1"] = [e for e in measured.devices["n0:1"] if e.kind != "backward"]
    row = next(r for r in compare(predicted, measured).rows if r.device == "n0:1" and r.kind == "backward")
    assert math.isnan(row.relative_error) and "n/a" in str(compare(predicted, measured))
    assert compare(predicted, measured).worst() is not None


def test_compare_peak_memory_prefers_the_measured_peak() -> None:
    predicted, measured = small_timeline(), small_timeline(scale=1.1, source="measured")
    predicted.memory = {"n0:0": [(0.0, 1e9), (1.0, 3e9), (2.0, 1e9)]}
    measured.memory = {"n0:0": [(0.0, 1e9), (1.0, 2e9)], "n0:1": [(0.0, 5e8)]}
    # no predicted track for n0:1: nothing to compare there
    (row,) = compare(predicted, measured).memory
    assert (row.device, row.predicted_bytes, row.measured_bytes) == ("n0:0", 3e9, 2e9)
    assert row.relative_error == pytest.approx(0.5)
    # the runtime's peak over the iteration (on a GPU) beats the samples between actions
    measured.meta["peak_memory_bytes"] = {"n0:0": 4e9}
    (row,) = compare(predicted, measured).memory
    assert row.measured_bytes == 4e9 and row.relative_error == pytest.approx(-0.25)
    text = str(compare(predicted, measured))
    assert "peak memory" in text and "3000.0MB" in text and "4000.0MB" in text and "-25.0%" in text


# --- hetrain compare: the files it is given are timelines, predicted first ------------------------------

@pytest.mark.slow  # plans for its 1 s time budget
def test_compare_names_a_plan_or_profile_given_as_a_timeline(tmp_path: Path, capsys) -> None:
    from hetrain.cli import main

    examples = Path(__file__).resolve().parents[1] / "examples" / "clusters"
    plan_file, profile_file, predicted = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "pred.json"
    assert main(["plan", "--cluster", str(examples / "pipetorch.toml"), "--model", "gpt-tiny", "--global-batch", "8",
                 "--time-budget", "1s", "-o", str(plan_file)]) == 0
    profile_data = json.loads(plan_file.read_text())["profile"]
    profile_file.write_text(json.dumps(profile_data))
    small_timeline().save(predicted)
    capsys.readouterr()
    for other, kind in ((plan_file, "a plan"), (profile_file, "a profile")):
        assert main(["compare", str(predicted), str(other)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{other} is {kind}, not a timeline" in err
        assert "format_version" not in err and "hetrain simulate PLAN --timeline FILE" in err
    with pytest.raises(TimelineError, match=r"plan\.json is a plan, not a timeline"):
        load_timeline(plan_file)


def test_compare_refuses_the_measured_timeline_first(tmp_path: Path, capsys) -> None:
    from hetrain.cli import main

    predicted, measured = tmp_path / "predicted.json", tmp_path / "measured.json"
    small_timeline().save(predicted)
    small_timeline(1.2, "measured").save(measured)
    assert main(["compare", str(measured), str(predicted)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{measured} is a measured timeline and {predicted} a simulated one" in err
    assert f"hetrain compare {predicted} {measured}" in err
    assert main(["compare", str(predicted), str(measured)]) == 0  # the right order runs
    assert "-16.7%" in capsys.readouterr().out  # predicted 1.0 s against measured 1.2 s

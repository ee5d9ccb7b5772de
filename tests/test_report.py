"""The demo's result types: a plan's predicted and measured rates, the comparison table and speed-ups."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

import hetrain.report
from hetrain.cluster import parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan
from hetrain.planner import plan
from hetrain.report import DemoResult, PlanRun
from hetrain.simulator import simulate

CLUSTER = {"name": "two", "node": [{"name": "n", "devices": [{"type": "cpu", "count": 2}], "intra_link": "loopback",
                                    "nic": "1Gbit/s"}]}


def _plan(strategy: str) -> Plan:
    return plan(parse_cluster(CLUSTER), build_profile("gpt-tiny"), 8, strategy=strategy, micro_batch_sizes=(2,),
                simulate_top_k=0, max_tp=1)


def _run(tmp_path: Path, name: str, p: Plan, step_times_s: list[float], warmup: int) -> PlanRun:
    metrics = tmp_path / f"metrics-{name}.jsonl"
    rows = [{"step": i, "step_time_s": t, "loss": 1.0} for i, t in enumerate(step_times_s)]
    metrics.write_text("\n".join(json.dumps(r) for r in [{"event": "start"}, *rows]) + "\n\n")
    run = PlanRun(name, p, simulate(p), tmp_path / f"plan-{name}.json", metrics, tmp_path / f"timeline-{name}.json",
                  warmup=warmup)
    run.load_metrics()
    return run


def test_plan_run_leaves_the_warmup_steps_out_of_the_measured_rate(tmp_path: Path) -> None:
    p = _plan("pp")
    run = _run(tmp_path, "pp", p, [9.0, 9.0, 0.5, 1.5], warmup=2)
    assert len(run.metrics) == 4  # the row without step_time_s and the blank line are skipped
    assert run.measured_iteration_s == pytest.approx(1.0)
    assert run.measured_samples_per_s == pytest.approx(8.0)
    assert run.predicted_iteration_s == simulate(p).iteration_s
    assert run.prediction_error == pytest.approx(run.predicted_iteration_s - 1.0)
    short = _run(tmp_path, "short", p, [2.0, 4.0], warmup=5)  # too few steps: all of them count
    assert short.measured_iteration_s == pytest.approx(3.0)
    missing = PlanRun("none", p, simulate(p), tmp_path / "x.json", tmp_path / "absent.jsonl", tmp_path / "t.json")
    missing.load_metrics()
    assert missing.metrics == [] and math.isnan(missing.measured_iteration_s)


def test_comparison_tabulates_each_run_and_divides_measured_rates(tmp_path: Path) -> None:
    runs = {"hetrain": _run(tmp_path, "hetrain", _plan("pp"), [0.5, 0.5], warmup=0),
            "dp": _run(tmp_path, "dp", _plan("dp"), [2.0, 2.0], warmup=0)}
    result = DemoResult(tmp_path, tmp_path / "cluster.toml", tmp_path / "profile.json", runs, "", {})
    assert result.speedup("dp") == pytest.approx(4.0)
    assert result.speedup("hetrain", of="dp") == pytest.approx(0.25)
    header, _, first, second = result.table().splitlines()
    assert header.startswith("| plan | VWs x stages |")
    assert first.startswith("| hetrain | 2 | ") and "| 16.0 |" in first  # one VW of two stages, 8 / 0.5 s
    assert second.startswith("| dp | 1 + 1 | ") and "| 4.0 |" in second
    assert first.endswith(f"{100 * runs['hetrain'].prediction_error:+.1f}% |")


def test_report_does_not_import_the_demo() -> None:
    tree = ast.parse(Path(hetrain.report.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "hetrain.timeline" in imported and not any(m and m.startswith("hetrain.demo") for m in imported)

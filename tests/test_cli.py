"""The hetrain command, run in-process and as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hetrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "pipetorch.toml"


def test_plan_prints_table_and_writes_plan(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64", "-o", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "pure data parallelism" in text and "pure pipeline" in text and "samples/s" in text
    assert json.loads(out.read_text())["global_batch"] == 64


def test_plan_json_and_forced_strategy(capsys) -> None:
    code = main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "--strategy", "dp", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["strategy"] == "dp"
    assert [r["strategy"] for r in data["comparison"]][1:] == ["pure data parallelism", "pure pipeline"]


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text('[[node]]\nname = "x"\ndevices = ["A100-40G"]\n')
    assert main(["plan", "--cluster", str(bad), "--model", "gpt2-small", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown device type 'A100-40G'" in err and "A100-40GB" in err and "Traceback" not in err
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt3", "--global-batch", "8"]) == 2
    assert "gpt3" in capsys.readouterr().err


def test_simulate_command_writes_trace_and_gantt(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "32",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    timeline = tmp_path / "predicted.json"
    assert main(["simulate", str(out), "--trace", str(trace), "--gantt", str(gantt), "--timeline", str(timeline)]) == 0
    assert main(["compare", str(timeline), str(timeline)]) == 0
    assert "iteration" in capsys.readouterr().out
    assert "traceEvents" in json.loads(trace.read_text())
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planning_commands_do_not_import_torch() -> None:
    code = ("import sys; from hetrain.cli import main; "
            f"main(['plan', '--cluster', {str(CLUSTER)!r}, '--model', 'mlp', '--global-batch', '16']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_top_level_api_without_torch() -> None:
    code = ("import sys, hetrain; assert callable(hetrain.plan); from hetrain.plan import Plan; "
            "assert 'torch' not in sys.modules; hetrain.Trainer; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)

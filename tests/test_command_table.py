"""The one command table (``hetrain.cli.COMMANDS``): every command listed, only the chosen one loaded, one
exit-status convention (0 done, 2 bad input, 1 a failure while running), the planner and the simulator run
once per thing asked."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetrain.cli import COMMANDS, build_parser, main
from hetrain.planning import usable_cpus

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "small-hetero.toml"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)


def test_help_lists_every_command_with_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for name, command in COMMANDS.items():
        assert f" {name} {' '.join(command.help.split())}" in text, name
    assert {"train", "discover", "emulate", "demo"} <= set(COMMANDS)


def test_help_imports_no_command_module_and_no_torch() -> None:
    code = ("import sys\nfrom hetrain.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('hetrain.commands.') or m == 'torch'\n"
            "                or m == 'hetrain.runtime.command' or m == 'hetrain.profiler.network')\n"
            "print(loaded)")
    assert run_python(code).stdout.strip().splitlines()[-1] == "[]"


def test_a_command_loads_its_own_module_only() -> None:
    code = ("import sys\nfrom hetrain.cli import main\n"
            "main(['models'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('hetrain.commands.') or m == 'torch'))")
    assert run_python(code).stdout.strip().splitlines()[-1] == "['hetrain.commands.models']"


def test_only_the_chosen_subparser_has_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser, chosen = build_parser("simulate")
    assert chosen is not None and chosen.prog == "hetrain simulate"
    assert "--timeline" in chosen.format_help()
    with pytest.raises(SystemExit):  # plan is listed, but its options were never added
        parser.parse_args(["plan", "--cluster", "c.toml"])
    assert "unrecognized arguments: --cluster c.toml" in capsys.readouterr().err
    assert build_parser(None)[1] is None


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_has_add_arguments_and_run(name: str) -> None:
    if name in ("train", "discover", "export"):
        pytest.importorskip("torch")
    module = importlib.import_module(COMMANDS[name].module)
    assert callable(module.add_arguments) and callable(module.run)
    _, chosen = build_parser(name)
    assert chosen is not None and chosen.format_help().startswith(f"usage: hetrain {name}")


def test_train_and_discover_keep_their_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    for name, text in (("train", "Train a reference model with a plan."),
                       ("discover", "Measure the cluster under torchrun and write it as a cluster file")):
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: hetrain {name}") and text in out


def test_the_modules_of_their_own_hand_over_to_the_one_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m hetrain.runtime.command``, ``python -m hetrain.profiler.network`` and ``python -m
    hetrain.emulate`` are ``hetrain train``, ``hetrain discover`` and ``hetrain emulate``."""
    pytest.importorskip("torch")
    from hetrain.emulate.cli import main as emulate_main
    from hetrain.profiler.network import main as discover_main
    from hetrain.runtime.command import main as train_main

    for command_main, name in ((train_main, "train"), (discover_main, "discover"), (emulate_main, "emulate")):
        with pytest.raises(SystemExit):
            command_main(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: hetrain {name}"), name


# --- one exit status for bad input, whatever the command --------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("table")
    (d / "list.json").write_text("[]")
    return {"missing": str(d / "missing.json"), "list": str(d / "list.json"), "dir": str(d)}


BAD_INPUT = [
    ("plan-unknown-model", ["plan", "--cluster", str(CLUSTER), "--model", "gpt9", "--global-batch", "8"]),
    ("plan-missing-cluster", ["plan", "--cluster", "{missing}", "--model", "mlp", "--global-batch", "8"]),
    ("simulate-missing-plan", ["simulate", "{missing}"]),
    ("simulate-list-plan", ["simulate", "{list}", "--timeline", "{dir}/t.json"]),
    ("calibrate-missing-plan", ["calibrate", "{missing}", "{missing}"]),
    ("compare-missing", ["compare", "{missing}", "{missing}"]),
    ("fit-time-model-missing-profile", ["fit-time-model", "--profiles", "{missing}", "-o", "{dir}/m.json"]),
    ("demo-missing-cluster", ["demo", "--plan-only", "--cluster", "{missing}", "--out", "{dir}/demo"]),
]


@pytest.mark.parametrize("name, argv", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_status_2_on_every_command(name: str, argv: list[str], files: dict[str, str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main([a.format(**files) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err


def test_argument_errors_of_torch_side_commands_are_status_2(files: dict[str, str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    for argv in (["train", "--plan", files["missing"], "--model", "mlp-digits"],  # read before any process group
                 ["discover", "--repeats", "0"], ["discover", "--sizes", "0B"], ["discover", "--timeout", "0"]):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own refusal
            code = e.code if isinstance(e.code, int) else 1
        assert code == 2, argv
        assert "error:" in capsys.readouterr().err


# --- the planner and the simulator run once per thing asked ---------------------------------------------------

def test_plan_runs_the_planner_once_and_once_per_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each call noted in a file: the families may be planned in a forked process beside the plan."""
    import hetrain.planning as planning

    log = tmp_path / "calls"
    real = planning.planner_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        with log.open("a") as f:
            f.write(args[3].strategy + "\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "planner_plan", counted)
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "mlp", "--global-batch", "16", "--json",
                 "--sync", "auto", "--time-budget", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["comparison"]
    assert sorted(log.read_text().split()) == ["auto", "dp", "pp"]
    assert out["comparison_beside"] is (usable_cpus() > 1)  # a second CPU: the rows beside the plan
    assert [r["strategy"] for r in rows][1:] == ["pure data parallelism", "pure pipeline"]


def test_simulate_reads_and_replays_the_plan_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import hetrain.simulator

    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "mlp", "--global-batch", "16", "-o", str(path)]) == 0
    counts = {"load_plan": 0, "simulate": 0}

    def counting(module: Any, name: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(sys.modules["hetrain.plan"], "load_plan")
    counting(hetrain.simulator, "simulate")
    timeline, trace = tmp_path / "t.json", tmp_path / "trace.json"
    assert main(["simulate", str(path), "--timeline", str(timeline), "--trace", str(trace)]) == 0
    assert counts == {"load_plan": 1, "simulate": 1}
    out = capsys.readouterr().out
    assert f"timeline: {timeline}" in out and f"trace: {trace}" in out
    assert json.loads(timeline.read_text()) and json.loads(trace.read_text())["traceEvents"]


def test_emulate_down_of_a_run_id_that_names_no_run_is_status_2(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import hetrain.emulate.cli as emulate_cli

    monkeypatch.setattr(emulate_cli, "list_runs", lambda: [])
    assert main(["emulate", "down", "abcdef"]) == 2
    assert "no emulated cluster with run id abcdef" in capsys.readouterr().out
    assert main(["emulate", "down"]) == 0  # nothing to remove is no error
    assert "nothing to remove" in capsys.readouterr().out

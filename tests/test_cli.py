"""The hetrain command, run in-process and as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.plan import PlanError, load_plan

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


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
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


@pytest.mark.slow  # starts a Python process
def test_planning_commands_do_not_import_torch() -> None:
    code = ("import sys; from hetrain.cli import main; "
            f"main(['plan', '--cluster', {str(CLUSTER)!r}, '--model', 'mlp', '--global-batch', '16']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


@pytest.mark.slow  # starts a Python process
def test_top_level_api_without_torch() -> None:
    code = ("import sys, hetrain; assert callable(hetrain.plan); from hetrain.plan import Plan; "
            "assert 'torch' not in sys.modules; hetrain.Trainer; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
def test_plan_sync_auto_prints_every_mode_and_picks_one(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64", "--strategy",
                 "dp", "--sync", "auto", "--staleness-penalty", "0.2", "--sync-option", "period=8",
                 "--sync-option", "placement=round-robin", "-o", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "sync mode chosen by predicted time to accuracy" in text and "staleness penalty 0.2" in text
    for mode in ("bsp", "wsp", "hybrid-ps", "daso", "local-sgd"):
        assert f"  {mode} " in text
    saved = json.loads(out.read_text())
    chosen = saved["options"]["sync_choice"]["modes"][0]["mode"]
    assert saved["sync"]["mode"] == chosen and f"  {chosen} " in text.split("<- chosen")[0].splitlines()[-1]
    assert saved["sync"]["options"]["period"] == 8 and saved["sync"]["options"]["placement"] == "round-robin"


def test_bad_sync_option_names_the_key_the_value_and_what_is_allowed(capsys) -> None:
    base = ["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64"]
    assert main([*base, "--sync", "wsp", "--sync-option", "lag=2"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'lag'" in err and "staleness=N" in err and "Traceback" not in err
    assert main([*base, "--sync", "wsp", "--sync-option", "placement=nearest"]) == 2
    err = capsys.readouterr().err
    assert "placement must be one of sharded, local, round-robin, got 'nearest'" in err


def test_train_runs_the_plan_as_it_is() -> None:
    """The sync mode, its options and the optimizer are the plan's: train has no flag to change them."""
    import argparse

    from hetrain.runtime.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flag in (["--sync", "wsp"], ["--sync-option", "period=2"], ["--optimizer", "sgd"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--plan", "p.json", "--model", "mlp-digits", *flag])


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
def test_plan_from_a_plan_changes_the_mode_and_re_predicts(tmp_path: Path, capsys) -> None:
    first, second = tmp_path / "plan.json", tmp_path / "daso.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64", "--strategy",
                 "dp", "-o", str(first)]) == 0
    assert main(["plan", "--from", str(first), "--sync", "daso", "--sync-option", "period=8", "-o", str(second)]) == 0
    capsys.readouterr()
    old, new = load_plan(first), load_plan(second)
    assert (old.sync, new.sync, new.sync_options.period) == ("bsp", "daso", 8)
    assert [vw.to_dict()["stages"] for vw in new.virtual_workers] == [vw.to_dict()["stages"]
                                                                      for vw in old.virtual_workers]
    assert new.prediction.sync_s == pytest.approx(new.options["sync_predictions"]["daso"]["sync_s"])
    assert new.prediction.sync_s != pytest.approx(old.prediction.sync_s)
    assert new.prediction.simulated_iteration_s and new.prediction.simulated_iteration_s > 0
    assert all(seg["local_groups"] for seg in new.to_dict()["sync"]["segments"])  # DASO's node-local groups
    # --from takes the cluster and the batch from the plan
    assert main(["plan", "--from", str(first), "--global-batch", "32"]) == 2
    assert "drop --global-batch" in capsys.readouterr().err


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
def test_a_format_1_plan_is_refused_with_the_way_to_upgrade_it(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt-tiny", "--global-batch", "64", "--sync",
                 "wsp", "--sync-option", "staleness=2", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    # what format_version 1 wrote: the mode's name, and its options among the plan's options
    data.update(format_version=1, sync="wsp", options={**data["options"], "staleness": 2})
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"format_version: 1 .*`hetrain plan --from PLAN -o NEW`"):
        load_plan(path)
    upgraded = tmp_path / "v2.json"
    assert main(["plan", "--from", str(path), "-o", str(upgraded)]) == 0
    capsys.readouterr()
    plan = load_plan(upgraded)
    assert plan.sync == "wsp" and plan.sync_options.staleness == 2 and "staleness" not in plan.options


# --- --model and --time-model: what hetrain plan and profile say when they cannot use what they are given -----

def test_plan_says_a_trained_model_needs_a_profile_and_how(capsys) -> None:
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "mlp-digits", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model 'mlp-digits'" in err and "unknown" not in err
    assert "`hetrain profile --model mlp-digits -o p.json`, then `hetrain plan --profile p.json`" in err
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "own.py", "--global-batch", "8"]) == 2
    assert "`hetrain profile --model own.py:FUNCTION -o p.json`" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt9", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("--model 'gpt9': unknown model (did you mean 'gpt2-xl', 'gpt-tiny', 'gpt-2.7b'?); hetrain plan knows "
            "gpt-tiny") in err


def test_profile_suggests_a_function_for_a_python_file(tmp_path: Path, capsys) -> None:
    own = tmp_path / "own.py"
    own.write_text("def build():\n    raise SystemExit('not called')\n")
    assert main(["profile", "--model", str(own), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model {own}:FUNCTION" in err and "unknown model" not in err


def test_a_profile_given_as_time_model_is_named_as_one(tmp_path: Path, capsys) -> None:
    from hetrain.models.analytic import build_profile

    profile = tmp_path / "prof.json"
    build_profile("gpt-tiny").save(profile)
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt-tiny", "--global-batch", "8",
                 "--time-model", str(profile)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--time-model {profile}: a profile, not a time model" in err
    assert "field 'format'" not in err


CPUS = ROOT / "examples" / "clusters" / "small-hetero.toml"  # CPU devices only


def test_a_cpu_cluster_gets_a_plan_it_can_train(tmp_path: Path, capsys) -> None:
    """gpt2-small's own precision is fp16, which no CPU trains (``amp.check_precision``): on a cluster of
    CPUs the plan is bf16, said in one line; fp16 asked for is refused naming the file and the devices."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CPUS), "--model", "gpt2-small", "--global-batch", "8", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "gpt2-small plans in bf16" in err and "are CPUs" in err
    assert load_plan(out).precision == "bf16"
    assert main(["plan", "--cluster", str(CPUS), "--model", "gpt2-small", "--global-batch", "8",
                 "--precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(CPUS) in err and "--precision fp16" in err and "CPUs" in err
    # fp32 asked for stays fp32; a model whose own precision is fp32 plans without a word
    assert main(["plan", "--cluster", str(CPUS), "--model", "gpt2-small", "--global-batch", "8",
                 "--precision", "fp32", "-o", str(out)]) == 0
    assert load_plan(out).precision == "fp32" and "bf16" not in capsys.readouterr().err
    assert main(["plan", "--cluster", str(CPUS), "--model", "gpt-tiny", "--global-batch", "8", "-o", str(out)]) == 0
    assert load_plan(out).precision == "fp32" and capsys.readouterr().err == ""


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
def test_the_comparison_ranks_the_families_as_the_planner_does_by_simulation(capsys) -> None:
    """The closed form may miss a pipeline's transfers by far more than the simulator (cloud-mixed gpt2-medium:
    a pure pipeline at 285.9 samples/s closed, 188.7 simulated), so the table compares simulated figures, each
    family's best plan simulated as the chosen one was, and says so."""
    argv = ["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["comparison"]
    assert all(r["simulated_samples_per_s"] for r in rows if r["samples_per_s"] is not None), rows
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "predicted against the pure families on the same cluster (simulated):" in text
    table = text.split("(simulated):", 1)[1]
    for r in rows:
        if r["simulated_samples_per_s"]:
            assert f"{r['simulated_samples_per_s']:.1f}" in table, (r, table)


def test_the_sync_table_counts_the_large_batch_factor_as_the_plan_does(tmp_path: Path, capsys) -> None:
    """Under time to accuracy the mode table's time is the plan's own: samples to target times the factor
    1 + B / B_crit (the table had left the factor out, 2x off at B = B_crit)."""
    out = tmp_path / "tta.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "--objective", "time-to-accuracy", "--critical-batch", "64", "-o", str(out)]) == 0
    chosen = next(line for line in capsys.readouterr().out.splitlines() if line.endswith("<- chosen"))
    tta = load_plan(out).prediction.time_to_accuracy_s
    assert tta is not None and f"{tta:.1f}s" in chosen, (tta, chosen)


@pytest.mark.slow  # plans gpt2-small on pipetorch's 8 devices and simulates
def test_from_a_plan_with_sync_auto_takes_an_option_of_a_mode_auto_considers(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "64",
                 "-o", str(out)]) == 0
    assert main(["plan", "--from", str(out), "--sync", "auto", "--sync-option", "staleness=3"]) == 0
    assert main(["plan", "--from", str(out), "--sync", "bsp", "--sync-option", "staleness=3"]) == 2
    assert "staleness=3" in capsys.readouterr().err

"""``--force-drift``: its value parsed and checked against plan.json's own cluster before anything runs (no
process group, no re-plan, no file), named as given (flag or config file), naming only what fails."""

from __future__ import annotations

from pathlib import Path

import pytest

import hetrain
from factories import make_cluster, mlp_digits_profile
from hetrain.drift import DriftError, DriftOptions, parse_force
from hetrain.runtime.command import main

MLP = mlp_digits_profile()


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planner's plan for three CPUs (n0:0, n0:1, n0:2): a world of one process would re-plan it."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    hetrain.plan(make_cluster({"n0": 3}), MLP, 48, optimizer="sgd").save(path)
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``hetrain train`` (one process, no torchrun); it must refuse with status 2 and one line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetrain train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "((" not in err, err  # no internal repr of the parsed value
    return err.removeprefix("hetrain train: error: ").rstrip("\n")


@pytest.mark.parametrize(("value", "why"), [
    ("3:n0:1=0", "a factor must be a number > 0 (how many times slower: 3, or 0.5 for twice as fast), got n0:1=0"),
    ("3:n0:1=-2", "a factor must be a number > 0 (how many times slower: 3, or 0.5 for twice as fast), got n0:1=-2"),
    ("3:n0:1=nan", "a factor must be a number > 0 (how many times slower: 3, or 0.5 for twice as fast), got n0:1=nan"),
    ("0:n0:1=2", "the step must be >= 1 (the drill acts after a step is done), got 0"),
    ("3:n0:1=2,n0:1=3", "device n0:1 is given twice; give each device once"),
    ("3:n9:0=2", "n9:0 is not a device of {plan}'s cluster 'cpus' (its devices: n0:0, n0:1, n0:2)"),
])
def test_a_bad_drill_is_refused_before_anything_runs(plan_file: Path, tmp_path: Path, value: str, why: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckz"
    err = refused(capsys, ["--plan", str(plan_file), "--model", "mlp-digits", "--data", "synthetic",
                           "--checkpoint-dir", str(ckpt), "--force-drift", value])
    assert err == f"--force-drift {value}: {why.format(plan=plan_file)}"
    assert not ckpt.exists()  # no re-plan was written (plans/plan-step0.json), no checkpoint


def test_a_drill_from_a_config_file_is_named_by_its_file_and_key(plan_file: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "train.toml"
    config.write_text(f'plan = "{plan_file}"\nmodel = "mlp-digits"\ndata = "synthetic"\n'
                      f'checkpoint_dir = "{tmp_path / "ckz"}"\nforce_drift = "3:n0:1=0"\n')
    err = refused(capsys, ["--config", str(config)])
    assert err.startswith(f'{config}: force_drift = "3:n0:1=0": a factor must be a number > 0'), err
    assert not (tmp_path / "ckz").exists()
    # the command line overrides the file, and is named as a flag
    err = refused(capsys, ["--config", str(config), "--force-drift", "3:n7:0=2"])
    assert err.startswith(f"--force-drift 3:n7:0=2: n7:0 is not a device of {plan_file}'s cluster"), err


def test_only_the_condition_that_fails_is_named(plan_file: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--plan", str(plan_file), "--model", "mlp-digits", "--data", "synthetic", "--force-drift", "3:n0:1=2"]
    assert refused(capsys, base) == "--force-drift 3:n0:1=2: a drift switch needs a --checkpoint-dir (got none)"
    ckpt = tmp_path / "ckz"
    assert refused(capsys, [*base, "--replan", "off", "--checkpoint-dir", str(ckpt)]) == (
        "--force-drift 3:n0:1=2: a drift switch needs --replan auto (got off)")
    assert refused(capsys, [*base, "--replan", "world"]) == (
        "--force-drift 3:n0:1=2: a drift switch needs --replan auto (got world) and a --checkpoint-dir (got none)")
    assert not ckpt.exists()


def test_parse_force_reads_several_devices_and_the_options_name_a_bad_one_readably() -> None:
    assert parse_force("40:n1:0=2.5,n0:1=0.5") == (40, (("n0:1", 0.5), ("n1:0", 2.5)))
    with pytest.raises(DriftError, match=r"^train.toml: force_drift = \"x\": expected STEP:DEVICE=FACTOR"):
        parse_force("x", 'train.toml: force_drift = "x"')
    with pytest.raises(DriftError) as e:  # the dataclass's own check, for a force built in Python
        DriftOptions(force=(3, (("n0:1", 0.0),)))
    assert str(e.value) == "forced drift must be at a step >= 1 with factors > 0, got step 3, n0:1=0"

"""A model file that imports a module beside it trains on two ranks: every rank loads it as ``hetrain profile``
does (``hetrain.models.spec``), with the file's directory on the path, from a current directory elsewhere.

    pkgdir/helpers_beside.py      build(), dataset() and loss_fn(): examples/own_model/model.py
    pkgdir/main_model.py          from helpers_beside import build, dataset, loss_fn
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_jobs import TWO_CPUS, hetrain, step_rows, train_ranks

pytest.importorskip("torch")

# the example's own model file (examples/own_model/model.py), copied beside the file that imports it
HELPERS = (Path(__file__).resolve().parents[2] / "examples" / "own_model" / "model.py").read_text()
MAIN = "from helpers_beside import build, dataset, loss_fn\n"


@pytest.mark.timeout(300)
def test_a_model_importing_its_neighbour_profiles_plans_and_trains_on_two_ranks(tmp_path: Path, clean_env) -> None:
    pkgdir = tmp_path / "pkgdir"
    pkgdir.mkdir()
    (pkgdir / "helpers_beside.py").write_text(HELPERS)
    (pkgdir / "main_model.py").write_text(MAIN)
    (tmp_path / "two-cpus.toml").write_text(TWO_CPUS)
    model, data = "pkgdir/main_model.py:build", "pkgdir/main_model.py:dataset"  # relative to tmp_path
    hetrain(["profile", "--model", model, "--data", data, "-o", "p.json", "--micro-batch", "4,8", "--repeats", "1"],
            tmp_path)
    assert len(json.loads((tmp_path / "p.json").read_text())["layers"]) == 5  # the example's 5 layers
    hetrain(["plan", "--cluster", "two-cpus.toml", "--profile", "p.json", "--global-batch", "16", "--strategy", "pp",
             "--max-tp", "1", "-o", "plan.json"], tmp_path)

    metrics = tmp_path / "metrics.jsonl"  # the ranks run from this test's directory, not tmp_path
    stdout = train_ranks({**clean_env, "HETRAIN_NODE": "n0"}, [
        "--plan", str(tmp_path / "plan.json"), "--model", str(tmp_path / model), "--data", str(tmp_path / data),
        "--steps", "2", "--log-every", "1", "--metrics-out", str(metrics), "--timeout-s", "60", "--no-progress"])
    assert "hetrain train:" in stdout, stdout
    assert len(step_rows(metrics)) == 2

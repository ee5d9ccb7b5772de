"""``hetrain demo --plan-only``: the demo's plans on its default cluster, with no emulation and no root."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from hetrain.demo import DEFAULT_CLUSTER, build_plans, run_plan_only
from hetrain.models.analytic import build_profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]


def test_the_demo_compares_hetrains_plan_with_dp_and_the_even_split_pipeline() -> None:
    nominal = {k: v for k, v in tomllib.loads(DEFAULT_CLUSTER).items() if k != "emulation"}
    plans = build_plans(nominal, build_profile("gpt-tiny"), 32)
    assert list(plans) == ["hetrain", "dp", "even-split"]
    assert all(p.global_batch == 32 for p in plans.values())
    assert plans["dp"].strategy == "dp" and all(len(vw.stages) == 1 for vw in plans["dp"].virtual_workers)
    (vw,) = plans["even-split"].virtual_workers
    assert vw.devices == ["fast:0", "fast:1", "slow:0", "slow:1"] and plans["even-split"].formation == "even-split"


def test_plan_only_prints_each_plan_with_its_predicted_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(model="gpt-tiny", global_batch=32, cluster=None, out=str(tmp_path))
    assert run_plan_only(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan only: nominal links from the cluster file, layer costs estimated (analytic profile)")
    assert "cluster small-hetero: 2 nodes, 4 devices" in out
    names = re.findall(r"^(\S+) plan: predicted [0-9.]+ samples/s \(iteration [0-9.]+ ms\)$", out, re.MULTILINE)
    assert names == ["hetrain", "dp", "even-split"]


def test_the_profile_worker_takes_its_options_and_names_a_wrong_one() -> None:
    from hetrain.demo import worker_options
    from hetrain.errors import InputError

    assert worker_options(["--model", "gpt-tiny", "--out-dir", "d", "--repeats", "2"]) == {
        "--model": "gpt-tiny", "--out-dir": "d", "--micro-batches": "2,4,8,16", "--repeats": "2", "--tp": "1"}
    for argv, needle in ((["--model", "m", "--out-dir", "d", "--bogus", "x"], "--bogus"),
                         (["--model", "m", "--out-dir"], "--out-dir has no value"),
                         (["--out-dir", "d"], "--model is required")):
        with pytest.raises(InputError, match=needle):
            worker_options(argv)

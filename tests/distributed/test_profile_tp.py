"""``hetrain profile --tp 2`` on two ranks as torchrun starts them (``worker_ranks.run_ranks``): two real Gloo
ranks time each block on a TP group of the two, and the profile carries those times (``measured_tp``) beside
the one-device ones, which the cost model then uses as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_ranks import run_ranks

from hetrain.cli import main
from hetrain.cost import MEASURED_TP, tp_rank_profile
from hetrain.profile import load_profile

pytestmark = pytest.mark.slow


def test_profile_times_blocks_on_a_tp_group_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    stdout = "".join(run_ranks("-m", ["hetrain", "profile", "--model", "gpt-tiny", "--micro-batch", "1,2", "--repeats",
                                      "2", "--tp", "2", "-o", str(out)], 2, 300, cwd=tmp_path))
    assert "timed 4 layer(s) on a rank of a TP group of 2" in stdout, stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # rank 1's own profile is not left behind
    data = json.loads(out.read_text())
    blocks = [layer for layer in data["layers"] if "tp" in layer]
    assert len(blocks) == 4 and all(set(layer["measured_tp"]["cpu"]) == {"2"} for layer in blocks)
    assert all("measured_tp" not in layer for layer in data["layers"] if "tp" not in layer)
    profile = load_profile(out)
    rank = tp_rank_profile(profile, 2).layers[1]
    (type_name, ms), = rank.measured
    assert type_name == "cpu" and [m.micro_batch for m in ms] == [1, 2]
    assert all(m.source == MEASURED_TP and m.forward_s > 0 and m.backward_s > 0 for m in ms)


def test_profile_tp_outside_torchrun_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["profile", "--model", "gpt-tiny", "--micro-batch", "1", "--tp", "2", "-o", str(tmp_path / "p.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--tp 2: time TP layers under `torchrun --nproc-per-node 2 -m hetrain profile ... --tp 2`" in err

"""``--data tokens:FILE.bin`` on two ranks of ``torchrun --standalone``, with no HETRAIN_NODE set.

    hetrain plan --cluster one-node.toml --model gpt-tiny --global-batch 8 --strategy pp -o plan.json
    torchrun --standalone --nproc-per-node 2 -m hetrain train --config train.toml --steps 20

The token file is written here with numpy (uint16); the cluster's node is "n0", not this host's
name, so the ranks' host is matched to the plan's node by shape (one host of 2 ranks, one node of
2 devices) and the job says so. The loss of gpt-tiny on a repeated phrase must fall.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_jobs import TWO_CPUS, hetrain, step_rows, train_standalone

pytest.importorskip("torch")

STEPS = 20




@pytest.mark.timeout(300)
def test_gpt_tiny_learns_from_a_token_file_on_one_host_without_naming_its_node(tmp_path: Path, spawn,
                                                                               clean_env) -> None:
    phrase = np.random.default_rng(0).integers(0, 96, size=37)
    phrase[np.arange(20000) % 37].astype("<u2").tofile(tmp_path / "train.bin")  # 20,000 tokens of a 37-token phrase
    (tmp_path / "one-node.toml").write_text(TWO_CPUS)
    hetrain(["plan", "--cluster", "one-node.toml", "--model", "gpt-tiny", "--global-batch", "8", "--strategy", "pp",
             "-o", "plan.json"], tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    (tmp_path / "train.toml").write_text(f'plan = "{tmp_path / "plan.json"}"\nmodel = "gpt-tiny"\n'
                                         f'data = "tokens:{tmp_path / "train.bin"}"\n'
                                         f'steps = 1000\nlr = 3e-3\nlog_every = 1\nmetrics_out = "{metrics}"\n'
                                         'timeout_s = 60\nprogress = false\n')
    env = {k: v for k, v in clean_env.items() if k not in ("HETRAIN_NODE", "HETRAIN_HOST")}
    stdout = train_standalone(spawn, env, ["--config", str(tmp_path / "train.toml"), "--steps", str(STEPS)])
    assert "hosts matched to the plan's nodes by their device counts: " in stdout and "-> n0 (2 rank(s))" in stdout, \
        stdout
    assert f"hetrain train: gpt-tiny on tokens:{tmp_path / 'train.bin'}" in stdout, stdout

    losses = [r["loss"] for r in step_rows(metrics)]
    assert len(losses) == STEPS  # --steps on the command line over the file's 1000
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses

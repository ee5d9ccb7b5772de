"""Helpers for the tests that drive the ``hetrain`` command end to end: profile, plan, then train under torchrun.

Shared by test_own_model, test_hf_model, test_hf_export and test_token_data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: one node of two CPU devices: the cluster these tests plan for
TWO_CPUS = """
name = "two-cpus"
[[node]]
name = "n0"
devices = [{type = "cpu", count = 2}]
intra_link = "loopback"
nic = "1Gbit/s"
"""



def counting_tokens(samples: int) -> str:
    """A ``--data MODULE:FUNCTION`` module: ``samples`` token sequences of 16 that count up (mod 64) from a
    random start, so the next token is learnable; targets are the inputs shifted by one."""
    return f"""
import torch
from torch.utils.data import TensorDataset

def dataset():
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, ({samples}, 1), generator=g)
    seq = (start + torch.arange(17)) % 64          # (N, T + 1)
    return TensorDataset(seq[:, :-1], seq[:, 1:])  # inputs (N, T), targets shifted by one
"""


def hetrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m hetrain ARGS`` in ``cwd`` with this tree's sources; asserts it succeeds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "hetrain", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train_standalone(spawn: Callable[..., subprocess.Popen[str]], env: dict[str, str], args: list[str],
                     timeout_s: float = 240) -> str:
    """``torchrun --standalone --nproc-per-node 2 -m hetrain train ARGS`` on the CPU; asserts it succeeds and
    returns its stdout."""
    p = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "hetrain", "train", *args],
              {**env, "HETRAIN_DEVICE": "cpu", "PYTHONPATH": str(ROOT / "src")})
    stdout, stderr = p.communicate(timeout=timeout_s)
    assert p.returncode == 0, stderr[-4000:]
    return str(stdout)


def step_rows(metrics: Path) -> list[dict[str, Any]]:
    """The per-step rows of a metrics file (those with a step time)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time_s" in r]

"""Helpers for the tests that drive the ``hetrain`` command end to end: profile, plan, then train on
two ranks (``train_ranks``; ``train_standalone``: the same under torchrun itself).

Shared by test_own_model, test_hf_model, test_hf_export and test_token_data.
"""

from __future__ import annotations

import contextlib
import io
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
    """``hetrain ARGS`` in ``cwd``, in this process (``hetrain.cli.main``: the command's own code, without the
    seconds a fresh interpreter spends importing torch); asserts it succeeds. Its stdout and stderr as a
    CompletedProcess's."""
    from hetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        os.chdir(here)
    assert code == 0, err.getvalue()[-3000:]
    return subprocess.CompletedProcess(["hetrain", *args], code, out.getvalue(), err.getvalue())


def train_ranks(env: dict[str, str], args: list[str], timeout_s: float = 240) -> str:
    """``hetrain train ARGS`` as two Gloo ranks on one host, forked from the session's fork server
    (``worker_ranks.run_ranks``: torch and hetrain imported once), with the variables ``torchrun --standalone
    --nproc-per-node 2`` gives its workers; asserts both succeed and returns their stdout, rank 0's first.
    ``train_standalone`` runs the same under torchrun itself."""
    from worker_ranks import run_ranks

    return "".join(run_ranks("-m", ["hetrain", "train", *args], 2, timeout_s, {**env, "HETRAIN_DEVICE": "cpu"}))


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

"""The CUDA path, end to end through the command line: profile, discover, plan, train under torchrun (NCCL).

Runs only where CUDA is available (skipped elsewhere). One GPU is enough: every
check here is of one rank on its own GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HETRAIN = [sys.executable, "-m", "hetrain"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture
def cuda_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HETRAIN_DEVICE="cuda", PYTHONUNBUFFERED="1")
    return env


def test_one_gpu_trains_and_times_what_the_gpu_ran(tmp_path: Path, cuda_env: dict[str, str]) -> None:
    """The recorded iteration is timed on the GPU (after a synchronize), not by when its kernels were queued.

    gpt2-small at micro-batch 4 takes on the order of 100 ms a step on a current GPU,
    while queueing its kernels takes a few ms: a timeline read off the host clock
    alone came out at a few per cent of the step time.
    """
    prof, cluster, plan = tmp_path / "p.json", tmp_path / "c.toml", tmp_path / "plan.json"
    timeline, metrics = tmp_path / "t.json", tmp_path / "m.jsonl"
    _run([*HETRAIN, "profile", "--model", "gpt2-small", "--device", "cuda", "--micro-batch", "2,4",
          "--repeats", "3", "-o", str(prof)], cuda_env)
    _run([*TORCHRUN, "--nproc-per-node", "1", "-m", "hetrain", "discover", "-o", str(cluster), "--sizes", "4KB"],
         cuda_env)
    assert 'type = "' in cluster.read_text() and "nccl" in cluster.read_text()
    _run([*HETRAIN, "plan", "--cluster", str(cluster), "--profile", str(prof), "--global-batch", "8",
          "--micro-batch", "4", "-o", str(plan)], cuda_env)
    _run([*TORCHRUN, "--nproc-per-node", "1", "-m", "hetrain", "train", "--plan", str(plan), "--model",
          "gpt2-small", "--steps", "8", "--no-progress", "--timeline-out", str(timeline),
          "--metrics-out", str(metrics)], cuda_env)
    steps = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]
    data = json.loads(timeline.read_text())
    (events,) = data["devices"].values()
    compute = sum(end - start for start, end, kind, *_ in events if kind in ("forward", "backward"))
    typical = statistics.median(steps[2:])
    assert 0.5 * typical < compute < 1.5 * typical, (compute, steps)
    (peak,) = data["meta"]["peak_memory_bytes"].values()
    assert peak > 0
    predicted = json.loads(plan.read_text())["prediction"]["memory"][0]["peak_bytes"]
    assert 0.5 * peak < predicted < 2 * peak, (predicted, peak)


def test_more_ranks_than_gpus_is_refused_by_name(tmp_path: Path, cuda_env: dict[str, str]) -> None:
    n = torch.cuda.device_count()
    p = subprocess.run([*TORCHRUN, "--nproc-per-node", str(n + 1), "-m", "hetrain", "discover",
                        "-o", str(tmp_path / "c.toml"), "--sizes", "4KB", "--timeout", "30"],
                       env=cuda_env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert f"LOCAL_RANK {n}, but this node has {n} CUDA device(s)" in p.stderr


def test_the_profiler_measures_the_runtime_footprint_and_bf16(tmp_path: Path, cuda_env: dict[str, str]) -> None:
    """``hetrain profile --device cuda --precision bf16`` records the CUDA footprint (context, NCCL buffers, the
    allocator's reserve) and fp32 parameters with bf16 activations."""
    out = tmp_path / "profile.json"
    _run([*HETRAIN, "profile", "--model", "gpt-tiny", "--device", "cuda", "--precision", "bf16",
          "--micro-batch", "1,2", "--repeats", "2", "-o", str(out)], cuda_env)
    data = json.loads(out.read_text())
    assert data["precision"] == "bf16"
    ((type_name, footprint),) = data["memory_footprint"].items()
    assert type_name in data["measured_on"]
    assert 100e6 < footprint["fixed_bytes"] < 4e9, footprint  # a CUDA context is some hundreds of MB
    assert 0 <= footprint["allocator_fraction"] < 1.0, footprint
    fp32 = tmp_path / "fp32.json"
    _run([*HETRAIN, "profile", "--model", "gpt-tiny", "--device", "cuda", "--micro-batch", "1,2", "--repeats", "2",
          "-o", str(fp32)], cuda_env)
    ref = json.loads(fp32.read_text())
    assert [x["param_bytes"] for x in data["layers"]] == [x["param_bytes"] for x in ref["layers"]]
    block = 1  # a block's hidden states: fp32 in fp32, sent in bf16
    assert data["layers"][block]["output_bytes_per_sample"] * 2 == ref["layers"][block]["output_bytes_per_sample"]

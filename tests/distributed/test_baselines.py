"""torch's DDP and pipelining baselines (``hetrain.baselines``) on 2 Gloo ranks of this host, started as
torchrun starts them (``worker_ranks.run_ranks``).

Each trains a small gpt-tiny 2 SGD steps on synthetic data and writes its per-step
rows; the weights of every rank after those steps equal single-process training on
the same global batches (relative error <= 1e-5), so the baselines train the model
the plans train, with the same data and optimizer. The hand-made hybrid of the two
(``build_hybrid_step``: 2 pipelines of 2 stages, each stage under DDP) is held to the
same on 4 ranks, each running this file as its script (``hybrid_rank``).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from worker_ranks import run_ranks

from hetrain.baselines import BaselineError, even_bounds, interleaved_replicas
from hetrain.data.datasets import iter_batches
from hetrain.data.registry import build_datasets
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn

STEPS = 2
BATCH = 8
LR = 0.5
GPT = {"hidden": 32, "heads": 2, "seq_len": 16}


def reference_weights() -> dict[str, torch.Tensor]:
    """The whole model after ``STEPS`` SGD steps in one process, on the baselines' global batches."""
    torch.manual_seed(0)
    model = LayerRange(build_layers("gpt-tiny", seed=0, **GPT))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = build_datasets("synthetic", "gpt-tiny", seed=0, **GPT).train
    lossf = loss_fn("gpt-tiny")
    for _, (x, y) in zip(range(STEPS), iter_batches(data, BATCH, 0), strict=False):
        opt.zero_grad()
        lossf(model(x), y).backward()
        opt.step()
    return model.state_dict()


def run_baseline(kind: str, tmp_path: Path, clean_env: dict[str, str], *extra: str) -> Path:
    """``python -m hetrain.baselines KIND ...`` on two ranks as torchrun starts them, forked from the fork server."""
    out = tmp_path / "-".join((kind, *extra))
    run_ranks("-m", ["hetrain.baselines", kind, "--data", "synthetic", "--global-batch", str(BATCH),
                     "--steps", str(STEPS), "--micro-batches", "2", "--lr", str(LR), "--timeout-s", "60",
                     "--metrics-out", str(out / "metrics.jsonl"), "--weights-out", str(out),
                     *(f"--set={k}={v}" for k, v in GPT.items()), *extra], 2, 180, clean_env)
    return out


def check_rows(path: Path, kind: str) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head, rows = lines[0], lines[1:]
    assert head["baseline"] == kind and head["ranks"] == 2 and head["global_batch"] == BATCH
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["step_time_s"] > 0 and r["samples_per_s"] == pytest.approx(BATCH / r["step_time_s"])
        assert 0 < r["loss"] < 10


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                 tolerance: float = 1e-5) -> float:
    """Every tensor of ``got`` within ``tolerance`` of ``want`` (relative); the worst relative error."""
    worst = 0.0
    for key, value in got.items():
        err = float((value - want[key]).norm() / want[key].norm().clamp_min(1e-12))
        assert err <= tolerance, f"{what}: {key} differs from single-process training by {err:.2e} (relative)"
        worst = max(worst, err)
    return worst


def test_ddp_baseline_trains_like_one_process(tmp_path: Path, clean_env) -> None:
    out = run_baseline("ddp", tmp_path, clean_env)
    check_rows(out / "metrics.jsonl", "ddp")
    want = reference_weights()
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt")
        assert set(got) == set(want)
        assert_close(got, want, f"DDP rank {r}")


def test_ddp_baseline_in_bf16_trains_within_bf16s_rounding(tmp_path: Path, clean_env) -> None:
    """``--reduce-dtype bf16``: DDP's buckets all-reduced in bfloat16 (its Gloo-capable hook), as hetrain's sync
    option reduce_dtype does: within bf16's rounding of one process (2^-9 per rounding; tests/test_reduce_dtype.py),
    and further than fp32's 1e-5, or nothing was rounded."""
    out = run_baseline("ddp", tmp_path, clean_env, "--reduce-dtype", "bf16")
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["reduce_dtype"] == "bf16"
    want = reference_weights()
    worst = max(assert_close(torch.load(out / f"rank{r}.pt"), want, f"DDP bf16 rank {r}", 2e-2) for r in range(2))
    assert worst > 1e-5, f"DDP in bf16 is within fp32's error of one process ({worst:.1e})"


def test_pipelining_baseline_trains_like_one_process(tmp_path: Path, clean_env) -> None:
    out = run_baseline("pipelining", tmp_path, clean_env)
    check_rows(out / "metrics.jsonl", "pipelining")
    want = reference_weights()
    got = {**torch.load(out / "rank0.pt"), **torch.load(out / "rank1.pt")}
    assert set(got) == set(want)  # the two stages hold every layer between them, once
    assert_close(got, want, "pipelining")


def hybrid_rank(out: Path) -> None:
    """One rank of the hybrid's check (torchrun's environment): ``STEPS`` steps of ``build_hybrid_step`` on 2
    pipelines of 2 stages, 2 micro-batches each, then the stage's weights to ``out/rank{r}.pt``."""
    import torch.distributed as dist

    from hetrain.baselines import build_hybrid_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    step, module = build_hybrid_step("gpt-tiny", GPT, 2, interleaved_replicas(4, 2),
                                     lambda params: torch.optim.SGD(params, lr=LR), seed=0, timeout_s=60)
    data = build_datasets("synthetic", "gpt-tiny", seed=0, **GPT).train
    for _, batch in zip(range(STEPS), iter_batches(data, BATCH, 0), strict=False):
        step(batch)
    torch.save(module.state_dict(), out / f"rank{dist.get_rank()}.pt")
    dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)  # every file written
    sys.stdout.flush()
    os._exit(0)  # skip the group's C++ teardown, which can abort at exit (hetrain.baselines)


@pytest.mark.slow  # starts 4 processes
def test_hybrid_baseline_trains_like_one_process(tmp_path: Path, clean_env) -> None:
    """2 pipelines (ranks 0 -> 2, 1 -> 3), each on half of every global batch, stages under DDP over {0, 1} and
    {2, 3}: both replicas end where one process does on the whole batches, so DDP averaged the stages' gradients
    over the replicas (without it each replica would follow its half) and the schedule over the micro-batches."""
    run_ranks(Path(__file__).resolve(), ["hybrid-rank", str(tmp_path)], 4, 240, clean_env)
    want = reference_weights()
    for v, (first, last) in enumerate(interleaved_replicas(4, 2)):
        got = {**torch.load(tmp_path / f"rank{first}.pt"), **torch.load(tmp_path / f"rank{last}.pt")}
        assert set(got) == set(want)  # the replica's two stages hold every layer between them, once
        assert_close(got, want, f"hybrid replica {v} (ranks {first}, {last})")


def test_interleaved_replicas() -> None:
    assert interleaved_replicas(4, 2) == [[0, 2], [1, 3]]
    assert interleaved_replicas(6, 3) == [[0, 3], [1, 4], [2, 5]]
    assert interleaved_replicas(4, 1) == [[0, 1, 2, 3]]
    with pytest.raises(BaselineError, match="4 ranks do not split into 3 pipelines"):
        interleaved_replicas(4, 3)


def test_even_bounds() -> None:
    assert even_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert even_bounds(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(BaselineError, match="3 layers into 4 stages"):
        even_bounds(3, 4)


if __name__ == "__main__" and sys.argv[1:2] == ["hybrid-rank"]:
    hybrid_rank(Path(sys.argv[2]))

"""How long from `torchrun ... hetrain train` to the end of its first step, before and after a change?

The model is cut by tracing its forward since issue 32 (``hetrain.models.trace``); tracing costs time at
start-up on every rank. This runs, side by side and alternating, the same one-step job of a tiny
Llama (``hf:DIR`` built from a config.json) over two Gloo ranks on 2 pipeline stages, with this tree and
with another commit of the repository (``--base``, checked out into a temporary worktree), and reports
the wall time of each run from launch to exit (start-up, one step, tear-down: the tear-down is the same
code in both).

    python benchmarks/first_step.py --base 1258713 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "bos_token_id": 0, "eos_token_id": 0}
CLUSTER = """
name = "two-cpus"
[[node]]
name = "n0"
devices = [{type = "cpu", count = 2}]
intra_link = "loopback"
nic = "1Gbit/s"
"""
DATA = """
import torch
from torch.utils.data import TensorDataset

def dataset():
    seq = (torch.arange(64).unsqueeze(1) + torch.arange(33)) % 128   # (N, T + 1)
    return TensorDataset(seq[:, :-1], seq[:, 1:])
"""


def _env(src: Path, cache: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "HETRAIN_DEVICE": "cpu", "HETRAIN_NODE": "n0", "OMP_NUM_THREADS": "1",
            "HETRAIN_CACHE_DIR": cache}


def _run(args: list[str], src: Path, cwd: Path, cache: str = "off") -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(src, cache), capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])}... with {src} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with (before the change)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        base = tmp / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            (tmp / "llama").mkdir()
            (tmp / "llama" / "config.json").write_text(json.dumps(LLAMA))
            (tmp / "tokens.py").write_text(DATA)
            (tmp / "cluster.toml").write_text(CLUSTER)
            trees = {"before": base / "src", "after": ROOT / "src", "after, no cut cache": ROOT / "src"}
            cache = str(tmp / "cuts")  # the traced cut kept by the first run (hetrain.models.trace.save_cut)
            model, data = f"hf:{tmp / 'llama'}", f"{tmp / 'tokens.py'}:dataset"
            _run(["-m", "hetrain", "profile", "--model", model, "--data", data, "-o", "p.json", "--micro-batch", "2",
                  "--repeats", "1"], trees["before"], tmp)
            _run(["-m", "hetrain", "plan", "--cluster", "cluster.toml", "--profile", "p.json", "--global-batch", "8",
                  "--strategy", "pp", "-o", "plan.json"], trees["before"], tmp)
            train = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "hetrain", "train",
                     "--plan", "plan.json", "--model", model, "--data", data, "--steps", "1", "--no-progress",
                     "--timeout-s", "120"]
            times: dict[str, list[float]] = {name: [] for name in trees}
            _run(train, trees["after"], tmp, cache)  # warm the file caches of both trees once; the cut is kept
            _run(train, trees["before"], tmp)
            for _ in range(args.repeats):
                for name in trees:
                    times[name].append(_run(train, trees[name], tmp, cache if name == "after" else "off"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = ["| code | median s | min s | max s | vs before, median (pairs) |", "|---|---:|---:|---:|---|"]
    for name, runs in times.items():
        ratios = sorted(a / b for a, b in zip(runs, times["before"], strict=True))
        rows.append(f"| {name} ({args.base if name == 'before' else 'this tree'}) | {med[name]:.2f} | "
                    f"{min(runs):.2f} | {max(runs):.2f} | {med[name] / med['before']:.3f} "
                    f"({ratios[0]:.3f} .. {ratios[-1]:.3f}) |")
    table = "\n".join(rows)
    notes = (f"{args.repeats} alternating rounds. Each run: torchrun, 2 Gloo ranks, a 4-block Llama (hidden 64) from "
             "config.json on 2 pipeline stages, one step of 8 samples of 32 tokens, launch to exit. 'after' finds "
             "the cut that the first run traced and kept (as hetrain profile keeps it for hetrain train); 'no cut "
             "cache' traces on every rank of every run (HETRAIN_CACHE_DIR=off).")
    print(table)
    print(notes)
    if not args.no_write:
        write_section("Start to first step, traced cut vs named cut (issue 32)",
                      f"python benchmarks/first_step.py --base {args.base} --repeats {args.repeats}", table, notes)


if __name__ == "__main__":
    main()

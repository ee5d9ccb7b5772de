"""Gradients all-reduced in bf16 against fp32, hetrain's and DistributedDataParallel's, on emulated slow links.

The sync option ``reduce_dtype = "bf16"`` halves the bytes of every gradient all-reduce
(docs/sync.md, "Gradients in 16 bits"); DistributedDataParallel does the same with a
communication hook (torch's ``bf16_compress_hook`` needs NCCL, so ``hetrain.baselines`` has its own,
the same arithmetic on Gloo). On the emulated clusters of ``emulated_speedup.py`` whose NICs are
slow (network, both; 2 nodes x 2 devices, isolate_comm on as on a GPU host), one job
per cluster builds four data-parallel runtimes in the same four rank processes, on the
same batch split, and times them in blocks taking turns (ABBA, ``_vs_torch.take_turns``):

    hetrain bf16   hetrain's Trainer, gradients all-reduced in bf16 (ring, as DDP's)
    DDP bf16       DistributedDataParallel with that bf16 hook
    hetrain fp32   the same Trainer in fp32
    DDP fp32       DistributedDataParallel

Reported per cluster: samples/s of each (median block) and three ratios, each the median
over adjacent pairs of blocks (quartiles): what bf16 gains for hetrain, what it gains for
DDP, and hetrain bf16 / DDP bf16 (the same numerics side by side). Needs root.

    sudo -E .venv/bin/python benchmarks/reduce_dtype.py [--scenarios network both] [--blocks 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _emulated import can_emulate, finish
from _vs_torch import paired_ratio
from emulated_vs_torch import rank_main, run_job

RUNTIMES = (("hetrain", "hetrain bf16"), ("torch", "DDP bf16"), ("hetrain-fp32", "hetrain fp32"),
            ("torch-fp32", "DDP fp32"))


def parse_args() -> argparse.Namespace:
    from emulated_speedup import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=["network", "both"])
    parser.add_argument("--isolate-comm", choices=("on", "off"), default="on",
                        help="on (default): only the main threads throttled, as on a GPU host")
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks per runtime (default 8)")
    parser.add_argument("--block-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per runtime (default 20)")
    parser.add_argument("--job-timeout", type=float, default=1200.0)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-reduce-dtype")
    args = parser.parse_args()
    if args.blocks < 2 or args.block_steps < 1 or args.warmup < 0 or args.global_batch % 4:
        parser.error("need 2+ blocks of 1+ steps, 0+ warm-up steps and a global batch that 4 devices share")
    # what emulated_vs_torch's ranks read: the DP case, ring all-reduces and DDP's own buckets, bf16 and fp32
    args.config, args.micro_batches, args.cases = {}, 1, ["dp"]
    args.allreduce, args.ddp_buckets, args.first_bucket_bytes, args.bucket_cut = "ring", "torch", None, "exact"
    args.early_receives, args.reduce_dtype, args.both_dtypes = "always", "bf16", True
    return args


def row(name: str, blocks: dict[str, list[float]], samples: int) -> str:
    rates = " | ".join(f"{samples / statistics.median(blocks[key]):.1f}" for key, _ in RUNTIMES)
    ratios = []
    for fast, slow in (("hetrain", "hetrain-fp32"), ("torch", "torch-fp32"), ("hetrain", "torch")):
        q1, q2, q3 = paired_ratio(blocks[fast], blocks[slow])
        ratios.append(f"{q2:.2f}x ({q1:.2f}-{q3:.2f})")
    return f"| {name} | {rates} | {' | '.join(ratios)} |"


def main() -> int:
    if sys.argv[1:2] == ["--rank-worker"]:
        return rank_main(sys.argv[2])
    args = parse_args()
    if not can_emulate():
        return 0
    rows = ["| scenario | " + " | ".join(f"{label} samples/s" for _, label in RUNTIMES)
            + " | hetrain bf16 / fp32 | DDP bf16 / fp32 | hetrain bf16 / DDP bf16 |",
            "| --- |" + " ---: |" * (len(RUNTIMES) + 3)]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    failed = []
    for name in args.scenarios:
        saved = run_job(name, args.isolate_comm, args, worker=__file__)
        if saved is None:
            failed.append(name)
            continue
        rows.append(row(name, saved["blocks"]["dp"], args.global_batch * args.block_steps))  # type: ignore[index]
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    notes = (f"{args.model}, global batch {args.global_batch} split evenly over the 4 devices, SGD, fixed batch; "
             f"isolate_comm {args.isolate_comm}; hetrain's all-reduces a ring (as DDP's), its buckets cut at their "
             f"size inside layers as DDP cuts between parameters. The four runtimes built in the same 4 rank "
             f"processes of one emulated job per scenario; {args.warmup} warm-up steps each, then {args.blocks} "
             f"timed blocks of {args.block_steps} steps each, taking turns (ABBA); samples/s from the median block; "
             f"each ratio the median over pairs of blocks of the second runtime's time / the first's (> 1: the "
             f"first faster), quartiles in brackets. Load average {load0:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end; took {time.perf_counter() - start:.0f} s.")
    print(table)
    return finish(args, failed, "reduce_dtype.py", "Gradients all-reduced in bf16, emulated", table, notes)


if __name__ == "__main__":
    sys.exit(main())

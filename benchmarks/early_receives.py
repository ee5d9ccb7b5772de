"""What posting a stage's receives ahead of its RECVs costs, against torch's Schedule1F1B, where it costs most.

hetrain's runtime posts the receive of a micro-batch's activation (and of its
gradient) one ahead of the RECV that waits for it, so that the transfer lands
while the stage computes (sync option ``early_receives``, ``runtime.step.p2p``). On an
unthrottled CPU host each receive posted early keeps Gloo's progress thread
busier; where the transfers are short and many (small layers, many micro-batches:
a pipeline bound by per-micro-batch overhead rather than by its kernels, the CPU's
stand-in for a launch-bound GPU pipeline) that shows. Three runtimes side by side in
the same 2 Gloo ranks, on the same 2-stage partition and micro-batches, taking turns
block by block (A B C, C B A, ...):

    hetrain, early_receives = always    every receive posted one ahead (the default)
    hetrain, early_receives = never     every receive posted at its RECV
    torch    Schedule1F1B               receives posted at each step of its schedule

Where the ranks' CPU is the bottleneck it goes the other way (``emulated_vs_torch.py
--early-receives never``; benchmarks/RESULTS.md, "Receives posted ahead").

    python benchmarks/early_receives.py [--repeats 3] [--blocks 30] [--set hidden=16 ...]

Each repeat is its own job (fresh processes); the table gives each repeat's median
over paired blocks of torch's block time / the runtime's (> 1: faster than torch),
then the spread of those medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from _results import write_section
from _vs_torch import (
    add_repeat_arguments,
    build_hetrain,
    build_torch,
    local_cluster,
    paired_ratio,
    read_repeat_arguments,
    spawn_job,
    take_turns,
)
from hetrain.models.registry import num_layers, sample_batch

#: the overhead-bound default: gpt-tiny shrunk to 16-wide layers of 8 tokens, 10 layers, 32 micro-batches of 2
TINY = {"hidden": 16, "seq_len": 8, "heads": 2, "n_blocks": 8}
RUNTIMES = ("hetrain always", "hetrain never", "torch")


def worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), HETRAIN_NODE="n0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))  # no block waits longer for a peer
    cluster = local_cluster(args.ranks)
    layers = num_layers(args.model, **args.config)
    batch = sample_batch(args.model, args.global_batch, torch.Generator().manual_seed(0), **args.config)
    runs: dict[str, Callable[[int], None]] = {}
    for name in RUNTIMES:
        if name == "torch":
            runs[name] = build_torch("1f1b", args, layers, batch, cluster)
        else:
            options = argparse.Namespace(**{**vars(args), "early_receives": name.split()[1]})
            runs[name] = build_hetrain("1f1b", options, layers, batch, cluster)
    blocks = take_turns(runs, args, dist.barrier)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"blocks": blocks}, f)
    # every rank past this barrier (rank 0's file written) before leaving; it names any rank that does not come
    dist.monitored_barrier(timeout=timedelta(seconds=120), wait_all_ranks=True)
    os._exit(0)  # the process groups' C++ teardown can abort at exit (hetrain.baselines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_repeat_arguments(parser, TINY, "the overhead-bound shape", global_batch=64, micro_batches=32)
    args = parser.parse_args()
    read_repeat_arguments(parser, args, TINY)
    args.ranks = 2
    return args


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()[0]
    samples = args.global_batch * args.block_steps
    medians: dict[str, list[float]] = {name: [] for name in RUNTIMES}
    rows = ["| repeat | runtime | samples/s (median block) | torch / this (paired blocks: median, quartiles) |",
            "|---|---|---:|---:|"]
    for k in range(args.repeats):
        saved = spawn_job(worker, args, args.ranks, "early_receives")
        blocks: dict[str, list[float]] = saved["blocks"]  # type: ignore[assignment]
        for name in RUNTIMES:
            q1, q2, q3 = paired_ratio(blocks[name], blocks["torch"])
            medians[name].append(q2)
            rows.append(f"| {k + 1} | {name} | {samples / statistics.median(blocks[name]):.1f} | "
                        f"{q2:.3f} ({q1:.3f}-{q3:.3f}) |")
        print("\n".join(rows[-3:]), flush=True)
    rows += ["", "| runtime | torch / this, median of the repeats' medians (lowest-highest) |", "|---|---:|"]
    for name in RUNTIMES[:2]:
        m = medians[name]
        rows.append(f"| {name} | {statistics.median(m):.3f} ({min(m):.3f}-{max(m):.3f}) |")
    gain = [n / a for a, n in zip(medians["hetrain always"], medians["hetrain never"], strict=True)]
    rows.append(f"| never / always, per repeat | {', '.join(f'{g:.3f}' for g in gain)} |")
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        config = ", ".join(f"{k}={v}" for k, v in args.config.items())
        notes = (f"{args.model} ({config}), 2 stages of {num_layers(args.model, **args.config) // 2} layers, global "
                 f"batch {args.global_batch} in {args.micro_batches} micro-batches, SGD, fixed batch; 2 Gloo ranks "
                 f"on one host ({os.cpu_count()} CPUs), one torch thread each, torch {torch.__version__}. Per repeat "
                 f"(fresh processes) {args.warmup} warm-up steps per runtime, then {args.blocks} blocks of "
                 f"{args.block_steps} steps, the three runtimes taking turns. Load average {load_before:.1f} "
                 f"before and {os.getloadavg()[0]:.1f} after.")
        write_section("Receives posted ahead (issue 19)",
                      "python benchmarks/early_receives.py " + " ".join(sys.argv[1:]), table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

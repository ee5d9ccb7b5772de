"""Is hetrain's runtime as fast as PyTorch's own, on the same partition and schedule?

Side by side in one run, on CPU Gloo ranks of this machine (one torch thread each):

    pipeline, 1F1B    hetrain Trainer   vs  torch.distributed.pipelining PipelineStage + Schedule1F1B
    pipeline, GPipe   hetrain Trainer   vs  PipelineStage + ScheduleGPipe
    pure DP           hetrain Trainer   vs  DistributedDataParallel
    hybrid            hetrain Trainer   vs  Schedule1F1B per pipeline, each stage under DistributedDataParallel
                      (2 pipelines over --ranks 4 or more; not among the default cases)

Both data-parallel runtimes all-reduce the gradients in buckets (1 MiB first, then
25 MiB, last layers first) posted during the backward as the buckets' gradients are
final: DistributedDataParallel by its reducer, hetrain by its schedule's
ALLREDUCE_START actions. DDP closes a bucket between two parameters; hetrain's plan
here closes it at its size inside a layer (sync option ``bucket_cut = "exact"``);
``--bucket-cut layer`` closes it on the next layer boundary instead (gpt-tiny's first
bucket: 1.6 MB, three layers), and ``--ddp-buckets hetrain`` gives DDP hetrain's cuts.

Same model (per-layer seeded layers), same stage boundaries, same micro-batches,
same fixed global batch, SGD step included. For each comparison both runtimes
are built side by side in the same processes, warmed up, then timed in blocks
of ``--block-steps`` steps between barriers, taking turns (hetrain, torch,
torch, hetrain, ...) so that both meet the same background load; the ratio is
the median over adjacent pairs of blocks. Target: hetrain >= 1.0x of torch.

    python benchmarks/runtime_vs_torch.py [--ranks 2] [--model gpt-tiny] [--blocks 20] [--block-steps 5]

With ``--cpu-quota CPUS`` (root, a cgroup cpu controller) the whole run, every thread of every
rank with Gloo's, shares a CPU quota of that many CPUs, as on a host whose CPU is the
bottleneck; the script makes the cgroup (``hetrain.emulate.cgroups``) and removes it at the end,
and writes its own section, "Runtime vs torch, CPU-throttled (CPUS CPUs)":

    sudo -E .venv/bin/python benchmarks/runtime_vs_torch.py --cpu-quota 1.2 --blocks 12 --cases 1f1b dp

With ``--rank-quota CPUS`` each rank's threads are held in a quota of their own instead, as the emulator
holds each device's (one cgroup per rank, joined by the rank at its start, Gloo's threads included): a
host whose every rank has its own CPU as the bottleneck. Its section is "Runtime vs torch, each rank under
its own CPU quota (CPUS CPUs)":

    sudo -E .venv/bin/python benchmarks/runtime_vs_torch.py --rank-quota 0.6 --cases dp --blocks 30

The ranks' code is in ``_vs_torch`` (shared with ``emulated_vs_torch.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from _results import write_section
from _vs_torch import (
    CASES,
    HYBRID_REPLICAS,
    QUOTA_PERIOD_S,
    TORCH_NAMES,
    QuotaError,
    add_bucket_arguments,
    cpu_ms_per_step,
    cpu_quota_group,
    cpu_quota_problem,
    local_cluster,
    paired_ratio,
    rank_quota_groups,
    run_rank,
)
from hetrain.emulate.cgroups import read_cpu_stat


def worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    if args.rank_procs:  # into this rank's own CPU quota before any thread starts (--rank-quota)
        from hetrain.emulate.rankwrap import join_cgroup

        join_cgroup(args.rank_procs[rank], os.getpid())
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), HETRAIN_NODE="n0")
    run_rank(args, local_cluster(args.ranks), out_path, teardown=False)
    os._exit(0)  # the process group's C++ teardown can abort at exit ("terminate called...", hetrain.baselines)


def cpu_table(cpu: list[dict[str, dict[str, dict[str, float]]]], args: argparse.Namespace) -> str:
    """CPU milliseconds per step, summed over the ranks, by runtime and kind of thread, per comparison."""
    steps = args.blocks * args.block_steps
    rows = ["| comparison | thread | hetrain CPU ms/step | torch CPU ms/step |", "|---|---|---:|---:|"]
    for case in args.cases:
        for kind, (h, t) in cpu_ms_per_step(cpu, case, steps).items():
            rows.append(f"| {case} | {kind} | {h:.1f} | {t:.1f} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="Gloo ranks = pipeline stages = DP replicas (default 2)")
    parser.add_argument("--model", default="gpt-tiny", help="reference model (default gpt-tiny)")
    parser.add_argument("--set", dest="config", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model preset field, e.g. --set n_blocks=6")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per runtime and case (default 20)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per timed block (default 5)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps per runtime and case (default 20: a process's heap grows through its "
                             "first steps, faulting pages in, and the runtime that warms up first would pay it)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=[c for c in CASES if c != "hybrid"],
                        help="what to compare (default all but hybrid, which needs --ranks 4 or more)")
    parser.add_argument("--cpu-quota", type=float, metavar="CPUS",
                        help="run every thread of every rank (Gloo's included) under one CPU quota of this many "
                             "CPUs, e.g. 1.2 (a cgroup: needs root and the cpu controller)")
    parser.add_argument("--rank-quota", type=float, metavar="CPUS",
                        help="hold each rank's threads (Gloo's included) in a CPU quota of its own of this many "
                             "CPUs, e.g. 0.6, as the emulator holds each device's (cgroups: root)")
    add_bucket_arguments(parser)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.config = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.config)}
    if args.cpu_quota is not None and args.rank_quota is not None:
        parser.error("--cpu-quota (one quota for the run) and --rank-quota (one per rank) exclude each other")
    args.rank_procs = []
    if args.global_batch % args.ranks or args.global_batch < args.micro_batches:
        parser.error("the global batch must divide among the ranks and hold the micro-batches")
    if "hybrid" in args.cases and (args.ranks < 2 * HYBRID_REPLICAS or args.ranks % HYBRID_REPLICAS):
        parser.error(f"hybrid: {HYBRID_REPLICAS} pipelines of 2 or more stages each need --ranks a multiple of "
                     f"{HYBRID_REPLICAS}, at least {2 * HYBRID_REPLICAS}")
    return args


def main() -> int:
    args = parse_args()
    name = Path(__file__).name
    for quota in (args.cpu_quota, args.rank_quota):
        problem = None if quota is None else cpu_quota_problem(quota, os.cpu_count() or 1)
        if problem:
            print(f"{name}: {problem}", file=sys.stderr)
            return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".runtime_vs_torch.json")
    load_before = os.getloadavg()[0]
    throttled = ("" if args.cpu_quota is None else f", all under a quota of {args.cpu_quota:g} CPUs") + (
        "" if args.rank_quota is None else f", each rank under its own quota of {args.rank_quota:g} CPUs")
    throttled_s = None
    try:
        with contextlib.ExitStack() as stack:
            if args.cpu_quota is not None:
                group = stack.enter_context(cpu_quota_group(args.cpu_quota))
            if args.rank_quota is not None:
                args.rank_procs = [str(p) for p in stack.enter_context(rank_quota_groups(args.ranks, args.rank_quota))]
            print(f"{args.model}, {args.ranks} Gloo ranks, global batch {args.global_batch}, {args.micro_batches} "
                  f"micro-batches; {args.blocks} blocks of {args.block_steps} steps per runtime, taking "
                  f"turns{throttled}", flush=True)
            mp.spawn(worker, args=(args, port, out_path), nprocs=args.ranks, join=True)
            stats = ([read_cpu_stat(group)] if args.cpu_quota is not None else
                     [read_cpu_stat(Path(p).parent) for p in args.rank_procs])
            if stats:
                throttled_s = sum(st.get("throttled_time", st.get("throttled_usec", 0) * 1000) / 1e9 for st in stats)
    except QuotaError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    with open(out_path) as f:
        saved = json.load(f)
    blocks, cpu = saved["blocks"], saved["cpu"]
    os.remove(out_path)
    load_after = os.getloadavg()[0]

    what = {"1f1b": f"pipeline of {args.ranks} stages, 1F1B, {args.micro_batches} micro-batches",
            "gpipe": f"pipeline of {args.ranks} stages, GPipe, {args.micro_batches} micro-batches",
            "dp": f"data parallel, {args.ranks} replicas",
            "1f1b-eager": f"pipeline of {args.ranks} stages, hetrain 1F1B-eager vs torch 1F1B, "
                          f"{args.micro_batches} micro-batches",
            "hybrid": f"{HYBRID_REPLICAS} pipelines of {args.ranks // HYBRID_REPLICAS} stages, 1F1B, each stage under "
                      "DDP"}
    rows = ["| comparison | hetrain samples/s | torch samples/s | torch runtime | hetrain / torch (paired blocks: "
            "median, quartiles) |", "|---|---:|---:|---|---:|"]
    samples = args.global_batch * args.block_steps
    for case in args.cases:
        h, t = blocks[case]["hetrain"], blocks[case]["torch"]
        q1, q2, q3 = paired_ratio(h, t)
        rows.append(f"| {what[case]} | {samples / statistics.median(h):.1f} | {samples / statistics.median(t):.1f} "
                    f"| {TORCH_NAMES[case]} | {q2:.2f}x ({q1:.2f}-{q3:.2f}) |")
    table = "\n".join(rows) + "\n\n" + cpu_table(cpu, args)
    print(table)
    quota_note = ""
    if args.cpu_quota is not None:
        outside = sum(moved for moved, _ in saved["threads"])
        quota_note = (f" Every thread of every rank (Gloo's included: {outside} of them outside the quota's cgroup "
                      f"at the end) ran under one cgroup CPU quota of {args.cpu_quota:g} CPUs "
                      f"({args.cpu_quota * QUOTA_PERIOD_S * 1e3:g} ms per {QUOTA_PERIOD_S * 1e3:g} ms period), "
                      f"made and removed by the script; it was throttled {throttled_s:.1f} s in all.")
        print(quota_note.strip())
    if args.rank_quota is not None:
        quota_note = (f" Each rank's threads (Gloo's included: {sum(moved for moved, _ in saved['threads'])} of them "
                      f"outside their rank's cgroup at the end) ran under a cgroup CPU quota of their own of "
                      f"{args.rank_quota:g} CPUs ({args.rank_quota * QUOTA_PERIOD_S * 1e3:g} ms per "
                      f"{QUOTA_PERIOD_S * 1e3:g} ms period), as the emulator holds each device's, made and removed "
                      f"by the script; the ranks were throttled {throttled_s:.1f} s in all.")
        print(quota_note.strip())
    if not args.no_write:
        command = "python benchmarks/runtime_vs_torch.py " + " ".join(sys.argv[1:])
        config = ", ".join(f"{k}={v}" for k, v in args.config.items()) or "preset"
        cut = ("inside layers at their size (bucket_cut exact)" if args.bucket_cut == "exact"
               else "on layer boundaries (bucket_cut layer)")
        cut += ", DDP given the same cuts" if args.ddp_buckets == "hetrain" else ""
        notes = (f"Model {args.model} ({config}), global batch {args.global_batch}, SGD step included, fixed batch. "
                 f"hetrain's DP buckets cut {cut}. "
                 f"{args.ranks} Gloo ranks on one host, one torch thread each ({os.cpu_count()} CPUs, "
                 f"{platform.processor() or platform.machine()}), torch {torch.__version__}.{quota_note} Each "
                 f"runtime runs {args.blocks} timed blocks of {args.block_steps} steps (after {args.warmup} warm-up "
                 "steps), the two taking turns (ABBA) so that both see the same background load; samples/s from the "
                 "median block, ratio = median over pairs of adjacent blocks of torch's time / hetrain's (quartiles "
                 "in brackets). The host's load average was "
                 f"{load_before:.1f} before and {load_after:.1f} after: where other jobs share the CPUs, absolute "
                 "samples/s move from row to row with their load; read the ratio within a row.")
        title = ("Runtime vs torch" if args.cpu_quota is None and args.rank_quota is None
                 else f"Runtime vs torch, CPU-throttled ({args.cpu_quota:g} CPUs)" if args.cpu_quota is not None
                 else f"Runtime vs torch, each rank under its own CPU quota ({args.rank_quota:g} CPUs)")
        write_section(title, command.strip(), table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

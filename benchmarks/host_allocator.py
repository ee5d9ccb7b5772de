"""Host allocator: minor page faults and CPU per step, hetrain's DP step against DDP's, glibc's thresholds or raised.

One Gloo rank (world size 1), gpt-tiny, 8 samples per step, SGD. In each of two fresh processes, one with
``HETRAIN_HOST_MALLOC=default`` (glibc's own mmap and trim thresholds) and one without (the Trainer raises them:
``hetrain.runtime.lifecycle.host_memory``), both runtimes are built, warmed up, then timed in alternating (ABBA) blocks;
each block reads the main thread's CPU time and minor page faults (``getrusage(RUSAGE_THREAD)``). The
CPU per step is the median over blocks, the page faults and kernel time the mean (they come in bursts, and
the kernel time in clock ticks); the ratio is the median over pairs of blocks of DDP's CPU / hetrain's.

    python benchmarks/host_allocator.py [--blocks 40] [--block-steps 5] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _results import write_section

HERE = Path(__file__).resolve().parent

# one process: both runtimes on one rank, ABBA blocks; prints JSON {who: [[cpu_s, minor faults, kernel_s] per
# step, one entry per block]}
WORKER = """
import argparse, json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
from _vs_torch import build_hetrain, build_torch, local_cluster
from hetrain.models.registry import num_layers, sample_batch
torch.set_num_threads(1)
dist.init_process_group("gloo")
args = argparse.Namespace(model="gpt-tiny", config={}, global_batch=8, micro_batches=1, allreduce="ring",
                          bucket_cut="exact", block_steps=int(sys.argv[3]), ddp_buckets="torch")
batch = sample_batch("gpt-tiny", 8, torch.Generator().manual_seed(0))
cluster = local_cluster(1)
runs = {"hetrain": build_hetrain("dp", args, num_layers("gpt-tiny"), batch, cluster),
        "torch": build_torch("dp", args, num_layers("gpt-tiny"), batch, cluster)}
for run in runs.values():
    run(3)
out = {"hetrain": [], "torch": []}
for block in range(int(sys.argv[2])):
    for who in (("hetrain", "torch") if block % 2 == 0 else ("torch", "hetrain")):
        r0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        runs[who](args.block_steps)
        r1, c1 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        out[who].append([(c1 - c0) / args.block_steps, (r1.ru_minflt - r0.ru_minflt) / args.block_steps,
                         (r1.ru_stime - r0.ru_stime) / args.block_steps])
dist.destroy_process_group()
print(json.dumps(out))
"""


def run_worker(allocator: str, blocks: int, block_steps: int, port: int) -> dict[str, list[list[float]]]:
    env = dict(os.environ)
    if allocator == "glibc's":
        env["HETRAIN_HOST_MALLOC"] = "default"
    else:
        env.pop("HETRAIN_HOST_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", WORKER, str(HERE), str(blocks), str(block_steps), str(port)],
                         capture_output=True, text=True, env=env, timeout=1800, check=True)
    result: dict[str, list[list[float]]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks per runtime (default 40)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if args.blocks < 2 or args.block_steps < 1:
        parser.error(f"--blocks must be >= 2 and --block-steps >= 1, got {args.blocks} and {args.block_steps}")
    lines = ["| host allocator | runtime | main-thread CPU ms/step | minor page faults/step | kernel ms/step | "
             "DDP / hetrain CPU (paired blocks: median, quartiles) |", "|---|---|---:|---:|---:|---:|"]
    for k, allocator in enumerate(("glibc's", "raised by hetrain")):
        blocks = run_worker(allocator, args.blocks, args.block_steps, 29600 + k)
        ratios = sorted(t[0] / h[0] for h, t in zip(blocks["hetrain"], blocks["torch"], strict=True))
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        for who, name in (("hetrain", "hetrain DP"), ("torch", "DistributedDataParallel")):
            cpu = statistics.median(b[0] for b in blocks[who])
            faults, kernel = (statistics.mean(b[i] for b in blocks[who]) for i in (1, 2))
            ratio = f"{q2:.3f} ({q1:.3f}-{q3:.3f})" if who == "hetrain" else ""
            lines.append(f"| {allocator} | {name} | {cpu * 1e3:.2f} | {faults:.0f} | {kernel * 1e3:.2f} | {ratio} |")
        print("\n".join(lines[-2:]), flush=True)
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        notes = (f"gpt-tiny, one Gloo rank, 8 samples per step, SGD, fixed batch; {args.blocks} blocks of "
                 f"{args.block_steps} steps per runtime after 3 warm-up steps, taking turns (ABBA), in one process per "
                 "allocator setting (both runtimes in it, so DDP runs under the same thresholds); 'glibc's': "
                 "HETRAIN_HOST_MALLOC=default. CPU: the median block; page faults and kernel time: the mean over "
                 "blocks (they come in bursts; kernel time is counted in clock ticks). Ratio > 1: hetrain's step "
                 "used less CPU. "
                 f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
        command = "python benchmarks/host_allocator.py" + (f" --blocks {args.blocks}" if args.blocks != 40 else "")
        write_section("Host allocator: page faults per step (issue 19)", command, table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Uneven shards on Gloo: which collectives move a range to its owner, and back, fastest.

ZeRO's owners of a segment keep uneven ranges of its flat buffers (``Segment.shard_bounds``).
Gloo cuts ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` into even parts only, and
has no uneven ``all_gather``, so ``hetrain.runtime.sync.shard`` chose between (per iteration):

    gradients to owners   all_reduce (everyone gets every sum) | reduce(dst=owner) per owner |
                          reduce_scatter_tensor, each range padded to the largest
    weights back          broadcast(src=owner) per owner | all_gather_into_tensor, padded

One job per case on this host (Gloo, CPU, one thread per rank), medians of ``--reps`` timed
calls after one untimed. The runtime uses the per-owner reduce and broadcast.

    .venv/bin/python benchmarks/shard_collectives.py [--elements 4000000] [--reps 5] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _results import write_section

#: (ranks, each owner's share)
CASES = ((2, (0.75, 0.25)), (3, (0.25, 0.5, 0.25)))
METHODS = ("all_reduce", "reduce per owner", "padded reduce_scatter", "broadcast per owner", "padded all_gather")


def bounds(n: int, shares: tuple[float, ...]) -> list[tuple[int, int]]:
    """Each owner's [lo, hi), as ``Segment.shard_bounds`` cuts them."""
    edges, acc = [0], 0.0
    for f in shares[:-1]:
        acc += f
        edges.append(round(acc * n))
    edges.append(n)
    return list(itertools.pairwise(edges))


def rank_main(rank: int, world: int, port: int, n: int, shares: tuple[float, ...], reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flat = torch.randn(n)
    cut = bounds(n, shares)
    widest = max(hi - lo for lo, hi in cut)
    padded, part = torch.zeros(world * widest), torch.empty(widest)

    def reduce_each() -> None:
        for w in [dist.reduce(flat[lo:hi], dst=j, async_op=True) for j, (lo, hi) in enumerate(cut)]:
            w.wait()

    def reduce_scatter() -> None:
        for j, (lo, hi) in enumerate(cut):
            padded[j * widest:j * widest + hi - lo].copy_(flat[lo:hi])
        dist.reduce_scatter_tensor(part, padded)

    def broadcast_each() -> None:
        for w in [dist.broadcast(flat[lo:hi], src=j, async_op=True) for j, (lo, hi) in enumerate(cut)]:
            w.wait()

    def all_gather() -> None:
        dist.all_gather_into_tensor(padded, part)
        for j, (lo, hi) in enumerate(cut):
            flat[lo:hi].copy_(padded[j * widest:j * widest + hi - lo])

    runs = dict(zip(METHODS, (lambda: dist.all_reduce(flat), reduce_each, reduce_scatter, broadcast_each,
                              all_gather), strict=True))
    times: dict[str, float] = {}
    for name, run in runs.items():
        run()
        dist.barrier()
        took = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            dist.barrier()
            took.append(time.perf_counter() - t0)
        times[name] = statistics.median(took)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=4_000_000, help="fp32 elements of the flat buffer")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = ["| ranks, shares | " + " | ".join(f"{m} (ms)" for m in METHODS) + " |",
            "|---|" + "---:|" * len(METHODS)]
    with tempfile.TemporaryDirectory() as tmp:
        for world, shares in CASES:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = os.path.join(tmp, f"{world}.json")
            mp.spawn(rank_main, (world, port, args.elements, shares, args.reps, out), nprocs=world)
            times = json.loads(Path(out).read_text())
            rows.append(f"| {world}, {':'.join(f'{x:g}' for x in shares)} | "
                        + " | ".join(f"{1e3 * times[m]:.1f}" for m in METHODS) + " |")
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        write_section("Uneven shards: collectives on Gloo (issue 35)",
                      f"benchmarks/shard_collectives.py --elements {args.elements} --reps {args.reps}", table,
                      f"A flat fp32 buffer of {args.elements} elements. The runtime reduces each range to its owner "
                      "and broadcasts it back (hetrain.runtime.sync.shard): Gloo's padded reduce_scatter and "
                      "all_gather move the largest range from every rank. Host load average "
                      f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end: read the ratios.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a send of hetrain's runtime block its sender's compute? (CPU, Gloo, 2 ranks)

hetrain's runtime (``runtime/step/p2p.py``) posts a receive ahead (``irecv``) and sends with
``isend``, waiting for its sends only before the optimizer step. Whether the transfer then
overlaps the sender's next compute, or is on its critical path as with a blocking send, is
a property of the transport; the cost model needs to know which (``Plan.transfers``).

Rank 1 posts the receive, then does nothing but wait. Rank 0, one torch thread, times:

    compute alone           C   a fixed loop of matrix products
    send alone              S   isend of the message + wait
    isend, compute, wait    T   the message posted, the same loop, then the wait

and reports ``T`` against ``max(C, S)`` (the send overlaps compute) and ``C + S`` (it
blocks): the share of the send that lands on the sender's critical path is
``(T - max(C, S)) / min(C, S)`` (0: overlapped, 1: blocking). The medians of
``--repeats`` rounds are printed, with the time the ``isend`` call itself took.

    python benchmarks/transfer_blocking.py [--mbytes 256] [--repeats 7] [--json OUT]

Over this host's loopback the transfer is a memory copy through the kernel's sockets;
Gloo's transport does it on its own thread, so the share depends on a free core for it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _compute(a: torch.Tensor, steps: int) -> float:
    t0 = time.perf_counter()
    x = a
    for _ in range(steps):
        x = torch.tanh(x @ a)
    return time.perf_counter() - t0


def _rank(rank: int, port: int, numel: int, steps: int, repeats: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    msg = torch.ones(numel)
    a = torch.randn(384, 384) / 20
    rows: list[dict[str, float]] = []
    for r in range(repeats):
        # send alone
        dist.barrier()
        if rank == 1:
            dist.irecv(msg, 0, tag=3 * r).wait()
        else:
            t0 = time.perf_counter()
            dist.isend(msg, 1, tag=3 * r).wait()
            send_s = time.perf_counter() - t0
        # compute alone
        dist.barrier()
        if rank == 0:
            compute_s = _compute(a, steps)
        # isend, compute, wait
        dist.barrier()
        if rank == 1:
            dist.irecv(msg, 0, tag=3 * r + 1).wait()
        else:
            t0 = time.perf_counter()
            work = dist.isend(msg, 1, tag=3 * r + 1)
            post_s = time.perf_counter() - t0
            overlapped_compute_s = _compute(a, steps)
            work.wait()
            total_s = time.perf_counter() - t0
            rows.append({"send_s": send_s, "compute_s": compute_s, "post_s": post_s,
                         "compute_during_send_s": overlapped_compute_s, "total_s": total_s})
    dist.barrier()
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=256.0, help="message size, MB (default 256)")
    ap.add_argument("--steps", type=int, default=0, help="matrix products per compute (default: about the send's time)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the medians here")
    args = ap.parse_args(argv)
    numel = int(args.mbytes * 1e6 / 4)
    steps = args.steps
    if steps <= 0:  # about as long as a loopback copy of the message at ~2 GB/s
        torch.set_num_threads(1)
        a = torch.randn(384, 384) / 20
        per = _compute(a, 20) / 20
        steps = max(1, int(args.mbytes * 1e6 / 2e9 / per))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, numel, steps, args.repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    c, s, t = med["compute_s"], med["send_s"], med["total_s"]
    share = (t - max(c, s)) / min(c, s)
    med.update(mbytes=args.mbytes, steps=steps, blocking_share=share, cpus=os.cpu_count() or 0)
    print(f"message {args.mbytes:g} MB, {steps} matrix products, median of {args.repeats} rounds, "
          f"{os.cpu_count()} CPUs")
    print(f"  send alone {s * 1e3:.1f} ms, compute alone {c * 1e3:.1f} ms, isend call {med['post_s'] * 1e3:.2f} ms")
    print(f"  isend + compute + wait {t * 1e3:.1f} ms (compute within it {med['compute_during_send_s'] * 1e3:.1f} ms)")
    print(f"  overlap would give {max(c, s) * 1e3:.1f} ms, blocking {(c + s) * 1e3:.1f} ms: "
          f"share of the send on the sender's critical path {share:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(med, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Is hetrain's runtime as fast as PyTorch's own, on the same partition and schedule?

Side by side in one run, on CPU Gloo ranks of this machine (one torch thread each):

    pipeline, 1F1B    hetrain Trainer   vs  torch.distributed.pipelining PipelineStage + Schedule1F1B
    pipeline, GPipe   hetrain Trainer   vs  PipelineStage + ScheduleGPipe
    pure DP           hetrain Trainer   vs  DistributedDataParallel

Both data-parallel runtimes all-reduce the gradients in buckets (1 MiB first, then
25 MiB, last layers first) posted during the backward as the buckets' gradients are
final: DistributedDataParallel by its reducer, hetrain by its schedule's
ALLREDUCE_START actions.

Same model (per-layer seeded layers), same stage boundaries, same micro-batches,
same fixed global batch, SGD step included. For each comparison both runtimes
are built side by side in the same processes, warmed up, then timed in blocks
of ``--block-steps`` steps between barriers, taking turns (hetrain, torch,
torch, hetrain, ...) so that both meet the same background load; the ratio is
the median over adjacent pairs of blocks. Target: hetrain >= 1.0x of torch.

    python benchmarks/runtime_vs_torch.py [--ranks 2] [--model gpt-tiny] [--blocks 20] [--block-steps 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _results import write_section
from hetrain.baselines import build_ddp_step, build_pipelining_step, even_bounds
from hetrain.cluster import parse_cluster
from hetrain.models.registry import build_layers, layer_names, loss_fn, num_layers, sample_batch
from hetrain.plan import Plan, Prediction, Stage, VirtualWorker
from hetrain.profile import LayerProfile, ModelProfile
from hetrain.runtime import Trainer, build_optimizer_fn

LR = 0.01
CASES = ("1f1b", "gpipe", "dp")
TORCH_NAMES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "dp": "DistributedDataParallel"}


def build_plan(case: str, args: argparse.Namespace, layers: int) -> Plan:
    """The plan both runtimes follow: one pipeline over every rank, or one single-stage VW per rank."""
    p = args.ranks
    cluster = parse_cluster({"name": "local", "node": [{"name": "n0", "devices": [{"type": "cpu", "count": p}],
                                                       "intra_link": "loopback", "nic": "1Gbit/s"}]})
    devices = [f"n0:{k}" for k in range(p)]
    if case == "dp":
        share = args.global_batch // p
        vws = tuple(VirtualWorker((Stage(d, 0, layers),), share, 1) for d in devices)
        strategy = "dp"
    else:
        b = even_bounds(layers, p)
        vws = (VirtualWorker(tuple(Stage(d, b[j], b[j + 1]) for j, d in enumerate(devices)), args.global_batch,
                             args.micro_batches),)
        strategy = "pp"
    # the runtime reads the layer count of the profile, and each layer's parameter bytes, from which
    # the plan's sync layout cuts the gradient buckets (DistributedDataParallel's sizes: 1 MiB first, then 25 MiB)
    sizes = [float(sum(p.numel() * p.element_size() for p in layer.parameters()))
             for layer in build_layers(args.model, seed=0, **args.config)]
    profile = ModelProfile(args.model, tuple(LayerProfile(name, size, 0, 0, 0) for name, size in
                                             zip(layer_names(args.model, **args.config), sizes, strict=True)), 0)
    return Plan(args.model, args.global_batch, "gpipe" if case == "gpipe" else "1f1b", "bsp", "sgd", vws,
                Prediction(0, 0, 0, 0, 0), strategy, "manual", cluster, profile)


def build_hetrain(case: str, args: argparse.Namespace, layers: int,
                  batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[int], None]:
    """``run(k)``: k more steps of hetrain's Trainer."""
    plan = build_plan(case, args, layers)
    trainer = Trainer(lambda a, b: build_layers(args.model, a, b, seed=0, **args.config), plan,
                      build_optimizer_fn("sgd", LR), loss_fn(args.model), timeout_s=120, progress=False,
                      log_every=args.block_steps)
    data = itertools.repeat(batch)

    def run(k: int) -> None:
        trainer.fit(data, trainer.step + k)

    return run


def build_torch(case: str, args: argparse.Namespace, layers: int,
                batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[int], None]:
    """``run(k)``: k more steps of torch's pipelining schedule, or of DistributedDataParallel
    (``hetrain.baselines``, the same runners the emulated benchmark launches)."""
    opt_fn = build_optimizer_fn("sgd", LR)
    if case == "dp":
        step, _ = build_ddp_step(args.model, args.config, args.global_batch, opt_fn, seed=0)
    else:
        step, _ = build_pipelining_step(args.model, args.config, args.micro_batches, case, opt_fn, seed=0)

    def run(k: int) -> None:
        for _ in range(k):
            step(batch)

    return run


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used, by what it is: ``main``, a Python
    thread's name, or ``native`` (the threads Python does not know: Gloo's, torch's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # the thread ended
            continue
        tid = int(task)
        kind = "main" if tid == os.getpid() else names.get(tid, "native")
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return out


Blocks = dict[str, list[float]]
ThreadCpu = dict[str, dict[str, float]]


def measure_case(case: str, args: argparse.Namespace, layers: int,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Blocks, ThreadCpu]:
    """Seconds of each block of ``block_steps`` steps, per runtime, the runtimes taking turns (ABBA); and the CPU
    seconds this rank's threads spent in them, per runtime and kind of thread."""
    runs = {"hetrain": build_hetrain(case, args, layers, batch), "torch": build_torch(case, args, layers, batch)}
    for run in runs.values():
        run(args.warmup)
    out: dict[str, list[float]] = {"hetrain": [], "torch": []}
    cpu: dict[str, dict[str, float]] = {"hetrain": {}, "torch": {}}
    for block in range(args.blocks):
        order = ("hetrain", "torch") if block % 2 == 0 else ("torch", "hetrain")
        for who in order:
            dist.barrier()
            before = thread_cpu_s()
            start = time.perf_counter()
            runs[who](args.block_steps)
            dist.barrier()
            out[who].append(time.perf_counter() - start)
            for kind, seconds in thread_cpu_s().items():
                cpu[who][kind] = cpu[who].get(kind, 0.0) + seconds - before.get(kind, 0.0)
    return out, cpu


def worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), HETRAIN_NODE="n0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layers = num_layers(args.model, **args.config)
    batch = sample_batch(args.model, args.global_batch, torch.Generator().manual_seed(0), **args.config)
    blocks, cpu = {}, {}
    for case in args.cases:
        blocks[case], cpu[case] = measure_case(case, args, layers, batch)
        if rank == 0:
            rates = {w: args.global_batch * args.block_steps / statistics.median(t) for w, t in blocks[case].items()}
            print(f"  {case:<6} hetrain {rates['hetrain']:8.1f}  torch {rates['torch']:8.1f} samples/s", flush=True)
    every: list[object] = [None] * args.ranks
    dist.all_gather_object(every, cpu)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"blocks": blocks, "cpu": every}, f)
    dist.destroy_process_group()


def cpu_table(cpu: list[dict[str, dict[str, dict[str, float]]]], args: argparse.Namespace) -> str:
    """CPU milliseconds per step, summed over the ranks, by runtime and kind of thread, per comparison."""
    steps = args.blocks * args.block_steps
    rows = ["| comparison | thread | hetrain CPU ms/step | torch CPU ms/step |", "|---|---|---:|---:|"]
    for case in args.cases:
        kinds = sorted({k for rank in cpu for who in rank[case].values() for k in who})
        for kind in kinds:
            h = sum(rank[case]["hetrain"].get(kind, 0.0) for rank in cpu) / steps * 1e3
            t = sum(rank[case]["torch"].get(kind, 0.0) for rank in cpu) / steps * 1e3
            rows.append(f"| {case} | {kind} | {h:.1f} | {t:.1f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="Gloo ranks = pipeline stages = DP replicas (default 2)")
    parser.add_argument("--model", default="gpt-tiny", help="reference model (default gpt-tiny)")
    parser.add_argument("--set", dest="config", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model preset field, e.g. --set n_blocks=6")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per runtime and case (default 20)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per timed block (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per runtime and case (default 3)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="what to compare (default all)")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.config = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.config)}
    if args.global_batch % args.ranks or args.global_batch < args.micro_batches:
        parser.error("the global batch must divide among the ranks and hold the micro-batches")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".runtime_vs_torch.json")
    load_before = os.getloadavg()[0]
    print(f"{args.model}, {args.ranks} Gloo ranks, global batch {args.global_batch}, {args.micro_batches} "
          f"micro-batches; {args.blocks} blocks of {args.block_steps} steps per runtime, taking turns", flush=True)
    mp.spawn(worker, args=(args, port, out_path), nprocs=args.ranks, join=True)
    with open(out_path) as f:
        saved = json.load(f)
    blocks, cpu = saved["blocks"], saved["cpu"]
    os.remove(out_path)
    load_after = os.getloadavg()[0]

    what = {"1f1b": f"pipeline of {args.ranks} stages, 1F1B, {args.micro_batches} micro-batches",
            "gpipe": f"pipeline of {args.ranks} stages, GPipe, {args.micro_batches} micro-batches",
            "dp": f"data parallel, {args.ranks} replicas"}
    rows = ["| comparison | hetrain samples/s | torch samples/s | torch runtime | hetrain / torch (paired blocks: "
            "median, quartiles) |", "|---|---:|---:|---|---:|"]
    samples = args.global_batch * args.block_steps
    for case in args.cases:
        h, t = blocks[case]["hetrain"], blocks[case]["torch"]
        ratios = sorted(tb / hb for hb, tb in zip(h, t, strict=True))  # > 1: hetrain's block was shorter
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        rows.append(f"| {what[case]} | {samples / statistics.median(h):.1f} | {samples / statistics.median(t):.1f} "
                    f"| {TORCH_NAMES[case]} | {q2:.2f}x ({q1:.2f}-{q3:.2f}) |")
    table = "\n".join(rows) + "\n\n" + cpu_table(cpu, args)
    print(table)
    if not args.no_write:
        command = "python benchmarks/runtime_vs_torch.py " + " ".join(sys.argv[1:])
        config = ", ".join(f"{k}={v}" for k, v in args.config.items()) or "preset"
        notes = (f"Model {args.model} ({config}), global batch {args.global_batch}, SGD step included, fixed batch. "
                 f"{args.ranks} Gloo ranks on one host, one torch thread each ({os.cpu_count()} CPUs, "
                 f"{platform.processor() or platform.machine()}), torch {torch.__version__}. Each runtime runs "
                 f"{args.blocks} timed blocks of {args.block_steps} steps (after {args.warmup} warm-up steps), the "
                 "two taking turns (ABBA) so that both see the same background load; samples/s from the median "
                 "block, ratio = median over pairs of adjacent blocks of torch's time / hetrain's (quartiles in "
                 "brackets). The host's load average was "
                 f"{load_before:.1f} before and {load_after:.1f} after: where other jobs share the CPUs, absolute "
                 "samples/s move from row to row with their load; read the ratio within a row.")
        write_section("Runtime vs torch", command.strip(), table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

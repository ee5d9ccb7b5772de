"""Is hetrain's runtime as fast as PyTorch's on the same partition, inside hetrain's emulator?

The three clusters of ``emulated_speedup.py`` (SCENARIOS there: network, compute, both; 2 nodes
x 2 devices), each emulated twice (hetrain.emulate: a namespace per node with its shaped NIC, a
cgroup CPU quota per device, each device pinned to a CPU with an idle filler):

    isolate_comm on    only each rank's main thread is throttled; Gloo's threads (and hetrain's
                       helpers) run outside the quota, as on a GPU where NCCL does not take the compute
    isolate_comm off   every thread of a rank spends its device's quota, as on a CPU-bound host

On each, one job whose four ranks (one per device, in the cluster's order) run
``runtime_vs_torch``'s worker (``_vs_torch.run_rank``): per case both runtimes are built in the
same processes on the same partition and timed in blocks taking turns (ABBA):

    dp      pure data parallelism, the batch split evenly: hetrain's Trainer vs DistributedDataParallel
            (hetrain's all-reduces: a ring as DDP's; ``--allreduce auto``: hierarchical across the nodes
            where hetrain's sync layout finds that cheaper, as a plan of its own would; its buckets cut at
            their size inside a layer as DDP's, ``--bucket-cut layer``: on layer boundaries)
    1f1b    one pipeline over the 4 devices, layers split evenly, 1F1B, the same micro-batches:
            hetrain's Trainer vs torch.distributed.pipelining Schedule1F1B
    hybrid  2 data-parallel replicas (VWs), each a 2-stage pipeline, layers split evenly (for gpt-tiny the
            cut 0-2 | 3-5 of hetrain's own plan for the network scenario), 1F1B, ``--hybrid-micro-batches`` (4,
            the plan's) per VW of half the batch: hetrain's Trainer (its DP sync through DDP's reducer, each
            segment a whole stage: runtime.sync.reducer) vs torch.distributed.pipelining's Schedule1F1B per VW
            with every stage under DistributedDataParallel (hetrain.baselines.build_hybrid_step)
    1f1b-eager  the same pipeline as 1f1b, hetrain under 1F1B-eager (one more micro-batch in flight on every
            stage but the last) vs Schedule1F1B (not in the default cases)

Which devices form a hybrid VW: stage j of VW v is device ``2j + v`` in the cluster's order
(``baselines.interleaved_replicas``), so VW 0 is fast:0 -> slow:0 and VW 1 fast:1 -> slow:1: each pipeline
crosses the NIC with its activations, each stage's two replicas all-reduce inside a node. It is the pairing
hetrain's planner chose for the network scenario ("hybrid: 2 + 2"), and the one a hand-made torch hybrid
gets from the usual rank layouts: Megatron-LM's default order puts data parallelism inside pipeline
parallelism (ranks 0, 1 one stage's replicas, pipelines 0 -> 2 and 1 -> 3), as torchtitan's device mesh
does with ``pp`` its outermost dimension. The other choice, a pipeline inside each node and DDP across the
nodes, would put each stage's gradients (1.6 MB for gpt-tiny, every step) on the 50 Mbit/s NIC instead
of the activations of its micro-batches (0.5 MB per VW and direction); either way both runtimes run the
same partition, which is what is compared.

Reported per scenario x isolate_comm x case: samples/s of each (median block), hetrain / torch (median
over adjacent pairs of blocks, quartiles), CPU ms per step by thread (main, Python threads, native)
summed over the ranks, and how many threads other than the main one sat outside the device's quota at
the end (isolate_comm's mover, ``emulate.rankwrap``, at work). Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/emulated_vs_torch.py [--blocks 8] [--scenarios both] [--isolate-comm on off]
    sudo -E .venv/bin/python benchmarks/emulated_vs_torch.py --quick   # 2 blocks of 2 steps, no RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

from _emulated import can_emulate, finish
from _vs_torch import (
    HYBRID_MICRO_BATCHES,
    HYBRID_REPLICAS,
    TORCH_NAMES,
    add_bucket_arguments,
    cpu_ms_per_step,
    paired_ratio,
    run_rank,
    thread_group,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CASES = ("dp", "1f1b", "hybrid", "1f1b-eager")
THREADS = ("main", "python", "native")


def rank_main(config_path: str) -> NoReturn:
    """One emulated rank (started by the emulator's torchrun): the cases of the job's config, measured."""
    from hetrain.cluster import parse_cluster

    with open(config_path) as f:
        config = json.load(f)
    run_rank(argparse.Namespace(**config["args"]), parse_cluster(tomllib.loads(config["cluster_toml"])),
             config["result"], teardown=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the process group's C++ teardown, which aborted a rank at exit once (and failed its job)


def run_job(name: str, isolate: str, args: argparse.Namespace, worker: str = __file__) -> dict[str, object] | None:
    """One emulated cluster, one job of every case; what rank 0 wrote, or None (the log's path said). Each rank
    runs ``worker --rank-worker CONFIG`` (a script whose main hands that to ``rank_main``)."""
    from emulated_speedup import SCENARIOS
    from hetrain.cluster import parse_cluster
    from hetrain.emulate import EmulatedCluster, parse_emulation_settings

    out = Path(args.out) / f"{name}-isolate-{isolate}"
    out.mkdir(parents=True, exist_ok=True)
    text = SCENARIOS[name]
    nominal = tomllib.loads(text)
    settings = parse_emulation_settings(nominal.get("emulation")).with_overrides(isolate_comm=isolate == "on")
    result = out / "result.json"
    result.unlink(missing_ok=True)
    rank_args = {k: getattr(args, k) for k in ("model", "config", "global_batch", "micro_batches", "blocks",
                                               "block_steps", "warmup", "cases", "allreduce", "ddp_buckets",
                                               "first_bucket_bytes", "bucket_cut", "early_receives",
                                               "reduce_dtype")}
    rank_args["both_dtypes"] = getattr(args, "both_dtypes", False)
    rank_args["hybrid_micro_batches"] = getattr(args, "hybrid_micro_batches", HYBRID_MICRO_BATCHES)
    config = out / "config.json"
    config.write_text(json.dumps({"args": rank_args, "cluster_toml": text, "result": str(result.resolve())}))
    log_path = out / "job.log"
    start = time.perf_counter()
    with open(log_path, "w") as log, EmulatedCluster(parse_cluster(nominal), settings,
                                                     log=lambda m: print(m, file=log, flush=True)) as em:
        print(em.describe(), file=log, flush=True)
        status = em.launch([sys.executable, str(Path(worker).resolve()), "--rank-worker", str(config.resolve())],
                           timeout_s=args.job_timeout, stdout=log, stderr=log)
    took = time.perf_counter() - start
    if status != 0 or not result.exists():
        print(f"{name}, isolate_comm {isolate}: the job failed with exit status {status} after {took:.0f} s; "
              f"see {log_path}", flush=True)
        return None
    print(f"{name}, isolate_comm {isolate}: {took:.0f} s", flush=True)
    saved: dict[str, object] = json.loads(result.read_text())
    return saved


def table_rows(name: str, isolate: str, saved: dict[str, object], args: argparse.Namespace) -> list[str]:
    """The rows of one job: one per case."""
    blocks: dict[str, dict[str, list[float]]] = saved["blocks"]  # type: ignore[assignment]
    cpu = saved["cpu"]
    threads: list[list[int]] = saved["threads"]  # type: ignore[assignment]
    moved, others = sum(m for m, _ in threads), sum(n for _, n in threads)
    samples = args.global_batch * args.block_steps
    rows = []
    for case in args.cases:
        h, t = blocks[case]["hetrain"], blocks[case]["torch"]
        q1, q2, q3 = paired_ratio(h, t)
        ms = cpu_ms_per_step(cpu, case, args.blocks * args.block_steps, thread_group)  # type: ignore[arg-type]
        by_thread = " | ".join("{:.1f} / {:.1f}".format(*ms.get(kind, (0.0, 0.0))) for kind in THREADS)
        rows.append(f"| {name} | {isolate} | {case} ({TORCH_NAMES[case]}) | {samples / statistics.median(h):.1f} | "
                    f"{samples / statistics.median(t):.1f} | {q2:.2f}x ({q1:.2f}-{q3:.2f}) | {by_thread} | "
                    f"{moved} of {others} |")
    return rows


def parse_args() -> argparse.Namespace:
    from emulated_speedup import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--isolate-comm", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="emulate with isolate_comm on, off or both (default both)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES[:3]),
                        help="what to compare (default dp, 1f1b and hybrid)")
    parser.add_argument("--allreduce", choices=("ring", "auto"), default="ring",
                        help="hetrain's all-reduces: ring, as DistributedDataParallel's (default), or auto: "
                             "hierarchical across the nodes where its sync layout finds that cheaper")
    parser.add_argument("--model", default="gpt-tiny", help="reference model (default gpt-tiny)")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8, help="of the 1f1b pipeline (default 8)")
    parser.add_argument("--hybrid-micro-batches", type=int, default=HYBRID_MICRO_BATCHES,
                        help=f"of each of the hybrid's {HYBRID_REPLICAS} pipelines (default {HYBRID_MICRO_BATCHES})")
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks per runtime and case (default 8)")
    parser.add_argument("--block-steps", type=int, default=3, help="steps per timed block (default 3)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps per runtime and case (default 20: a process's heap grows through its "
                             "first steps, faulting pages in, and the runtime that warms up first would pay it; "
                             "runtime.lifecycle.host_memory)")
    parser.add_argument("--job-timeout", type=float, default=900.0, help="seconds one emulated job may run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 blocks of 2 steps, 1 warm-up step, "
                                                             "RESULTS.md left alone")
    add_bucket_arguments(parser)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-emulated-vs-torch", help="where each job's log and result go")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.block_steps, args.warmup, args.no_write = 2, 2, 1, True
    for option in ("blocks", "block_steps"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1, got {getattr(args, option)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.global_batch % 4 or args.global_batch < args.micro_batches:
        parser.error(f"--global-batch {args.global_batch} must divide among the 4 devices and hold the "
                     f"--micro-batches {args.micro_batches}")
    m = args.hybrid_micro_batches
    if "hybrid" in args.cases and (m < 1 or args.global_batch % (HYBRID_REPLICAS * m)):
        parser.error(f"--global-batch {args.global_batch} must split into {HYBRID_REPLICAS} pipelines of "
                     f"--hybrid-micro-batches {m} equal micro-batches")
    args.config = {}
    return args


def main() -> int:
    if sys.argv[1:2] == ["--rank-worker"]:
        return rank_main(sys.argv[2])
    args = parse_args()
    if not can_emulate():
        return 0
    rows = ["| scenario | isolate_comm | case (torch runtime) | hetrain samples/s | torch samples/s | "
            "hetrain / torch (median, quartiles) | main CPU ms/step, hetrain / torch | Python threads | native | "
            "threads outside the quota |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    failed = []
    for name in args.scenarios:
        for isolate in args.isolate_comm:
            saved = run_job(name, isolate, args)
            if saved is None:
                failed.append(f"{name}/{isolate}")
                continue
            rows += table_rows(name, isolate, saved, args)
            print("\n".join(rows[-len(args.cases):]), flush=True)
    table = "\n".join(rows)
    notes = run_notes(args, load0, time.perf_counter() - start)
    return finish(args, failed, "emulated_vs_torch.py", section_title(args.cases, args.isolate_comm), table, notes)


def section_title(cases: list[str], isolate: list[str]) -> str:
    """RESULTS.md's section of a run of ``cases`` under ``isolate`` (isolate_comm on, off): the default run's own,
    else one named after what ran (a run of one case does not replace the section of all)."""
    title = f"Runtime vs torch, emulated (isolate_comm {' and '.join(isolate)})"
    return title if list(cases) == list(CASES[:3]) else f"{title}: {', '.join(cases)}"


def run_notes(args: argparse.Namespace, load0: float, took: float) -> str:
    """The notes under the table: what each case of the run was, how it was timed, the host's load."""
    allreduce = ("ring, as DistributedDataParallel's" if args.allreduce == "ring" else
                 "auto: hierarchical across the nodes where its sync layout finds that cheaper, against "
                 "DistributedDataParallel's one ring")
    cut = ("inside layers at their size (bucket_cut exact), as DDP cuts between two parameters"
           if args.bucket_cut == "exact" else "on layer boundaries (bucket_cut layer)")
    cut += ", DDP given the same cuts" if args.ddp_buckets == "hetrain" else ""
    m = args.hybrid_micro_batches
    what = {"1f1b": f"the 1f1b pipeline over the 4 devices in the cluster's order (fast:0, fast:1, slow:0, slow:1), "
                    f"layers split evenly, {args.micro_batches} micro-batches",
            "dp": f"dp: {args.global_batch // 4} samples per device; hetrain's all-reduces {allreduce}; hetrain's "
                  f"buckets cut {cut}",
            "hybrid": f"hybrid: 2 VWs, fast:0 -> slow:0 and fast:1 -> slow:1, layers split evenly, 1F1B, {m} "
                      f"micro-batches of {args.global_batch // HYBRID_REPLICAS // m} samples per VW; hetrain's DP "
                      "sync through DDP's reducer (each segment a whole stage), torch's every stage under "
                      "DistributedDataParallel (its defaults), Schedule1F1B per VW"}
    what["1f1b-eager"] = what["1f1b"].replace("the 1f1b", "the 1f1b-eager", 1)
    return (f"{args.model}, global batch {args.global_batch}, SGD, fixed batch; "
            + "; ".join(what[c] for c in args.cases) + ". "
            "Both runtimes built in the same 4 "
            f"rank processes of one emulated job per scenario and isolate_comm; per case {args.warmup} warm-up "
            f"steps each, then {args.blocks} timed blocks of {args.block_steps} steps each, taking turns (ABBA); "
            "samples/s from the median block; ratio = median over pairs of blocks of torch's time / hetrain's "
            "(> 1: hetrain faster). CPU ms/step summed over the 4 ranks (a throttled rank's CPU time is what its "
            "quota let it run); 'Python threads' are hetrain's heartbeat and all-reduce chain; 'native' are "
            "Gloo's and torch's. 'Threads outside the quota': threads other than the main one that sat in "
            "another cgroup than the main thread at the end, over the 4 ranks (isolate_comm on: all of them; "
            "off: none). The host has 2 cores shared with other work: absolute samples/s move with its load "
            f"(load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), read the ratio "
            f"within a row; few blocks, so the quartiles are wide. Took {took:.0f} s.")

if __name__ == "__main__":
    sys.exit(main())

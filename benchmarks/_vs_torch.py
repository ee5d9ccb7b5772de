"""What the runtime-vs-torch benchmarks share: both runtimes on one partition in the same Gloo processes.

``runtime_vs_torch.py`` runs the ranks on this host (optionally all of them under one CPU
quota: ``cpu_quota_group``); ``emulated_vs_torch.py`` runs them as the ranks of an emulated
cluster. Either way each rank calls ``run_rank``: per case it builds hetrain's Trainer and
torch's runner on the same plan (``build_plan``), warms both up, then times blocks of steps
between barriers, the two taking turns (ABBA: ``measure_case``), and reads the CPU time of
each of its threads. The ratio of a case is the median over adjacent pairs of blocks
(``paired_ratio``)::

    block      0        1        2        3     ...
    order   hetrain  torch    torch    hetrain
            torch    hetrain  hetrain  torch
    pair k: torch's seconds / hetrain's seconds in block k  (> 1: hetrain was faster)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import secrets
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetrain.baselines import (
    build_ddp_step,
    build_hybrid_step,
    build_pipelining_step,
    even_bounds,
    interleaved_replicas,
)
from hetrain.cluster import Cluster, parse_cluster
from hetrain.models.registry import build_layers, layer_names, num_layers, sample_batch
from hetrain.models.user import resolve_model
from hetrain.plan import Plan, Prediction, Stage, VirtualWorker
from hetrain.planner.baselines import torch_schedule
from hetrain.profile import LayerProfile, ModelProfile
from hetrain.runtime import Trainer, build_optimizer_fn
from hetrain.runtime.config import LoggingConfig, TrainConfig
from hetrain.runtime.step.p2p import flatten
from hetrain.sync_layout import REDUCE_DTYPES, SyncOptions

LR = 0.01
CASES = ("1f1b", "gpipe", "dp", "1f1b-eager", "hybrid")
#: the torch runtime each case is compared with: ``1f1b-eager`` (hetrain's 1F1B with one more micro-batch in
#: flight on every stage but the last) against torch's Schedule1F1B, which has no such schedule; ``hybrid``
#: against Schedule1F1B per replica with every stage under DistributedDataParallel (``build_hybrid_step``)
TORCH_NAMES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "dp": "DistributedDataParallel",
               "1f1b-eager": "Schedule1F1B", "hybrid": "pipelining + DistributedDataParallel"}
#: the torch.distributed.pipelining schedule of each pipeline case (``hetrain.baselines``' names)
TORCH_SCHEDULES = {case: torch_schedule(case) for case in CASES if case != "dp"}
#: the hybrid case: data-parallel replicas (VWs), each a pipeline over ``ranks / HYBRID_REPLICAS`` ranks, and the
#: micro-batches of each (``args.hybrid_micro_batches`` where set); 2 x 2 with 4 micro-batches of 4 samples is
#: the plan hetrain's planner makes for the emulated network scenario (emulated_speedup.py: "hybrid: 2 + 2")
HYBRID_REPLICAS = 2
HYBRID_MICRO_BATCHES = 4
#: how long either runtime's collectives and transfers wait (hetrain's Trainer; torch's hybrid's process groups)
TIMEOUT_S = 120
#: the CFS period of ``cpu_quota_group`` (the hand-made throttled runs of RESULTS.md used 100 ms too)
QUOTA_PERIOD_S = 0.100

Batch = tuple[torch.Tensor, torch.Tensor]
Blocks = dict[str, list[float]]
ThreadCpu = dict[str, dict[str, float]]


def local_cluster(ranks: int) -> Cluster:
    """One node ``n0`` of ``ranks`` CPU devices (``n0:0``, ``n0:1``, ...): the ranks of this host."""
    return parse_cluster({"name": "local", "node": [{"name": "n0", "devices": [{"type": "cpu", "count": ranks}],
                                                    "intra_link": "loopback", "nic": "1Gbit/s"}]})


def build_plan(case: str, args: argparse.Namespace, layers: int, cluster: Cluster) -> Plan:
    """The plan both runtimes follow on ``cluster``'s devices, in its order (rank k: device k): one pipeline
    over every device with the layers split evenly; or one single-stage VW per device with the batch split
    evenly (``dp``); or ``hybrid``: ``HYBRID_REPLICAS`` VWs, each a pipeline over its devices with the layers
    split evenly and an equal share of the batch, stage j of VW v on device ``j * HYBRID_REPLICAS + v``
    (``interleaved_replicas``: each stage's replicas on one node, each pipeline across the nodes). Its
    all-reduces: ``args.allreduce`` where set (``ring``, as DistributedDataParallel; ``auto``: hierarchical
    across nodes where the sync layout finds it cheaper), else ``auto``; its buckets: ``sync_options``."""
    devices = [d.name for d in cluster.devices]
    p = len(devices)
    if case == "dp":
        share = args.global_batch // p
        vws = tuple(VirtualWorker((Stage(d, 0, layers),), share, 1) for d in devices)
        strategy = "dp"
    elif case == "hybrid":
        replicas = interleaved_replicas(p, HYBRID_REPLICAS)
        b = even_bounds(layers, len(replicas[0]))
        m = hybrid_micro_batches(args)
        vws = tuple(VirtualWorker(tuple(Stage(devices[r], b[j], b[j + 1]) for j, r in enumerate(ranks)),
                                  args.global_batch // HYBRID_REPLICAS, m) for ranks in replicas)
        strategy = "hybrid"
    else:
        b = even_bounds(layers, p)
        vws = (VirtualWorker(tuple(Stage(d, b[j], b[j + 1]) for j, d in enumerate(devices)), args.global_batch,
                             args.micro_batches),)
        strategy = "pp"
    # the runtime reads the layer count of the profile, and each layer's parameter bytes, from which the plan's
    # sync layout cuts the gradient buckets (DistributedDataParallel's sizes: 1 MiB first, then 25 MiB); each
    # layer's output bytes per sample make the plan's transfers what they are, for the simulator and the
    # closed forms that read them (planner.sync.plan_traffic)
    built = build_layers(args.model, seed=0, **args.config)
    sizes = [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in built]
    outputs = output_bytes_per_sample(args.model, built, args.config)
    profile = ModelProfile(args.model, tuple(LayerProfile(name, size, out, 0, 0) for name, size, out in
                                             zip(layer_names(args.model, **args.config), sizes, outputs,
                                                 strict=True)), 0)
    return Plan(args.model, args.global_batch, "1f1b" if case in ("dp", "hybrid") else case, "bsp", "sgd", vws,  # type: ignore[arg-type]
                Prediction(0, 0, 0, 0, 0), strategy, "manual", cluster, profile,
                sync_options=sync_options(args))


def hybrid_micro_batches(args: argparse.Namespace) -> int:
    """The micro-batches of each pipeline of the hybrid case: ``args.hybrid_micro_batches``, else
    ``HYBRID_MICRO_BATCHES``."""
    return int(vars(args).get("hybrid_micro_batches") or HYBRID_MICRO_BATCHES)


def output_bytes_per_sample(model: str, layers: list[torch.nn.Module], config: dict[str, object]) -> list[float]:
    """Each layer's output bytes for one sample, measured by running one sample through ``layers``."""
    x: object = sample_batch(model, 1, torch.Generator().manual_seed(0), **config)[0]
    out = []
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
            tensors, _ = flatten(x)
            out.append(float(sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())))
    return out


def sync_options(args: argparse.Namespace) -> SyncOptions:
    """The plan's sync options: ``args.allreduce`` (default ``auto``); ``args.bucket_cut`` (default ``exact``:
    hetrain's gradient buckets close at their size inside a layer, as DistributedDataParallel's close between
    two parameters, rather than on the next layer boundary); ``args.early_receives`` (default ``always``:
    whether hetrain's runtime posts receives ahead of their RECVs, ``runtime.step.p2p``); ``args.reduce_dtype``
    (default ``fp32``: the dtype its gradients are all-reduced in); and, where set,
    ``args.first_bucket_bytes`` (the size at which the first bucket closes; DistributedDataParallel's 1 MiB by
    default)."""
    options = SyncOptions(allreduce=vars(args).get("allreduce", "auto"),
                          bucket_cut=vars(args).get("bucket_cut", "exact"),
                          early_receives=vars(args).get("early_receives", "always"),
                          reduce_dtype=vars(args).get("reduce_dtype", "fp32"))
    first = vars(args).get("first_bucket_bytes")
    return options if first is None else replace(options, first_bucket_bytes=float(first))


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    """The hetrain plan's options, shared by both benchmarks: the DP cases' ``--ddp-buckets``, ``--bucket-cut``,
    ``--first-bucket-bytes``, ``--reduce-dtype``, and the pipelines' ``--early-receives`` (read by
    ``sync_options`` and ``build_torch``)."""
    parser.add_argument("--ddp-buckets", choices=("torch", "hetrain"), default="torch",
                        help="dp: DistributedDataParallel's own buckets (1 MiB first, cut between parameters; "
                             "default) or hetrain's (cut at the same layer boundaries), to see what the cut costs")
    parser.add_argument("--bucket-cut", choices=("exact", "layer"), default="exact",
                        help="dp: hetrain's buckets close at their size inside a layer, as DDP's between two "
                             "parameters (exact, default), or on the next layer boundary (layer)")
    parser.add_argument("--first-bucket-bytes", type=float, metavar="BYTES",
                        help="dp: where hetrain's first gradient bucket closes (default DDP's 1 MiB)")
    parser.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=REDUCE_DTYPES[0],
                        help="dp: the dtype gradients are all-reduced in, by both runtimes (hetrain's sync option "
                             "reduce_dtype; DDP's communication hook, hetrain.baselines)")
    parser.add_argument("--early-receives", choices=("always", "never"), default="always",
                        help="pipelines: hetrain posts a stage's receives one ahead of its RECVs (always, the "
                             "default) or at them (never); sync option early_receives")


def add_repeat_arguments(parser: argparse.ArgumentParser, shape: dict[str, Any], what: str, global_batch: int,
                         micro_batches: int) -> None:
    """The options of the benchmarks that repeat one comparison in fresh processes (``early_receives.py``,
    ``launch_bound.py``): the model and its ``shape`` (``--set`` fields, ``what`` names it), the batch, the
    blocks, the warm-up and the repeats; ``read_repeat_arguments`` checks them."""
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--set", dest="config", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a model field (default {what}: " + " ".join(f"--set {k}={v}" for k, v in shape.items())
                             + ")")
    parser.add_argument("--global-batch", type=int, default=global_batch)
    parser.add_argument("--micro-batches", type=int, default=micro_batches)
    parser.add_argument("--blocks", type=int, default=30, help="timed blocks per runtime (default 30)")
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per runtime (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs, each in fresh processes (default 3)")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")


def read_repeat_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, shape: dict[str, Any]) -> None:
    """``args.config`` from the ``--set`` fields (``shape`` where none), a ring all-reduce; refuses, through
    ``parser.error``, a batch smaller than its micro-batches, no repeats or fewer than 2 blocks."""
    given = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.config)}
    args.config = given if given else dict(shape)
    args.allreduce = "ring"
    if args.global_batch < args.micro_batches or args.repeats < 1 or args.blocks < 2:
        parser.error("need a global batch of at least one sample per micro-batch, 1+ repeats and 2+ blocks")


def spawn_job(worker: Callable[..., None], args: argparse.Namespace, ranks: int, name: str) -> Any:
    """Run ``worker(rank, args, port, out_path)`` on ``ranks`` fresh processes; what rank 0 wrote to ``out_path``
    (JSON), read back and the file removed. ``name`` names the file (next to this module)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".{name}.json")
    mp.spawn(worker, args=(args, port, out_path), nprocs=ranks, join=True)
    with open(out_path) as f:
        saved = json.load(f)
    os.remove(out_path)
    return saved


def ddp_bucket_caps_mb(args: argparse.Namespace, layers: int, cluster: Cluster) -> list[float]:
    """DistributedDataParallel's bucket sizes (MiB, in the order it fills them: last layers first) that cut its
    buckets where hetrain's DP plan cuts its own (at the same layer boundaries), for ``--ddp-buckets hetrain``.

    DDP closes a bucket once it holds at least its cap; with each cap the bytes of hetrain's bucket, walking
    the parameters backwards, it closes on the same layers."""
    plan = build_plan("dp", args, layers, cluster)
    return [b.param_bytes / 2**20 for b in plan.layout.device_buckets(cluster.devices[0].name)]


def build_hetrain(case: str, args: argparse.Namespace, layers: int, batch: Batch,
                  cluster: Cluster) -> Callable[[int], None]:
    """``run(k)``: k more steps of hetrain's Trainer."""
    plan = build_plan(case, args, layers, cluster)
    trainer = Trainer(resolve_model(args.model, **args.config), plan,
                      TrainConfig(timeout_s=TIMEOUT_S,
                                  logging=LoggingConfig(progress=False, log_every=args.block_steps)),
                      optimizer_fn=build_optimizer_fn("sgd", LR))
    data = itertools.repeat(batch)

    def run(k: int) -> None:
        trainer.fit(data, trainer.step + k)

    return run


def build_torch(case: str, args: argparse.Namespace, layers: int, batch: Batch,
                cluster: Cluster) -> Callable[[int], None]:
    """``run(k)``: k more steps of torch's pipelining schedule, or of DistributedDataParallel
    (``hetrain.baselines``, the same runners the emulated speed-up benchmark launches); DDP's buckets its
    own (``args.ddp_buckets`` ``torch``, the default: 1 MiB first, then 25 MiB, cut between parameters) or
    hetrain's (``hetrain``: ``ddp_bucket_caps_mb``); its gradients all-reduced in ``args.reduce_dtype``. ``hybrid``:
    ``build_hybrid_step`` on ``build_plan``'s VWs (Schedule1F1B per VW, every stage under DDP's defaults), its
    process groups waiting ``TIMEOUT_S`` as hetrain's Trainer here."""
    opt_fn = build_optimizer_fn("sgd", LR)
    if case == "dp":
        ddp_options = ({"bucket_cap_mb_list": ddp_bucket_caps_mb(args, layers, cluster)}
                       if vars(args).get("ddp_buckets", "torch") == "hetrain" else {})
        step, _ = build_ddp_step(args.model, args.config, args.global_batch, opt_fn, seed=0,
                                 reduce_dtype=vars(args).get("reduce_dtype", "fp32"), **ddp_options)
    elif case == "hybrid":
        step, _ = build_hybrid_step(args.model, args.config, hybrid_micro_batches(args),
                                    interleaved_replicas(len(cluster.devices), HYBRID_REPLICAS), opt_fn, seed=0,
                                    timeout_s=TIMEOUT_S, schedule=TORCH_SCHEDULES[case])
    else:
        step, _ = build_pipelining_step(args.model, args.config, args.micro_batches, TORCH_SCHEDULES[case], opt_fn,
                                        seed=0)

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


def cpu_cgroup_of(proc_cgroup_text: str) -> str:
    """The cgroup path of the cpu controller in a ``/proc/<pid>/cgroup`` text: the v1 line whose controllers
    include ``cpu``, else the v2 line (``0::``); ``""`` where neither is there.

    Example:
        >>> cpu_cgroup_of("2:cpuacct:/\\n1:cpu:/hetrain-emu-1a2b3c/0-n0-0\\n0::/\\n")
        '/hetrain-emu-1a2b3c/0-n0-0'
    """
    unified = ""
    for line in proc_cgroup_text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" in controllers.split(","):
            return path
        if hierarchy == "0" and controllers == "":
            unified = path
    return unified


def threads_outside_main_cgroup() -> tuple[int, int]:
    """``(moved, others)``: of this process's threads other than the main one, how many sit in another cpu
    cgroup than the main thread (``isolate_comm`` moves them out of the device's quota), and how many there are."""
    def cgroup(tid: int) -> str | None:
        try:
            return cpu_cgroup_of(Path(f"/proc/self/task/{tid}/cgroup").read_text())
        except OSError:  # the thread ended
            return None

    main = cgroup(os.getpid())
    others = [g for g in (cgroup(int(t)) for t in os.listdir("/proc/self/task") if int(t) != os.getpid())
              if g is not None]
    return sum(g != main for g in others), len(others)


def take_turns(runs: dict[str, Callable[[int], None]], args: argparse.Namespace, fence: Callable[[], None],
               on_start: Callable[[str], None] | None = None, on_end: Callable[[str], None] | None = None) -> Blocks:
    """Seconds of each block of ``args.block_steps`` steps, per runtime of ``runs`` (``run(k)``: k more steps),
    after ``args.warmup`` untimed steps each: ``args.blocks`` rounds, the runtimes taking turns in their order
    and then in reverse (A B, B A, ... : each meets the same background load). ``fence`` opens and closes each
    block (``dist.barrier``; ``torch.cuda.synchronize`` on one GPU); ``on_start(name)`` and ``on_end(name)``
    run right after the opening fence and after the block's time is taken (CPU counters, say)."""
    for run in runs.values():
        run(args.warmup)
    names = tuple(runs)
    out: Blocks = {name: [] for name in names}
    for block in range(args.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            fence()
            if on_start is not None:
                on_start(name)
            start = time.perf_counter()
            runs[name](args.block_steps)
            fence()
            out[name].append(time.perf_counter() - start)
            if on_end is not None:
                on_end(name)
    return out


def measure_case(case: str, args: argparse.Namespace, layers: int, batch: Batch,
                 cluster: Cluster) -> tuple[Blocks, ThreadCpu]:
    """Seconds of each block of ``block_steps`` steps, per runtime, the runtimes taking turns (ABBA: ``take_turns``);
    and the CPU seconds this rank's threads spent in them, per runtime and kind of thread. Runtimes ``hetrain``
    and ``torch``; with ``args.both_dtypes`` also ``hetrain-fp32`` and ``torch-fp32``, the same with their
    gradients all-reduced in fp32 whatever ``args.reduce_dtype``."""
    runs = {"hetrain": build_hetrain(case, args, layers, batch, cluster),
            "torch": build_torch(case, args, layers, batch, cluster)}
    if vars(args).get("both_dtypes"):  # and both again with their gradients all-reduced in fp32 (reduce_dtype.py)
        fp32 = argparse.Namespace(**{**vars(args), "reduce_dtype": "fp32"})
        runs["hetrain-fp32"] = build_hetrain(case, fp32, layers, batch, cluster)
        runs["torch-fp32"] = build_torch(case, fp32, layers, batch, cluster)
    cpu: dict[str, dict[str, float]] = {name: {} for name in runs}
    before: dict[str, float] = {}

    def start(_: str) -> None:
        before.clear()
        before.update(thread_cpu_s())

    def end(who: str) -> None:
        for kind, seconds in thread_cpu_s().items():
            cpu[who][kind] = cpu[who].get(kind, 0.0) + seconds - before.get(kind, 0.0)

    return take_turns(runs, args, dist.barrier, start, end), cpu


def run_rank(args: argparse.Namespace, cluster: Cluster, out_path: str | Path, teardown: bool = True) -> None:
    """This rank's part of the comparison (the process group from the environment, as torchrun sets it): every
    case of ``args.cases`` measured; rank 0 writes ``{"blocks": {case: Blocks}, "cpu": [per rank {case:
    ThreadCpu}], "threads": [per rank (moved, others)]}`` to ``out_path``. With ``teardown`` False the process group
    is left up for the caller to leave with ``os._exit``: its C++ teardown can abort the interpreter at exit
    ("terminate called without an active exception"), as ``hetrain.baselines`` notes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = num_layers(args.model, **args.config)
    batch = sample_batch(args.model, args.global_batch, torch.Generator().manual_seed(0), **args.config)
    blocks, cpu = {}, {}
    for case in args.cases:
        blocks[case], cpu[case] = measure_case(case, args, layers, batch, cluster)
        if rank == 0:
            rates = {w: args.global_batch * args.block_steps / statistics.median(t) for w, t in blocks[case].items()}
            print(f"  {case:<6} hetrain {rates['hetrain']:8.1f}  torch {rates['torch']:8.1f} samples/s", flush=True)
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"cpu": cpu, "threads": threads_outside_main_cgroup()})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"blocks": blocks, "cpu": [r["cpu"] for r in every],  # type: ignore[index]
                       "threads": [r["threads"] for r in every]}, f)  # type: ignore[index]
    if teardown:
        dist.destroy_process_group()
    else:  # the caller leaves with os._exit: every rank past this barrier, rank 0's file written
        # monitored_barrier times out and names the ranks that did not arrive
        dist.monitored_barrier(timeout=timedelta(seconds=120), wait_all_ranks=True)


# ---------------------------------------------------------------------------
# reading the blocks back (pure)
# ---------------------------------------------------------------------------


def paired_ratio(hetrain_s: list[float], torch_s: list[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of torch's block time / hetrain's over the pairs of blocks taken side by side
    (> 1: hetrain's block was shorter), quartiles by ``statistics.quantiles``' default (exclusive) method.
    One pair: that ratio three times.

    Example:
        >>> paired_ratio([1.0, 2.0, 1.0], [1.1, 2.0, 0.9])
        (0.9, 1.0, 1.1)
    """
    if len(hetrain_s) != len(torch_s) or not hetrain_s:
        raise ValueError(f"need as many blocks of each runtime, at least one: got {len(hetrain_s)} of hetrain's "
                         f"and {len(torch_s)} of torch's")
    ratios = sorted(t / h for h, t in zip(hetrain_s, torch_s, strict=True))
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)  # the "exclusive" method, as the figures before
    return q1, q2, q3


def thread_group(kind: str) -> str:
    """The column a kind of thread of ``thread_cpu_s`` goes in: ``main``, ``native``, else ``python`` (a Python
    thread: hetrain's heartbeat and all-reduce chain)."""
    return kind if kind in ("main", "native") else "python"


def cpu_ms_per_step(cpu: list[dict[str, ThreadCpu]], case: str, steps: int,
                    group: Callable[[str], str] = lambda kind: kind) -> dict[str, tuple[float, float]]:
    """CPU milliseconds per step, summed over the ranks, by kind of thread (``group(kind)``): (hetrain, torch).

    Example:
        >>> cpu_ms_per_step([{"dp": {"hetrain": {"main": 1.0}, "torch": {"main": 0.5, "native": 0.1}}}], "dp", 10)
        {'main': (100.0, 50.0), 'native': (0.0, 10.0)}
    """
    out: dict[str, list[float]] = {}
    for rank in cpu:
        for k, who in enumerate(("hetrain", "torch")):
            for kind, seconds in rank[case][who].items():
                out.setdefault(group(kind), [0.0, 0.0])[k] += seconds / steps * 1e3
    return {kind: (h, t) for kind, (h, t) in sorted(out.items())}


# ---------------------------------------------------------------------------
# the whole run under one CPU quota
# ---------------------------------------------------------------------------


class QuotaError(Exception):
    """The run cannot be put under a CPU quota here; the message says why in one line."""


def cpu_quota_problem(cpus: float, host_cpus: int) -> str | None:
    """Why ``cpus`` is no CPU quota for this host (None: it is one): it must be positive and at most the host's.

    Example:
        >>> cpu_quota_problem(3.0, 2)
        '--cpu-quota 3 is more than the 2 CPUs of this host'
    """
    if not cpus > 0:  # NaN too
        return f"--cpu-quota must be a number of CPUs > 0, got {cpus:g}"
    if cpus > host_cpus:
        return f"--cpu-quota {cpus:g} is more than the {host_cpus} CPUs of this host"
    return None


@contextlib.contextmanager
def rank_quota_groups(ranks: int, cpus: float, period_s: float = QUOTA_PERIOD_S) -> Iterator[list[Path]]:
    """One cgroup per rank, each with a quota of ``cpus`` CPUs, as the emulator gives each device its own
    (``hetrain.emulate.cgroups``); yields their ``cgroup.procs`` files, rank by rank. Each rank joins its own at its
    start (``join_cgroup``), before it starts a thread, so that every thread it makes (Gloo's too) is held in its
    quota; this process stays outside. The cgroups are removed at the end (the ranks have exited by then).

    Raises:
        QuotaError: no cgroup hierarchy with a cpu controller, or not writable (not root).
    """
    from hetrain.emulate.cgroups import create_device_cgroup, find_cpu_cgroups, remove_run_dir, run_dir

    root, why = find_cpu_cgroups()
    if root is None:
        raise QuotaError(f"cannot hold the ranks in CPU quotas: {why}")
    run_id = secrets.token_hex(3)
    try:
        procs = [create_device_cgroup(root, run_id, f"rank{r}", cpus, period_s) for r in range(ranks)]
    except OSError as e:
        remove_run_dir(run_dir(root, run_id))
        raise QuotaError(f"cannot hold the ranks in CPU quotas in {root.describe()}: "
                         f"{e.filename}: {e.strerror}") from None
    try:
        yield procs
    finally:
        remove_run_dir(run_dir(root, run_id))


@contextlib.contextmanager
def cpu_quota_group(cpus: float, period_s: float = QUOTA_PERIOD_S) -> Iterator[Path]:
    """This process, and every process and thread it starts inside the block, under a quota of ``cpus`` CPUs.

    A cgroup made as the emulator makes a device's (``hetrain.emulate.cgroups``: cgroup v1's cpu hierarchy,
    else v2's; named ``hetrain-emu-<id>``, so ``hetrain emulate down`` finds a leftover); this process joins
    it, and leaves it for the cgroup it came from before it is removed at the end. Yields the cgroup's
    directory (its ``cpu.stat`` says how long the run was throttled).

    Raises:
        QuotaError: no cgroup hierarchy with a cpu controller, or not writable (not root).
    """
    from hetrain.emulate.cgroups import create_device_cgroup, find_cpu_cgroups, remove_run_dir, run_dir
    from hetrain.emulate.rankwrap import join_cgroup

    root, why = find_cpu_cgroups()
    if root is None:
        raise QuotaError(f"cannot put the run under a CPU quota: {why}")
    home = root.path / cpu_cgroup_of(Path("/proc/self/cgroup").read_text()).lstrip("/") / "cgroup.procs"
    run_id = secrets.token_hex(3)
    try:
        procs = create_device_cgroup(root, run_id, "run", cpus, period_s)
        join_cgroup(str(procs), os.getpid())
    except OSError as e:
        remove_run_dir(run_dir(root, run_id))
        raise QuotaError(f"cannot put the run under a CPU quota in {root.describe()}: "
                         f"{e.filename}: {e.strerror}") from None
    try:
        yield procs.parent
    finally:
        with contextlib.suppress(OSError):
            join_cgroup(str(home), os.getpid())
        remove_run_dir(run_dir(root, run_id))

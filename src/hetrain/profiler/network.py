"""Measure the cluster under torchrun and write it as a cluster file (``hetrain discover``).

    torchrun --nproc-per-node 4 --no-python hetrain discover -o cluster.toml
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --no-python hetrain discover -o cluster.toml

1. Every rank reports its device (type and memory; ``cpu`` without CUDA) and its
   host; ranks on one host form a node. ``HETRAIN_HOST`` overrides the host: one
   name, or a comma-separated list indexed by RANK (one machine posing as several).
2. Ranks agree on the measurement plan: the settings and a hash of the plan are
   all-gathered and compared, and a rank that differs is named.
3. Links are timed by ping-pong, in rounds where no rank and no node's NIC is in
   two pairs at once::

       round 0        n0: r0-r1   n1: r4-r5   n2: r8-r9   n3: r12-r13   (inside every node)
       round 1        n0-n3   n1-n2        circle method over the nodes:
       round 2        n0-n2   n3-n1        n-1 rounds for n nodes (n even),
       round 3        n0-n1   n2-n3        every node pair once

   Each pair fits ``latency + bytes / bandwidth`` to the one-way times of messages
   of 4 KB to 64 MB (``fit.fit_link``), and times one step of a collective between
   the two (``measure_collective_latency``): a ping-pong's latency holds both ends'
   handing over and waking for each message, which a collective's steps, run by the
   library's own threads, do not pay.
4. Rank 0 writes [[node]] entries (devices, the measured intra_link, a nic) and a
   [[link]] for every node pair. An all-reduce over all ranks is timed and
   compared with ``cost.estimate_allreduce_time`` on the measured cluster.

Every wait has a timeout and names the rank it waited for (``hetrain.distributed``).
Ranks beat a heartbeat into the rendezvous store; a barrier names the ranks whose
heartbeat stopped for ``timeout_s``; every send and receive waits at most
``timeout_s``; a rank that fails posts its error in the store, and the others stop
with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.catalog import lookup_device_type
from hetrain.cluster import Cluster, ClusterError, parse_cluster
from hetrain.cost import allreduce_shape, estimate_allreduce
from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.device import DeviceError, choose_device
from hetrain.distributed.health import Heartbeat, beat_counter
from hetrain.distributed.store import JobStore, StoreError
from hetrain.distributed.work import WaitError, wait_work
from hetrain.distributed.work import first_line as _first_line
from hetrain.distributed.work import ranks_text as _ranks
from hetrain.errors import RunError
from hetrain.fit import fit_link
from hetrain.profiler.layers import describe_device, measure_device_figures
from hetrain.units import UnitError, format_bandwidth, format_bytes, format_time, parse_bytes
from hetrain.version import __version__

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

DEFAULT_SIZES: tuple[int, ...] = tuple(4096 * 4**k for k in range(8))  # 4 KB, 16 KB, ..., 64 MB
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RUNS = itertools.count()  # discover() calls in this process: keeps store keys of two calls apart


class DiscoveryError(RunError):
    """Discovery cannot go on; the message names the rank that reports it and the rank at fault."""

    def __init__(self, message: str, relayed: bool = False) -> None:
        super().__init__(message)
        self.relayed = relayed  # True: this rank stops because another one failed


# ---------------------------------------------------------------------------
# the plan: pure functions
# ---------------------------------------------------------------------------


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of ``range(n)`` once (circle method).

    Fix item 0, rotate the others one step per round; with n odd a bye is added.
    n - 1 rounds for n even, n rounds for n odd.

    Example:
        >>> round_robin(4)
        [[(0, 3), (1, 2)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]]
    """
    items: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(items)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = items[k], items[m - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        if pairs:
            rounds.append(sorted(pairs))
        items = [items[0], items[-1], *items[1:-1]]
    return rounds


@dataclass(frozen=True)
class PairTask:
    """One link to time: ``ranks[0]`` starts the ping-pong with ``ranks[1]``; node indices."""

    ranks: tuple[int, int]
    nodes: tuple[int, int]

    @property
    def intra(self) -> bool:
        return self.nodes[0] == self.nodes[1]


@dataclass(frozen=True)
class MeasurementPlan:
    """Nodes (hosts in order of their first rank), their ranks, and the rounds of pairs."""

    node_names: tuple[str, ...]
    node_ranks: tuple[tuple[int, ...], ...]
    rounds: tuple[tuple[PairTask, ...], ...]

    def digest(self, settings: dict[str, Any]) -> str:
        """A hash of the plan and the settings, equal on every rank that agrees."""
        data = {"settings": settings, "plan": asdict(self)}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_plan(hosts: Sequence[str]) -> MeasurementPlan:
    """The measurement plan for ranks whose hosts are ``hosts[rank]``.

    Round 0 times one pair inside every node of two or more ranks (its first two
    ranks), all nodes at once; then the node pairs of ``round_robin``, each timed
    between the two nodes' first ranks, so no NIC carries two measurements at once.
    """
    names: list[str] = []
    ranks: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        if h not in ranks:
            names.append(h)
            ranks[h] = []
        ranks[h].append(r)
    node_ranks = tuple(tuple(ranks[h]) for h in names)
    rounds: list[tuple[PairTask, ...]] = []
    intra = tuple(PairTask((rs[0], rs[1]), (k, k)) for k, rs in enumerate(node_ranks) if len(rs) >= 2)
    if intra:
        rounds.append(intra)
    for pairs in round_robin(len(names)):
        rounds.append(tuple(PairTask((node_ranks[a][0], node_ranks[b][0]), (a, b)) for a, b in pairs))
    return MeasurementPlan(tuple(names), node_ranks, tuple(rounds))


def parse_message_sizes(text: str) -> list[int]:
    """``"4KB,64KB,1MB"`` -> bytes; ``"4KB..64MB"`` -> 4 KB, 16 KB, ... up to 64 MB (x4 steps).

    Raises:
        ValueError: a size without a unit or below 1 byte, none at all, or a range whose end is below its start.
    """
    try:
        if ".." in text:
            lo_text, hi_text = text.split("..", 1)
            lo, hi = int(parse_bytes(lo_text.strip(), "sizes")), int(parse_bytes(hi_text.strip(), "sizes"))
            if lo < 1 or hi < lo:
                raise ValueError(f"message size range {text!r} must go up from at least 1 byte")
            out = [lo]
            while out[-1] * 4 <= hi:
                out.append(out[-1] * 4)
            return out
        sizes = [int(parse_bytes(part.strip(), "sizes")) for part in text.split(",") if part.strip()]
    except UnitError as e:
        raise ValueError(str(e)) from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"message sizes {text!r} must be at least 1 byte each")
    return sizes


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports about itself.

    ``figures``: measured peak figures, only for a device type the catalog lacks.
    """

    rank: int
    host: str
    type_name: str
    memory_bytes: float | None  # device memory; None for a CPU (host memory is shared)
    host_memory_bytes: float
    figures: dict[str, float] | None = None


@dataclass(frozen=True)
class LinkMeasurement:
    """One timed link: one-way seconds per message size and the fitted latency and bandwidth."""

    ranks: tuple[int, int]
    nodes: tuple[int, int]
    sizes_bytes: tuple[int, ...]
    times_s: tuple[float, ...]
    bandwidth_bytes_per_s: float
    latency_s: float
    residual: float
    collective_latency_s: float | None = None

    def describe(self, node_names: Sequence[str]) -> str:
        a, b = (node_names[n] for n in self.nodes)
        where = f"inside {a}" if a == b else f"{a} <-> {b}"
        step = ("" if self.collective_latency_s is None else
                f", collective step {format_time(self.collective_latency_s)}")
        return (f"{where} (ranks {self.ranks[0]}-{self.ranks[1]}): {format_bandwidth(self.bandwidth_bytes_per_s)}, "
                f"latency {format_time(self.latency_s)}{step}, fit residual {100 * self.residual:.1f}%")


@dataclass(frozen=True)
class DiscoveryResult:
    """What ``discover`` measured and wrote (identical on every rank).

    Attributes:
        cluster: the cluster file as loaded back.
        rank_device: for each rank, its device index in ``cluster`` (node by node).
        allreduce_*: the timed all-reduce over all ranks and the cost model's estimate.
        toml: the text of the cluster file.
    """

    cluster: Cluster
    plan: MeasurementPlan
    links: tuple[LinkMeasurement, ...]
    rank_device: tuple[int, ...]
    allreduce_bytes: int
    allreduce_measured_s: float
    allreduce_predicted_s: float
    allreduce_algorithm: str
    toml: str
    elapsed_s: float

    @property
    def allreduce_error(self) -> float:
        """(measured - predicted) / predicted; 0 with one rank."""
        if self.allreduce_predicted_s <= 0:
            return 0.0
        return (self.allreduce_measured_s - self.allreduce_predicted_s) / self.allreduce_predicted_s

    def allreduce_line(self) -> str:
        if self.cluster.num_devices < 2:
            return "all-reduce: one rank, nothing to compare"
        measured, predicted = format_time(self.allreduce_measured_s), format_time(self.allreduce_predicted_s)
        return (f"all-reduce of {format_bytes(self.allreduce_bytes)} over {self.cluster.num_devices} ranks: "
                f"measured {measured}, cost model {predicted} ({self.allreduce_algorithm}), "
                f"error {100 * self.allreduce_error:+.1f}%")

    def summary(self) -> str:
        lines = [self.cluster.summary(), f"links ({len(self.plan.rounds)} rounds, {self.elapsed_s:.1f} s):"]
        lines += [f"  {link.describe(self.plan.node_names)}" for link in self.links]
        lines.append(self.allreduce_line())
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# the session: store, heartbeat, barriers with named peers
# ---------------------------------------------------------------------------


def _environment() -> tuple[int, int, int]:
    missing = [v for v in ENV_VARS if not os.environ.get(v)]
    if missing:
        raise DiscoveryError(
            f"hetrain discover must run under torchrun: environment variable{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} {'are' if len(missing) > 1 else 'is'} not set. Launch it as, for example, "
            "`torchrun --nproc-per-node 2 --no-python hetrain discover -o cluster.toml` "
            "(on several hosts: one torchrun per host with --nnodes, --node-rank and --rdzv-endpoint)")
    try:
        rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        int(os.environ["MASTER_PORT"])
    except ValueError:
        got = {v: os.environ[v] for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        raise DiscoveryError(f"RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got {got}") from None
    if not 0 <= rank < world:
        raise DiscoveryError(f"RANK {rank} is outside WORLD_SIZE {world}")
    return rank, world, local


def host_name(rank: int) -> str:
    """This rank's host: ``HETRAIN_HOST`` (one name, or a list indexed by rank), else the host name."""
    override = os.environ.get("HETRAIN_HOST", "").strip()
    if not override:
        return socket.gethostname()
    names = [n.strip() for n in override.split(",")]
    if len(names) == 1:
        return names[0]
    if rank >= len(names) or not names[rank]:
        raise DiscoveryError(f"HETRAIN_HOST lists {len(names)} hosts ({override!r}) but has none for rank {rank}")
    return names[rank]


class _Session:
    """This run's keys in the job store, a heartbeat, barriers that name late or silent ranks."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        # torchrun's agent hosts the store when it says so; otherwise rank 0 does (as env:// would).
        try:
            self.store = JobStore.connect(f"discover/{next(_RUNS)}", rank, timeout_s)
        except StoreError as e:
            raise DiscoveryError(str(e)) from None
        self.barriers = 0
        self.beat_s = min(1.0, timeout_s / 5)
        self.count = beat_counter(self.store)
        self.barrier_ = Barrier(self.store, rank, world, timeout_s, beats=self.count)
        self._heart = Heartbeat(self.store, rank, self.beat_s)
        with contextlib.suppress(StoreError):  # without a second connection, nobody sees this rank beat
            self._heart.start()

    def close(self) -> None:
        self._heart.stop()

    def abort(self, error: DiscoveryError) -> None:
        """Post this rank's error so the others stop instead of waiting for it."""
        if error.relayed:
            return
        with contextlib.suppress(Exception):
            self.store.post_error(self.rank, str(error))

    def barrier(self, phase: str) -> None:
        """Wait until every rank is here; raise naming the ranks that stopped beating for ``timeout_s``."""
        self.barriers += 1
        try:
            self.barrier_.sync(f"barrier/{self.barriers}", phase)
        except BarrierError as e:
            if e.failed:
                raise DiscoveryError(f"rank {self.rank} stops because {e.failed[min(e.failed)]}",
                                     relayed=True) from None
            hint = (f"; is every rank started, with WORLD_SIZE {self.world} and the same MASTER_ADDR:MASTER_PORT?"
                    if e.late else "")
            raise DiscoveryError(f"rank {self.rank}: {e}{hint}") from None
        except StoreError as e:
            raise DiscoveryError(f"rank {self.rank}: lost the rendezvous store at {self.store.where} "
                                 f"while waiting at {phase}: {_first_line(e.cause)}") from None

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """``dist.all_gather_object`` after a barrier (which names absent ranks)."""
        self.barrier(what)
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            raise DiscoveryError(f"rank {self.rank}: all-gather of {what} failed{self.silent_note()}: "
                                 f"{_first_line(e)}") from None
        return out

    def silent_note(self) -> str:
        """After a collective failed: ``"; rank 3 stopped answering"`` for ranks whose heartbeat stands still."""
        try:
            before = [self.count(r) for r in range(self.world)]
            time.sleep(2 * self.beat_s + 0.1)
            silent = [r for r in range(self.world) if r != self.rank and self.count(r) == before[r]]
        except StoreError:
            return ""
        return f"; {_ranks(silent)} stopped answering (no heartbeat)" if silent else ""


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


def _wait(work: Any, timeout_s: float, peer: int, doing: str) -> None:
    try:
        wait_work(work, doing, [peer], timeout_s)
    except WaitError as e:
        raise DiscoveryError(f"rank {dist.get_rank()}: no answer from rank {peer} within {timeout_s:g} s "
                             f"while {doing} ({_first_line(e.cause or e)})") from None


def measure_pingpong(peer: int, sizes: Sequence[int], initiator: bool, repeats: int = 5, warmup: int = 1,
                     timeout_s: float = 60.0, device: torch.device | None = None) -> list[float] | None:
    """One-way seconds per message size between this rank and ``peer`` (default process group).

    The initiator sends, the responder echoes; one-way time is half the round trip,
    median of ``repeats`` after ``warmup``. Both ranks call it with the same sizes;
    the initiator gets the times, the responder None.

    Raises:
        DiscoveryError: ``peer`` did not answer a send or receive within ``timeout_s``.
    """
    dev = device or torch.device("cpu")
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
    times: list[float] = []
    for s in sizes:
        msg = buf[:s]  # a contiguous view: one allocation for every size
        doing = f"timing the link to it with {format_bytes(s)} messages"
        runs = []
        for k in range(warmup + repeats):
            t0 = time.perf_counter()
            if initiator:
                _wait(dist.isend(msg, peer), timeout_s, peer, doing)
                _wait(dist.irecv(msg, peer), timeout_s, peer, doing)
            else:
                _wait(dist.irecv(msg, peer), timeout_s, peer, doing)
                _wait(dist.isend(msg, peer), timeout_s, peer, doing)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if k >= warmup:
                runs.append((time.perf_counter() - t0) / 2)
        times.append(statistics.median(runs))
    return times if initiator else None


COLLECTIVE_BATCH = 16  # one-element all-reduces per timed batch (measure_collective_latency)


def measure_collective_latency(group: Any, peer: int, repeats: int = 3, timeout_s: float = 60.0,
                               device: torch.device | None = None) -> float:
    """Seconds of one step of a collective between this rank and ``peer``, the two ranks of ``group``.

    Both ranks post ``COLLECTIVE_BATCH`` one-element all-reduces at once and wait for
    the last: the library runs them one after another in its own threads, and a
    two-rank ring all-reduce is one reduce-scatter and one all-gather step, so a step
    is the batch's time / (2 x COLLECTIVE_BATCH). The caller wakes once per batch, not
    per step, as a training step's bucket all-reduces, posted during the backward pass,
    are waited for once. Median of ``repeats`` batches, each after a one-element
    all-reduce that lines the two ranks up.
    """
    dev = device or torch.device("cpu")
    tick = torch.zeros(1, device=dev)
    xs = [torch.zeros(1, device=dev) for _ in range(COLLECTIVE_BATCH)]
    times = []
    for _ in range(repeats + 1):  # the first batch warms up
        _wait_collective(dist.all_reduce(tick, group=group, async_op=True), timeout_s,
                         f"lining up with rank {peer} to time a collective step")
        t0 = time.perf_counter()
        works = [dist.all_reduce(x, group=group, async_op=True) for x in xs]
        for w in works:
            _wait_collective(w, timeout_s, f"timing a collective step with rank {peer}")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) / (2 * COLLECTIVE_BATCH))
    return statistics.median(times[1:])


def measure_allreduce(num_bytes: int, repeats: int = 3, warmup: int = 1, timeout_s: float = 60.0,
                      device: torch.device | None = None) -> list[float]:
    """This rank's seconds for an all-reduce of ``num_bytes`` (fp32) over the default group, per repeat.

    Each run starts after a one-element all-reduce that lines the ranks up.
    """
    dev = device or torch.device("cpu")
    x = torch.ones(max(1, num_bytes // 4), dtype=torch.float32, device=dev)
    tick = torch.zeros(1, device=dev)
    times = []
    for k in range(warmup + repeats):
        _wait_collective(dist.all_reduce(tick, async_op=True), timeout_s, "lining up for the all-reduce")
        t0 = time.perf_counter()
        _wait_collective(dist.all_reduce(x, async_op=True), timeout_s, f"an all-reduce of {format_bytes(num_bytes)}")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _wait_collective(work: Any, timeout_s: float, doing: str) -> None:
    try:
        wait_work(work, doing, [], timeout_s)
    except WaitError as e:
        raise DiscoveryError(f"rank {dist.get_rank()}: {doing} did not finish within {timeout_s:g} s; a peer "
                             f"stopped answering ({_first_line(e.cause or e)})") from None


def _rank_info(rank: int, device: torch.device) -> RankInfo:
    host_memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if device.type != "cuda":
        return RankInfo(rank, host_name(rank), "cpu", None, host_memory)
    type_name, memory = describe_device(device)
    figures = None
    try:
        lookup_device_type(type_name)
    except KeyError:
        fp32 = measure_device_figures(device, "fp32")
        fp16 = measure_device_figures(device, "fp16")
        figures = {"peak_fp32_flops": fp32.peak_flops, "peak_fp16_flops": fp16.peak_flops,
                   "memory_bandwidth_bytes_per_s": fp32.memory_bandwidth_bytes_per_s}
    return RankInfo(rank, host_name(rank), type_name, memory, host_memory, figures)


# ---------------------------------------------------------------------------
# the cluster file
# ---------------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:.6g}"


def _inline(table: dict[str, Any]) -> str:
    parts = [f"{k} = {json.dumps(v) if isinstance(v, str) else _num(v)}" for k, v in table.items()]
    return "{ " + ", ".join(parts) + " }"


def _device_spec(info: RankInfo, ranks_on_host: int) -> dict[str, Any]:
    if info.figures is not None:
        return {"type": info.type_name, **info.figures, "memory_bytes": info.memory_bytes or 0.0}
    catalog = lookup_device_type(info.type_name)
    memory = info.memory_bytes if info.memory_bytes is not None else info.host_memory_bytes / ranks_on_host
    if abs(memory - catalog.memory_bytes) <= 0.01 * catalog.memory_bytes:
        return {"type": catalog.name}
    return {"type": catalog.name, "memory_bytes": memory}


def _link_fields(link: LinkMeasurement) -> dict[str, float]:
    out = {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}
    if link.collective_latency_s is not None:
        out["collective_latency_s"] = link.collective_latency_s
    return out


def _link_value(link: LinkMeasurement) -> str:
    step = "" if link.collective_latency_s is None else f" (collective step {format_time(link.collective_latency_s)})"
    return (f"{_inline(_link_fields(link))}"
            f"  # {format_bandwidth(link.bandwidth_bytes_per_s)}, {format_time(link.latency_s)}{step}:"
            f" ranks {link.ranks[0]}-{link.ranks[1]}, fit residual {100 * link.residual:.1f}%")


def cluster_toml(plan: MeasurementPlan, infos: Sequence[RankInfo], links: Sequence[LinkMeasurement],
                 header: Sequence[str] = ()) -> str:
    """The cluster file: [[node]] per host, a [[link]] per measured node pair.

    A node's ``nic`` is its fastest measured link to another node (every pair has
    its own [[link]], so the nic only matters for nodes added by hand later).
    """
    lines = [f"# {h}" for h in header]
    intra = {link.nodes[0]: link for link in links if link.nodes[0] == link.nodes[1]}
    inter = [link for link in links if link.nodes[0] != link.nodes[1]]
    for k, (name, ranks) in enumerate(zip(plan.node_names, plan.node_ranks, strict=True)):
        specs = [_device_spec(infos[r], len(ranks)) for r in ranks]
        groups = [(spec, len(list(g))) for spec, g in itertools.groupby(specs)]
        devices = ", ".join(
            (json.dumps(spec["type"]) if count == 1 and len(spec) == 1 else
             _inline({**spec, **({"count": count} if count > 1 else {})}))
            for spec, count in groups)
        lines += ["", "[[node]]", f"name = {json.dumps(name)}",
                  f"devices = [{devices}]  # rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"]
        if k in intra:
            lines.append(f"intra_link = {_link_value(intra[k])}")
        else:
            lines.append('intra_link = "pcie3"  # not measured: one device on this node')
        own = [link for link in inter if k in link.nodes]
        if own:
            best = max(own, key=lambda link: link.bandwidth_bytes_per_s)
            lines.append(f"nic = {_link_value(best)} (its fastest)")
    for link in inter:
        a, b = (plan.node_names[n] for n in link.nodes)
        lines += ["", "[[link]]", f"nodes = [{json.dumps(a)}, {json.dumps(b)}]",
                  f"bandwidth_bytes_per_s = {_num(link.bandwidth_bytes_per_s)}  "
                  f"# {format_bandwidth(link.bandwidth_bytes_per_s)}: ranks {link.ranks[0]}-{link.ranks[1]}",
                  f"latency_s = {_num(link.latency_s)}  # {format_time(link.latency_s)}, "
                  f"fit residual {100 * link.residual:.1f}%"]
        if link.collective_latency_s is not None:
            lines.append(f"collective_latency_s = {_num(link.collective_latency_s)}  "
                         f"# {format_time(link.collective_latency_s)}: one step of a collective")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# discover
# ---------------------------------------------------------------------------


def _check_settings(rank: int, settings: Sequence[dict[str, Any]]) -> None:
    for r, s in enumerate(settings):
        diff = [k for k in sorted(set(s) | set(settings[0])) if s.get(k) != settings[0].get(k)]
        if diff:
            what = "; ".join(f"rank {r} has {k}={s.get(k)!r} where rank 0 has {k}={settings[0].get(k)!r}"
                             for k in diff)
            raise DiscoveryError(f"rank {rank}: ranks disagree about the measurement plan: {what}")


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({int(s) for s in sizes}))
    if not out or out[0] < 1:
        raise DiscoveryError(f"message sizes must be positive byte counts, got {list(sizes)}")
    return out


def discover(output_path: str | Path, sizes: Sequence[int] = DEFAULT_SIZES, timeout_s: float = 60.0,
             repeats: int = 5, warmup: int = 1, allreduce_bytes: int | None = None) -> DiscoveryResult:
    """Measure devices and links of the ranks of this torchrun job; rank 0 writes the cluster file.

    Run on every rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set).
    Uses the default process group if one exists, else creates one (NCCL with CUDA,
    else Gloo) and destroys it at the end.

    Args:
        output_path: the cluster TOML to write (rank 0).
        sizes: message sizes in bytes for the latency + bandwidth fit (4 KB..64 MB).
        timeout_s: the longest any wait may take: joining, one send or receive (so
            at least the time of the largest message on the slowest link), a
            barrier after a rank's heartbeat stops.
        repeats / warmup: timed and untimed round trips per size.
        allreduce_bytes: the all-reduce compared with the cost model (default the largest size).

    Returns:
        The same DiscoveryResult on every rank.

    Raises:
        DiscoveryError: not under torchrun (names the missing variables), a rank
            that does not join or stops answering (named), ranks that disagree
            about the plan (named, with the setting), an unwritable output.

    Example:
        >>> result = discover("cluster.toml", sizes=[4096, 2**20, 2**24])   # doctest: +SKIP
        >>> print(result.summary())                                         # doctest: +SKIP
    """
    start = time.monotonic()
    rank, world, local_rank = _environment()
    sizes = _check_sizes(sizes)
    if repeats < 1 or warmup < 0 or timeout_s <= 0:
        raise DiscoveryError(f"need repeats >= 1, warmup >= 0, timeout_s > 0; got {repeats}, {warmup}, {timeout_s}")
    allreduce_bytes = int(allreduce_bytes or sizes[-1])
    session = _Session(rank, world, timeout_s)
    own_group = False
    try:
        session.barrier("joining")
        if not dist.is_initialized():
            try:
                backend, _ = choose_device(local_rank)
            except DeviceError as e:
                raise DiscoveryError(f"rank {rank}: {e}") from None
            dist.init_process_group(backend, store=session.store.child("pg").raw, rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
            own_group = True
        device = torch.device("cuda", local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
        settings = {"hetrain": __version__, "sizes": list(sizes), "repeats": repeats, "warmup": warmup,
                    "allreduce_bytes": allreduce_bytes, "world_size": world}
        infos, plan = _agree(session, device, settings)
        links = _measure_rounds(session, plan, sizes, repeats, warmup, device)
        result = _result(session, plan, infos, links, settings, device, Path(output_path).stem, start)
        if rank == 0:
            _write(Path(output_path), result.toml)
        session.barrier("rank 0 writing the cluster file")
        return result
    except DiscoveryError as e:
        session.abort(e)
        raise
    finally:
        session.close()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _agree(session: _Session, device: torch.device,
           settings: dict[str, Any]) -> tuple[list[RankInfo], MeasurementPlan]:
    """Every rank's device and host, and the measurement plan, once the ranks agree on the settings and the plan.

    Raises:
        DiscoveryError: a rank whose settings or plan differ, named.
    """
    rank = session.rank
    reports = session.all_gather((_rank_info(rank, device), settings), "device and host reports")
    _check_settings(rank, [s for _, s in reports])
    infos: list[RankInfo] = [info for info, _ in reports]
    plan = build_plan([info.host for info in infos])
    digests = session.all_gather(plan.digest(settings), "plan hashes")
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise DiscoveryError(f"rank {rank}: ranks disagree about the measurement plan: {_ranks(odd)} "
                             f"computed plan {digests[odd[0]]}, rank 0 computed {digests[0]} "
                             "(different hetrain versions on different hosts?)")
    return infos, plan


def _result(session: _Session, plan: MeasurementPlan, infos: Sequence[RankInfo],
            links: tuple[LinkMeasurement, ...], settings: dict[str, Any], device: torch.device, name: str,
            start: float) -> DiscoveryResult:
    """The measured cluster (its all-reduce timed and compared with the cost model) and its file's text."""
    world = session.world
    allreduce_bytes = int(settings["allreduce_bytes"])
    cluster = _parse(cluster_toml(plan, infos, links), name)
    measured_s, predicted_s, algorithm = _compare_allreduce(session, cluster, allreduce_bytes, device)
    device_order = sorted(range(world), key=lambda r: (plan.node_names.index(infos[r].host), r))
    result = DiscoveryResult(cluster, plan, links, tuple(device_order.index(r) for r in range(world)),
                             allreduce_bytes, measured_s, predicted_s, algorithm, "", time.monotonic() - start)
    text = cluster_toml(plan, infos, links, _header(result, settings, dist.get_backend()))
    return dataclasses.replace(result, cluster=_parse(text, name), toml=text)


def _measure_rounds(session: _Session, plan: MeasurementPlan, sizes: tuple[int, ...], repeats: int, warmup: int,
                    device: torch.device) -> tuple[LinkMeasurement, ...]:
    """Every pair of the plan, round by round (a barrier after each); all ranks get every result."""
    mine: list[LinkMeasurement] = []
    for k, pairs in enumerate(plan.rounds):
        for task in pairs:
            if session.rank not in task.ranks:
                continue
            initiator = session.rank == task.ranks[0]
            peer = task.ranks[1] if initiator else task.ranks[0]
            times = measure_pingpong(peer, sizes, initiator, repeats, warmup, session.timeout_s, device)
            group = dist.new_group(list(task.ranks), timeout=timedelta(seconds=session.timeout_s),
                                   use_local_synchronization=True)
            try:
                step = measure_collective_latency(group, peer, 3, session.timeout_s, device)
            finally:
                dist.destroy_process_group(group)
            if times is not None:
                bandwidth, latency, residual = fit_link(sizes, times)
                mine.append(LinkMeasurement(task.ranks, task.nodes, sizes, tuple(times), bandwidth, latency,
                                            residual, step))
        session.barrier(f"the end of measurement round {k}")
    every = session.all_gather(mine, "link measurements")
    return tuple(sorted((m for ms in every for m in ms), key=lambda m: (m.nodes[0] != m.nodes[1], m.nodes)))


def _compare_allreduce(session: _Session, cluster: Cluster, num_bytes: int,
                       device: torch.device) -> tuple[float, float, str]:
    """(measured s, cost-model s, algorithm) of an all-reduce over all ranks; measured = slowest rank, median."""
    if session.world < 2:
        return 0.0, 0.0, "none"
    session.barrier("the all-reduce")
    try:
        mine = measure_allreduce(num_bytes, 3, 1, session.timeout_s, device)
    except DiscoveryError as e:
        raise DiscoveryError(f"{e}{session.silent_note()}") from None
    every = session.all_gather(mine, "all-reduce times")
    measured = statistics.median(max(ts[k] for ts in every) for k in range(len(mine)))
    predicted, algorithm = estimate_allreduce(4 * max(1, num_bytes // 4),
                                              allreduce_shape(cluster, list(range(cluster.num_devices))))
    return measured, predicted, algorithm


def _header(result: DiscoveryResult, settings: dict[str, Any], backend: str) -> list[str]:
    world, nodes = result.cluster.num_devices, len(result.plan.node_names)
    sizes = settings["sizes"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"Measured by `hetrain discover` (hetrain {settings['hetrain']}, {backend}) on {now}:",
        f"{world} rank{'s' if world > 1 else ''} on {nodes} node{'s' if nodes > 1 else ''}, "
        f"{len(result.plan.rounds)} rounds, {result.elapsed_s:.1f} s.",
        f"Links: latency + bytes / bandwidth fitted to ping-pong over {format_bytes(sizes[0])} .. "
        f"{format_bytes(sizes[-1])} messages ({len(sizes)} sizes, median of {settings['repeats']}).",
        "Devices are numbered node by node; the comment beside `devices` names their ranks.",
        result.allreduce_line(),
    ]


def _parse(text: str, name: str) -> Cluster:
    try:
        return parse_cluster(tomllib.loads(text), name=name)
    except (ClusterError, tomllib.TOMLDecodeError) as e:  # a bug here, not the user's: say what was written
        raise DiscoveryError(f"the measured cluster does not load back ({e}):\n{text}") from None


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        raise DiscoveryError(f"rank 0: cannot write the cluster file {path}: {e.strerror}") from None


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def run_discover_command(output: str, sizes: Sequence[int] | None = None, timeout_s: float = 60.0,
                         repeats: int = 5, allreduce_bytes: int | None = None) -> int:
    """``hetrain discover``: measure, write ``output`` (rank 0), print the summary; exit status.

    Rank 0 prints the cluster, every link and the all-reduce error; a rank that
    fails prints its error to stderr. Returns 0, or 1 on a DiscoveryError.
    """
    try:
        result = discover(output, sizes or DEFAULT_SIZES, timeout_s=timeout_s, repeats=repeats,
                          allreduce_bytes=allreduce_bytes)
    except DiscoveryError as e:
        print(f"hetrain discover: error: {e}", file=sys.stderr, flush=True)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(result.summary())
        print(f"wrote {output}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.profiler.network [options]`` under torchrun: ``hetrain discover`` (the one command line,
    ``hetrain.cli``; its options are ``hetrain.commands.discover``'s)."""
    from hetrain.cli import main as cli_main

    return cli_main(["discover", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

"""Launch a job on an emulated cluster: one torchrun per node, inside the node's namespace.

For node k of N (``d_k`` devices), the launcher runs, in its own session::

    nsenter --net=/run/netns/hetrain-emu-<id>-<k>-<node> -- \\
      python -m torch.distributed.run --nnodes N --nproc-per-node d_k \\
        --rdzv-backend c10d --rdzv-endpoint 10.213.0.100:29400 --rdzv-id hetrain-emu-<id> \\
        --rdzv-conf is_host=<1 on node 0, else 0>,join_timeout=120 --local-addr <node k's address> \\
        --max-restarts 0 --no-python python -m hetrain.emulate.rankwrap COMMAND...

with ``HETRAIN_NODE`` and ``HETRAIN_HOST`` set to the node's name and
``GLOO_SOCKET_IFNAME=nic``. The c10d rendezvous is the one a real multi-node job
uses: node 0's torchrun hosts the store, every node joins it over the emulated
network, and since the rendezvous orders nodes by ``--local-addr`` (sorting as
node order) global ranks follow the cluster file's device order. Each rank
process is ``rankwrap``, which joins its device's cgroup and execs COMMAND.
``nsenter`` is used rather than ``ip netns exec``, which remounts /sys and would
hide the cgroup tree from the rank.

The job's output comes back line by line, each prefixed with ``[node]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, TextIO

from hetrain.emulate.events import EmulationEvent, absent_nodes, late_nodes
from hetrain.emulate.keepawake import cpus_kept_awake
from hetrain.emulate.network import NIC, PREFIX, kill_pids, namespace_pids
from hetrain.emulate.rankwrap import CGROUPS_ENV, COMM_ENV, CPUS_ENV, FILL_ENV
from hetrain.emulate.settings import EmulationError, EmulationSettings

if TYPE_CHECKING:
    from hetrain.emulate.emulator import EmulatedCluster

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "HETRAIN_HOST", "HETRAIN_NODE", CGROUPS_ENV, CPUS_ENV,
                  FILL_ENV, COMM_ENV)
#: torchrun's switch that gives each rendezvous round its own workers' store (set where nodes leave or join)
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
FAILURE_GRACE_S = 2.0  # after one node fails, how long the others may take to stop on their own
STOP_GRACE_S = 2.0     # after SIGTERM, how long a torchrun may take to stop its ranks


class EmulationInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived while an emulated cluster was up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into ``EmulationInterrupted`` (main thread only), so ``with`` blocks
    and ``finally`` clauses tear the cluster down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise EmulationInterrupted(signum)

    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def build_torchrun_command(em: EmulatedCluster, k: int, command: Sequence[str]) -> list[str]:
    """The argv that runs ``command`` on node ``k`` of ``em`` (nsenter + torchrun + rankwrap)."""
    settings: EmulationSettings = em.settings
    nodes = em.network.nodes
    # a node killed or joining later: the nodes meet elastically, from those no event takes away
    away = absent_nodes(settings.events)
    nnodes = f"{max(1, len(nodes) - len(away))}:{len(nodes)}" if away else str(len(nodes))
    conf = f"is_host={int(k == 0)},join_timeout={round(settings.join_timeout_s)}"
    if away:  # how soon a dead node is dropped, and how long a round waits for late nodes once MIN are there
        conf += (f",last_call_timeout={round(settings.last_call_timeout_s)}"
                 f",keep_alive_interval={round(settings.keep_alive_interval_s)}"
                 f",keep_alive_max_attempt={settings.keep_alive_max_attempt}")
    return [
        "nsenter", f"--net={em.netns_path(k)}", "--",
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", nnodes,
        "--nproc-per-node", str(len(em.cluster.nodes[k].devices)),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0].address}:{settings.rdzv_port}",
        "--rdzv-id", f"{PREFIX}{em.run_id}",
        "--rdzv-conf", conf,
        "--local-addr", nodes[k].address, "--max-restarts", str(settings.max_restarts),
        "--no-python", sys.executable, "-m", "hetrain.emulate.rankwrap", *command,
    ]


def build_node_env(em: EmulatedCluster, k: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of node ``k``'s torchrun (its ranks inherit it)."""
    env = {key: v for key, v in (os.environ if base is None else base).items()
           if key not in _TORCHRUN_VARS and not key.startswith("TORCHELASTIC_")}
    name = em.cluster.nodes[k].name
    # the interpreter's bin directory first: `python` and `hetrain` in COMMAND are this environment's
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        HETRAIN_NODE=name, HETRAIN_HOST=name, GLOO_SOCKET_IFNAME=NIC, TP_SOCKET_IFNAME=NIC,
        PATH=os.pathsep.join([bin_dir, env.get("PATH", os.defpath)]), PYTHONUNBUFFERED="1",
    )
    if absent_nodes(em.settings.events):
        # torchrun's agents share one TCP store with their workers by default; a node joining a running job then
        # waits for the master address of the new round, which the first node, holding its store from before,
        # never writes (both agents time out after 60 s; pytorch issue 135712). Unshared, each round writes it.
        env[UNSHARED_STORE_ENV] = "1"
    env[CGROUPS_ENV] = json.dumps(em.node_cgroups(k))
    env[CPUS_ENV] = json.dumps(em.node_cpus(k))
    env[FILL_ENV] = json.dumps(em.node_fillers(k))
    env[COMM_ENV] = json.dumps(em.node_comm_targets(k))
    return env


def _forward(pipe: IO[str], out: TextIO, prefix: str) -> None:
    for line in iter(pipe.readline, ""):
        try:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
        except (ValueError, OSError):  # the stream was closed under us: keep draining the pipe
            pass
    pipe.close()


def _stop(procs: Sequence[subprocess.Popen[str]], grace_s: float) -> None:
    """SIGTERM each torchrun's process group (torchrun passes it to its ranks), SIGKILL after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@dataclass
class _NodeRuns:
    """Each node's torchrun started so far, its output forwarded line by line with the node's name."""

    em: EmulatedCluster
    command: list[str]
    out: TextIO
    err: TextIO
    say: Callable[[str], None]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    started: list[int] = field(default_factory=list)  # node index of each of procs
    killed: set[int] = field(default_factory=set)  # indices in procs of the torchruns an event killed: expected exits

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.em.cluster.nodes]

    def start(self, k: int) -> None:
        """Start node ``k``'s torchrun in its own session, its stdout and stderr forwarded."""
        p = subprocess.Popen(build_torchrun_command(self.em, k, self.command), env=build_node_env(self.em, k),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, errors="replace", bufsize=1, start_new_session=True)
        self.procs.append(p)
        self.started.append(k)
        names = self.names
        prefix = f"[{names[k]:<{max(len(n) for n in names)}}] "
        for pipe, target in ((p.stdout, self.out), (p.stderr, self.err)):
            t = threading.Thread(target=_forward, args=(pipe, target, prefix), daemon=True,
                                 name=f"hetrain-emulate-{names[k]}")
            t.start()
            self.threads.append(t)

    def apply(self, event: EmulationEvent) -> None:
        """Apply an event that is due: start a node late, or act on one (a node's torchrun killed is expected
        to exit; one started again later must not fail)."""
        names = self.names
        if event.kind == "start":
            self.start(names.index(event.target))
            self.say(f"event {event.describe()}: node {event.target} started")
            return
        if event.kind == "kill":
            gone = names.index(event.target)
            self.killed.update(j for j, node in enumerate(self.started) if node == gone)
        try:
            self.say(f"event {event.describe()}: {self.em.apply_event(event)}")
        except EmulationError as e:
            self.say(f"event {event.describe()} failed: {e}")

    def first_failure(self, codes: Sequence[int | None]) -> tuple[str, int] | None:
        """The first node whose torchrun exited non-zero (not one an event killed), with its status."""
        bad = [(self.names[self.started[j]], c) for j, c in enumerate(codes) if c not in (None, 0)
               and j not in self.killed]
        return bad[0] if bad else None

    def stop(self, awake: contextlib.ExitStack) -> None:
        """Stop every torchrun, let the CPUs sleep again, kill what is left in the namespaces, drain the output."""
        with signals_deferred():
            _stop(self.procs, STOP_GRACE_S)
            awake.close()
            leftovers = [pid for nn in self.em.network.nodes for pid in namespace_pids(nn.namespace)]
            if leftovers:
                kill_pids(leftovers)
            for t in self.threads:
                t.join(timeout=2.0)


def launch_job(em: EmulatedCluster, command: Sequence[str], timeout_s: float | None = None,
               stdout: TextIO | None = None, stderr: TextIO | None = None,
               log: Callable[[str], None] | None = None) -> int:
    """Run ``command`` on every node of ``em`` under torchrun; the job's exit status.

    0 when every node's torchrun exits 0; else the first non-zero status (the other nodes
    get ``FAILURE_GRACE_S`` to stop, then are stopped); 124 when ``timeout_s`` passes.
    Whatever happens, no process of the job is left in the namespaces afterwards. While
    it runs, the host's CPUs are kept out of sleep states where ``em.keeps_awake()`` (``emulate.keepawake``).
    """
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise EmulationError("no command to run: give it after `--`, for example "
                             "`hetrain emulate run cluster.toml -- python -m hetrain.profiler.network -o m.toml`")
    err = stderr or sys.stderr
    say = log or (lambda m: print(f"hetrain emulate: {m}", file=err, flush=True))
    runs = _NodeRuns(em, command, stdout or sys.stdout, err, say)
    awake = contextlib.ExitStack()
    if em.keeps_awake():
        problem = awake.enter_context(cpus_kept_awake())
        if problem:
            say(f"keep_awake: {problem}; the CPUs may sleep between quota periods")
    pending = list(em.settings.events)
    late = late_nodes(pending)
    try:
        for k, name in enumerate(runs.names):
            if name not in late:
                runs.start(k)
        return _watch(runs, pending, timeout_s)
    finally:
        runs.stop(awake)


def _watch(runs: _NodeRuns, pending: list[EmulationEvent], timeout_s: float | None) -> int:
    """Apply the events as they fall due and poll the torchruns until the job ends (``launch_job``'s status)."""
    t0 = time.monotonic()
    deadline = None if timeout_s is None else t0 + timeout_s
    status: int | None = None
    failed_at: float | None = None
    while True:
        while pending and time.monotonic() - t0 >= pending[0].at_s:
            runs.apply(pending.pop(0))
        codes = [p.poll() for p in runs.procs]
        failure = runs.first_failure(codes)
        if failure is not None and status is None:
            status = failure[1]
            failed_at = time.monotonic()
            runs.say(f"node {failure[0]} failed with exit status {status}; stopping the other nodes")
        if all(c is not None for c in codes) and not any(e.kind == "start" for e in pending):
            return status or 0
        now = time.monotonic()
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return status or 1
        if deadline is not None and now > deadline:
            runs.say(f"the job ran past its time limit of {timeout_s:g} s; stopping it")
            return 124
        time.sleep(0.05)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP while tearing down, so a second Ctrl-C cannot leave half a cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

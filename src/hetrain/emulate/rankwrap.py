"""Per-rank wrapper: join this device's cgroup, then exec the real command.

torchrun starts one of these per local rank (``--no-python python -m
hetrain.emulate.rankwrap CMD...``). It reads ``LOCAL_RANK``, writes its own pid
into that device's ``cgroup.procs`` (from ``HETRAIN_EMULATE_CGROUPS``, a JSON
list indexed by local rank, ``""`` for an unthrottled device), pins itself to
that device's CPU (``HETRAIN_EMULATE_CPUS``, where ``pin_cpus`` is on), starts the
device's idle filler where ``fill_idle`` is on (``HETRAIN_EMULATE_FILL``; see
``start_filler``) and the mover of its communication threads where ``isolate_comm`` is
on (``HETRAIN_EMULATE_COMM``; see ``start_comm_mover``), removes its own variables
from the environment and replaces itself with ``CMD``, so the command's process is
the rank process torchrun watches and signals. The command
sees the environment torchrun gives it plus ``HETRAIN_NODE`` / ``HETRAIN_HOST``;
nothing tells it that it is emulated.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

CGROUPS_ENV = "HETRAIN_EMULATE_CGROUPS"
CPUS_ENV = "HETRAIN_EMULATE_CPUS"  # JSON list by local rank of the CPUs to pin to ([]: not pinned)
FILL_ENV = "HETRAIN_EMULATE_FILL"  # JSON list by local rank: whether the device gets an idle filler
COMM_ENV = "HETRAIN_EMULATE_COMM"  # JSON list by local rank: the cgroup ``tasks`` file for the rank's other threads
COMM_SCAN_S = 0.02  # how often the mover looks for new threads
_PR_SET_PDEATHSIG = 1  # prctl(2)


def join_cgroup(procs_file: str, pid: int) -> None:
    """Move process ``pid`` (with all its threads) into the cgroup whose ``cgroup.procs`` is ``procs_file``."""
    with open(procs_file, "w") as f:
        f.write(str(pid))


def start_filler() -> int:
    """Fork this device's idle filler; returns its pid (in the caller, which goes on to exec the rank).

    The filler spins at ``SCHED_IDLE`` priority in the device's cgroup, on its CPU (both
    inherited), so it runs only when the rank has nothing to run, and it uses up the
    quota the rank leaves idle. Without it a throttled device banks quota while it
    waits (for an all-reduce, a pipeline neighbour) and runs its next compute at full
    host speed until that is spent: faster than its share, and faster after a pause
    than back to back. A GPU computes at the same speed after a pause, and so does
    a device with a filler. The filler dies with the rank (``PR_SET_PDEATHSIG``).
    """
    return _fork_helper(_spin_idle)


def _spin_idle(parent: int) -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def _fork_helper(body: Callable[[int], None]) -> int:
    """Fork a child that serves this process (the rank-to-be) with ``body(parent pid)``; returns its pid.

    The child dies with the rank (``PR_SET_PDEATHSIG``), holds none of its files, and
    never returns into the caller's code.
    """
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the rank ended before the line above
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # hold none of the rank's pipes open
            os.dup2(null, fd)
        os.closerange(3, 65536)
        body(parent)
    finally:
        os._exit(0)


def start_comm_mover(tasks_file: str, interval_s: float = COMM_SCAN_S) -> int:
    """Fork a watcher that moves every thread of this process but the main one into ``tasks_file``'s cgroup;
    returns its pid (in the caller, which goes on to exec the rank).

    The rank computes on its main thread (one torch thread; autograd runs CPU work on
    the thread that calls backward). Its other threads are Gloo's transport and work
    threads (and the runtime's helpers), which move and sum the messages: on a GPU that
    is NCCL's and the copy engines' work, which does not take the device's compute. The
    watcher moves each new thread, within ``interval_s`` of its start, out of the
    device's quota into the run's unthrottled cgroup (cgroup v1: a thread can leave its
    process's cgroup; the file is that cgroup's ``tasks``), and moves itself there first.
    It dies with the rank.

    Raises:
        OSError: ``tasks_file`` cannot be written (checked before forking, so the rank's wrapper says so).
    """
    os.stat(tasks_file)  # FileNotFoundError where the run's cgroup is gone
    if not os.access(tasks_file, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), tasks_file)

    def move_threads(parent: int) -> None:
        _move_thread(tasks_file, os.getpid())  # its own scans take nothing from the device's quota
        moved = {parent}
        while True:
            time.sleep(interval_s)
            try:
                tids = {int(t) for t in os.listdir(f"/proc/{parent}/task")}
            except OSError:  # the rank is gone
                return
            for tid in tids - moved:
                _move_thread(tasks_file, tid)
            moved |= tids

    return _fork_helper(move_threads)


def _move_thread(tasks_file: str, tid: int) -> None:
    with contextlib.suppress(OSError), open(tasks_file, "w") as f:  # a thread may end before it is moved
        f.write(str(tid))


def main(argv: Sequence[str] | None = None) -> int:
    """Join the cgroup of device LOCAL_RANK and exec ``argv``; returns only on an error (exit status)."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("hetrain.emulate.rankwrap: no command to run", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = os.environ.get("HETRAIN_NODE", "?")
    # each variable: a JSON list by local rank; the step runs where this rank's entry is set
    steps: list[tuple[str, Callable[[Any], object], Callable[[Any], str]]] = [
        (CGROUPS_ENV, lambda path: join_cgroup(path, os.getpid()), lambda path: f"join cgroup {path}"),
        # the affinity is kept across exec, and by the threads the rank starts
        (CPUS_ENV, lambda cpus: os.sched_setaffinity(0, cpus), lambda cpus: f"pin to CPUs {cpus}"),
        (FILL_ENV, lambda _: start_filler(), lambda _: "start the idle filler"),
        (COMM_ENV, start_comm_mover, lambda path: f"start the mover of its threads into {path}"),
    ]
    for env, step, what in steps:
        values = json.loads(os.environ.pop(env, "[]") or "[]")
        value = values[local_rank] if local_rank < len(values) else None
        if value:
            try:
                step(value)
            except OSError as e:
                print(f"hetrain.emulate.rankwrap: node {node} local rank {local_rank}: cannot {what(value)}: "
                      f"{e.strerror}", file=sys.stderr, flush=True)
                return 1
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"hetrain.emulate.rankwrap: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())

"""Per-rank wrapper: join this device's cgroup, then exec the real command.

torchrun starts one of these per local rank (``--no-python python -m
hetrain.emulate.rankwrap CMD...``). It reads ``LOCAL_RANK``, writes its own pid
into that device's ``cgroup.procs`` (from ``HETRAIN_EMULATE_CGROUPS``, a JSON
list indexed by local rank, ``""`` for an unthrottled device), pins itself to
that device's CPU (``HETRAIN_EMULATE_CPUS``, where ``pin_cpus`` is on), removes its own
variables from the environment and replaces itself with ``CMD``, so the
command's process is the rank process torchrun watches and signals. The command
sees the environment torchrun gives it plus ``HETRAIN_NODE`` / ``HETRAIN_HOST``;
nothing tells it that it is emulated.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

CGROUPS_ENV = "HETRAIN_EMULATE_CGROUPS"
CPUS_ENV = "HETRAIN_EMULATE_CPUS"  # JSON list by local rank of the CPUs to pin to ([]: not pinned)


def join_cgroup(procs_file: str, pid: int) -> None:
    """Move process ``pid`` (with all its threads) into the cgroup whose ``cgroup.procs`` is ``procs_file``."""
    with open(procs_file, "w") as f:
        f.write(str(pid))


def main(argv: Sequence[str] | None = None) -> int:
    """Join the cgroup of device LOCAL_RANK and exec ``argv``; returns only on an error (exit status)."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("hetrain.emulate.rankwrap: no command to run", file=sys.stderr)
        return 2
    paths = json.loads(os.environ.pop(CGROUPS_ENV, "[]") or "[]")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank < len(paths) and paths[local_rank]:
        try:
            join_cgroup(paths[local_rank], os.getpid())
        except OSError as e:
            node = os.environ.get("HETRAIN_NODE", "?")
            print(f"hetrain.emulate.rankwrap: node {node} local rank {local_rank}: cannot join cgroup "
                  f"{paths[local_rank]}: {e.strerror}", file=sys.stderr, flush=True)
            return 1
    cpus = json.loads(os.environ.pop(CPUS_ENV, "[]") or "[]")
    if local_rank < len(cpus) and cpus[local_rank]:
        try:
            os.sched_setaffinity(0, cpus[local_rank])  # kept across exec, and by the threads it starts
        except OSError as e:
            print(f"hetrain.emulate.rankwrap: local rank {local_rank}: cannot pin to CPUs {cpus[local_rank]}: "
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

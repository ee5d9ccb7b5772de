"""Keep the CPUs the emulated devices run on from sleeping (``[emulation] keep_awake``).

A device throttled to a share ``c`` of a CPU runs ``c x period`` and is then held off
its CPU until the next period. If nothing else wants that CPU, the CPU sleeps; on a
virtual machine a sleeping virtual CPU is handed back to the hypervisor, and waking it
again, with its caches cold, costs the device part of its next quota. A device alone
on its CPU at share 0.2 then computed 15-20% slower than beside a busy one, so its
speed depended on what else ran on the host: in the profiling job it fell once the
faster devices had finished, and its profile no longer matched training.

While a job runs, ``launch_job`` starts one keeper per such CPU: a process pinned to
it that spins at ``SCHED_IDLE`` priority in the launcher's own cgroup, outside every
quota. It runs only when nothing else wants the CPU (any other thread that wakes
preempts it at once), and it dies with the launcher.

Run as ``python -m hetrain.emulate.keepawake CPU PARENT_PID`` (``start_keepers`` does).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence

from hetrain.emulate.rankwrap import _spin_idle, die_with_parent


def start_keepers(cpus: Sequence[int]) -> list[subprocess.Popen[bytes]]:
    """One keeper per CPU of ``cpus``, started now; stop them with ``stop_keepers``."""
    return [subprocess.Popen([sys.executable, "-m", "hetrain.emulate.keepawake", str(cpu), str(os.getpid())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for cpu in cpus]


def stop_keepers(keepers: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill the keepers and reap them."""
    for p in keepers:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    for p in keepers:
        p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Pin to CPU ``argv[0]`` and spin at idle priority until process ``argv[1]`` (the launcher) ends."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("usage: python -m hetrain.emulate.keepawake CPU PARENT_PID", file=sys.stderr)
        return 2
    cpu, parent = int(args[0]), int(args[1])
    die_with_parent(parent)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        print(f"hetrain.emulate.keepawake: cannot pin to CPU {cpu}: {e.strerror}", file=sys.stderr)
        return 1
    _spin_idle(parent)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

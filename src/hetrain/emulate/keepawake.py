"""Keep the host's CPUs out of sleep states while an emulated job runs (``[emulation] keep_awake``).

A device throttled to a share ``c`` of a CPU runs ``c x period`` and is then held off
its CPU until the next period. If nothing else wants that CPU, the CPU sleeps; on a
virtual machine a sleeping virtual CPU halts, is handed back to the hypervisor, and
wakes slowly with cold caches, which costs the device part of its next quota. The
device's speed then depends on what else runs on the host: at share 0.2 alone on its
CPU a gpt-tiny step took 571 ms, 493 ms with the CPUs kept awake (mean of 20 one-second
blocks each, taken in turn); in the profiling job the slower devices, which finish
last and alone, drifted by up to 25% from run to run.

``cpus_kept_awake`` asks the kernel, through the PM QoS file ``/dev/cpu_dma_latency``,
for a CPU wake-up latency of 0 µs for as long as it holds the file open: the idle
loop then polls instead of halting. (An idle-priority spinner on each CPU did better
for a lone device, 443 ms, but cost devices sharing a busy CPU 23%: a throttled group
whose quota is refilled does not preempt a running task at once, so it waited for the
next tick. The latency request takes nothing from a busy CPU: 235 ms and 220 ms, two
devices of share 0.4 on one CPU, without and with it.) The request needs root; where
it cannot be made the job runs as before and the launcher says so.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

PM_QOS_FILE = "/dev/cpu_dma_latency"


def can_keep_awake(path: str = PM_QOS_FILE) -> str | None:
    """None where ``cpus_kept_awake`` can make its request, else why not."""
    if not os.path.exists(path):
        return f"{path} does not exist (a kernel without PM QoS)"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable (it needs root)"
    return None


@contextlib.contextmanager
def cpus_kept_awake(path: str = PM_QOS_FILE) -> Iterator[str | None]:
    """Request a CPU wake-up latency of 0 µs while the block runs; yields None, or why the request failed."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        yield f"cannot open {path}: {e.strerror}"
        return
    try:
        os.write(fd, struct.pack("i", 0))  # the request lasts while the file stays open
        yield None
    finally:
        os.close(fd)


def wakeup_latency_request(path: str = PM_QOS_FILE) -> int:
    """The CPU wake-up latency the kernel honours now (µs; the smallest request of any process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return int(struct.unpack("i", os.read(fd, 4))[0])
    finally:
        os.close(fd)

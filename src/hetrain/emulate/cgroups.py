"""Compute throttling: one cgroup per emulated device, CPU quota = cpu_share x period.

A device with ``cpu_share = 0.4`` and a 10 ms period may run 4 ms of CPU time in
every 10 ms; its process (and its threads and children) wait out the rest::

    cgroup v1 (cpu controller mount)         cgroup v2 (unified mount)
    <cpu>/hetrain-emu-1a2b3c/                <root>/hetrain-emu-1a2b3c/    (+cpu in subtree_control)
          cpu.shares 10240 (10x default)           cpu.weight 1000 (10x default)
        0-fast-0/  cpu.cfs_period_us 10000       0-fast-0/  cpu.max "10000 10000"
                   cpu.cfs_quota_us  10000       1-slow-0/  cpu.max "4000 10000"
        1-slow-0/  cpu.cfs_quota_us  4000
        comm/      cpu.shares <comm_weight>, no quota (only where comm_weight is set)

Which one is used is found at run time from ``/proc/self/mounts``: a v1 hierarchy
with the ``cpu`` controller first, else a cgroup2 mount whose root offers ``cpu``.
Neither (or no permission): ``find_cpu_cgroups`` says why, and the launcher then
runs unthrottled with a warning (or refuses, with ``throttle = "cgroup"``).

The launcher makes the cgroups; each rank's wrapper (``rankwrap``) writes its own
pid into ``cgroup.procs`` before it execs the real command.

Where ``isolate_comm`` moves each rank's threads but its main one (Gloo's, which move
and sum the messages; ``rankwrap.start_comm_mover``), cgroup v1 only:

- by default into the run's cgroup itself, where each thread weighs 1024 (a nice-0
  task), as much as a whole device's cgroup. Devices are pinned and their fillers keep
  their quotas in use, so a CPU whose quotas sum to 0.8 is saturated as soon as two
  ranks' Gloo threads sum an all-reduce, and the scheduler splits it by weight: a device
  then gets less than its quota exactly while gradients are all-reduced, which its
  profile (taken without communication) does not show;
- with ``comm_weight`` set, into the child ``comm/`` with that ``cpu.shares`` and no
  quota. At 2, the kernel's least, every quota is honoured first and the messages move
  in what the quotas leave of the CPU (about ``1 - the pinned shares``), waiting for each
  period's quotas to run out; link discovery runs under the same emulation and meets
  that wait too.

Measured on ``benchmarks/emulated_speedup.py``'s compute cluster (docs/emulate.md):
the first costs a device up to 18% of its compute speed while all-reducing, the second
makes a 3.2 MB all-reduce 3.7x slower; a GPU's collective does neither. The planner
predicted training far worse with the second (iteration errors of -30% and -32% on the
DP plan, against -8% and +5% with the first: training's all-reduces waited more than
discovery's ping-pong did; at 256, within the host's noise either way), so the default
is the first, as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hetrain.emulate.network import PREFIX, kill_pids, run_id_of

MIN_QUOTA_S = 0.001  # the kernel refuses a CFS quota below 1 ms
COMM_GROUP = "comm"  # the run's child cgroup for the ranks' communication threads (cgroup v1)


@dataclass(frozen=True)
class CgroupRoot:
    """Where cgroups with a CPU controller can be made: version 1 or 2, and the directory."""

    version: int
    path: Path

    def describe(self) -> str:
        return f"cgroup v{self.version} at {self.path}"


def quota_stall(cpu_share: float, period_s: float) -> float:
    """Seconds a throttled device without an idle filler waits, on average, before it handles a message
    that comes after a stretch of its compute.

    Once it has used its quota it waits half the throttled part of its period,
    ``(period - quota) / 2`` (0 for a share of 1 or more). With an idle filler the device
    is throttled the same part of the time whether it computes or idles, so link
    discovery meets the stall as training does and nothing needs adding
    (``cluster_fixups.with_measured_links``).

    Example:
        >>> round(quota_stall(0.4, 0.010), 6)
        0.003
    """
    if cpu_share >= 1:
        return 0.0
    quota_us, period_us = estimate_quota(cpu_share, period_s)
    return max(period_us - quota_us, 0) / 2e6


def estimate_quota(cpu_share: float, period_s: float) -> tuple[int, int]:
    """``(quota_us, period_us)`` for a CPU share: quota = share x period.

    The period is lengthened where the quota would fall under the kernel's 1 ms minimum
    (share 0.05 at 10 ms -> 1 ms per 20 ms).

    Example:
        >>> estimate_quota(0.4, 0.010)
        (4000, 10000)
        >>> estimate_quota(0.05, 0.010)
        (1000, 20000)
    """
    if not cpu_share > 0:
        raise ValueError(f"cpu_share must be positive, got {cpu_share!r}")
    period_s = max(period_s, MIN_QUOTA_S / cpu_share)
    period_us = round(period_s * 1e6)
    return max(round(cpu_share * period_us), round(MIN_QUOTA_S * 1e6)), period_us


def _mounts(mounts_text: str | None) -> list[tuple[str, str, set[str]]]:
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/self/mounts").read_text()
        except OSError:
            return []
    out = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    return out


def find_cpu_cgroups(mounts_text: str | None = None) -> tuple[CgroupRoot | None, str]:
    """The cgroup hierarchy to throttle with, or None and the reason there is none.

    Args:
        mounts_text: the text of ``/proc/self/mounts`` (read when None; tests pass their own).
    """
    mounts = _mounts(mounts_text)
    for point, fstype, options in mounts:
        if fstype == "cgroup" and "cpu" in options:
            path = Path(point)
            if not os.access(path, os.W_OK):
                return None, f"the cgroup v1 cpu hierarchy at {path} is not writable (run as root)"
            return CgroupRoot(1, path), ""
    for point, fstype, _ in mounts:
        if fstype == "cgroup2":
            path = Path(point)
            try:
                controllers = (path / "cgroup.controllers").read_text().split()
            except OSError as e:
                return None, f"cannot read {path / 'cgroup.controllers'}: {e.strerror}"
            if "cpu" not in controllers:
                return None, (f"the cgroup v2 hierarchy at {path} offers no cpu controller "
                              f"(it has: {' '.join(controllers) or 'none'})")
            if not os.access(path, os.W_OK):
                return None, f"the cgroup v2 hierarchy at {path} is not writable (run as root)"
            return CgroupRoot(2, path), ""
    return None, "no cgroup hierarchy with a cpu controller is mounted"


def run_dir(root: CgroupRoot, run_id: str) -> Path:
    return root.path / f"{PREFIX}{run_id}"


def create_device_cgroup(root: CgroupRoot, run_id: str, key: str, cpu_share: float, period_s: float) -> Path:
    """Make ``<root>/hetrain-emu-<run>/<key>`` with quota ``cpu_share x period``; returns its ``cgroup.procs``.

    Raises:
        OSError: the cgroup filesystem refused (the caller names the device and falls back or stops).
    """
    parent = run_dir(root, run_id)
    if not parent.exists():
        parent.mkdir()
        if root.version == 2:
            _enable_cpu_controller(root.path)
            _enable_cpu_controller(parent)
        # The run's tree is one entity to the scheduler, weighed against every other task of
        # the host: a weight of 10x the default keeps other work from eating into the quotas.
        if root.version == 1:
            (parent / "cpu.shares").write_text(str(10 * 1024))
        else:
            (parent / "cpu.weight").write_text(str(10 * 100))
    group = parent / key
    group.mkdir(exist_ok=True)
    quota_us, period_us = estimate_quota(cpu_share, period_s)
    if root.version == 1:
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    else:
        (group / "cpu.max").write_text(f"{quota_us} {period_us}")
    return group / "cgroup.procs"


def create_comm_cgroup(root: CgroupRoot, run_id: str, shares: int) -> Path:
    """Make ``<root>/hetrain-emu-<run>/comm`` (cgroup v1) with ``cpu.shares`` ``shares`` and no quota; returns its
    ``tasks``.

    The ranks' communication threads go there (``rankwrap.start_comm_mover``, ``comm_weight``
    set); at 2, the kernel's least, they use what the devices' quotas leave of their CPU, not
    the quotas themselves (module docstring).
    Call it after ``create_device_cgroup`` (which makes the run's cgroup).

    Raises:
        OSError: the cgroup filesystem refused, or ``root`` is cgroup v2 (a thread cannot leave its
            process's cgroup there; ``errno.EINVAL``).
    """
    if root.version != 1:
        raise OSError(errno.EINVAL, f"a cgroup for threads needs cgroup v1, not {root.describe()}")
    group = run_dir(root, run_id) / COMM_GROUP
    group.mkdir(exist_ok=True)
    (group / "cpu.shares").write_text(str(shares))
    return group / "tasks"


def set_cpu_share(group: Path, version: int, cpu_share: float, period_s: float) -> tuple[int, int]:
    """Change a device cgroup's quota to ``cpu_share x period`` now (its processes stay); returns (quota, period) us."""
    quota_us, period_us = estimate_quota(cpu_share, period_s)
    if version == 1:
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))  # the period stays: only the quota moves
        (group / "cpu.cfs_period_us").write_text(str(period_us))
    else:
        (group / "cpu.max").write_text(f"{quota_us} {period_us}")
    return quota_us, period_us


def _enable_cpu_controller(path: Path) -> None:
    control = path / "cgroup.subtree_control"
    enabled = control.read_text().split() if control.exists() else []  # always there on a real cgroupfs
    if "cpu" not in enabled:
        control.write_text("+cpu")  # EBUSY where path holds processes itself (a container's root): told to the user


def list_run_dirs(roots: list[CgroupRoot] | None = None) -> dict[str, list[Path]]:
    """Cgroup directories made by emulation runs, by run id."""
    if roots is None:
        root, _ = find_cpu_cgroups()
        roots = [root] if root else []
    out: dict[str, list[Path]] = {}
    for root in roots:
        with contextlib.suppress(OSError):
            for entry in root.path.iterdir():
                rid = run_id_of(entry.name)
                if rid and entry.is_dir():
                    out.setdefault(rid, []).append(entry)
    return out


def cgroup_pids(group: Path) -> list[int]:
    try:
        return [int(t) for t in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_run_dir(path: Path) -> list[str]:
    """Kill the processes left in a run's cgroups, then remove them; returns problems ([] when all went)."""
    problems = []
    children = [c for c in path.iterdir() if c.is_dir()] if path.exists() else []
    for group in [*children, path]:
        pids = cgroup_pids(group)
        survivors = kill_pids(pids) if pids else []
        for attempt in range(50):  # the kernel empties a cgroup a moment after its last process exits
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if attempt == 49:
                    left = f" (processes {survivors} would not die)" if survivors else ""
                    problems.append(f"cannot remove cgroup {group}: {e.strerror}{left}")
                time.sleep(0.05)
    return problems


def read_cpu_stat(group: Path) -> dict[str, int]:
    """``cpu.stat`` of a cgroup as numbers (v1: nr_throttled, throttled_time ns; v2: usage_usec, ...)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in (group / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    return out

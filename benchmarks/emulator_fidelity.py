"""Does an emulated device compute at its share after a pause, as it does back to back?

A GPU computes a kernel at the same speed whether it idled before or not; the
profile of an emulated device measures layers back to back. A process under a
CFS CPU quota banks the quota it leaves idle within a period (and the kernel
keeps up to one slice of runtime on the CPU across periods), so a short stretch of
compute after a pause runs at full host speed: faster than its share. Training
alternates compute with waits (for a neighbour, an all-reduce), so such a device
trains faster than its profile says, by how much depending on the plan.

``fill_idle`` (on by default) gives each device throttled below one CPU an idle
filler: a process in its cgroup, on its CPU, at SCHED_IDLE priority, which uses up
the quota the device leaves idle (``emulate.rankwrap.start_filler``). This script
runs one throttled rank through ``hetrain.emulate.rankwrap`` (the path every
emulated rank takes) with and without its filler, times stretches of W ms of
full-speed work (matrix products, single thread) after random pauses of 10-30 ms,
and prints their slow-down against full speed next to the back-to-back one and
the nominal 1 / share.

    sudo -E .venv/bin/python benchmarks/emulator_fidelity.py [--shares 0.4 0.24] [--reps 30] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys

from _results import write_section
from hetrain.emulate.cgroups import create_device_cgroup, find_cpu_cgroups, remove_run_dir, run_dir
from hetrain.emulate.rankwrap import CGROUPS_ENV, CPUS_ENV, FILL_ENV

WORKS_MS = (1, 2, 4, 8, 16, 32)

WORKER = r"""
import json, random, sys, time
import torch
torch.set_num_threads(1)
a = torch.randn(128, 128)
def run(n):
    t = time.perf_counter()
    for _ in range(n):
        a @ a
    return time.perf_counter() - t
run(200)
t0 = time.thread_time(); run(2000); cpu = (time.thread_time() - t0) / 2000  # full-speed seconds per product
out = {"b2b": run(4000) / (4000 * cpu)}
reps = int(sys.argv[1])
for w in json.loads(sys.argv[2]):
    n = max(1, round(w / 1e3 / cpu))
    times = []
    for _ in range(reps):
        time.sleep(random.uniform(0.010, 0.030))
        times.append(run(n))
    out[str(w)] = sum(times) / len(times) / (n * cpu)
print(json.dumps(out), flush=True)
"""


def measure(procs_file: str, cpu: int, fill: bool, reps: int) -> dict[str, float]:
    """Slow-down factors of one throttled rank run through rankwrap: back to back, and per W after a pause."""
    env = {**os.environ, "LOCAL_RANK": "0", CGROUPS_ENV: json.dumps([procs_file]), CPUS_ENV: json.dumps([[cpu]]),
           FILL_ENV: json.dumps([fill])}
    done = subprocess.run([sys.executable, "-m", "hetrain.emulate.rankwrap", sys.executable, "-c", WORKER,
                           str(reps), json.dumps(WORKS_MS)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the throttled rank failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.4, 0.24])
    parser.add_argument("--period", type=float, default=0.010, help="CPU period, s (default 0.010, the emulator's)")
    parser.add_argument("--reps", type=int, default=30, help="stretches per W (default 30)")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    root, why = find_cpu_cgroups()
    if root is None:
        print(f"skipped: {why}")
        return 0
    cpu = sorted(os.sched_getaffinity(0))[-1]
    run_id = "fid" + secrets.token_hex(2)
    header = ("| share | fill_idle | back to back | " + " | ".join(f"W = {w} ms" for w in WORKS_MS)
              + " | mean of W / back to back |")
    rows = [header, "| ---: | --- | ---: | " + " | ".join("---:" for _ in WORKS_MS) + " | ---: |"]
    try:
        for share in args.shares:
            for fill in (False, True):
                procs = create_device_cgroup(root, run_id, f"{share:g}-{'fill' if fill else 'plain'}", share,
                                             args.period)
                r = measure(str(procs), cpu, fill, args.reps)
                bursts = [r[str(w)] for w in WORKS_MS]
                ratio = statistics.mean(bursts) / r["b2b"]
                rows.append(f"| {share:g} (1/share {1 / share:.2f}) | {'on' if fill else 'off'} | {r['b2b']:.2f} | "
                            + " | ".join(f"{b:.2f}" for b in bursts) + f" | {ratio:.2f} |")
                print(rows[-1], flush=True)
    finally:
        remove_run_dir(run_dir(root, run_id))
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        notes = (f"Slow-down against full host speed (wall time / CPU time) of one rank throttled by a cgroup CPU "
                 f"quota (period {args.period * 1e3:g} ms) on CPU {cpu}, run through hetrain.emulate.rankwrap: back "
                 f"to back (what the profile measures), and for stretches of W ms of CPU work after random pauses "
                 f"of 10-30 ms, mean of {args.reps}. Without a filler a stretch after a pause runs near full speed "
                 f"until the banked quota is spent; with it, at about the back-to-back rate. The last column is "
                 f"what a training device that pauses would gain over its profile (1.00: none). One run on a "
                 f"shared 2-core host.")
        write_section("Emulator fidelity (compute after a pause)",
                      "sudo -E .venv/bin/python benchmarks/emulator_fidelity.py", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measured speed-up of hetrain's plan over data parallelism and an even-split pipeline, emulated.

Three clusters emulated on this host (hetrain.emulate: namespaces, tc-shaped NICs,
cgroup CPU quotas), 2 nodes x 2 devices each; on each, the demo's path
(hetrain.demo.run_emulated_comparison): profile gpt-tiny per device type on an
emulated device of that type, discover the links, plan, simulate, then train every
plan the same number of steps on Shakespeare, one after the other:

    network    equal devices (share 0.4 each), NICs 1 Gbit/s and 50 Mbit/s
    compute    devices at shares 0.6 and 0.2, both NICs 1 Gbit/s
    both       shares 0.6 and 0.24, NICs 1 Gbit/s and 100 Mbit/s (the demo's cluster)

Baselines, both run by hetrain's own runtime (not torch's DDP / pipelining):
"dp" is the planner's pure data-parallel plan (strategy="dp": one VW per device,
batch split by speed, all-reduce every iteration); "even-split" is one pipeline
over all devices with layers split as evenly as possible. Samples/s leave out
the warm-up steps; prediction error is (simulated - measured) / measured
iteration time. Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/emulated_speedup.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _results import write_section
from hetrain.demo import run_emulated_comparison
from hetrain.emulate import EmulationError
from hetrain.emulate.emulator import check_permissions


def cluster_text(name: str, fast_share: float, slow_share: float, fast_nic: str, slow_nic: str) -> str:
    def dev(type_name: str, share: float) -> str:
        return (f'{{ type = "{type_name}", tflops = {0.02 * share:.4f}, memory = "4GB", '
                f'memory_bandwidth = "{10 * share:.1f}GB/s", cpu_share = {share}, count = 2 }}')

    return f"""
name = "{name}"

[[node]]
name = "fast"
devices = [{dev("cpu-a", fast_share)}]
intra_link = "loopback"
nic = "{fast_nic}"

[[node]]
name = "slow"
devices = [{dev("cpu-b", slow_share)}]
intra_link = "loopback"
nic = "{slow_nic}"
"""


SCENARIOS = {
    "network": cluster_text("network-hetero", 0.4, 0.4, "1Gbit/s", "50Mbit/s"),
    "compute": cluster_text("compute-hetero", 0.6, 0.2, "1Gbit/s", "1Gbit/s"),
    "both": cluster_text("both-hetero", 0.6, 0.24, "1Gbit/s", "100Mbit/s"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--out", default="out/bench-emulated")
    args = parser.parse_args()
    try:
        check_permissions("up")
    except EmulationError as e:
        print(f"skipped: {e}")
        return 0
    rows = ["| scenario | plan | shape | predicted samples/s | measured samples/s | iteration error | "
            "speed-up over dp |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    for name, text in SCENARIOS.items():
        result = run_emulated_comparison(text, Path(args.out) / name, "gpt-tiny", args.global_batch, args.steps,
                                         args.warmup, log=lambda s: None)
        for r in result.runs.values():
            shape = f"{r.plan.strategy}: " + " + ".join(str(len(vw.stages)) for vw in r.plan.virtual_workers)
            rows.append(f"| {name} | {r.name} | {shape} | {r.predicted_samples_per_s:.1f} | "
                        f"{r.measured_samples_per_s:.1f} | {100 * r.prediction_error:+.1f}% | "
                        f"{result.speedup('dp', r.name):.2f}x |")
        print("\n".join(rows), flush=True)
    table = "\n".join(rows)
    notes = (f"gpt-tiny, global batch {args.global_batch}, {args.steps} steps per plan, first {args.warmup} left out; "
             f"2-core host, cgroup v1 quotas, tc htb (no latency emulation). Baselines are hetrain's runtime on "
             f"the planner's dp plan and on a hand-built even-split pipeline, not torch DDP or "
             f"torch.distributed.pipelining. Took {time.perf_counter() - start:.0f} s; host load average "
             f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print(notes)
    write_section("Emulated speed-up (hetrain plan vs dp vs even-split pipeline)",
                  "sudo -E .venv/bin/python benchmarks/emulated_speedup.py", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

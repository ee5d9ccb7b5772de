"""How long does planning take as clusters and models grow?

Synthetic heterogeneous clusters (nodes of 8 devices; A100, V100, T4 and RTX 3090
nodes in turn; NICs of 100, 25 and 10 Gbit/s) and GPT-style models of 24 to 200
layers. Targets (issue 2): 64 devices x 100 layers under 1 s; 1024 devices x 200
layers under 30 s. For scale: AMP reports ~500 s on one CPU, Alpa minutes to hours.

    python benchmarks/planner_scale.py [--quick] [--repeat N]

Each case is planned ``--repeat`` times (default 3) from a fresh profile, so no
cache carries over, and the shortest time is reported, as timeit does: on a
shared machine the other runs only add other programs' time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _results import write_section
from hetrain.cluster import Cluster, parse_cluster
from hetrain.models.analytic import build_gpt_profile
from hetrain.planner import plan

TYPES = [("A100-40GB", "nvlink3", "100Gbit/s"), ("V100-32GB", "nvlink2", "25Gbit/s"),
         ("T4", "pcie3", "10Gbit/s"), ("RTX3090", "pcie4", "25Gbit/s")]


def build_cluster(num_devices: int) -> Cluster:
    per_node = min(8, num_devices)
    nodes = []
    for k in range(num_devices // per_node):
        t, intra, nic = TYPES[k % len(TYPES)]
        nodes.append({"name": f"n{k}", "devices": [{"type": t, "count": per_node}], "intra_link": intra, "nic": nic})
    return parse_cluster({"name": f"synthetic-{num_devices}", "node": nodes})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1024-device case")
    parser.add_argument("--repeat", type=int, default=3, help="plan each case this many times, report the fastest")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    cases = [(16, 24), (16, 100), (64, 24), (64, 100), (256, 100), (256, 200), (1024, 100), (1024, 200)]
    if args.quick:
        cases = [c for c in cases if c[0] < 1024]
    targets = {(64, 100): 1.0, (1024, 200): 30.0}
    rows = []
    print(f"{'devices':>8} {'layers':>7} {'plan time':>10} {'target':>8}  chosen plan")
    for n, layers in cases:
        cluster = build_cluster(n)
        elapsed = float("inf")
        for _ in range(args.repeat):
            profile = build_gpt_profile(layers - 2, 1024, 16, 1024, 50257, name=f"gpt-{layers}")
            start = time.perf_counter()
            p = plan(cluster, profile, global_batch=4 * n, simulate_top_k=0)
            elapsed = min(elapsed, time.perf_counter() - start)
        target = targets.get((n, layers))
        verdict = "" if target is None else (f"< {target:g} s" + (" ok" if elapsed < target else " MISSED"))
        desc = f"{p.strategy} {p.formation}, {len(p.virtual_workers)} VWs, {p.prediction.samples_per_s:.0f} samples/s"
        print(f"{n:>8} {layers:>7} {elapsed:>9.2f}s {verdict:>8}  {desc}", flush=True)
        rows.append(f"| {n} | {layers} | {elapsed:.2f} s | {verdict} | {desc} |")
    table = "| devices | layers | planning time | target | chosen plan |\n|---:|---:|---:|---|---|\n" + "\n".join(rows)
    command = "python benchmarks/planner_scale.py" + (" --quick" if args.quick else "") \
        + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
    load = f" Load average while it ran: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores." \
        if hasattr(os, "getloadavg") else ""
    write_section("Planner scale", command, table,
                  "Planning only (closed forms, `simulate_top_k=0`); global batch 4 x devices; one process; "
                  f"fastest of {args.repeat} runs per case.{load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

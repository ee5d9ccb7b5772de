"""The simulator's prediction error against the micro-batch size, on the demo's emulated cluster.

The demo's planner only considers micro-batches of 4 or more samples (hetrain.demo.MICRO_BATCH_SIZES).
This benchmark measures why: on the demo's cluster (hetrain.demo.DEFAULT_CLUSTER: 2 fast devices on a
1 Gbit/s NIC, 2 slow ones at 0.4 of their speed on 100 Mbit/s), after one profile and one discovery,
the planner plans with ONE micro-batch size at a time, for two shapes:

    pp       one pipeline over the 4 devices (strategy "pp")
    hybrid   hetrain's best plan (pipelines and data parallelism)

and each plan is simulated, then trained by hetrain's runtime for the same steps, one after the other.
Prediction error is (simulated - measured) / measured iteration time. A plan of micro-batch b runs
2 x (mini-batch / b) forward and backward actions per stage and as many messages across each stage
boundary: what each action costs beyond its layers' profiled compute (the runtime's own work per
action: posting and completing a message, its copies, the executor) is not in the layer profile, so
the smaller b, the more a prediction without it runs ahead of the measurement. Two predictions per
plan: without any overhead per action, and with the one calibrated before planning
(hetrain.calibrate, from a separate run of an even-split pipeline of micro-batches of 2).
Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/micro_batch_error.py [--sizes 1,2,4,8] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from _emulated import ready_to_emulate
from _results import write_section
from hetrain.demo import DEFAULT_CLUSTER, run_emulated_comparison
from hetrain.plan import Plan
from hetrain.profile import ModelProfile

SHAPES = ("pp", "hybrid")


def plan_builder(sizes: list[int]) -> Any:
    def build(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> dict[str, Plan]:
        from hetrain.cluster import parse_cluster
        from hetrain.planner import plan

        cluster = parse_cluster(cluster_dict)
        plans = {}
        for shape in SHAPES:
            for b in sizes:
                kw = {"strategy": "pp"} if shape == "pp" else {}
                plans[f"{shape}-b{b}"] = plan(cluster, profile, global_batch, simulate_top_k=3,
                                              micro_batch_sizes=(b,), **kw)
        return plans

    return build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="micro-batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-micro-batch")
    args = parser.parse_args()
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or sizes[0] < 1 or sizes[-1] > args.global_batch:
        parser.error(f"--sizes must lie in 1..{args.global_batch} (the global batch), got {args.sizes!r}")
    if not ready_to_emulate(parser, args):
        return 0
    names = [f"{shape}-b{b}" for shape in SHAPES for b in sizes]
    load0 = os.getloadavg()[0]
    start = time.perf_counter()
    result = run_emulated_comparison(DEFAULT_CLUSTER, args.out, global_batch=args.global_batch, steps=args.steps,
                                     warmup=args.warmup, train=names, plan_builder=plan_builder(sizes))
    took = time.perf_counter() - start
    from dataclasses import replace

    from hetrain.simulator import simulate

    rows = ["| shape | micro-batch | VWs x stages x micro-batches | actions per stage and step | "
            "measured samples/s | predicted, no overhead | error | predicted, calibrated | error |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        r = result.runs[name]
        shape, b = name.rsplit("-b", 1)
        vws = r.plan.virtual_workers
        layout = " + ".join(f"{len(vw.stages)}x{vw.micro_batches}" for vw in vws)
        actions = max(2 * vw.micro_batches for vw in vws)
        bare = simulate(replace(r.plan, profile=replace(r.plan.profile, action_overhead_s=()))).iteration_s
        measured = r.measured_iteration_s
        rows.append(f"| {shape} | {b} | {layout} | {actions} | {r.measured_samples_per_s:.1f} | "
                    f"{r.plan.global_batch / bare:.1f} | {100 * (bare - measured) / measured:+.1f}% | "
                    f"{r.predicted_samples_per_s:.1f} | {100 * r.prediction_error:+.1f}% |")
    table = "\n".join(rows)
    print(table)
    cal = result.calibration
    calibrated = f"calibrated overhead {1e3 * cal.overhead_s:.2f} ms per action ({cal.summary()})" if cal else ""
    notes = (f"gpt-tiny, global batch {args.global_batch}, the demo's cluster and emulation, {args.steps} steps per "
             f"plan, first {args.warmup} left out; each plan planned with one micro-batch size only; one profile, "
             f"one link discovery and one calibration for all: {calibrated}. Negative error: the plan ran slower "
             f"than predicted. Took {took:.0f} s; "
             f"host load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print(notes)
    if not args.no_write:
        command = "sudo -E .venv/bin/python benchmarks/micro_batch_error.py " + " ".join(sys.argv[1:])
        write_section("Prediction error against the micro-batch size (emulated)", command.strip(), table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A plan with TP stages on the emulated cluster: measured against predicted (issue 34).

On the demo's emulated cluster (hetrain.demo.DEFAULT_CLUSTER: node "fast" of two devices at a full CPU share,
node "slow" of two at 0.4, loopback inside a node, 1 Gbit/s and 100 Mbit/s NICs), after one profile (its TP
splits from the analytic profile: ``profile_combine.with_tp_splits``), one link discovery and one calibration,
with the layers also timed on a rank of a TP group of a node's two devices (``runtime.tp_measure``), the
planner plans gpt-tiny twice with the same options but the TP degree:

    tp2   every stage on a TP group of the node's two devices (``--tp 2``): a pipeline of two TP groups, or
          TP groups side by side, as the planner finds best
    tp1   the best plan without TP (``--tp 1``)

Each is simulated, then trained by hetrain's runtime (the TP stages with torch's DTensor, ranks as the emulator
runs them: each rank's threads in its own CPU quota), one after the other. Target: the TP plan's measured
iteration within 10% of its prediction. Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/tp_emulated.py [--steps 20] [--warmup 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

from _emulated import finish, ready_to_emulate
from hetrain.demo import DEFAULT_CLUSTER, run_emulated_comparison
from hetrain.plan import Plan
from hetrain.profile import ModelProfile

MODEL = "gpt-tiny"
TARGET = 0.10


def build(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> dict[str, Plan]:
    from hetrain.cluster import parse_cluster
    from hetrain.models.analytic import build_profile
    from hetrain.planner import PlannerOptions
    from hetrain.planning import plan_with_simulator
    from hetrain.profile_combine import with_tp_splits

    twin = build_profile(MODEL, **({"seq_len": profile.seq_len} if profile.seq_len else {}))
    split, note = with_tp_splits(profile, twin)
    print(note, flush=True)
    cluster = parse_cluster(cluster_dict)
    opts = PlannerOptions(simulate_top_k=3, micro_batch_sizes=(4, 8), time_budget_s=None)
    return {f"tp{k}": plan_with_simulator(cluster, split, global_batch, replace(opts, tp=k)) for k in (2, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-tp-emulated")
    args = parser.parse_args()
    if not ready_to_emulate(parser, args):
        return 0
    load0 = os.getloadavg()[0]
    start = time.perf_counter()
    failed: list[str] = []
    try:
        result = run_emulated_comparison(DEFAULT_CLUSTER, args.out, model=MODEL, global_batch=args.global_batch,
                                         steps=args.steps, warmup=args.warmup, train=["tp2", "tp1"],
                                         plan_builder=build, profile_tp=2)
    except RuntimeError as e:
        print(f"failed: {e}")
        return 1
    rows = ["| plan | stages (TP groups) | measured iteration | predicted (simulated) | error | target |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for name in ("tp2", "tp1"):
        r = result.runs[name]
        shape = " + ".join("[" + ", ".join(f"{s.device}" + (f" TP{s.tp}" if s.tp > 1 else "") for s in vw.stages)
                           + f"] x{vw.micro_batches}" for vw in r.plan.virtual_workers)
        error = r.prediction_error
        ok = "" if name != "tp2" else ("ok" if abs(error) <= TARGET else "MISSED")
        if name == "tp2" and abs(error) > TARGET:
            failed.append(f"{name} error {100 * error:+.1f}%")
        rows.append(f"| {name} | {shape} | {1e3 * r.measured_iteration_s:.1f} ms | "
                    f"{1e3 * r.predicted_iteration_s:.1f} ms | {100 * error:+.1f}% | {ok} |")
    table = "\n".join(rows)
    print(table)
    notes = (f"{MODEL}, global batch {args.global_batch}, {args.steps} steps per plan, first {args.warmup} left out; "
             f"one profile, one link discovery, one calibration for both. Error: (predicted - measured) / measured. "
             f"Took {time.perf_counter() - start:.0f} s; host load average {load0:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end.")
    return finish(args, [], "tp_emulated.py", "TP stages on the emulated cluster (issue 34)",
                  table, notes + (f" Missed: {'; '.join(failed)}." if failed else ""))


if __name__ == "__main__":
    sys.exit(main())

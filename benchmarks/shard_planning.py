"""What does sharded optimizer state buy the planner? The largest model that fits, and the predicted samples/s,
with and without sharding (issue 35).

For each cluster and model: the planner's best plan with ``--shard none`` and with ``--shard auto`` (which also
plans ZeRO-1, and ZeRO-2 where ZeRO-1 does not fit, where the plan without could be memory-bound, then shards
each segment only as far as its owners need: "optimizer in 1 of 4 segments" in the shape column), both at TP 1
(``--max-tp 1``) so that only sharding differs, each the best by the simulator among its 3 best candidates, with
a time budget per planning; pure data parallelism (``--strategy dp``) at one sample per device per iteration, the
planner's choice (``auto``) at a global batch of 64. Clusters:

    t4-nodes      examples/clusters/t4-nodes.toml: 2 nodes of 4 T4 (16 GB), 10 Gbit/s
    cloud-mixed   examples/clusters/cloud-mixed.toml: 8 A100-40GB, 4 V100-16GB, 8 T4 on 100/25/10 Gbit/s
    hetpipe       examples/clusters/hetpipe.toml

Models: analytic profiles (no measurement), gpt2-large to llama2-13b. Target: the largest model that fits grows
with sharding on at least one cluster, and where both fit, the sharded plan is chosen only where it is faster.

    python benchmarks/shard_planning.py [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import hetrain
from _results import write_section
from hetrain.models.analytic import build_profile
from hetrain.planner.search import PlannerError, PlannerOptions, plan
from hetrain.planning import simulated_iteration_s
from hetrain.simulator import simulate

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("gpt2-large", "gpt2-xl", "gpt-2.7b", "llama2-7b", "llama2-13b")
BUDGET_S = 30.0


def case(cluster: hetrain.Cluster, name: str, batch: int, strategy: str) -> dict[str, object]:
    profile = build_profile(name)
    opts = PlannerOptions(time_budget_s=BUDGET_S, simulate_top_k=3, max_tp=1, strategy=strategy)  # type: ignore[arg-type]
    row: dict[str, object] = {"cluster": cluster.name, "model": name, "batch": batch, "strategy": strategy}
    for key, shard in (("without", "none"), ("with", "auto")):
        start = time.perf_counter()
        try:
            p = plan(cluster, profile, batch, replace(opts, shard=shard), score=simulated_iteration_s)
        except PlannerError as e:
            row[key] = None
            row[f"{key}_error"] = "fits nowhere" if "fits no" in str(e) else str(e).split(";")[0][:50]
            continue
        row[f"{key}_plan_s"] = time.perf_counter() - start
        row[key] = batch / simulate(p).iteration_s
        row[f"{key}_shape"] = (f"{len(p.virtual_workers)} VW x {max(len(vw.stages) for vw in p.virtual_workers)} st"
                               + shard_label(p))
    return row


def shard_label(p: hetrain.Plan) -> str:
    """``, optimizer`` where every shared segment shards alike; ``, optimizer in 1 of 4 segments`` where the
    planner chose per segment (``Plan.segment_shards``)."""
    if p.sync_options.shard == "none":
        return ""
    if not p.layout.mixed_shards:
        return f", {p.sync_options.shard}"
    shared = [seg for seg in p.segments() if seg.shared]
    return f", {p.sync_options.shard} in {sum(seg.sharded for seg in shared)} of {len(shared)} segments"


def fmt(row: dict[str, object]) -> str:
    a, b = row.get("without"), row.get("with")
    ratio = f"{b / a:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"
    without = f"{a:.2f}" if isinstance(a, float) else row.get("without_error", "-")
    with_ = f"{b:.2f}" if isinstance(b, float) else row.get("with_error", "-")
    return (f"| {row['cluster']} | {row['model']} | {row['strategy']} | {row['batch']} | {without} | "
            f"{row.get('without_shape', '-')} | {with_} | {row.get('with_shape', '-')} | {ratio} | "
            f"{row.get('with_plan_s', 0):.1f} s |")


def largest(rows: list[dict[str, object]], key: str, cluster: str, strategy: str) -> str:
    fits = [str(r["model"]) for r in rows if r["cluster"] == cluster and r["strategy"] == strategy
            and isinstance(r.get(key), float)]
    return fits[-1] if fits else "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="t4-nodes only")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    clusters = {n: hetrain.load_cluster(ROOT / f"examples/clusters/{n}.toml")
                for n in (("t4-nodes",) if args.quick else ("t4-nodes", "cloud-mixed", "hetpipe"))}
    header = ("| cluster | model | strategy | global batch | samples/s without sharding | its shape | "
              "samples/s with --shard auto | its shape | with / without | planning with |\n"
              "|---|---|---|---:|---:|---|---:|---|---:|---:|")
    print(header, flush=True)
    lines, rows = [], []
    for _cname, cluster in clusters.items():
        for strategy in ("dp", "auto"):
            for name in MODELS:
                # pure DP: one sample per device (one micro-batch, where ZeRO-2 frees gradients bucket by bucket)
                rows.append(case(cluster, name, cluster.num_devices if strategy == "dp" else 64, strategy))
                lines.append(fmt(rows[-1]))
                print(lines[-1], flush=True)
    summary = ["| cluster | strategy | largest model without sharding | with |", "|---|---|---|---|"]
    summary += [f"| {c} | {s} | {largest(rows, 'without', c, s)} | {largest(rows, 'with', c, s)} |"
                for c in clusters for s in ("dp", "auto")]
    print("\n".join(summary))
    table = header + "\n" + "\n".join(lines) + "\n\n" + "\n".join(summary)
    load = f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    print(load)
    if not args.no_write:
        write_section("Sharded optimizer state: what fits, and how fast (issue 35)",
                      "python benchmarks/shard_planning.py", table,
                      "Each plan is the planner's best by the simulator among its 3 best candidates, at TP 1, with a "
                      f"{BUDGET_S:g} s budget per planning; samples/s are simulated. Predicted, not measured: no GPU "
                      "cluster here; the memory model that decides what fits is checked against measured GPUs in "
                      "docs/profile.md, and the runtime's sharded memory against its tensors in "
                      "tests/distributed (issue 35). " + load)
    return 0


if __name__ == "__main__":
    sys.exit(main())

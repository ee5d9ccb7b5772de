"""Which schedule the planner keeps once it replays its best plans under each (simulated).

``--schedule auto`` partitions for 1F1B, which holds the fewest activations, prices each candidate
by the better of 1F1B's and 1F1B-eager's closed forms where eager fits, then replays the best candidate
and its reverse under the other schedules where every stage still fits, and keeps the fastest
(docs/planner.md, section 5). Per example cluster, model and batch: the plan chosen with the
planner restricted to 1F1B (``schedule="1f1b"``) and with ``auto``, their simulated iterations, and the
largest stage's predicted memory of each against its device's.

    python benchmarks/schedule_choice.py [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import hetrain
from _results import write_section
from hetrain.cluster import load_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan
from hetrain.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
#: (cluster, model, global batch, strategy)
CASES = [
    ("pipetorch", "gpt2-small", 16, "auto"), ("pipetorch", "gpt2-small", 64, "auto"),
    ("cloud-mixed", "gpt2-small", 16, "auto"), ("cloud-mixed", "gpt2-small", 32, "auto"),
    ("cloud-mixed", "gpt2-small", 64, "auto"), ("cloud-mixed", "gpt2-medium", 128, "auto"),
    ("cloud-mixed", "gpt2-medium", 32, "pp"), ("hetpipe", "gpt2-small", 64, "auto"),
]


def fullest(p: Plan) -> str:
    """The stage whose predicted memory is the largest share of its device's, as 'used / capacity'."""
    stage = max((s for vw in p.virtual_workers for s in vw.stages),
                key=lambda s: s.predicted_memory_bytes / p.cluster.device(s.device).memory_bytes)
    return f"{format_bytes(stage.predicted_memory_bytes)} / {format_bytes(p.cluster.device(stage.device).memory_bytes)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    rows = ["| cluster | model, batch | strategy | 1F1B only: plan, simulated | auto: plan, simulated | "
            "auto / 1F1B only | fullest stage, 1F1B only -> auto |", "|---|---|---|---|---|---:|---|"]
    start = time.perf_counter()
    for cluster_name, model, batch, strategy in CASES:
        cluster = load_cluster(ROOT / "examples" / "clusters" / f"{cluster_name}.toml")
        only, auto = (hetrain.plan(cluster, build_profile(model), batch, strategy=strategy, schedule=s)
                      for s in ("1f1b", "auto"))
        t_only, t_auto = only.prediction.simulated_iteration_s, auto.prediction.simulated_iteration_s
        assert t_only is not None and t_auto is not None
        rows.append(f"| {cluster_name} | {model}, {batch} | {strategy} | {only.formation} {only.schedule}, "
                    f"{t_only * 1e3:.1f} ms | {auto.formation} {auto.schedule}, {t_auto * 1e3:.1f} ms | "
                    f"{t_only / t_auto:.3f}x | {fullest(only)} -> {fullest(auto)} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    notes = (f"`hetrain.plan` with its defaults (time budget 10 s), the analytic profiles, each case planned twice: "
             f"`schedule=\"1f1b\"` and `schedule=\"auto\"`; simulated: the plan's replayed iteration; auto / 1F1B "
             f"only > 1: the schedule-auto plan is faster. Took {time.perf_counter() - start:.0f} s.")
    print(notes)
    if not args.no_write:
        write_section("Schedule choice: 1F1B only against auto (simulated)",
                      "python benchmarks/schedule_choice.py", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Is the plan faster than pure data parallelism and a pure pipeline? (predicted)

For each example cluster and reference model: predicted samples/s of hetrain's
plan, of pure data parallelism (every device its own virtual worker, batch split
by speed) and of a pure pipeline (one virtual worker), all by the same cost
model, with the simulator's figure for the chosen plan. Pipe-Torch reports about
1.4x over DP on networks of mixed speed.

    python benchmarks/plan_vs_dp.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hetrain
from _results import write_section
from hetrain.cluster import load_cluster
from hetrain.models.analytic import build_profile
from hetrain.planner import PlannerError, plan

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("hetpipe", "gpt2-medium", 256), ("hetpipe", "vgg19", 512),
    ("pipetorch", "gpt2-small", 128), ("pipetorch", "resnet50", 512),
    ("cloud-mixed", "gpt2-medium", 512), ("cloud-mixed", "gpt2-xl", 256), ("cloud-mixed", "resnet152", 1024),
    ("gpu256", "gpt2-large", 2048),
]


def samples_per_s(cluster, profile, batch, strategy):
    try:
        p = plan(cluster, profile, batch, strategy=strategy, simulate_top_k=0)
    except PlannerError as e:
        return None, str(e).split(":")[0]
    return p.prediction.samples_per_s, ""


def main() -> int:
    rows = []
    header = (f"{'cluster':<12} {'model':<12} {'batch':>6} {'plan':>9} {'sim':>9} {'DP':>9} {'PP':>9} "
              f"{'vs DP':>6} {'vs PP':>6}  plan")
    print(header)
    for cluster_name, model, batch in CASES:
        cluster = load_cluster(ROOT / "examples" / "clusters" / f"{cluster_name}.toml")
        profile = build_profile(model)
        start = time.perf_counter()
        best = hetrain.plan(cluster, profile, batch)  # as `hetrain plan` does: the simulator re-ranks the best
        elapsed = time.perf_counter() - start
        sim = best.prediction.simulated_iteration_s
        sim_sps = batch / sim if sim else float("nan")
        dp, _ = samples_per_s(cluster, profile, batch, "dp")
        pp, _ = samples_per_s(cluster, profile, batch, "pp")
        ours = best.prediction.samples_per_s
        vs_dp = f"{ours / dp:.2f}x" if dp else "-"
        vs_pp = f"{ours / pp:.2f}x" if pp else "-"
        desc = f"{best.strategy} {best.formation}, {len(best.virtual_workers)} VWs ({elapsed:.1f} s to plan)"
        fmt = lambda x: f"{x:9.1f}" if x else f"{'infeas.':>9}"  # noqa: E731
        print(f"{cluster_name:<12} {model:<12} {batch:>6} {ours:9.1f} {sim_sps:9.1f} {fmt(dp)} {fmt(pp)} "
              f"{vs_dp:>6} {vs_pp:>6}  {desc}", flush=True)
        rows.append(f"| {cluster_name} | {model} | {batch} | {ours:.1f} | {sim_sps:.1f} | "
                    f"{f'{dp:.1f}' if dp else 'infeasible'} | {f'{pp:.1f}' if pp else 'infeasible'} | "
                    f"{vs_dp} | {vs_pp} | {desc} |")
    table = ("| cluster | model | global batch | plan samples/s | plan, simulated | pure DP | pure PP | plan vs DP "
             "| plan vs PP | chosen plan |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n" + "\n".join(rows))
    notes = ("Predicted by the cost model (closed forms), all three families scored by the same functions; "
             "'simulated' is the discrete-event simulator's figure for the chosen plan. Pure DP over devices "
             "that cannot hold the model is infeasible; a pure pipeline needs at most one device per layer.")
    write_section("Plan vs data parallelism (predicted)", "python benchmarks/plan_vs_dp.py", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

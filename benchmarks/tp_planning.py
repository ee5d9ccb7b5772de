"""Where does tensor parallelism pay? The planner with TP against the planner without it (issue 34).

For each cluster, model and global batch: the best plan without TP (``--max-tp 1``) and the best with TP up to 8
(``--max-tp 8``), each the planner's choice among its best 3 candidates per degree by the simulator (no time
budget), as ``hetrain plan`` chooses; the ratio of their simulated iteration times, the degree chosen, and the
planning's wall time. Clusters:

    nvlink-25g   examples/clusters/nvlink-nodes.toml: 2 nodes of 8 A100-40GB (NVLink 3), 2 of 8 V100-32GB
                 (NVLink 2), 25 Gbit/s between nodes
    nvlink-10g   the same on 10 Gbit/s
    pcie-10g     2 nodes of 8 RTX 3090 on PCIe 3, 10 Gbit/s between them

Models: analytic profiles (no measurement): gpt2-xl (1.5B), gpt-2.7b, llama2-7b, llama2-13b where the registry
has them, else GPT shapes of the same size (Brown et al. 2020, table 2.1). Targets: on the NVLink clusters a
1.5B-13B model gets a plan with TP predicted >= 1.3x the best without it; on PCIe nodes a model that fits
without TP plans without it.

    python benchmarks/tp_planning.py [--quick] [--no-write]
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
from hetrain.models.analytic import UnknownModelError, build_gpt_profile, build_profile
from hetrain.planner.search import PlannerError, PlannerOptions, plan
from hetrain.planning import simulated_iteration_s
from hetrain.profile import ModelProfile
from hetrain.simulator import simulate

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.3


def clusters() -> dict[str, hetrain.Cluster]:
    nv = hetrain.load_cluster(ROOT / "examples/clusters/nvlink-nodes.toml")
    data = nv.to_dict()
    slow = {**data, "name": "nvlink-10g",
            "node": [{**n, "nic": {"bandwidth_bytes_per_s": 10e9 / 8, "latency_s": n["nic"]["latency_s"]}}
                     for n in data["node"]]}
    pcie = {"name": "pcie-10g", "node": [
        {"name": f"r{k}", "devices": [{"type": "RTX3090", "count": 8}], "intra_link": "pcie3", "nic": "10Gbit/s"}
        for k in range(2)]}
    return {"nvlink-25g": nv, "nvlink-10g": hetrain.parse_cluster(slow), "pcie-10g": hetrain.parse_cluster(pcie)}


def model(name: str) -> ModelProfile:
    """A reference model by name, or the GPT shape of its size where the registry has none."""
    shapes = {"gpt-2.7b": (32, 2560, 32), "llama2-7b": (32, 4096, 32), "llama2-13b": (40, 5120, 40)}
    try:
        return build_profile(name)
    except (UnknownModelError, KeyError):
        layers, hidden, heads = shapes[name]
        return build_gpt_profile(layers, hidden, heads, 2048, 50257, name=f"{name} (GPT shape)")


def case(cluster: hetrain.Cluster, profile: ModelProfile, batch: int) -> dict[str, object]:
    opts = PlannerOptions(time_budget_s=None, simulate_top_k=3)
    row: dict[str, object] = {"cluster": cluster.name, "model": profile.name, "batch": batch}
    for key, max_tp in (("without", 1), ("with", 8)):
        start = time.perf_counter()
        try:
            p = plan(cluster, profile, batch, replace(opts, max_tp=max_tp), score=simulated_iteration_s)
        except PlannerError as e:
            row[key] = None
            row[f"{key}_error"] = str(e).split(";")[0][:60]
            continue
        row[f"{key}_plan_s"] = time.perf_counter() - start
        row[key] = simulate(p).iteration_s
        row[f"{key}_shape"] = f"{len(p.virtual_workers)} VW x {len(p.virtual_workers[0].stages)} st, TP {p.max_tp}"
    return row


def fmt(row: dict[str, object]) -> str:
    a, b = row.get("without"), row.get("with")
    ratio = f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"
    without = f"{a:.2f} s" if isinstance(a, float) else row.get("without_error", "-")
    with_tp = f"{b:.2f} s" if isinstance(b, float) else row.get("with_error", "-")
    return (f"| {row['cluster']} | {row['model']} | {row['batch']} | {without} | "
            f"{row.get('without_shape', '-')} | {with_tp} | "
            f"{row.get('with_shape', '-')} | {ratio} | {row.get('with_plan_s', 0):.1f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the NVLink 25 Gbit/s cluster and 13B only")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    names = ["llama2-13b"] if args.quick else ["gpt2-xl", "gpt-2.7b", "llama2-7b", "llama2-13b"]
    cs = clusters()
    header = ("| cluster | model | global batch | without TP (simulated) | its shape | with TP <= 8 (simulated) "
              "| its shape | with / without | planning with TP |\n|---|---|---:|---:|---|---:|---|---:|---:|")
    print(header, flush=True)
    lines = []
    for cname, cluster in cs.items():
        if args.quick and cname != "nvlink-25g":
            continue
        for name in names:
            for batch in (64, 512):
                lines.append(fmt(case(cluster, model(name), batch)))
                print(lines[-1], flush=True)
    table = header + "\n" + "\n".join(lines)
    load = f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    print(load)
    if not args.no_write:
        write_section("Tensor parallelism: where it pays (issue 34)", "python benchmarks/tp_planning.py", table,
                      "Each plan is the planner's best by the simulator among its 3 best candidates per TP degree "
                      "(no time budget); the ratio is of simulated iteration times. Predicted, not measured: no GPU "
                      "cluster here. "
                      f"Target: >= {TARGET}x on an NVLink cluster for some 1.5B-13B model; none on PCIe nodes for a "
                      "model that fits without TP. " + load)
    return 0


if __name__ == "__main__":
    sys.exit(main())

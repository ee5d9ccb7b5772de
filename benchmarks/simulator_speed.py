"""How long does one simulation take of each plan the planner re-ranks on 1024 and 4096 devices?

The cluster of issue 21: nodes of 8 GPUs, four GPU generations in turn (A100 with NVLink 3
and a 200 Gbit/s NIC, V100 with NVLink 2 and 100 Gbit/s, T4 on PCIe 3 and 10 Gbit/s,
RTX 3090 on PCIe 4 and 25 Gbit/s); gpt2-medium (26 layers), a global batch of 4 samples per
device (16384 on 4096 devices). The planner (``simulate_top_k=3``) hands each of the plans
it re-ranks to the scoring function; this script times ``simulate`` on each of them.

``--scale-models MODEL ...`` times instead the plans of ``simulator_scale.py``: the closed form's best
two (``planner.search.candidate_plans``) on the clusters of ``_scale_cases.py``, for each model named
(``gpt2-medium``, ``gpt-200``: 26 and 200 layers).

``--before-src DIR`` times the same plans with another checkout's sources too (``DIR`` is
its ``src``), in a fresh process per run, alternating with this checkout's, so that both
see the same load on a shared machine; each figure is the fastest of ``--repeat`` runs.
Either way the iteration times of the two must be equal (the script fails otherwise).

    python benchmarks/simulator_speed.py [--devices 1024 4096] [--repeat 3] [--before-src DIR] [--no-write]
    python benchmarks/simulator_speed.py --devices 4096 --scale-models gpt2-medium gpt-200 --before-src DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section
from _scale_cases import build_cluster as build_scale_cluster
from _scale_cases import build_model
from hetrain.cluster import Cluster, parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan
from hetrain.planner import plan
from hetrain.planner.search import candidate_plans

TYPES = [("A100-40GB", "nvlink3", "200Gbit/s"), ("V100-32GB", "nvlink2", "100Gbit/s"),
         ("T4", "pcie3", "10Gbit/s"), ("RTX3090", "pcie4", "25Gbit/s")]
SRC = Path(__file__).resolve().parent.parent / "src"

# run in a fresh process: load a plan, simulate it, print seconds and the simulated iteration as JSON
TIME_ONE = """
import gc, json, sys, time
from hetrain.plan import load_plan
from hetrain.simulator import simulate
p = load_plan(sys.argv[1])
gc.collect()
t0, c0 = time.perf_counter(), time.process_time()
r = simulate(p)
print(json.dumps({"simulate_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                  "iteration_s": r.iteration_s}))
"""


def build_cluster(num_devices: int) -> Cluster:
    nodes = []
    for k in range(num_devices // 8):
        t, intra, nic = TYPES[k % len(TYPES)]
        nodes.append({"name": f"n{k}", "devices": [{"type": t, "count": 8}], "intra_link": intra, "nic": nic})
    return parse_cluster({"name": f"four-generations-{num_devices}", "node": nodes})


def reranked_plans(num_devices: int) -> list[Plan]:
    """The plans the planner simulates for gpt2-medium on ``num_devices`` (its scorer records them)."""
    seen: list[Plan] = []

    def record(p: Plan) -> float:
        seen.append(p)
        return p.prediction.iteration_s

    plan(build_cluster(num_devices), build_profile("gpt2-medium"), 4 * num_devices, simulate_top_k=3, score=record)
    return seen


def scale_case_plans(num_devices: int, model: str) -> list[Plan]:
    """The closed form's best two plans for ``model`` on ``_scale_cases.build_cluster(num_devices)``."""
    return candidate_plans(build_scale_cluster(num_devices), build_model(model), 4 * num_devices, 2)


def time_one(src: Path, plan_path: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", TIME_ONE, str(plan_path)], env=env, check=True,
                         capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out.splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1024, 4096], help="cluster sizes (x8 GPUs)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per plan and checkout; the fastest counts")
    parser.add_argument("--before-src", type=Path, help="another checkout's src, timed alternately with this one")
    parser.add_argument("--scale-models", nargs="+", metavar="MODEL",
                        help="time the closed form's best two plans of _scale_cases.py for these models instead")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    trees = {"after": SRC} if args.before_src is None else {"before": args.before_src.resolve(), "after": SRC}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(n, model, scale_case_plans(n, model)) for n in args.devices for model in args.scale_models] \
            if args.scale_models else [(n, "", reranked_plans(n)) for n in args.devices]
        for n, model, plans in cases:
            for k, p in enumerate(plans):
                path = Path(tmp) / f"plan-{n}-{model}-{k}.json"
                p.save(path)
                best: dict[str, float] = {}  # wall seconds, and CPU seconds under "name cpu"
                iteration: dict[str, float] = {}
                for _ in range(args.repeat):
                    for name, src in trees.items():
                        r = time_one(src, path)
                        best[name] = min(best.get(name, float("inf")), r["simulate_s"])
                        best[f"{name} cpu"] = min(best.get(f"{name} cpu", float("inf")), r["cpu_s"])
                        iteration[name] = r["iteration_s"]
                if len(set(iteration.values())) != 1:
                    print(f"MISMATCH on {n} devices, plan {k}: {iteration}", file=sys.stderr)
                    return 1
                vw = p.virtual_workers[0]
                shape = f"{len(p.virtual_workers)} x {len(vw.stages)} ({p.formation})"
                row = {"devices": n, "plan": f"{model}: {shape}" if model else shape,
                       "m": vw.micro_batches, "iteration_s": iteration["after"], **best}
                rows.append(row)
                times = "  ".join(f"{name} {best[name]:6.2f} s (CPU {best[name + ' cpu']:6.2f} s)" for name in trees)
                print(f"{n:>5} {row['plan']:<28} m={row['m']:<4} iteration {row['iteration_s'] * 1e3:8.1f} ms  "
                      f"{times}", flush=True)
    head = "| devices | VWs x stages (formation) | micro-batches | simulated iteration | " + " | ".join(
        f"simulate, {name}: wall (CPU)" for name in trees) + (
        " | after / before, wall (CPU) |" if "before" in trees else " |")
    lines = [head, "|" + "---:|" * (4 + len(trees) + ("before" in trees))]
    for r in rows:
        cells = [str(r["devices"]), str(r["plan"]), str(r["m"]), f"{float(r['iteration_s']) * 1e3:.1f} ms",
                 *(f"{float(r[name]):.2f} s ({float(r[name + ' cpu']):.2f} s)" for name in trees)]
        if "before" in trees:
            cells.append(f"{float(r['after']) / float(r['before']):.2f} "
                         f"({float(r['after cpu']) / float(r['before cpu']):.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    load = f" Load average when it ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared host)."
    if not args.no_write:
        command = "python benchmarks/simulator_speed.py" + (
            f" --devices {' '.join(map(str, args.devices))}" if args.devices != [1024, 4096] else "") + (
            f" --scale-models {' '.join(args.scale_models)}" if args.scale_models else "") + (
            " --before-src <checkout of the commit before>/src" if args.before_src else "") + (
            f" --repeat {args.repeat}" if args.repeat != 3 else "")
        which = ("The closed form's best two plans (`planner.search.candidate_plans`, the plans of "
                 "benchmarks/simulator_scale.py) for each model, 4 samples per device, on the clusters of "
                 "benchmarks/_scale_cases.py (H100 / A100-80GB / V100-32GB / T4 nodes of 8, NICs 200 to 10 Gbit/s)"
                 if args.scale_models else
                 "Each plan the planner re-ranks (`simulate_top_k=3`, and the best plan's reverse order) for "
                 "gpt2-medium, 4 samples per device, on nodes of 8 GPUs of four generations (NICs 10 to 200 Gbit/s)")
        write_section("Simulator speed (issue 21)", command, "\n".join(lines),
                      f"{which}; `simulate(plan)` wall and CPU time, schedule building and compiling included, "
                      f"fastest of {args.repeat} runs in fresh processes, the two checkouts alternating; the simulated "
                      f"iterations of the two are equal.{load}")
    print("\n".join(lines))
    print(f"{time.strftime('%H:%M:%S')} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

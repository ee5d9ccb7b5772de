"""How long does the simulator take on large plans, and how far is the closed form from it?

Default (issue 21): the closed form's best two plans (the chosen and the runner-up,
``planner.search.candidate_plans``) on 64, 256, 1024 and 4096 devices (four GPU generations,
NICs of 10 to 200 Gbit/s, benchmarks/_scale_cases.py), for models of 26 and 200 layers,
global batch 4 x devices; each simulated once and timed; the closed form's iteration against
the simulated one. Targets: a 4096-device plan simulated in <= 10 s; the closed form within 10%.
Writes the "Simulator scale, planner's plans (issue 21)" section of benchmarks/RESULTS.md.

``--hand-built``: the earlier question, plans built by hand (no planner): 128 nodes of 8
A100-80GB (NVLink 3 inside, InfiniBand HDR between), a synthetic 32-layer transformer-like
profile, and 128 VWs of 8 stages each, 64 micro-batches per VW, in two formations:

- ``node``:   each VW is one node's 8 GPUs (p2p over NVLink); each segment is
              all-reduced across 128 nodes, one GPU per node (flat ring over the NICs).
- ``spread``: VW v puts stage j on node 8*(v // 8) + j, GPU v % 8, so every stage
              boundary crosses a NIC shared by 8 VWs; each segment is all-reduced
              among 8 GPUs in each of 16 nodes (hierarchical).

It times ``build_schedule``, ``validate`` and ``simulate`` separately, prints a table, and
replaces the "Simulator scale" section of benchmarks/RESULTS.md.

Run:
    python benchmarks/simulator_scale.py [--quick] [--sizes 64 256] [--no-write]   # the planner's plans
    python benchmarks/simulator_scale.py --hand-built [--vws 16]    # the hand-built 1024-device plans
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from _results import write_section as write_results_section
from _scale_cases import MODELS, SIZES, build_model
from _scale_cases import build_cluster as build_hetero_cluster
from hetrain.cluster import Cluster, parse_cluster
from hetrain.plan import Plan, Prediction, Stage, VirtualWorker
from hetrain.planner.budget import simulation_size
from hetrain.planner.search import candidate_plans
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.schedule import build_schedule, validate
from hetrain.simulator import simulate
from hetrain.units import format_time

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Simulator scale"
GPUS_PER_NODE = 8


def build_cluster(nodes: int) -> Cluster:
    return parse_cluster({"name": f"a100x{nodes * GPUS_PER_NODE}", "node": [
        {"name": f"n{k:03d}", "devices": [{"type": "A100-80GB", "count": GPUS_PER_NODE}],
         "intra_link": "nvlink3", "nic": "ib-hdr"} for k in range(nodes)]})


def build_profile(num_layers: int) -> ModelProfile:
    """A GPT-like block repeated: 50 MB of fp16 weights, sequence 1024 x hidden 2048 activations."""
    hidden_bytes = 1024 * 2048 * 2  # (T, C) in fp16 per sample
    measured = (("A100-80GB", (Measurement(1, 2.0e-3, 4.0e-3),)),)
    layers = tuple(LayerProfile(f"block{i}", param_bytes=50e6, output_bytes_per_sample=hidden_bytes,
                                saved_bytes_per_sample=16 * hidden_bytes, forward_flops_per_sample=2e11,
                                measured=measured) for i in range(num_layers))
    return ModelProfile("synthetic-32", layers, input_bytes_per_sample=1024 * 4, precision="fp16")


def build_plan(formation: str, vws: int, stages: int, micro_batches: int, layers_per_stage: int) -> Plan:
    nodes = max(stages, vws * stages // GPUS_PER_NODE)
    cluster = build_cluster(nodes)
    profile = build_profile(stages * layers_per_stage)
    workers = []
    for v in range(vws):
        if formation == "node":
            devices = [f"n{(v * stages + j) // GPUS_PER_NODE:03d}:{(v * stages + j) % GPUS_PER_NODE}"
                       for j in range(stages)]
        else:
            devices = [f"n{GPUS_PER_NODE * (v // GPUS_PER_NODE) + j:03d}:{v % GPUS_PER_NODE}" for j in range(stages)]
        workers.append(VirtualWorker(tuple(Stage(d, j * layers_per_stage, (j + 1) * layers_per_stage)
                                           for j, d in enumerate(devices)), micro_batches, micro_batches))
    return Plan(profile.name, vws * micro_batches, "1f1b", "bsp", "adam", tuple(workers),
                Prediction(0, 0, 0, 0, 0), "hybrid", formation, cluster, profile)


def run(formation: str, vws: int, stages: int, micro_batches: int) -> dict[str, float | int | str]:
    plan = build_plan(formation, vws, stages, micro_batches, layers_per_stage=4)
    t0 = time.perf_counter()
    schedule = build_schedule(plan)
    t1 = time.perf_counter()
    validate(schedule, plan)
    t2 = time.perf_counter()
    result = simulate(plan)  # builds the schedule again, as `hetrain simulate` does
    t3 = time.perf_counter()
    tl = result.timeline
    return {
        "formation": formation, "devices": len(plan.devices_used), "vws": vws, "stages": stages,
        "m": micro_batches, "actions": sum(len(a) for a in schedule.values()),
        "events": sum(len(e) for e in tl.devices.values()) + sum(len(e) for e in tl.links.values()),
        "build_s": t1 - t0, "validate_s": t2 - t1, "simulate_s": t3 - t2, "iteration_s": result.iteration_s,
        "samples_per_s": result.samples_per_s,
    }


def table(rows: list[dict[str, float | int | str]]) -> str:
    lines = ["| formation | devices | VWs x stages | m | actions | timeline events | build_schedule | validate "
             "| simulate (build included) | simulated iteration | samples/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['formation']} | {r['devices']} | {r['vws']} x {r['stages']} | {r['m']} | "
                     f"{r['actions']:,} | {r['events']:,} | {float(r['build_s']):.2f} s | "
                     f"{float(r['validate_s']):.2f} s | {float(r['simulate_s']):.2f} s | "
                     f"{format_time(float(r['iteration_s']))} | "
                     f"{float(r['samples_per_s']):,.0f} |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_section(text: str) -> None:
    """Replace the SECTION of RESULTS.md (up to the next ``## ``), or append it."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + ("" if end < 0 else "\n" + old[end + 1:])
    RESULTS.write_text(new.rstrip("\n") + "\n")


@dataclass(frozen=True)
class PlannedRow:
    """One of the closed form's best two plans of a case, simulated once."""

    devices: int
    layers: int
    rank: int  # 1: the closed form's choice, 2: its runner-up
    shape: str
    size: int  # planner.budget.simulation_size: a forward and a backward per stage and micro-batch, a sync per device
    simulate_s: float
    closed_s: float
    simulated_s: float


def simulate_planned(num_devices: int, model: str) -> list[PlannedRow]:
    """The closed form's best two plans of one case, each simulated and timed."""
    cluster, profile = build_hetero_cluster(num_devices), build_model(model)
    rows = []
    for rank, plan in enumerate(candidate_plans(cluster, profile, 4 * num_devices, 2), start=1):
        start = time.perf_counter()
        result = simulate(plan)
        took_s = time.perf_counter() - start
        vw = plan.virtual_workers
        shape = f"{plan.formation}: {len(vw)} VWs x {len(vw[0].stages)} stages, m = {vw[0].micro_batches}"
        rows.append(PlannedRow(num_devices, profile.num_layers, rank, shape, simulation_size(plan), took_s,
                               plan.prediction.iteration_s, result.iteration_s))
    return rows


def planned_table(rows: list[PlannedRow]) -> str:
    lines = ["| devices | layers | plan | shape | size (actions) | simulate | closed form | simulated "
             "| closed / simulated - 1 |", "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.devices} | {r.layers} | {'chosen' if r.rank == 1 else 'runner-up'} | {r.shape} | "
                     f"{r.size:,} | {r.simulate_s:.2f} s | {format_time(r.closed_s)} | {format_time(r.simulated_s)} | "
                     f"{r.closed_s / r.simulated_s - 1:+.1%} |")
    return "\n".join(lines)


def planner_plans(sizes: list[int], models: list[str], write: bool) -> None:
    """The planner's plans from 64 to 4096 devices: simulation time and the closed form's error (issue 21)."""
    rows: list[PlannedRow] = []
    for n in sizes:
        for model in models:
            for row in simulate_planned(n, model):
                rows.append(row)
                print(planned_table([row]).splitlines()[-1], flush=True)
    text = planned_table(rows)
    print(text)
    worst = max(abs(r.closed_s / r.simulated_s - 1) for r in rows)
    slowest = max(r.simulate_s for r in rows if r.devices == max(sizes))
    load = f" Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared host)." \
        if hasattr(os, "getloadavg") else ""
    print(f"slowest simulation at {max(sizes)} devices: {slowest:.1f} s; worst closed-form error {worst:.0%}")
    if write:
        command = "python benchmarks/simulator_scale.py" \
            + (f" --sizes {' '.join(map(str, sizes))}" if sizes != list(SIZES) else "") \
            + (f" --models {' '.join(models)}" if models != list(MODELS) else "")
        write_results_section(
            "Simulator scale, planner's plans (issue 21)", command, text,
            "The closed form's best two plans (`planner.search.candidate_plans`), global batch 4 x devices, on the "
            "clusters of benchmarks/_scale_cases.py (H100 / A100-80GB / V100-32GB / T4 nodes of 8, NICs 200 / 100 / "
            "25 / 10 Gbit/s); each simulated once (`simulate(plan)`, the schedule built inside), one process. "
            f"Targets: a 4096-device plan simulated in <= 10 s (slowest at {max(sizes)} devices: {slowest:.1f} s); "
            f"the closed form within 10% of the simulation (worst here: {worst:.0%}).{load}")
        print("wrote the 'Simulator scale, planner's plans (issue 21)' section of RESULTS.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hand-built", action="store_true", help="the hand-built 1024-device plans "
                    "(the 'Simulator scale' section)")
    ap.add_argument("--quick", action="store_true", help="planner's plans on 64 and 256 devices only")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="gpt2-medium, gpt2-xl, gpt-200 ...")
    ap.add_argument("--sizes", nargs="+", type=int, default=None, help="device counts, multiples of 8 (64 ... 4096)")
    ap.add_argument("--vws", type=int, default=128)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=64)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    if not args.hand_built:
        planner_plans(args.sizes or [n for n in SIZES if n <= 256 or not args.quick], args.models, not args.no_write)
        return
    rows = [run(f, args.vws, args.stages, args.micro_batches) for f in ("node", "spread")]
    text = table(rows)
    print(text)
    worst = max(float(r["simulate_s"]) for r in rows)
    print(f"slowest simulate: {worst:.2f} s (target < 10 s for 1024 devices, 64 micro-batches)")
    if not args.no_write:
        write_section(
            f"{SECTION}\n\n"
            "Question: how long does `simulate` take on a large plan? Target: one iteration of a "
            "1024-device plan with 64 micro-batches in under 10 s.\n\n"
            "Plans built by hand: 128 nodes x 8 A100-80GB (NVLink 3, InfiniBand HDR), a synthetic 32-layer "
            "profile (50 MB of weights and 4 MB of activations per sample per layer), 128 VWs x 8 stages, 1F1B, "
            "bsp, 64 micro-batches of 1 sample. `node`: each VW inside one node, segments all-reduced across "
            "128 nodes; `spread`: each VW across 8 nodes, every stage boundary through NICs shared by 8 VWs, "
            "segments all-reduced hierarchically.\n\n"
            f"{text}\n\n"
            f"Slowest `simulate(plan)` (schedule built inside): {worst:.2f} s. `validate` is not part of "
            "`simulate(plan)`; it runs only on a schedule passed in. "
            f"Machine: {cpu_name()}, one core, Python "
            f"{platform.python_version()}.\n\n"
            "Command: `python benchmarks/simulator_scale.py --hand-built`\n"
        )
        print(f"wrote the '{SECTION[3:]}' section of {RESULTS.name}")


if __name__ == "__main__":
    main()

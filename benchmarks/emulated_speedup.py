"""Measured speed-up of hetrain's plan over torch's DistributedDataParallel and pipelining, emulated.

Three clusters emulated on this host (hetrain.emulate: namespaces, tc-shaped NICs,
cgroup CPU quotas), 2 nodes x 2 devices each; on each, the demo's path
(hetrain.demo.run_emulated_comparison): profile gpt-tiny per device type on an
emulated device of that type, discover the links, calibrate the overhead per action
(hetrain.calibrate), plan, simulate, then train, one after the other, the same steps
on Shakespeare with the same global batch and optimizer (the plan's):

    network    equal devices (share 0.4 each), NICs 1 Gbit/s and 50 Mbit/s
    compute    devices at shares 0.6 and 0.2, both NICs 1 Gbit/s
    both       shares 0.6 and 0.24, NICs 1 Gbit/s and 100 Mbit/s (the demo's cluster)

Rows per scenario:

    hetrain            hetrain's plan, run by hetrain's runtime
    dp                 the planner's data-parallel plan (batch split by device speed), hetrain's runtime
    even-split         one pipeline over the 4 devices, layers split evenly (the partition torch-pipelining
                       runs), hetrain's runtime: the simulator's error on it, and torch's runtime against
                       hetrain's on the same partition
    torch-ddp          torch.nn.parallel.DistributedDataParallel, one replica per device, batch split
                       evenly (hetrain.baselines ddp)
    torch-pipelining   torch.distributed.pipelining over the 4 devices, layers split evenly, the
                       planner's pipeline micro-batch count and schedule (hetrain.baselines pipelining)

"predicted" is the simulator's iteration for hetrain's plans; for the torch rows it is
hetrain's model of them (the even-batch DP plan, the even-split pipeline plan), which
models hetrain's runtime, not torch's: their "error" is how far torch's runtime is from
what hetrain's would do on that partition. Samples/s leave out the warm-up steps; prediction
error is (simulated - measured) / measured iteration time; speed-up is over torch-ddp.
Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/emulated_speedup.py [--steps 20] [--scenarios both]
    sudo -E .venv/bin/python benchmarks/emulated_speedup.py --quick   # 4 steps, 1 warm-up, no RESULTS.md

With ``--repeats N`` (N >= 2) it asks another question instead: is the whole flow repeatable? Each
scenario runs profile -> discover -> calibrate -> plan -> train N times from scratch, training
hetrain's plan only, and reports per run the chosen plan (its layout and how sure the planner was,
``planner.robust``) and the measured samples/s; per scenario the spread of the measured samples/s
((max - min) / min) and how many distinct plans were chosen. As a control, run 1's plan is trained
once more (after a fresh profile and link discovery, not re-planned): how far two trainings of one
plan are apart on this host.

    sudo -E .venv/bin/python benchmarks/emulated_speedup.py --repeats 3 [--scenarios compute]

With ``--schedule-ab N`` it asks whether the schedules the planner replays besides 1F1B (1F1B-eager and
GPipe, docs/planner.md section 5) pay when trained: per scenario, N times, one profile -> discover ->
calibrate, then two plans from it, the planner's (``--schedule auto``) and the planner's restricted to 1F1B,
each trained twice in the same emulated session (A B B A in odd repeats, B A A B in even ones, so that a
drift over the session cancels); per repeat the two plans, their measured samples/s and the ratio (of the
geometric means); per scenario the median ratio and its range.

    sudo -E .venv/bin/python benchmarks/emulated_speedup.py --schedule-ab 3 [--scenarios network]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _emulated import finish, ready_to_emulate
from hetrain.demo import CALIBRATION_STEPS, CALIBRATION_WARMUP, MICRO_BATCH_SIZES, run_emulated_comparison
from hetrain.plan import Plan
from hetrain.planner.baselines import torch_pipelining_micro_batches
from hetrain.profile import ModelProfile


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


SCRIPT = Path(__file__).name
TRAIN = ("hetrain", "dp", "even-split")
BASELINES = ("ddp", "pipelining")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 4 steps, 1 warm-up, RESULTS.md left alone")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-emulated")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole flow this many times per scenario, hetrain's plan only (>= 2)")
    parser.add_argument("--schedule-ab", type=int, default=0, metavar="N",
                        help="train the planner's plan and the planner's 1F1B-only plan side by side, N times per "
                             "scenario")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.no_write = 4, 1, True
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not ready_to_emulate(parser, args):
        return 0
    if args.schedule_ab < 0:
        parser.error(f"--schedule-ab must be >= 1, got {args.schedule_ab}")
    if args.repeats > 1:
        return run_repeats(args)
    if args.schedule_ab:
        return run_schedule_ab(args)
    rows = ["| scenario | run | runtime | shape | predicted samples/s | measured samples/s | iteration error | "
            "speed-up over torch DDP |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    optimizers = set()
    calibrated = []
    for name in args.scenarios:
        result = run_emulated_comparison(SCENARIOS[name], Path(args.out) / name, "gpt-tiny", args.global_batch,
                                         args.steps, args.warmup, log=lambda s: None, train=TRAIN,
                                         baselines=BASELINES)
        optimizers.add(result.runs["hetrain"].plan.optimizer)
        if result.calibration is not None:
            cal = result.calibration
            calibrated.append(f"{name} {1e3 * cal.overhead_s:.2f} ms (its run "
                              f"{100 * (cal.simulated_before_s / cal.measured_s - 1):+.1f}% without)")
        for r in result.runs.values():
            if r.runtime == "torch" and r.name == "torch-ddp":
                shape = "DDP: 4 replicas, batch split evenly"
            elif r.runtime == "torch":
                vw = r.plan.virtual_workers[0]
                shape = f"pipelining: {len(vw.stages)} even stages, m={torch_pipelining_micro_batches(r.plan)}"
            else:
                shape = f"{r.plan.strategy}: " + " + ".join(str(len(vw.stages)) for vw in r.plan.virtual_workers)
            runtime = "torch" if r.runtime == "torch" else "hetrain"
            rows.append(f"| {name} | {r.name} | {runtime} | {shape} | {r.predicted_samples_per_s:.1f} | "
                        f"{r.measured_samples_per_s:.1f} | {100 * r.prediction_error:+.1f}% | "
                        f"{result.speedup('torch-ddp', r.name):.2f}x |")
        print("\n".join(rows), flush=True)
    table = "\n".join(rows)
    took = time.perf_counter() - start
    notes = (f"gpt-tiny, global batch {args.global_batch}, the plan's optimizer ({', '.join(sorted(optimizers))}) in "
             f"every run, the same data order and initial weights, {args.steps} steps per run, first {args.warmup} "
             f"left out; 2-core host, cgroup CPU quotas on each rank's main thread (isolate_comm), each device "
             f"pinned to a CPU and given an idle filler (fill_idle), its CPU kept awake (keep_awake), tc htb (no "
             f"latency emulation). Overhead per action calibrated before planning (hetrain.calibrate, "
             f"{CALIBRATION_STEPS} steps, {CALIBRATION_WARMUP} of them warm-up, of an even-split pipeline of "
             f"micro-batches of 2): {'; '.join(calibrated) or 'none'}. "
             f"torch rows: "
             f"hetrain.baselines (DistributedDataParallel; torch.distributed.pipelining), their predicted column is "
             f"hetrain's model of the same partition run by hetrain's runtime. Took {took:.0f} s; host load "
             f"average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    return finish(args, [], SCRIPT, "Emulated speed-up (hetrain plan vs torch DDP vs torch pipelining)", table, notes)


def schedule_ab_plans(cluster: dict[str, Any], profile: ModelProfile, global_batch: int) -> dict[str, Plan]:
    """The planner's plan as the demo makes it (``demo.build_plans``: schedule auto), and the same planning
    restricted to 1F1B."""
    from hetrain import plan
    from hetrain.cluster import parse_cluster

    parsed = parse_cluster(cluster)
    sizes = tuple(b for b in MICRO_BATCH_SIZES if b <= global_batch) or (1,)
    auto, only = (plan(parsed, profile, global_batch, simulate_top_k=5, micro_batch_sizes=sizes, schedule=schedule)
                  for schedule in ("auto", "1f1b"))
    return {"hetrain": auto, "hetrain-1f1b": only, "hetrain-1f1b-again": only, "hetrain-again": auto}


def run_schedule_ab(args: argparse.Namespace) -> int:
    """Per scenario, ``args.schedule_ab`` times: the planner's plan and its 1F1B-only plan from one profile,
    trained one after the other in one emulated session, in alternating order."""
    from hetrain.planner.robust import describe_layout

    rows = ["| scenario | repeat | hetrain's plan (schedule auto) | samples/s, two trainings | the 1F1B-only plan | "
            "samples/s, two trainings | auto / 1F1B-only |", "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    summary = ["| scenario | schedules chosen | auto / 1F1B-only, median (lowest-highest) |", "| --- | --- | ---: |"]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    for name in args.scenarios:
        ratios, chosen = [], []
        for k in range(args.schedule_ab):
            order = ("hetrain", "hetrain-1f1b", "hetrain-1f1b-again", "hetrain-again")  # ABBA, then BAAB
            result = run_emulated_comparison(SCENARIOS[name], Path(args.out) / f"{name}-ab{k}", "gpt-tiny",
                                             args.global_batch, args.steps, args.warmup, log=lambda s: None,
                                             train=order if k % 2 == 0 else order[::-1], baselines=(),
                                             plan_builder=schedule_ab_plans)
            auto, only = result.runs["hetrain"], result.runs["hetrain-1f1b"]
            rates = {n: r.measured_samples_per_s for n, r in result.runs.items()}
            # each plan trained twice, the two orders mirrored: a drift over the session cancels in the product
            ratio = math.sqrt(rates["hetrain"] * rates["hetrain-again"]
                              / (rates["hetrain-1f1b"] * rates["hetrain-1f1b-again"]))
            ratios.append(ratio)
            chosen.append(auto.plan.schedule)
            rows.append(f"| {name} | {k + 1} | {auto.plan.schedule}: {describe_layout(auto.plan)} | "
                        f"{rates['hetrain']:.1f}, {rates['hetrain-again']:.1f} | {describe_layout(only.plan)} | "
                        f"{rates['hetrain-1f1b']:.1f}, {rates['hetrain-1f1b-again']:.1f} | {ratio:.3f} |")
            print(rows[-1], flush=True)
        summary.append(f"| {name} | {', '.join(chosen)} | {statistics.median(ratios):.3f} "
                       f"({min(ratios):.3f}-{max(ratios):.3f}) |")
    table = "\n".join(rows) + "\n\n" + "\n".join(summary)
    took = time.perf_counter() - start
    notes = (f"gpt-tiny, global batch {args.global_batch}, {args.steps} steps per run, first {args.warmup} left out; "
             f"per repeat one profile, link discovery and calibration, then both plans planned from them (the "
             f"demo's options: simulate_top_k 5) and each trained twice in the same emulated session, in the order "
             f"auto, 1F1B-only, 1F1B-only, auto in odd repeats and the reverse in even ones; the ratio: the geometric "
             f"mean of the two trainings' samples/s, auto's over 1F1B-only's. Emulation as in the speed-up section. "
             f"Took {took:.0f} s; "
             f"host load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print(table)
    return finish(args, [], SCRIPT, "Emulated: schedule auto against 1F1B only (issue 19)", table, notes)


def run_repeats(args: argparse.Namespace) -> int:
    """The whole flow ``args.repeats`` times per scenario: the spread of what was measured and of the plans."""
    from hetrain.planner.robust import describe_layout

    rows = ["| scenario | run | hetrain's plan | overhead per action (+- step to step) | how sure the planner was | "
            "predicted samples/s | measured samples/s |", "| --- | ---: | --- | --- | --- | ---: | ---: |"]
    summary = ["| scenario | measured samples/s, min - max | spread (max - min) / min | distinct plans | "
               "measured per plan | run 1's plan, trained twice |", "| --- | --- | ---: | ---: | --- | --- |"]
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    for name in args.scenarios:
        measured: list[tuple[str, float]] = []
        measured_plans = []
        for k in range(args.repeats):
            result = run_emulated_comparison(SCENARIOS[name], Path(args.out) / f"{name}-{k}", "gpt-tiny",
                                             args.global_batch, args.steps, args.warmup, log=lambda s: None,
                                             train=("hetrain",), baselines=())
            run = result.runs["hetrain"]
            layout = describe_layout(run.plan)
            figures = run.plan.options.get("confidence", {})
            candidates = figures.get("candidates", [])
            sure = "one candidate"
            if len(candidates) >= 2:
                gap = min(c["objective"] for c in candidates[1:]) / candidates[0]["objective"] - 1
                sure = f"next best {100 * gap:+.1f}%"
                if figures.get("draws"):
                    sure += f", fastest in {candidates[0]['fastest_in_draws']} of {figures['draws']} draws"
            measured.append((layout, run.measured_samples_per_s))
            measured_plans.append(run.plan)
            cal = result.calibration
            overhead = "-" if cal is None else f"{1e3 * cal.overhead_s:.2f} ms (+- {1e3 * cal.spread_s:.2f})"
            rows.append(f"| {name} | {k + 1} | {layout} | {overhead} | {sure} | {run.predicted_samples_per_s:.1f} | "
                        f"{run.measured_samples_per_s:.1f} |")
            print(rows[-1], flush=True)
        # control: run 1's plan trained again after a fresh profile and discovery, no re-planning: how far two
        # trainings of one plan are apart on this host, against which the spread over repeats is to be read
        first = measured_plans[0]
        again = run_emulated_comparison(SCENARIOS[name], Path(args.out) / f"{name}-again", "gpt-tiny",
                                        args.global_batch, args.steps, args.warmup, log=lambda s: None,
                                        train=("hetrain",), baselines=(), calibrate=False,
                                        plan_builder=lambda cluster, profile, batch, p=first: {"hetrain": p})
        same = again.runs["hetrain"].measured_samples_per_s
        rows.append(f"| {name} | run 1's plan again | {describe_layout(first)} | (run 1's) | (not re-planned) | "
                    f"{again.runs['hetrain'].predicted_samples_per_s:.1f} | {same:.1f} |")
        print(rows[-1], flush=True)
        rates = [r for _, r in measured]
        per_plan: dict[str, list[float]] = {}
        for layout, rate in measured:
            per_plan.setdefault(layout, []).append(rate)
        summary.append(f"| {name} | {min(rates):.1f} - {max(rates):.1f} | {100 * (max(rates) / min(rates) - 1):.1f}% | "
                       f"{len(per_plan)} | " + "; ".join(f"plan {i + 1}: " + ", ".join(f"{r:.1f}" for r in rs)
                                                          for i, rs in enumerate(per_plan.values()))
                       + f" | {rates[0]:.1f} and {same:.1f}: "
                       f"{100 * (max(rates[0], same) / min(rates[0], same) - 1):.1f}% |")
        print(summary[-1], flush=True)
    table = "\n".join(rows) + "\n\n" + "\n".join(summary)
    took = time.perf_counter() - start
    notes = (f"gpt-tiny, global batch {args.global_batch}, {args.steps} steps per run, first {args.warmup} left out; "
             f"every run from scratch: each device profiled (3 repeats of blocks of calls, the spread recorded), "
             f"links discovered, overhead per action calibrated with its spread from step to step "
             f"({CALIBRATION_STEPS} steps, {CALIBRATION_WARMUP} of them warm-up), planned with the spreads "
             f"(planner.robust: the best plans simulated on 8 profiles drawn within them, the overhead's included), "
             f"then hetrain's plan trained; then run 1's plan trained "
             f"again. Emulation as in the "
             f"speed-up section (2-core host shared with other work, isolate_comm). Took {took:.0f} s; host load "
             f"average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print(table)
    return finish(args, [], SCRIPT, "Emulated repeatability (profile, plan, train, repeated)", table, notes)


if __name__ == "__main__":
    sys.exit(main())

"""Wall-clock time to a target validation loss for every sync mode, gpt-tiny on Shakespeare, emulated cluster.

One emulated cluster (hetrain.emulate: network namespaces, tc-shaped NICs, cgroup
CPU quotas), the "both" cluster of emulated_speedup.py: node ``fast`` with two
devices at CPU share 0.6 and a 1 Gbit/s NIC, node ``slow`` with two at 0.24 and
100 Mbit/s. Same model (gpt-tiny), optimizer, learning rate, global batch and
data order for every run, planned as the demo plans (hetrain.demo.build_plans: gpt-tiny
profiled on each emulated device type, the links discovered, micro-batches of 4 or more):

    run           plan                                         sync
    bsp-dp        the planner's data-parallel plan (4 VWs)     bsp
    bsp-hybrid    the planner's best plan                      bsp
    wsp           the data-parallel plan                       wsp (D = staleness)
    hybrid-ps     the data-parallel plan                       hybrid-ps
    daso          the data-parallel plan                       daso
    local-sgd     the data-parallel plan                       local-sgd
    wsp-hybrid    the planner's best plan                      wsp (HetPipe: VWs are pipelines)

Every run trains ``--steps`` steps and measures the validation loss before the
first step and every ``--eval-every`` steps (``hetrain train --eval-every``): VW
0's weights, forward only, on ``--eval-batches`` fixed batches of the held-out
last 10% of the text, never trained on (``hetrain.data.text``). Time is the
reporting rank's training time at that step, evaluation time left out (job
start-up too). The target is a validation loss bsp-dp reaches while still
falling, not at a plateau: by default the loss of bsp-dp's curve at
``--target-at`` (60%) of its training time, or ``--target`` given up front. Time
to target is interpolated linearly between the two evaluations around the first
crossing; a run that never reaches it shows "-". Needs root (the emulator), else
it stops saying so. Full run: about 12 minutes on a quiet 2-core host.

The optimizer is SGD with momentum 0.9 (lr 0.025) by default, not AdamW: with
AdamW at lr 3e-3, BSP sits for about 100 steps on the unigram plateau (validation
loss ~3.38), and the modes in which each VW steps its own Adam on its own
mini-batch for a while before averaging (wsp with D >= 1, local-sgd with k >= 2)
leave it within about 20: time to target would then measure how Adam's
per-VW normalisation shakes the weights off that plateau, not the cost of
synchronisation (docs/sync.md, "Validation loss"). ``--optimizer adam --lr 3e-3``
runs that comparison.

    sudo -E .venv/bin/python benchmarks/convergence.py            # the RESULTS.md section
    sudo -E .venv/bin/python benchmarks/convergence.py --quick    # smoke: a few steps, writes nothing
    sudo -E .venv/bin/python benchmarks/convergence.py --runs wsp # bsp-dp and wsp only: their own section
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import tomllib

from _results import write_section

CLUSTER = """
name = "both-hetero"

[[node]]
name = "fast"
intra_link = "loopback"
nic = "1Gbit/s"
[[node.devices]]
type = "cpu-a"
tflops = 0.0120
memory = "4GB"
memory_bandwidth = "6.0GB/s"
cpu_share = 0.6
count = 2

[[node]]
name = "slow"
intra_link = "loopback"
nic = "100Mbit/s"
[[node.devices]]
type = "cpu-b"
tflops = 0.0048
memory = "4GB"
memory_bandwidth = "2.4GB/s"
cpu_share = 0.24
count = 2
"""


RUN_NAMES = ("bsp-dp", "bsp-hybrid", "wsp", "hybrid-ps", "daso", "local-sgd", "wsp-hybrid")
Curve = list[tuple[float, float]]  # (training time s, validation loss), in step order


def val_curve(rows: list[dict[str, Any]]) -> Curve:
    """The (elapsed_s, val_loss) points of a run's metrics."""
    return [(float(r["elapsed_s"]), float(r["val_loss"])) for r in rows if "val_loss" in r]


def loss_at(curve: Curve, t: float) -> float:
    """The curve's loss at time ``t``, linear between evaluations."""
    for (t0, v0), (t1, v1) in itertools.pairwise(curve):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return curve[-1][1]


def time_to(curve: Curve, target: float) -> float | None:
    """When the curve first reaches ``target``, linear between the two evaluations around the crossing."""
    for k, (t, v) in enumerate(curve):
        if v <= target:
            if k == 0:
                return t
            t0, v0 = curve[k - 1]
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
    return None


def _servers(runs: dict[str, Any]) -> str:
    """How each run's parameter servers are placed: its segments' shards, host and fraction."""
    out = []
    for name, p in runs.items():
        shards = {tuple((x.host, round(x.fraction, 3)) for x in seg.ps_shards) for seg in p.segments() if seg.ps_shards}
        if shards:
            out.append(f"{name} {p.sync_options.placement} {'; '.join(str(list(x)) for x in sorted(shards))}")
    return ", ".join(out) or "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=4, help="validation batches (of the global batch) per eval")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--optimizer", choices=["momentum", "sgd", "adam"], default="momentum")
    ap.add_argument("--lr", type=float, default=0.025)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--target", type=float, default=None, help="target validation loss (default: see --target-at)")
    ap.add_argument("--target-at", type=float, default=0.6,
                    help="without --target: bsp-dp's validation loss at this fraction of its training time")
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 steps, eval every 4, 2 batches; no RESULTS.md")
    ap.add_argument("--out-dir", default="out/convergence")
    ap.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    ap.add_argument("--runs", nargs="+", choices=RUN_NAMES, default=None,
                    help="only these runs (and bsp-dp, the baseline); their table is its own RESULTS.md section")
    ap.add_argument("--reuse", action="store_true",
                    help="tabulate the metrics already in --out-dir instead of training again")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.eval_batches, args.no_write = 12, 4, 2, True
    if not 0 < args.target_at < 1:
        ap.error(f"--target-at must be between 0 and 1, got {args.target_at}")

    from hetrain.cluster import parse_cluster
    from hetrain.demo import run_emulated_comparison
    from hetrain.emulate import EmulatedCluster, EmulationError, parse_emulation_settings
    from hetrain.emulate.emulator import check_permissions
    from hetrain.plan import load_plan
    from hetrain.planner.sync import repredict_sync
    from hetrain.sync_layout import SyncOptions

    if not args.reuse:
        try:
            check_permissions()
        except EmulationError as e:
            print(f"convergence: cannot emulate here: {e}", file=sys.stderr)
            return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nominal = tomllib.loads(CLUSTER)
    cluster = parse_cluster(nominal)
    gb = args.global_batch
    if args.reuse:
        dp = load_plan(out / "plan-bsp-dp.json")
        hybrid = out / "plan-bsp-hybrid.json"
        best = load_plan(hybrid) if hybrid.exists() else dp  # absent where --runs left the hybrid runs out
    else:
        # the demo's planning path: gpt-tiny profiled on each emulated device type, the links
        # discovered, micro-batches of 4 or more (hetrain.demo.build_plans)
        planned = run_emulated_comparison(CLUSTER, out / "planning", model="gpt-tiny", global_batch=gb,
                                          train=(), baselines=(), log=lambda _: None)
        dp, best = planned.plans["dp"], planned.plans["hetrain"]
        print(f"planned on the profiled, discovered cluster: dp predicted {dp.prediction.samples_per_s:.1f} "
              f"samples/s, best ({best.strategy}, {len(best.virtual_workers)} VWs) "
              f"{best.prediction.samples_per_s:.1f}", flush=True)
    opts = SyncOptions(staleness=args.staleness, period=args.period, aggregate=args.period, warmup=5, cooldown=5)
    runs = {"bsp-dp": dp, "bsp-hybrid": best}
    for mode in ("wsp", "hybrid-ps", "daso", "local-sgd"):
        runs[mode] = repredict_sync(dp, mode, opts)  # the same VWs, the mode's layout and prediction
    # HetPipe's own pairing: WSP across VWs that are pipelines (the planner's best plan), where only
    # one VW's pushes and pulls of each segment cross a slow NIC instead of every replica's
    runs["wsp-hybrid"] = repredict_sync(best, "wsp", opts)
    if args.runs:
        runs = {name: p for name, p in runs.items() if name == "bsp-dp" or name in args.runs}
    rows: dict[str, list[dict[str, Any]]] = {}
    settings = parse_emulation_settings(nominal.get("emulation"))
    if args.reuse:
        for name in runs:
            rows[name] = [json.loads(line) for line in (out / f"metrics-{name}.jsonl").read_text().splitlines()]
    else:
        with open(out / "jobs.log", "w") as log, EmulatedCluster(cluster, settings) as em:
            for name, p in runs.items():
                path = out / f"plan-{name}.json"
                dataclasses.replace(p, optimizer=args.optimizer).save(path)  # train runs the plan's optimizer
                metrics = out / f"metrics-{name}.jsonl"
                metrics.unlink(missing_ok=True)
                cmd = ["python", "-m", "hetrain.runtime.command", "--plan", str(path), "--model", "gpt-tiny",
                       "--data", "shakespeare", "--steps", str(args.steps),
                       "--lr", str(args.lr), "--metrics-out", str(metrics), "--no-progress", "--log-every", "10",
                       "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
                       "--timeout-s", "120"]
                start = time.perf_counter()
                status = em.launch(cmd, timeout_s=1800, stdout=log, stderr=log)
                wall = time.perf_counter() - start
                print(f"{name}: exit {status} in {wall:.1f} s", flush=True)
                if status != 0:
                    print(f"{name} failed; see {out / 'jobs.log'}", file=sys.stderr)
                    return 1
                rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]

    curves = {name: val_curve(r) for name, r in rows.items()}
    for name, c in curves.items():
        if len(c) < 2:
            print(f"{name}: {len(c)} validation record(s) in its metrics; need 2 or more", file=sys.stderr)
            return 1
    base_curve = curves["bsp-dp"]
    if args.target is not None:
        target, how = args.target, f"{args.target:.3f} (given)"
    else:
        t_mark = args.target_at * base_curve[-1][0]
        target = loss_at(base_curve, t_mark)
        how = (f"{target:.3f}: bsp-dp's validation loss at {args.target_at:.0%} of its training time "
               f"({t_mark:.1f} s); it falls on to {base_curve[-1][1]:.3f} by the end of its run")
    base = time_to(base_curve, target)
    lines = ["| run | plan | sync | steps | train time | val loss: start | final | best | time to target "
             "| vs bsp-dp |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    sooner: dict[str, float] = {}
    for name, p in runs.items():
        c = curves[name]
        steps = max(int(r["step"]) for r in rows[name])
        t = time_to(c, target)
        vs = "-"
        if t is not None and base:
            sooner[name] = 1 - t / base
            vs = f"{sooner[name] * 100:+.0f}% sooner ({base / t:.2f}x)"
        lines.append(f"| {name} | {p.strategy} ({len(p.virtual_workers)} VWs) | {p.sync} | {steps} | "
                     f"{c[-1][0]:.1f} s | {c[0][1]:.3f} | {c[-1][1]:.3f} | {min(v for _, v in c):.3f} | "
                     f"{f'{t:.1f} s' if t is not None else '-'} | {vs} |")
    table = "\n".join(lines)
    print(f"target validation loss {how}")
    print(table)
    aware = {k: v for k, v in sooner.items() if k != "bsp-dp"}
    verdict = "no heterogeneity-aware run reached the target"
    if aware:
        top = max(aware, key=lambda k: aware[k])
        verdict = (f"best heterogeneity-aware run: {top}, {aware[top] * 100:+.0f}% sooner than bsp-dp "
                   f"(target >= +30%: {'met' if aware[top] >= 0.30 else 'MISSED'})")
    print(verdict)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, pts in curves.items():
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=name)
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
        ax.set_xlabel("training time (s), evaluation excluded")
        ax.set_ylabel("validation loss (held-out text)")
        ax.set_title("gpt-tiny on Shakespeare, emulated 2 x 2 heterogeneous cluster")
        ax.legend()
        fig.tight_layout()
        fig.savefig((out if args.no_write or args.runs else Path(__file__).resolve().parent) / "convergence.png",
                    dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    if not args.no_write:
        notes = (f"Target validation loss {how}. {verdict}. Validation loss: VW 0's weights, forward only, on "
                 f"{args.eval_batches} fixed batches of {gb} windows spread over the held-out last 10% of the text, "
                 f"every {args.eval_every} steps and before the first. Train time: the reporting rank's training "
                 "time at the last step, evaluation and job start-up excluded (every rank finishes the step before "
                 "an evaluation, which costs the asynchronous modes their lead at that point). Time to target: "
                 f"linear between the evaluations around the first crossing. Sync options: {opts}; "
                 f"{args.optimizer}, lr {args.lr:g}.{'' if args.runs else ' Plot: benchmarks/convergence.png.'} "
                 "One run per mode, on a "
                 "shared 2-core host: "
                 "differences of a few percent are noise. The papers report 49% faster convergence for HetPipe's "
                 "WSP (Park et al., ATC 2020) and 34% less training time for DASO (Coquelin et al. 2022). "
                 f"Parameter servers: {_servers(runs)}.")
        chosen = f" --runs {' '.join(args.runs)}" if args.runs else ""
        write_section("Convergence: time to a target loss per sync mode (emulated)"
                      + (f", {', '.join(runs)}" if args.runs else ""),
                      f"sudo -E .venv/bin/python benchmarks/convergence.py --steps {args.steps} --eval-every "
                      f"{args.eval_every} --eval-batches {args.eval_batches} --optimizer {args.optimizer} "
                      f"--lr {args.lr:g}{chosen}", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How close is hetrain's prediction on one real GPU, end to end through the command line?

For each model, on the machine's first CUDA device, the same path a user takes:

    hetrain profile --device cuda      measure the layers at several micro-batch sizes, in each precision
                                       (fp32, and bf16 under autocast with fp32 master weights)
    hetrain discover (torchrun, 1)     the one-device cluster file
    hetrain plan / simulate            predicted samples/s, timeline and peak memory
    torchrun -m hetrain train          measured samples/s (median step), timeline and peak memory

and prints, per model: predicted vs measured samples/s (the median over the
steps after ``--warmup``), the recorded iteration's predicted vs measured
forward, backward and optimizer time, and the predicted vs measured peak
memory (``torch.cuda.max_memory_allocated`` over the recorded iteration). One
GPU gives a one-stage plan: this checks the compute and memory model on a real
device; multi-GPU pipelines need a machine with a GPU per rank.

For each model the bf16 run's speed-up over fp32 is printed too, predicted and measured
side by side (issue: bf16 is a planning decision; the planner must know what it buys).

    python benchmarks/gpu_prediction.py [--models gpt2-small,resnet50] [--precisions fp32,bf16] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section

# model -> (global batch, micro-batch sizes to profile)
CASES = {
    "gpt2-small": (32, "1,2,4,8"),
    "gpt2-medium": (16, "1,2,4,8"),
    "resnet50": (128, "8,16,32,64"),
    "vgg19": (64, "8,16,32,64"),
    "mlp": (512, "64,128,256,512"),
}
ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], what: str) -> str:
    """Run one hetrain command; its output, or exit naming the command and its error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        sys.exit(f"gpu_prediction: {what} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def measure(model: str, precision: str, steps: int, warmup: int, out: Path) -> dict[str, float]:
    """Profile, plan, simulate and train one model in one precision; the predicted and measured figures."""
    batch, sizes = CASES[model]
    py, hetrain = sys.executable, [sys.executable, "-m", "hetrain"]
    torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    name = f"{model}.{precision}"
    prof, cluster, plan = out / f"{name}.profile.json", out / f"{name}.cluster.toml", out / f"{name}.plan.json"
    pred, meas, metrics = out / f"{name}.pred.json", out / f"{name}.meas.json", out / f"{name}.metrics.jsonl"
    t0 = time.monotonic()
    run([*hetrain, "profile", "--model", model, "--device", "cuda", "--micro-batch", sizes, "--precision", precision,
         "-o", str(prof)], f"profiling {model} in {precision}")
    run([*torchrun, "-m", "hetrain", "discover", "-o", str(cluster), "--sizes", "4KB"], "discovery")
    run([*hetrain, "plan", "--cluster", str(cluster), "--profile", str(prof), "--global-batch", str(batch),
         "-o", str(plan)], f"planning {model}")
    run([*hetrain, "simulate", str(plan), "--timeline", str(pred)], f"simulating {model}")
    run([*torchrun, "-m", "hetrain", "train", "--plan", str(plan), "--model", model, "--steps", str(steps),
         "--no-progress", "--timeline-out", str(meas), "--metrics-out", str(metrics)], f"training {model}")
    sys.path.insert(0, str(ROOT / "src"))
    from hetrain.timeline import compare, load_timeline

    predicted = json.loads(plan.read_text())["prediction"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rate = statistics.median(r["samples_per_s"] for r in rows[warmup:])
    c = compare(load_timeline(pred), load_timeline(meas))
    kinds = {r.kind: r for r in c.rows}
    figures = {"predicted_sps": predicted["samples_per_s"], "measured_sps": rate,
               "seconds": time.monotonic() - t0}
    for kind in ("forward", "backward", "optimizer", "iteration"):
        figures[f"{kind}_pred"], figures[f"{kind}_meas"] = kinds[kind].predicted_s, kinds[kind].measured_s
    if c.memory:
        figures["mem_pred"], figures["mem_meas"] = c.memory[0].predicted_bytes, c.memory[0].measured_bytes
    return figures


def pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%" if meas else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,resnet50,vgg19,mlp", help=f"comma-separated, of {list(CASES)}")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32, bf16, fp16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in CASES]
    if unknown:
        sys.exit(f"gpu_prediction: unknown model(s) {unknown}; choose from {list(CASES)}")
    if args.steps <= args.warmup:
        sys.exit(f"gpu_prediction: --steps {args.steps} must exceed --warmup {args.warmup}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_prediction: needs a CUDA GPU; torch.cuda.is_available() is False here")
    gpu = torch.cuda.get_device_name(0)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or set(precisions) - {"fp32", "bf16", "fp16"}:
        sys.exit(f"gpu_prediction: --precisions {args.precisions!r}: give some of fp32, bf16, fp16")
    head = ("| model | precision | global batch | predicted samples/s | measured samples/s | samples/s error | forward "
            "| backward | optimizer | recorded iteration | peak memory predicted / measured | memory error |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    speedups = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            by_precision = {}
            for precision in precisions:
                f = by_precision[precision] = measure(model, precision, args.steps, args.warmup, Path(tmp))
                mem = (f"{f['mem_pred'] / 1e9:.2f} / {f['mem_meas'] / 1e9:.2f} GB",
                       pct(f["mem_pred"], f["mem_meas"])) if "mem_pred" in f else ("n/a", "n/a")
                lines.append(f"| {model} | {precision} | {CASES[model][0]} | {f['predicted_sps']:.1f} "
                             f"| {f['measured_sps']:.1f} "
                             f"| {pct(f['predicted_sps'], f['measured_sps'])} "
                             f"| {pct(f['forward_pred'], f['forward_meas'])} "
                             f"| {pct(f['backward_pred'], f['backward_meas'])} "
                             f"| {pct(f['optimizer_pred'], f['optimizer_meas'])} "
                             f"| {pct(f['iteration_pred'], f['iteration_meas'])} | {mem[0]} | {mem[1]} |")
                print(lines[-1], flush=True)
            if "fp32" in by_precision and len(by_precision) > 1:
                base = by_precision["fp32"]
                for precision, f in by_precision.items():
                    if precision != "fp32":
                        speedups.append(f"| {model} | {precision} / fp32 | "
                                        f"{f['predicted_sps'] / base['predicted_sps']:.2f}x | "
                                        f"{f['measured_sps'] / base['measured_sps']:.2f}x |")
    table = "\n".join(lines)
    if speedups:
        table += ("\n\n| model | speed-up | predicted | measured |\n| --- | --- | ---: | ---: |\n"
                  + "\n".join(speedups))
    print(f"\n{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}\n\n{table}")
    if not args.no_write:
        notes = (f"On {gpu} (torch {torch.__version__}, CUDA {torch.version.cuda}), one rank under "
                 f"torchrun, NCCL. Errors are (predicted - measured) / measured; samples/s is the median "
                 f"over steps {args.warmup + 1}..{args.steps}; forward/backward/optimizer and the recorded "
                 "iteration are the last step's timeline, whose actions the runtime times after a device "
                 "synchronize.")
        write_section("Prediction on one real GPU",
                      f"python benchmarks/gpu_prediction.py --models {','.join(models)} "
                      f"--precisions {','.join(precisions)}",
                      table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

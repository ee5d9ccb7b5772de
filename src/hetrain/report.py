"""The demo's results and report: ``PlanRun`` and ``DemoResult``, and Markdown with PNGs from them.

``hetrain.demo.run_emulated_comparison`` returns a ``DemoResult`` (one ``PlanRun`` per plan trained:
its prediction and what training measured); ``write_report`` writes it out:

    out/demo/report.md            the tables and the pictures below, with how to read them
    out/demo/plan-<name>.png      each plan: a row per device, its stage's layer range, per VW
    out/demo/gantt-<name>.png     predicted (simulator) above measured (runtime) Gantt chart
    out/demo/loss.png             loss per step, one curve per plan
    out/demo/stages-<name>.png    per device and event kind: predicted vs measured seconds

Pictures use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetrain.timeline import Comparison, compare, load_timeline, save_side_by_side

if TYPE_CHECKING:
    from hetrain.calibrate import Calibration
    from hetrain.plan import Plan
    from hetrain.simulator import SimResult


@dataclass
class PlanRun:
    """One plan: its prediction, and what training it on the emulated cluster measured."""

    name: str
    plan: Plan
    sim: SimResult
    plan_path: Path
    metrics_path: Path
    timeline_path: Path
    status: int = -1
    metrics: list[dict[str, Any]] = field(default_factory=list)
    warmup: int = 0
    wall_s: float = 0.0
    runtime: str = "hetrain"  # or "torch": a torch baseline, whose ``plan`` is hetrain's model of it

    @property
    def predicted_iteration_s(self) -> float:
        return float(self.sim.iteration_s)

    @property
    def predicted_samples_per_s(self) -> float:
        return self.plan.global_batch / self.predicted_iteration_s

    @property
    def timed_steps(self) -> list[dict[str, Any]]:
        """The steps after warm-up (all of them when there are too few)."""
        rest = self.metrics[self.warmup:]
        return rest or self.metrics

    @property
    def measured_iteration_s(self) -> float:
        """Mean step time after warm-up; nan when nothing was measured."""
        steps = self.timed_steps
        if not steps:
            return math.nan
        return sum(float(s["step_time_s"]) for s in steps) / len(steps)

    @property
    def measured_samples_per_s(self) -> float:
        return self.plan.global_batch / self.measured_iteration_s

    @property
    def prediction_error(self) -> float:
        """``(predicted - measured) / measured`` iteration time."""
        return (self.predicted_iteration_s - self.measured_iteration_s) / self.measured_iteration_s

    def load_metrics(self) -> None:
        """Read the step rows (those with ``step_time_s``) of ``metrics_path``; none if it is missing."""
        self.metrics = []
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if "step_time_s" in row:
                        self.metrics.append(row)


@dataclass
class DemoResult:
    """What ``hetrain.demo.run_emulated_comparison`` produced: the plans, their runs, where things are."""

    out_dir: Path
    cluster_path: Path
    profile_path: Path
    runs: dict[str, PlanRun]
    discovered: str
    timings_s: dict[str, float]
    plans: dict[str, Plan] = field(default_factory=dict)  # the demo's plan builder's plans, trained or not
    calibration: Calibration | None = None  # the overhead per action found before planning

    def speedup(self, over: str, of: str = "hetrain") -> float:
        return self.runs[of].measured_samples_per_s / self.runs[over].measured_samples_per_s

    def table(self) -> str:
        """Predicted vs measured per plan, as a Markdown table."""
        lines = ["| plan | VWs x stages | predicted samples/s | measured samples/s | iteration error |",
                 "| --- | --- | ---: | ---: | ---: |"]
        for r in self.runs.values():
            shape = " + ".join(str(len(vw.stages)) for vw in r.plan.virtual_workers)
            err = "n/a" if math.isnan(r.measured_iteration_s) else f"{100 * r.prediction_error:+.1f}%"
            lines.append(f"| {r.name} | {shape} | {r.predicted_samples_per_s:.1f} | "
                         f"{r.measured_samples_per_s:.1f} | {err} |")
        return "\n".join(lines)


COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plan_picture(plan: Plan, path: str | Path, title: str = "") -> None:
    """Draw ``plan``: a row per device, a bar over the layers its stage holds, coloured by VW.

    Each bar is labelled ``VW v stage j: layers a-b``; the right margin says the VW's
    mini-batch and micro-batching. Devices the plan leaves unused are drawn empty.
    """
    plt = _pyplot()
    devices = [d.name for d in plan.cluster.devices]
    n = plan.profile.num_layers
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(devices) + 1.6))
    where = {s.device: (v, j, s) for v, vw in enumerate(plan.virtual_workers) for j, s in enumerate(vw.stages)}
    for row, dev in enumerate(devices):
        if dev not in where:
            ax.text(n / 2, row, "unused", ha="center", va="center", color="grey")
            continue
        v, j, s = where[dev]
        ax.barh(row, s.end_layer - s.first_layer, left=s.first_layer, color=COLORS[v % len(COLORS)],
                edgecolor="black", height=0.7)
        last = s.end_layer - 1
        layers = f"layer {s.first_layer}" if last == s.first_layer else f"layers {s.first_layer}-{last}"
        rc = f", recompute {list(s.recompute)}" if s.recompute else ""
        wide = s.end_layer - s.first_layer >= 0.3 * n
        label = f"VW{v} stage {j}: {layers}{rc}" if wide else f"VW{v} s{j}\n{layers.replace('layers ', 'L')}"
        ax.text((s.first_layer + s.end_layer) / 2, row, label.replace("layer ", "L") if not wide else label,
                ha="center", va="center", color="white", fontsize=9 if wide else 8, fontweight="bold")
    ax.set_yticks(range(len(devices)), [f"{d} ({plan.cluster.device(d).type_name})" for d in devices])
    ax.invert_yaxis()
    ax.set_xlim(0, n)
    ax.set_xticks(range(n + 1))
    ax.set_xlabel("layer index (a stage holds [first, end))")
    vws = "; ".join(f"VW{v}: {vw.mini_batch} samples as {vw.micro_batches} micro-batches"
                    for v, vw in enumerate(plan.virtual_workers))
    ax.set_title(f"{title or plan.strategy} — {plan.schedule}, sync {plan.sync}, global batch {plan.global_batch}\n"
                 f"{vws}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_loss_curve(runs: Sequence[PlanRun], path: str | Path) -> None:
    """Loss per step of each run, one curve per plan (from the metrics JSONL)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, r in enumerate(runs):
        rows = [m for m in r.metrics if m.get("loss") is not None]
        ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], marker="o", markersize=3,
                color=COLORS[k % len(COLORS)], label=r.name, linewidth=4 - 1.2 * k,
                linestyle=("-", "--", ":", "-.")[k % 4])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("loss on Shakespeare, same data and initial weights under every plan\n"
                 "(with sync bsp every plan makes the same updates, so the curves should overlap)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_stage_times(rows: Comparison, path: str | Path, title: str) -> None:
    """Grouped bars per device: predicted vs measured seconds of compute (forward + backward) and of the
    whole iteration (the device's last event)."""
    plt = _pyplot()
    devices = list(dict.fromkeys(r.device for r in rows.rows))
    groups = (("compute", ("forward", "backward")), ("iteration", ("iteration",)))
    fig, axes = plt.subplots(1, len(groups), figsize=(12, 4.2))
    for ax, (label, kinds) in zip(axes, groups, strict=True):
        pred = [sum(r.predicted_s for r in rows.rows if r.device == d and r.kind in kinds) for d in devices]
        meas = [sum(r.measured_s for r in rows.rows if r.device == d and r.kind in kinds) for d in devices]
        xs = range(len(devices))
        ax.bar([x - 0.2 for x in xs], [1e3 * p for p in pred], width=0.4, label="predicted", color=COLORS[0])
        ax.bar([x + 0.2 for x in xs], [1e3 * m for m in meas], width=0.4, label="measured", color=COLORS[1])
        ax.set_xticks(list(xs), devices)
        ax.set_ylabel("ms per iteration")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _md_compare(rows: Comparison) -> str:
    lines = ["| device | kind | n predicted | n measured | predicted ms | measured ms | error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows.rows:
        err = "n/a" if math.isnan(r.relative_error) else f"{100 * r.relative_error:+.0f}%"
        lines.append(f"| {r.device} | {r.kind} | {r.predicted_count} | {r.measured_count} | "
                     f"{1e3 * r.predicted_s:.1f} | {1e3 * r.measured_s:.1f} | {err} |")
    return "\n".join(lines)


def write_report(result: DemoResult) -> Path:
    """Write ``report.md`` and its pictures into ``result.out_dir``; returns the report's path."""
    out = result.out_dir
    runs = list(result.runs.values())
    sections = [
        "# hetrain demo report",
        "",
        f"Cluster: `{result.cluster_path.name}` emulated on this host; links as discovered "
        f"(`discovered.toml`); profile per device type in `{result.profile_path.name}`.",
        "",
        "## Predicted vs measured",
        "",
        result.table(),
        "",
        "Measured samples/s: global batch / mean step time over the steps after warm-up. Iteration error: "
        "(simulated - measured) / measured iteration time.",
    ]
    if {"hetrain", "dp", "even-split"} <= set(result.runs):
        sections += ["", f"Measured speed-up of hetrain's plan: **{result.speedup('dp'):.2f}x** over pure data "
                         f"parallelism, **{result.speedup('even-split'):.2f}x** over the even-split pipeline."]
    sections += ["", "## Loss", "", "![loss](loss.png)", ""]
    save_loss_curve(runs, out / "loss.png")
    for r in runs:
        picture = out / f"plan-{r.name}.png"
        save_plan_picture(r.plan, picture, title=f"{r.name} plan")
        sections += [f"## Plan: {r.name}", "", f"![plan {r.name}]({picture.name})", "", "```",
                     r.plan.summary(), "```", ""]
        if not r.timeline_path.exists():
            sections += ["(no measured timeline)", ""]
            continue
        measured = load_timeline(r.timeline_path)
        gantt = out / f"gantt-{r.name}.png"
        save_side_by_side(r.sim.timeline, measured, gantt)
        rows = compare(r.sim.timeline, measured)
        stages = out / f"stages-{r.name}.png"
        save_stage_times(rows, stages, f"{r.name}: per device, predicted vs measured (recorded step)")
        sections += ["Predicted (top) and measured (bottom) Gantt chart of one iteration "
                     "(the last step):", "", f"![gantt {r.name}]({gantt.name})", "",
                     f"![stage times {r.name}]({stages.name})", "", _md_compare(rows), ""]
    path = out / "report.md"
    path.write_text("\n".join(sections).rstrip() + "\n")
    return path

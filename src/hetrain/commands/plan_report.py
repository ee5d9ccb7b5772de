"""What ``hetrain plan`` prints besides the plan: the plan against the pure families (``planning.plan_families``)
and every sync mode's prediction for the plan's virtual workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hetrain.plan import Plan
from hetrain.planning import FamilyPlan
from hetrain.units import format_time


def comparison_rows(best: Plan, families: Sequence[FamilyPlan]) -> list[dict[str, Any]]:
    """The plan's row, then each family's: its closed form and, where the plan was simulated, its simulated
    iteration (each family's best plan simulated too); an infeasible family's row says why (its numbers None)."""
    def row(label: str, p: Plan, note: str) -> dict[str, Any]:
        sim = p.prediction.simulated_iteration_s
        return {"strategy": label, "samples_per_s": p.prediction.samples_per_s,
                "iteration_s": p.prediction.iteration_s,
                "simulated_samples_per_s": p.global_batch / sim if sim else None, "simulated_iteration_s": sim,
                "note": note}

    rows = [row(f"hetrain ({best.strategy}, {best.formation})", best, "")]
    for family in families:
        other = family.plan
        if other is None:
            rows.append({"strategy": family.label, "samples_per_s": None, "iteration_s": None,
                         "simulated_samples_per_s": None, "simulated_iteration_s": None,
                         "note": f"infeasible: {str(family.error).split(':')[0]}"})
            continue
        rows.append(row(family.label, other, f"{len(other.virtual_workers)} VW(s)"
                        + (f", {len(other.unused_devices)} devices unused" if other.unused_devices else "")))
    return rows


def comparison_basis(rows: list[dict[str, Any]]) -> str:
    """``simulated`` where every feasible row was simulated (the planner's own ranking), else ``closed form``."""
    feasible = [r for r in rows if r["samples_per_s"] is not None]
    return "simulated" if all(r.get("simulated_samples_per_s") for r in feasible) else "closed form"


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """The comparison table, by the simulated figures where every feasible row has them (a closed form that
    misses a pipeline's transfers or a relaxed mode's waits would misstate the ratios), else the closed forms."""
    simulated = comparison_basis(rows) == "simulated"
    sps_key, it_key = ("simulated_samples_per_s", "simulated_iteration_s") if simulated else \
        ("samples_per_s", "iteration_s")
    base = rows[0][sps_key]
    lines = [f"  {'strategy':<44} {'samples/s':>10} {'iteration':>10} {'plan is':>9}  note"]
    for r in rows:
        sps = r[sps_key]
        if sps is None:
            lines.append(f"  {r['strategy']:<44} {'-':>10} {'-':>10} {'-':>9}  {r['note']}")
            continue
        ratio = f"{base / sps:.2f}x" if r is not rows[0] else ""
        lines.append(f"  {r['strategy']:<44} {sps:>10.1f} {format_time(r[it_key]):>10} {ratio:>9}  {r['note']}")
    return "\n".join(lines)


def format_sync_modes(result: Plan, staleness_penalty: float) -> str:
    """Every sync mode's predicted samples/s, staleness and time to accuracy for the plan's VWs (docs/sync.md)."""
    from hetrain.cost import estimate_samples_to_accuracy_factor
    from hetrain.planner.sync import estimate_mode_table, format_mode_table

    choice = result.options.get("sync_choice")
    if choice is not None:
        rows = choice["modes"]
        how = "simulated" if rows and rows[0].get("simulated") else "closed form"
        head = (f"sync mode chosen by predicted time to accuracy ({how}; staleness penalty {staleness_penalty:g} "
                f"per iteration of mean staleness, {choice['target_samples']:g} samples to target):")
    else:
        table = result.options.get("sync_predictions", {})
        samples = {mode: float(v["samples_per_s"]) for mode, v in table.items()}
        critical = result.options.get("critical_batch")  # the large-batch factor the plan's own prediction has
        factor = estimate_samples_to_accuracy_factor(result.global_batch, float(critical)) if critical else 1.0
        rows = [r.to_dict() for r in estimate_mode_table(samples, result.sync_options, len(result.virtual_workers),
                                                         staleness_penalty,
                                                         float(result.options.get("target_samples", 1e6)),
                                                         batch_factor=factor)]
        head = (f"sync modes for this plan's VWs (closed form; staleness penalty {staleness_penalty:g}; "
                "--sync auto picks by time to accuracy):")
    return head + "\n" + format_mode_table(rows, result.sync) + _bf16_hint(result)


def _bf16_hint(result: Plan) -> str:
    """Where ``result`` all-reduces gradients in fp32 under bsp and that takes time: a line with its closed-form
    samples/s were they all-reduced in bf16 (sync option ``reduce_dtype``, docs/sync.md), the same stages."""
    from hetrain.planner.sync import repredict_sync

    if not result.sync_mode.synchronous or result.sync_options.reduce_dtype != "fp32" or result.prediction.sync_s <= 0:
        return ""
    table = result.options.get("sync_predictions", {})
    if result.sync not in table:
        return ""
    now = float(table[result.sync]["samples_per_s"])
    bf16 = repredict_sync(result, result.sync, replace(result.sync_options, reduce_dtype="bf16"))
    gain = bf16.prediction.samples_per_s / now if now > 0 else 1.0
    if gain < 1.01:
        return ""
    return (f"\n  gradients all-reduced in bf16 (--sync-option reduce_dtype=bf16): {bf16.prediction.samples_per_s:.1f} "
            f"samples/s on these stages, {gain:.2f}x (closed form; bf16's rounding of the sums, docs/sync.md)")

"""``hetrain plan``: the plan for a cluster and a model (or a plan's stages re-predicted, ``--from``), printed
with the planner's report, against the pure families and with every sync mode's prediction.

    hetrain plan --cluster C.toml --model gpt2-medium --global-batch 512 [-o plan.json] [--json]
    hetrain plan --from plan.json --sync daso --sync-option period=8 [-o daso.json]

The planner runs once for the plan, and once for each pure family it is compared with, all within one time
budget (``planning.plan_and_compare``); the tables read what the plan records. Where the chosen plans'
simulations (which always run) took it past the budget, one line says what it took.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from hetrain.arguments import int_between, micro_batch_sizes, number_at_least
from hetrain.cluster import Cluster, load_cluster
from hetrain.commands.plan_inputs import (
    load_model_profile,
    load_time_model_file,
    plan_precision,
    planner_options,
)
from hetrain.commands.plan_report import comparison_basis, comparison_rows, format_comparison, format_sync_modes
from hetrain.fields import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, check_output_path
from hetrain.plan import MAX_TP, SCHEDULES, Plan, PlanError
from hetrain.planner import PlannerOptions
from hetrain.planner.search import DEFAULT_TIME_BUDGET_S
from hetrain.planning import FamilyPlan, plan_and_compare, plan_families, simulated_iteration_s
from hetrain.sync_layout import SHARD_MODES, SYNC_OPTION_HELP, SyncOptions, check_mode_options
from hetrain.sync_mode import SYNC_MODES, sync_mode

_positive = number_at_least(0.0, inclusive=False)


def _tp_degree(text: str) -> int:
    """A TP degree: a power of two from 1 to ``plan.MAX_TP``."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two (1, 2, 4, 8, 16), got {text!r}") from None
    if k < 1 or k & (k - 1) or k > MAX_TP:
        raise argparse.ArgumentTypeError(f"expected a power of two from 1 to {MAX_TP}, got {k}")
    return k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hetrain plan``'s options."""
    parser.add_argument("--from", dest="from_plan", metavar="PLAN",
                        help="re-predict PLAN's stages under --sync / --sync-option (instead of searching anew)")
    parser.add_argument("--cluster", help="cluster TOML file")
    parser.add_argument("--model", help="a reference model (see `hetrain models`), or hf:DIR: a transformers "
                        "config.json, planned from its analytic profile (never built); your own: --profile")
    parser.add_argument("--seq-len", type=int_between(1, MAX_SEQ_LEN, "MAX_SEQ_LEN"), default=None, metavar="T",
                        help="tokens per sample of a token model (default: an hf:DIR config's longest, a reference "
                        "model's own)")
    parser.add_argument("--profile", help="a profile JSON file instead of --model")
    parser.add_argument("--global-batch", type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
                        help="samples per iteration")
    parser.add_argument("--strategy", choices=["auto", "dp", "pp"], default="auto")
    parser.add_argument("--max-tp", type=_tp_degree, default=None, metavar="K",
                        help="the largest tensor-parallel degree a stage may run at: the planner plans at every power "
                             "of two up to K that a node's devices of one type can form and keeps the fastest "
                             "(default 8; 1: no tensor parallelism; docs/planner.md)")
    parser.add_argument("--tp", type=_tp_degree, default=None, metavar="K",
                        help="run every stage on a TP group of K devices of one node (as --strategy forces a family)")
    parser.add_argument("--shard", choices=["auto", *SHARD_MODES], default="auto",
                        help="what each segment's owners shard under bsp: none, optimizer (ZeRO-1), "
                             "optimizer+gradients (ZeRO-2), uneven by each device's free memory; auto (default): "
                             "also plan sharded where the plan without could be memory-bound, keep the best "
                             "(docs/sync.md)")
    parser.add_argument("--use-every-device", action="store_true",
                        help="never leave a node out (by default auto also plans without the node of the slowest NIC "
                             "and the node of least compute, and keeps that plan where it is 10%% faster)")
    parser.add_argument("--schedule", choices=["auto", *SCHEDULES], default="auto")
    parser.add_argument("--sync", choices=[*SYNC_MODES, "auto"], default=None,
                        help="sync mode (docs/sync.md; default bsp, or the --from plan's); auto: the soonest predicted "
                        "time to accuracy")
    parser.add_argument("--sync-option", dest="sync_options", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a sync mode parameter (repeatable): {SYNC_OPTION_HELP}")
    parser.add_argument("--staleness-penalty", type=number_at_least(0.0), default=0.0, metavar="P",
                        help="extra samples to accuracy per iteration of mean staleness, for --sync auto (default 0)")
    parser.add_argument("--target-samples", type=_positive, default=None,
                        help="samples to reach the target at small batch (time to accuracy; default 1e6)")
    parser.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="precision of compute the plan trains in (default: the profile's; a reference model's "
                        "own)")
    parser.add_argument("--objective", choices=["throughput", "time-to-accuracy"], default="throughput")
    parser.add_argument("--critical-batch", type=_positive, help="critical batch size (time-to-accuracy)")
    parser.add_argument("--micro-batch", type=micro_batch_sizes, help="micro-batch sizes to try, e.g. 1,2,4")
    parser.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    parser.add_argument("--robust-draws", type=int_between(0, 1000), default=None, metavar="N",
                        help="where the profile records layer-time spreads, score the top plans on N profiles drawn "
                             "within them and prefer the best worst case (default 8; 0: medians only; docs/planner.md)")
    parser.add_argument("--time-budget", default=f"{DEFAULT_TIME_BUDGET_S:g}s", metavar="T",
                        help="seconds the planning may take (10s, 1.5s, 2m; none: no limit; default 10s): screening "
                             "and the exact search, then simulating as many of the best plans as fit (docs/planner.md)")
    parser.add_argument("--time-model", metavar="FILE", help="layer times for device types the profile has no "
                        "measurements of from this learned model (hetrain fit-time-model), not the roofline ratio")
    parser.add_argument("-o", "--output", help="write plan.json here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _replan_from(args: argparse.Namespace) -> Plan:
    """``hetrain plan --from PLAN``: the plan's stages under ``--sync`` / ``--sync-option`` (over its own mode and
    options), re-predicted by the closed forms and the simulator. A format_version 1 plan is upgraded."""
    from hetrain.plan import load_plan
    from hetrain.planner.sync import choose_sync_mode, repredict_sync

    given = [name for name in ("cluster", "model", "profile", "global_batch", "precision", "time_model", "seq_len")
             if getattr(args, name) is not None]
    if given:
        raise PlanError(f"--from {args.from_plan} takes its cluster, model, global batch and precision from the plan; "
                        f"drop --{given[0].replace('_', '-')}")
    old = load_plan(args.from_plan, check_layout=False, upgrade=True)
    options = SyncOptions.from_items(args.sync_options, old.sync_options)
    mode = args.sync or old.sync  # under auto, an option of any mode auto considers is the user's to give
    if "shard" not in options.given and args.sync is not None and not _synchronous(args.sync):
        options = replace(options, shard=SHARD_MODES[0])  # a relaxed mode (or auto's choice among them) shards none
    check_mode_options(mode, options, f"--from {args.from_plan} --sync {mode}")
    if args.sync == "auto":
        base = repredict_sync(old, "bsp", options, simulated_iteration_s)
        return choose_sync_mode(base, args.staleness_penalty, float(base.options.get("target_samples", 1e6)),
                                base.options.get("critical_batch"), simulated_iteration_s)
    return repredict_sync(old, args.sync or old.sync, options, simulated_iteration_s)


def _synchronous(mode: str) -> bool:
    """Whether ``mode`` is the synchronous mode (``auto``, which may pick another, is not)."""
    return mode != "auto" and sync_mode(mode).synchronous


@dataclass(frozen=True)
class _Planned:
    """What ``hetrain plan`` prints: the plan, the cluster it was made for, the pure families it is compared with,
    and the seconds the plan and the families took (None for a ``--from`` plan)."""

    plan: Plan
    cluster: Cluster
    families: list[FamilyPlan]
    planning_s: float | None
    families_s: float | None = None
    beside: bool = False  # the families planned beside the plan, in a process of their own


def _plan_anew(args: argparse.Namespace) -> _Planned:
    """``hetrain plan --cluster ... --model ...``: the planner's plan."""
    for name in ("cluster", "global_batch"):
        if getattr(args, name) is None:
            raise PlanError(f"hetrain plan needs --{name.replace('_', '-')} (or --from PLAN to re-predict a plan)")
    cluster = load_cluster(args.cluster)
    profile = load_model_profile(args.model, args.profile, plan_precision(args, cluster), args.seq_len)
    learned: tuple[str, ...] = ()
    if args.time_model:  # layer times of the unmeasured device types from the learned model (docs/profile.md)
        from hetrain.time_model import apply_time_model

        profile, learned = apply_time_model(profile, cluster.devices, load_time_model_file(args.time_model))
    compared = plan_and_compare(cluster, profile, args.global_batch, planner_options(args))
    result = compared.plan
    if learned:
        result = result.with_options({**result.options,
                                      "time_model": {"file": args.time_model, "types": list(learned)}})
    return _Planned(result, cluster, compared.families, compared.plan_s, compared.families_s, compared.beside)


def _planned(args: argparse.Namespace) -> _Planned:
    """The plan made anew, or ``--from``'s re-predicted (its families planned with its optimizer and sync,
    simulated as the plan is)."""
    if not args.from_plan:
        return _plan_anew(args)
    result = _replan_from(args)
    options = PlannerOptions(sync=result.sync, optimizer=result.optimizer, sync_options=result.sync_options,
                             simulate_top_k=1 if result.prediction.simulated_iteration_s else 0)
    return _Planned(result, result.cluster, plan_families(result.cluster, result.profile, result.global_batch,
                                                          options), None)


def run(args: argparse.Namespace) -> int:
    """Plan (or re-predict ``--from``), write ``-o``, print the plan and its comparisons (or them as JSON)."""
    from hetrain.planner.budget import PlannerReport, format_budget_overrun, format_planner_report
    from hetrain.planner.robust import format_confidence
    from hetrain.planner.search import REPORT_KEY

    if args.output:
        check_output_path(args.output, "-o")
    planned = _planned(args)
    result, planning_s = planned.plan, planned.planning_s
    if args.output:
        result.save(args.output)
    rows = comparison_rows(result, planned.families)
    if args.json:
        print(json.dumps({"plan": result.to_dict() if not args.output else args.output,
                          "comparison": rows, "planning_s": planning_s, "comparison_s": planned.families_s,
                          "comparison_beside": planned.beside},
                         indent=1))
        return 0
    print(planned.cluster.summary())
    print()
    print(result.summary())
    if planning_s is not None and REPORT_KEY in result.options:  # what this planning did (not a --from plan's)
        report = PlannerReport.from_dict(result.options[REPORT_KEY])
        print("planner: " + format_planner_report(report, planning_s))
        if over := format_budget_overrun(report.time_budget_s, planning_s, planned.families_s or 0.0,
                                         report.past_budget_s):
            print(over)
    if sure := format_confidence(result):
        print(sure)
    print()
    print(f"predicted against the pure families on the same cluster ({comparison_basis(rows)}):")
    print(format_comparison(rows))
    print()
    print(format_sync_modes(result, args.staleness_penalty))
    if args.output:
        print(f"\nplan written to {args.output}")
    return 0

"""The ``hetrain`` command.

    hetrain plan --cluster C.toml --model gpt2-medium --global-batch 512 [-o plan.json] [--json]
    hetrain simulate plan.json [--trace out.json] [--gantt out.png] [--timeline out.json] [--json]
    torchrun ... -m hetrain train --plan plan.json --model NAME [--steps N] [--checkpoint-dir D]
    hetrain compare predicted.json measured.json [--gantt both.png]
    hetrain calibrate plan.json metrics.jsonl [--warmup N] [-o profile.json]
    hetrain profile --model NAME|MODULE:FUNCTION|hf:DIR [--data SPEC] [--seq-len T] [--micro-batch 1,2,4,8] [-o P]
    hetrain fit-time-model --profiles P1.json P2.json ... [-o time_model.json]
    torchrun --nproc-per-node N --no-python hetrain discover -o cluster.toml
    hetrain export --checkpoint D --to-hf OUT [--step N] [--model hf:DIR]  (or --to-safetensors FILE)
    hetrain emulate run CLUSTER.toml -- COMMAND...  (also up, down, status)
    hetrain models | hetrain demo

Torch-side commands import torch only when run; the planning commands never do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hetrain.arguments import int_between, number_at_least
from hetrain.cluster import Cluster, load_cluster
from hetrain.errors import InputError, RunError
from hetrain.fields import (
    MAX_GLOBAL_BATCH,
    MAX_MICRO_BATCH,
    MAX_REPEATS,
    MAX_SEQ_LEN,
    MAX_STEPS,
    check_output_path,
)
from hetrain.plan import SCHEDULES, Plan, PlanError
from hetrain.planner.search import DEFAULT_TIME_BUDGET_S
from hetrain.profile import ModelProfile, ProfileError, load_profile
from hetrain.sync_layout import SYNC_OPTION_HELP, SyncOptions, check_mode_options
from hetrain.units import format_time

if TYPE_CHECKING:  # numpy, imported where --time-model is given
    from hetrain.time_model import LayerTimeModel


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    big = [v for v in values if v > MAX_MICRO_BATCH]
    if big:
        raise argparse.ArgumentTypeError(f"{big[0]} is more than the limit of {MAX_MICRO_BATCH} (MAX_MICRO_BATCH)")
    return values


_non_negative = number_at_least(0.0)

#: the units --time-budget reads: seconds (also bare numbers) and minutes
_BUDGET_UNITS_S = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0}
#: the longest --time-budget: a day
MAX_TIME_BUDGET_S = 86400.0


def _names(text: str) -> tuple[str, ...]:
    """``"model.layers.0,model.layers.4"`` -> its module names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no module; give NAME,... (e.g. model.layers.4)")
    return names


def parse_time_budget(text: str) -> float | None:
    """``--time-budget``: ``"10s"``, ``"10"``, ``"1.5s"``, ``"2m"`` in seconds; ``"none"``: no limit (None).

    Raises:
        InputError: one line naming the flag and the value.

    Example:
        >>> parse_time_budget("2m"), parse_time_budget("1.5s"), parse_time_budget("none")
        (120.0, 1.5, None)
    """
    word = text.strip().lower()
    if word in ("none", "off"):
        return None
    number = word.rstrip("smin")
    unit = word[len(number):]
    try:
        value = float(number) * _BUDGET_UNITS_S[unit]
    except (ValueError, KeyError):
        raise InputError(f"--time-budget {text!r}: expected seconds or minutes such as 10s, 1.5s, 2m, "
                         "or none for no limit") from None
    if not 0 <= value <= MAX_TIME_BUDGET_S:
        raise InputError(f"--time-budget {text!r}: expected a time from 0 s to {MAX_TIME_BUDGET_S:g} s "
                         "(MAX_TIME_BUDGET_S), or none for no limit")
    return value
_positive = number_at_least(0.0, inclusive=False)


def _cpu_precision(args: argparse.Namespace, cluster: Cluster) -> str | None:
    """The precision to plan in where the cluster has CPU devices, which have no fp16 kernels (``amp``):
    a reference model whose own precision is fp16 plans in bf16 there, saying so; fp16 asked for, or
    measured, is refused naming the devices. ``args.precision`` elsewhere."""
    cpus = [d.name for d in cluster.devices if d.type_name == "cpu"]
    if not cpus:
        return args.precision  # type: ignore[no-any-return]
    where = f"{args.cluster}: device(s) {', '.join(cpus[:3])}{' ...' if len(cpus) > 3 else ''} are CPUs"
    measured = load_profile(args.profile).precision if args.profile and args.precision is None else None
    if "fp16" in (args.precision, measured):
        given = "--precision fp16" if args.precision else f"{args.profile} was measured in fp16"
        raise PlanError(f"{given}, but {where}, which train in bf16 or fp32 (no fast fp16 kernels, and loss "
                        "scaling is only worth it on a GPU); use --precision bf16 or fp32")
    from hetrain.models.spec import is_user_spec

    if args.precision is None and args.model and not args.profile and not is_user_spec(args.model):
        from hetrain.models.analytic import build_profile

        try:
            own = build_profile(args.model).precision
        except (KeyError, ValueError):
            return None  # the name is refused, with its message, where the profile is built
        if own == "fp16":
            print(f"hetrain plan: {args.model} plans in bf16, not its usual fp16: {where} "
                  "(--precision fp32 for full precision)", file=sys.stderr)
            return "bf16"
    return args.precision  # type: ignore[no-any-return]


def _load_model_profile(model: str | None, profile_path: str | None, precision: str | None = None) -> ModelProfile:
    """The profile to plan with, in ``precision`` (None: the profile's own, or the reference model's default)."""
    if profile_path:
        profile = load_profile(profile_path)
        if precision is not None and precision != profile.precision:
            raise ProfileError(f"--precision {precision}: {profile_path} was measured in {profile.precision}; "
                               f"profile in {precision} (hetrain profile --precision {precision}) and plan with that")
        return profile
    if not model:
        raise ProfileError("give --model NAME (see `hetrain models`) or --profile profile.json")
    from hetrain.models.spec import is_user_spec

    if is_user_spec(model):  # no analytic profile: measure it (the planning side runs no user code)
        raise ProfileError(f"--model {model} is your own model, which hetrain plans from a measured profile; "
                           f"profile it first: hetrain profile --model {model} --data DATA -o profile.json, "
                           "then hetrain plan --profile profile.json")
    from hetrain.models.analytic import build_profile

    try:
        return build_profile(model) if precision is None else build_profile(model, precision=precision)
    except KeyError:
        raise ProfileError(_unknown_plan_model(model)) from None


def _unknown_plan_model(model: str) -> str:
    """Why ``hetrain plan --model MODEL`` has no profile for ``model``: a model hetrain trains but plans only from
    a measured profile (``hetrain profile``), a ``FILE.py`` without its function, or an unknown name."""
    import difflib

    from hetrain.models.analytic import MODEL_NAMES

    def measure(name: str) -> str:
        return f"measure it first: `hetrain profile --model {name} -o p.json`, then `hetrain plan --profile p.json`"

    if model.endswith(".py"):
        return (f"--model {model!r}: your own model is FILE.py:FUNCTION (the function that returns it); "
                f"{measure(model + ':FUNCTION')}")
    try:  # the models hetrain trains (torch modules); only on this error, as planning imports no torch
        from hetrain.models.registry import model_names

        trained = [n for n in model_names() if n not in MODEL_NAMES]
    except ImportError:
        trained = []
    if model in trained:
        return f"--model {model!r}: hetrain trains it but has no analytic profile of it to plan with; {measure(model)}"
    near = difflib.get_close_matches(model.strip().lower(), [*MODEL_NAMES, *trained], n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
    return (f"--model {model!r}: unknown model{hint}; hetrain plan knows {', '.join(MODEL_NAMES)} (`hetrain models`)"
            + (f"; {', '.join(trained)} and your own models plan from a measured profile "
               "(`hetrain profile --model NAME -o p.json`, then `hetrain plan --profile p.json`)" if trained else ""))


def _load_time_model(path: str) -> LayerTimeModel:
    """``--time-model FILE``; a profile or a plan given in its place is named as what it is."""
    from hetrain.fields import load_json_object
    from hetrain.time_model import FORMAT, TimeModelError, load_time_model

    try:
        return load_time_model(path)
    except TimeModelError:
        try:
            data = load_json_object(path, TimeModelError, "time model")
        except TimeModelError:
            data = {}
        if data.get("format") != FORMAT and "virtual_workers" in data:
            raise TimeModelError(f"--time-model {path}: a plan, not a time model (hetrain fit-time-model writes "
                                 "one)") from None
        if data.get("format") != FORMAT and "layers" in data:
            raise TimeModelError(f"--time-model {path}: a profile, not a time model; give a profile as --profile, "
                                 f"or fit a time model on profiles: `hetrain fit-time-model --profiles {path} ... "
                                 "-o time_model.json`") from None
        raise


def _planner_options(args: argparse.Namespace) -> dict[str, Any]:
    sync_options = SyncOptions.from_items(args.sync_options)
    check_mode_options(args.sync or "bsp", sync_options, f"--sync {args.sync or 'bsp'} with --sync-option")
    opts: dict[str, Any] = {
        "strategy": args.strategy, "schedule": args.schedule, "sync": args.sync or "bsp",
        "optimizer": args.optimizer, "objective": args.objective, "allow_recompute": not args.no_recompute,
        "sync_options": sync_options,
        "staleness_penalty": args.staleness_penalty, "leave_out": not args.use_every_device,
    }
    if args.robust_draws is not None:
        opts["robust_draws"] = args.robust_draws
    opts["time_budget_s"] = parse_time_budget(args.time_budget)
    if args.target_samples is not None:
        opts["target_samples"] = args.target_samples
    if args.critical_batch is not None:
        opts["critical_batch"] = args.critical_batch
    if args.micro_batch:
        opts["micro_batch_sizes"] = tuple(args.micro_batch)
    if args.objective == "time-to-accuracy":
        g = args.global_batch
        opts["global_batch_choices"] = tuple(sorted({max(1, g // 4), max(1, g // 2), g, 2 * g, 4 * g}))
    return opts


def compare_strategies(cluster: Cluster, profile: ModelProfile, global_batch: int, best: Plan,
                       options: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan against pure data parallelism and pure pipeline on the same cluster: each row's closed form
    and, where the plan was simulated, its simulated iteration (each family's best plan simulated too)."""
    from hetrain import plan
    from hetrain.planner import PlannerError

    def row(label: str, p: Plan, note: str) -> dict[str, Any]:
        sim = p.prediction.simulated_iteration_s
        return {"strategy": label, "samples_per_s": p.prediction.samples_per_s,
                "iteration_s": p.prediction.iteration_s,
                "simulated_samples_per_s": p.global_batch / sim if sim else None, "simulated_iteration_s": sim,
                "note": note}

    rows = [row(f"hetrain ({best.strategy}, {best.formation})", best, "")]
    simulate = 1 if best.prediction.simulated_iteration_s else 0  # as the plan was: simulated, or not
    for family, label in (("dp", "pure data parallelism"), ("pp", "pure pipeline")):
        try:
            other = plan(cluster, profile, global_batch, **{**options, "strategy": family, "simulate_top_k": simulate,
                                                            "global_batch_choices": ()})
            rows.append(row(label, other, f"{len(other.virtual_workers)} VW(s)"
                            + (f", {len(other.unused_devices)} devices unused" if other.unused_devices else "")))
        except PlannerError as e:
            rows.append({"strategy": label, "samples_per_s": None, "iteration_s": None,
                         "simulated_samples_per_s": None, "simulated_iteration_s": None,
                         "note": f"infeasible: {str(e).split(':')[0]}"})
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

    if result.sync != "bsp" or result.sync_options.reduce_dtype != "fp32" or result.prediction.sync_s <= 0:
        return ""
    table = result.options.get("sync_predictions", {})
    if "bsp" not in table:
        return ""
    now = float(table["bsp"]["samples_per_s"])
    bf16 = repredict_sync(result, "bsp", replace(result.sync_options, reduce_dtype="bf16"))
    gain = bf16.prediction.samples_per_s / now if now > 0 else 1.0
    if gain < 1.01:
        return ""
    return (f"\n  gradients all-reduced in bf16 (--sync-option reduce_dtype=bf16): {bf16.prediction.samples_per_s:.1f} "
            f"samples/s on these stages, {gain:.2f}x (closed form; bf16's rounding of the sums, docs/sync.md)")


def _replan_from(args: argparse.Namespace) -> Plan:
    """``hetrain plan --from PLAN``: the plan's stages under ``--sync`` / ``--sync-option`` (over its own mode and
    options), re-predicted by the closed forms and the simulator. A format_version 1 plan is upgraded."""
    from hetrain import simulated_iteration_s
    from hetrain.plan import load_plan
    from hetrain.planner.sync import choose_sync_mode, repredict_sync

    given = [name for name in ("cluster", "model", "profile", "global_batch", "precision", "time_model")
             if getattr(args, name) is not None]
    if given:
        raise PlanError(f"--from {args.from_plan} takes its cluster, model, global batch and precision from the plan; "
                        f"drop --{given[0].replace('_', '-')}")
    old = load_plan(args.from_plan, check_layout=False, upgrade=True)
    options = SyncOptions.from_items(args.sync_options, old.sync_options)
    mode = args.sync or old.sync  # under auto, an option of any mode auto considers is the user's to give
    check_mode_options(mode, options, f"--from {args.from_plan} --sync {mode}")
    if args.sync == "auto":
        base = repredict_sync(old, "bsp", options, simulated_iteration_s)
        return choose_sync_mode(base, args.staleness_penalty, float(base.options.get("target_samples", 1e6)),
                                base.options.get("critical_batch"), simulated_iteration_s)
    return repredict_sync(old, args.sync or old.sync, options, simulated_iteration_s)


def cmd_plan(args: argparse.Namespace) -> int:
    from hetrain import plan
    from hetrain.planner.budget import PlannerReport, format_planner_report
    from hetrain.planner.robust import format_confidence
    from hetrain.planner.search import REPORT_KEY

    if args.output:
        check_output_path(args.output, "-o")
    planning_s = None
    if args.from_plan:
        result = _replan_from(args)
        cluster, profile = result.cluster, result.profile
        options: dict[str, Any] = {"optimizer": result.optimizer, "sync_options": result.sync_options}
    else:
        for name in ("cluster", "global_batch"):
            if getattr(args, name) is None:
                raise PlanError(f"hetrain plan needs --{name.replace('_', '-')} (or --from PLAN to re-predict a plan)")
        cluster = load_cluster(args.cluster)
        profile = _load_model_profile(args.model, args.profile, _cpu_precision(args, cluster))
        learned: tuple[str, ...] = ()
        if args.time_model:  # layer times of the unmeasured device types from the learned model (docs/profile.md)
            from hetrain.time_model import apply_time_model

            profile, learned = apply_time_model(profile, cluster.devices, _load_time_model(args.time_model))
        options = _planner_options(args)
        start_s = time.perf_counter()
        result = plan(cluster, profile, args.global_batch, **options)
        planning_s = time.perf_counter() - start_s
        if learned:
            result = replace(result, options={**result.options,
                                              "time_model": {"file": args.time_model, "types": list(learned)}})
    if args.output:
        result.save(args.output)
    # the families compared under the plan's sync mode (the one --sync auto chose, if so)
    rows = compare_strategies(cluster, profile, result.global_batch, result, {**options, "sync": result.sync})
    if args.json:
        print(json.dumps({"plan": result.to_dict() if not args.output else args.output,
                          "comparison": rows, "planning_s": planning_s}, indent=1))
        return 0
    print(cluster.summary())
    print()
    print(result.summary())
    if planning_s is not None and REPORT_KEY in result.options:  # what this planning did (not a --from plan's)
        print("planner: " + format_planner_report(PlannerReport.from_dict(result.options[REPORT_KEY]), planning_s))
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from hetrain.plan import load_plan
    from hetrain.simulator import run_simulate_command, simulate

    for flag, path in (("--trace", args.trace), ("--gantt", args.gantt), ("--timeline", args.timeline)):
        if path:
            check_output_path(path, flag)
    plan = load_plan(args.plan)  # a bad plan file is an input error (exit status 2), named before any simulation
    code = run_simulate_command(args.plan, args.trace, args.gantt, args.json)
    if code == 0 and args.timeline:
        timeline = simulate(plan).timeline
        timeline.save(args.timeline)
        if not args.json:  # under --json stdout is the metrics alone, as for --trace and --gantt
            n = timeline.iterations
            cycle = f" ({n} simulated iterations; hetrain compare divides by them)" if n > 1 else ""
            print(f"timeline: {args.timeline}{cycle}")
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    from hetrain.timeline import compare, load_comparison, save_side_by_side

    if args.gantt:
        check_output_path(args.gantt, "--gantt")
    predicted, measured = load_comparison(args.predicted, args.measured)
    print(compare(predicted, measured))
    if args.gantt:
        save_side_by_side(predicted, measured, args.gantt)
        print(f"Gantt charts written to {args.gantt}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hetrain.calibrate import run_calibrate_command

    if args.output:
        check_output_path(args.output, "-o")
    return run_calibrate_command(args.plan, args.metrics, args.warmup, args.output)


def cmd_models(args: argparse.Namespace) -> int:
    from hetrain.models.analytic import MODEL_NAMES, build_profile
    from hetrain.units import format_bytes

    print(f"{'model':<14} {'layers':>6} {'parameters':>12} {'precision':>9}")
    for name in MODEL_NAMES:
        p = build_profile(name)
        print(f"{name:<14} {p.num_layers:>6} {format_bytes(p.param_bytes):>12} {p.precision:>9}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    check_output_path(args.output, "-o")
    from hetrain.models.spec import is_user_spec
    from hetrain.models.user import resolve_model
    from hetrain.profiler.layers import profile_inputs, run_profile_command

    if args.model.endswith(".py") and not is_user_spec(args.model):
        raise InputError(f"--model {args.model}: a Python file needs the function that returns the model: "
                         f"--model {args.model}:FUNCTION (docs/own-model.md)")
    source = resolve_model(args.model, split_points=args.split_points)  # a model or data that cannot be used is
    # bad input (status 2), named first
    inputs = profile_inputs(source, args.data, seq_len=args.seq_len)
    return run_profile_command(source, args.micro_batch, args.output, device=args.device,
                               repeats=args.repeats, precision=args.precision, data=args.data, inputs=inputs)


def cmd_fit_time_model(args: argparse.Namespace) -> int:
    check_output_path(args.output, "-o")
    from hetrain.profiler.learned import run_fit_command

    return run_fit_command(args.profiles, args.output)


def cmd_export(args: argparse.Namespace) -> int:
    from hetrain.runtime.state.export import export_hf, export_safetensors
    from hetrain.units import format_bytes

    if args.to_hf is not None:
        done = export_hf(args.checkpoint, args.to_hf, step=args.step, model=args.model, plan=args.plan,
                         force=args.force)
    else:
        for flag in ("model", "plan"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag} applies to --to-hf only; --to-safetensors writes hetrain's own names")
        done = export_safetensors(args.checkpoint, args.to_safetensors, step=args.step, force=args.force)
    print(f"hetrain export: step {done.step} of {done.model or 'the checkpoint'} -> {done.path} "
          f"({done.tensors} tensors, {format_bytes(done.weight_bytes)})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hetrain.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetrain", description=__doc__.split("\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a hybrid pipeline + data parallel run")
    p.add_argument("--from", dest="from_plan", metavar="PLAN",
                   help="re-predict PLAN's stages under --sync / --sync-option (instead of searching anew)")
    p.add_argument("--cluster", help="cluster TOML file")
    p.add_argument("--model", help="a reference model (see `hetrain models`); your own: --profile")
    p.add_argument("--profile", help="a profile JSON file instead of --model")
    p.add_argument("--global-batch", type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
                   help="samples per iteration")
    p.add_argument("--strategy", choices=["auto", "dp", "pp"], default="auto")
    p.add_argument("--use-every-device", action="store_true",
                   help="never leave a node out (by default auto also plans without the node of the slowest NIC "
                        "and the node of least compute, and keeps that plan where it is 10%% faster)")
    p.add_argument("--schedule", choices=["auto", *SCHEDULES], default="auto")
    p.add_argument("--sync", choices=["bsp", "wsp", "hybrid-ps", "daso", "local-sgd", "auto"], default=None,
                   help="sync mode (docs/sync.md; default bsp, or the --from plan's); auto: the soonest predicted "
                   "time to accuracy")
    p.add_argument("--sync-option", dest="sync_options", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a sync mode parameter (repeatable): {SYNC_OPTION_HELP}")
    p.add_argument("--staleness-penalty", type=_non_negative, default=0.0, metavar="P",
                   help="extra samples to accuracy per iteration of mean staleness, for --sync auto (default 0)")
    p.add_argument("--target-samples", type=_positive, default=None,
                   help="samples to reach the target at small batch (time to accuracy; default 1e6)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="precision of compute the plan trains in (default: the profile's; a reference model's own)")
    p.add_argument("--objective", choices=["throughput", "time-to-accuracy"], default="throughput")
    p.add_argument("--critical-batch", type=_positive, help="critical batch size (time-to-accuracy)")
    p.add_argument("--micro-batch", type=_ints, help="micro-batch sizes to try, e.g. 1,2,4")
    p.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    p.add_argument("--robust-draws", type=int_between(0, 1000), default=None, metavar="N",
                   help="where the profile records layer-time spreads, score the top plans on N profiles drawn "
                        "within them and prefer the best worst case (default 8; 0: medians only; docs/planner.md)")
    p.add_argument("--time-budget", default=f"{DEFAULT_TIME_BUDGET_S:g}s", metavar="T",
                   help="seconds the planning may take (10s, 1.5s, 2m; none: no limit; default 10s): screening and "
                        "the exact search, then simulating as many of the best plans as fit (docs/planner.md)")
    p.add_argument("--time-model", metavar="FILE", help="layer times for device types the profile has no "
                   "measurements of from this learned model (hetrain fit-time-model), not the roofline ratio")
    p.add_argument("-o", "--output", help="write plan.json here")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="simulate a plan's iteration, action by action")
    s.add_argument("plan")
    s.add_argument("--trace", help="write a Chrome trace JSON (Perfetto, chrome://tracing)")
    s.add_argument("--gantt", help="write a Gantt chart PNG")
    s.add_argument("--timeline", help="write the predicted timeline JSON (for hetrain compare)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)

    m = sub.add_parser("models", help="list the reference models")
    m.set_defaults(func=cmd_models)

    pr = sub.add_parser("profile", help="measure a model's layers on this device")
    pr.add_argument("--model", required=True, help="a reference model, or MODULE:FUNCTION / path/to/file.py:FUNCTION "
                    "returning your own (docs/own-model.md)")
    pr.add_argument("--data", default=None, help="MODULE:FUNCTION returning a torch Dataset of (input, target), "
                    "tokens:FILE.bin / text:FILE, or jsonl:FILE / parquet:FILE / dataset:DIR: the input to profile "
                    "on (needed for your own model)")
    pr.add_argument("--split-points", type=_names, default=(), metavar="NAME,...",
                    help="cut a traced model (hf:DIR, or your own module) where these modules begin, in forward "
                    "order (default: before each repeated block, and after the last); recorded in the profile, "
                    "hetrain train cuts alike (docs/own-model.md)")
    pr.add_argument("--seq-len", type=int_between(1, MAX_SEQ_LEN, "MAX_SEQ_LEN"), default=None, metavar="T",
                    help="tokens per sample of a token model or token data (default: a gpt model's seq_len; an "
                    "hf:DIR model needs it); recorded in the profile, hetrain train runs at it")
    pr.add_argument("--micro-batch", type=_ints, default=[1, 2, 4, 8])
    pr.add_argument("-o", "--output", default="profile.json")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--repeats", type=int_between(1, MAX_REPEATS, "MAX_REPEATS"), default=5)
    pr.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    pr.set_defaults(func=cmd_profile)

    ft = sub.add_parser("fit-time-model", help="fit the learned layer-time model on measured profiles (needs "
                        "scikit-learn)")
    ft.add_argument("--profiles", nargs="+", required=True, metavar="PROFILE",
                    help="profile JSON files with measured layer times on device types the catalog knows")
    ft.add_argument("-o", "--output", default="time_model.json")
    ft.set_defaults(func=cmd_fit_time_model)

    # Listed for --help; `main` hands `discover` and `train` to their own parsers (they import torch).
    sub.add_parser("discover", help="under torchrun: measure devices and links, write a cluster file",
                   add_help=False)
    sub.add_parser("train", help="under torchrun: train a model with a plan (torchrun ... -m hetrain train --plan P)",
                   add_help=False)

    c = sub.add_parser("compare", help="predicted vs measured timeline: error per device and action kind, per "
                       "iteration (each side's totals divided by the iterations it holds)")
    c.add_argument("predicted", help="the predicted timeline JSON (hetrain simulate PLAN --timeline FILE)")
    c.add_argument("measured", help="the runtime's measured timeline JSON (hetrain train --timeline-out)")
    c.add_argument("--gantt", help="write both timelines as one PNG, predicted above measured")
    c.set_defaults(func=cmd_compare)

    cal = sub.add_parser("calibrate", help="fit the cost model's overhead per action to a trained plan's metrics")
    cal.add_argument("plan", help="the plan that was trained (plan.json)")
    cal.add_argument("metrics", help="its training metrics (hetrain train --metrics-out FILE)")
    cal.add_argument("--warmup", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=3,
                     help="first steps left out (default 3)")
    cal.add_argument("-o", "--output", help="write the plan's profile with the fitted overhead here")
    cal.set_defaults(func=cmd_calibrate)

    ex = sub.add_parser("export", help="a checkpoint's weights as a Hugging Face model directory (hf:DIR models) "
                        "or one safetensors file")
    ex.add_argument("--checkpoint", required=True, metavar="DIR", help="the --checkpoint-dir hetrain train wrote")
    to = ex.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-hf", metavar="OUT", help="write a transformers model directory (a model trained from "
                    "--model hf:DIR): model.safetensors, config.json, tokenizer files")
    to.add_argument("--to-safetensors", metavar="FILE", help="write every layer's tensors, named layers.{k}.<name>, "
                    "as one safetensors file (any model)")
    ex.add_argument("--step", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=None,
                    help="the checkpoint's step (default: the newest complete one)")
    ex.add_argument("--model", metavar="hf:DIR", help="the model's directory (default: the plan's model, as the "
                    "checkpoint records it)")
    ex.add_argument("--plan", metavar="PLAN", help="the plan it was trained with, to read its model from")
    ex.add_argument("--force", action="store_true", help="replace a non-empty OUT or an existing FILE")
    ex.set_defaults(func=cmd_export)

    from hetrain.emulate.cli import add_emulate_arguments, run_emulate_args

    em = sub.add_parser("emulate", help="emulate a heterogeneous cluster on this host and run a job on it")
    add_emulate_arguments(em)
    em.set_defaults(func=run_emulate_args)

    demo = sub.add_parser("demo", help="the main job end to end on an emulated heterogeneous cluster (root)")
    demo.add_argument("--model", default="gpt-tiny", help="reference model (default gpt-tiny)")
    demo.add_argument("--global-batch", type=int_between(1, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"), default=32,
                      help="samples per iteration (default 32)")
    demo.add_argument("--steps", type=int_between(1, MAX_STEPS, "MAX_STEPS"), default=20,
                      help="training steps per plan (default 20)")
    demo.add_argument("--warmup", type=int_between(0, MAX_STEPS, "MAX_STEPS"), default=5,
                      help="first steps left out of samples/s (default 5)")
    demo.add_argument("--cluster", default=None, help="cluster file (default: the embedded 2-node cluster)")
    demo.add_argument("--out", default="out/demo", help="report and run files (default out/demo)")
    demo.add_argument("--plan-only", action="store_true", help="plan and simulate only: no emulation, no root")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hetrain`` command; returns the exit status.

    Bad input (``InputError``: a file, a field, an argument) is one line on stderr and status 2;
    a failure while running (``RunError``, or a file that cannot be written) one line and status 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["discover"]:
        from hetrain.profiler.network import main as discover_main

        return discover_main(argv[1:])
    if argv[:1] == ["train"]:
        from hetrain.runtime.command import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except (InputError, ValueError) as e:  # ValueError: the checks that predate InputError
        print(f"hetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"hetrain {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away (``hetrain plan ... | head``): stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the interpreter's final flush does not fail again
        return 1
    except OSError as e:
        print(f"hetrain {args.command}: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hetrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

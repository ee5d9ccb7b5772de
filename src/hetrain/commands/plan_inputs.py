"""What ``hetrain plan`` plans with: the model's profile (``--model``, ``--profile``, ``--precision``,
``--time-model``) and the planner options of its flags.

Nothing here imports torch: a name hetrain trains but has no analytic profile of is looked up in the
registry of trained models only to say so.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from hetrain.cluster import Cluster
from hetrain.errors import InputError
from hetrain.plan import PlanError
from hetrain.planner import PlannerOptions
from hetrain.profile import ModelProfile, ProfileError, load_profile
from hetrain.sync_layout import SyncOptions, check_mode_options
from hetrain.sync_mode import sync_mode

if TYPE_CHECKING:  # numpy, imported where --time-model is given
    from hetrain.time_model import LayerTimeModel

#: the units --time-budget reads: seconds (also bare numbers) and minutes
_BUDGET_UNITS_S = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0}
#: the longest --time-budget: a day
MAX_TIME_BUDGET_S = 86400.0


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


def plan_precision(args: argparse.Namespace, cluster: Cluster) -> str | None:
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


def load_model_profile(model: str | None, profile_path: str | None, precision: str | None = None,
                       seq_len: int | None = None) -> ModelProfile:
    """The profile to plan with, in ``precision`` (None: the profile's own, or the reference model's default), at
    ``seq_len`` tokens per sample (None: the model's own). An ``hf:DIR`` model's is analytic, from its config.json
    alone (``models.hf_analytic``): nothing is built, so no weights are allocated however large the model."""
    if profile_path:
        if seq_len is not None:
            raise ProfileError(f"--seq-len {seq_len}: {profile_path} was measured at its own sequence length; "
                               "--seq-len applies to --model")
        profile = load_profile(profile_path)
        if precision is not None and precision != profile.precision:
            raise ProfileError(f"--precision {precision}: {profile_path} was measured in {profile.precision}; "
                               f"profile in {precision} (hetrain profile --precision {precision}) and plan with that")
        return profile
    if not model:
        raise ProfileError("give --model NAME (see `hetrain models`) or --profile profile.json")
    from hetrain.models.hf_analytic import build_hf_profile, is_hf_spec
    from hetrain.models.spec import is_user_spec

    given: dict[str, Any] = {key: value for key, value in (("precision", precision), ("seq_len", seq_len))
                             if value is not None}  # the model's own where not given
    if is_hf_spec(model):
        return build_hf_profile(model, **given)

    if is_user_spec(model):  # no analytic profile: measure it (the planning side runs no user code)
        raise ProfileError(f"--model {model} is your own model, which hetrain plans from a measured profile; "
                           f"profile it first: hetrain profile --model {model} --data DATA -o profile.json, "
                           "then hetrain plan --profile profile.json")
    from hetrain.models.analytic import build_profile

    try:
        return build_profile(model, **given)
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


def load_time_model_file(path: str) -> LayerTimeModel:
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


def planner_options(args: argparse.Namespace) -> PlannerOptions:
    """The planner options ``hetrain plan``'s flags give (the planner's defaults for those not given).

    Raises:
        InputError: a ``--sync-option`` the mode does not take, a ``--time-budget`` that is no time, or options
            the planner refuses together (``PlannerOptions``), each naming the flag or the option.
    """
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
    if getattr(args, "max_tp", None) is not None:
        opts["max_tp"] = args.max_tp
    if getattr(args, "tp", None) is not None:
        opts["tp"] = args.tp
    shard = getattr(args, "shard", None)
    if shard is not None and "shard" in sync_options.given and shard != sync_options.shard:
        if shard != "auto":
            raise InputError(f"--shard {shard} and --sync-option shard={sync_options.shard} disagree: give one")
    elif shard is not None:
        if shard not in ("auto", "none") and args.sync not in (None, "auto") and not sync_mode(args.sync).synchronous:
            raise InputError(f"--shard {shard}: sharding is the bsp mode's; sync mode {args.sync} steps each "
                             f"replica's own optimizer (use --sync bsp, or --shard none)")
        opts["shard"] = shard
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
    return PlannerOptions(**opts)

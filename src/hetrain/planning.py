"""The planner wired to the simulator, once: what ``hetrain.plan``, re-planning and the commands call.

The planner imports no simulator (DESIGN.md); it ranks its best candidates by a scoring function it is
handed. This module hands it the simulator's, and records in the plan the options it was made with, so
that the plan can be re-made as it was (``elastic.planner_options_of``)::

    cluster, profile, global batch, PlannerOptions
          │
          ▼
    planner.plan(..., score=simulated_iteration_s) ──► Plan + options["planner"]      plan_with_simulator
          │
          └─ the same options, strategy forced to dp, then pp ──► FamilyPlan x 2      plan_families

``hetrain plan`` does both within one time budget (``plan_and_compare``)::

    |<------------------------------ time_budget_s ------------------------------>|
    | the plan: PLAN_SHARE of it                   | dp: half what is left | pp: the rest |

Each planning's chosen plan is simulated whatever is left of its share (``PlannerReport.past_budget_s``): the
budget is exceeded by what that takes, and ``hetrain plan`` says so (``budget.format_budget_overrun``).

Used by ``hetrain.plan``, ``hetrain plan`` (the plan and its comparison with the pure families),
``elastic.replan_on_cluster`` (a restart on other devices, and ``drift``'s slowed cluster) and the demo.
Pure Python, no torch.

Example:
    >>> from hetrain.cluster import load_cluster                                        # doctest: +SKIP
    >>> from hetrain.models.analytic import build_profile                               # doctest: +SKIP
    >>> cluster = load_cluster("examples/clusters/hetpipe.toml")                        # doctest: +SKIP
    >>> profile = build_profile("gpt2-medium")                                          # doctest: +SKIP
    >>> best = plan_with_simulator(cluster, profile, 512)                               # doctest: +SKIP
    >>> [f.plan.strategy for f in plan_families(cluster, profile, 512, PlannerOptions()) if f.plan]  # doctest: +SKIP
    ['dp', 'pp']
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from hetrain.cluster import Cluster
from hetrain.plan import Plan
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planner import plan as planner_plan
from hetrain.planner.budget import PlannerReport
from hetrain.planner.search import REPORT_KEY
from hetrain.profile import ModelProfile
from hetrain.simulator import simulate

#: the key of ``Plan.options`` that holds the planner options a plan was made with (``record_planner_options``)
PLANNER_KEY = "planner"

Family = Literal["dp", "pp"]
#: the pure families a plan is compared with: (strategy, how the comparison names it)
FAMILIES: tuple[tuple[Family, str], ...] = (("dp", "pure data parallelism"), ("pp", "pure pipeline"))


def simulated_iteration_s(plan: Plan) -> float:
    """The simulator's iteration seconds for ``plan``: the planner's scoring function."""
    return simulate(plan).iteration_s


def record_planner_options(plan: Plan, opts: PlannerOptions) -> Plan:
    """``plan`` with ``options["planner"]``: the options it was made with (those JSON holds), so that it can be
    re-made as it was (``elastic.planner_options_of``). ``plan_with_simulator`` records them in every plan."""
    recorded: dict[str, Any] = {}
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name == "sync_options":
            continue  # the plan's own (``Plan.sync_options``), which ``hetrain plan --from`` may change
        if isinstance(value, tuple) and all(isinstance(v, (int, float, str)) for v in value):
            value = list(value)
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            continue  # not a JSON value
        recorded[f.name] = value
    return replace(plan, options={**plan.options, PLANNER_KEY: recorded})


def plan_with_simulator(cluster: Cluster, profile: ModelProfile, global_batch: int,
                        options: PlannerOptions | None = None, **kwargs: Any) -> Plan:
    """``planner.plan`` whose best ``simulate_top_k`` candidates are re-ranked by the simulator
    (``hetrain.plan`` is this function).

    Args:
        cluster: the devices and links.
        profile: the model's per-layer costs.
        global_batch: samples per iteration.
        options: a PlannerOptions; or its fields as keyword arguments (both: ``options`` with those replaced).

    Returns:
        The best plan, with ``options["planner"]``: the options it was made with (``record_planner_options``),
        so that a restart on other devices re-makes it alike (``hetrain.elastic``, docs/elastic.md).

    Raises:
        PlannerError: no arrangement fits (the planner's reason, with the numbers).
    """
    opts = options if options is not None else PlannerOptions(**kwargs)
    if options is not None and kwargs:
        opts = replace(options, **kwargs)
    return record_planner_options(planner_plan(cluster, profile, global_batch, opts, score=simulated_iteration_s),
                                  opts)


@dataclass(frozen=True)
class FamilyPlan:
    """The best plan of one pure family on a cluster, or why it has none.

    Attributes:
        strategy: ``dp`` or ``pp``.
        label: how a comparison names it (``pure data parallelism``, ``pure pipeline``).
        plan: its best plan; None where no arrangement of the family fits.
        error: the planner's refusal where ``plan`` is None.
    """

    strategy: Family
    label: str
    plan: Plan | None
    error: PlannerError | None = None

    def required(self) -> Plan:
        """The plan; the planner's refusal raised where the family has none.

        Raises:
            PlannerError: no arrangement of the family fits.
        """
        if self.plan is None:
            assert self.error is not None
            raise self.error
        return self.plan


def plan_families(cluster: Cluster, profile: ModelProfile, global_batch: int,
                  options: PlannerOptions) -> list[FamilyPlan]:
    """Each pure family (``FAMILIES``: dp, then pp) planned with ``options``, its strategy forced and no other
    global batch tried: what a plan is compared with (``hetrain plan``'s table, the demo's runs). They share
    ``options.time_budget_s``: each has what is left of it over the families left to plan."""
    out = []
    start = time.perf_counter()
    for n, (strategy, label) in enumerate(FAMILIES):
        budget_s = options.time_budget_s
        if budget_s is not None:
            budget_s = max(0.0, budget_s - (time.perf_counter() - start)) / (len(FAMILIES) - n)
        try:
            found = plan_with_simulator(cluster, profile, global_batch, replace(
                options, strategy=strategy, global_batch_choices=(), time_budget_s=budget_s))
        except PlannerError as e:
            out.append(FamilyPlan(strategy, label, None, e))
            continue
        out.append(FamilyPlan(strategy, label, found))
    return out


#: the share of ``hetrain plan``'s time budget the plan is made in; the comparison rows (each pure family's best
#: plan, simulated) have what is left, however little (their screening, exact search and one simulation always run)
PLAN_SHARE = 0.7


@dataclass(frozen=True)
class Compared:
    """``hetrain plan``'s planning: the plan, the pure families it is compared with, and the seconds each took.

    Attributes:
        plan: the best plan (``plan_with_simulator``), recording the whole time budget, the one the user gave.
        families: each pure family's best plan or why it has none (``plan_families``).
        plan_s: seconds the plan took.
        families_s: seconds the families took.
    """

    plan: Plan
    families: list[FamilyPlan]
    plan_s: float
    families_s: float

    @property
    def took_s(self) -> float:
        return self.plan_s + self.families_s


def plan_and_compare(cluster: Cluster, profile: ModelProfile, global_batch: int,
                     options: PlannerOptions) -> Compared:
    """The plan and the pure families within one time budget, ``options.time_budget_s``: the plan in
    ``PLAN_SHARE`` of it, the families (under the plan's sync mode, simulated where it is) in what is left.

    The plan records the whole budget, the one the user gave, in its planner options and report. Each
    planning's chosen plan is simulated whatever the budget left, so ``took_s`` can exceed it
    (``budget.format_budget_overrun`` says by what).
    """
    budget_s = options.time_budget_s
    start = time.perf_counter()
    share = None if budget_s is None else PLAN_SHARE * budget_s
    best = plan_with_simulator(cluster, profile, global_batch, replace(options, time_budget_s=share))
    plan_s = time.perf_counter() - start
    report = replace(PlannerReport.from_dict(best.options[REPORT_KEY]), time_budget_s=budget_s)
    best = record_planner_options(replace(best, options={**best.options, REPORT_KEY: report.to_dict()}), options)
    left = None if budget_s is None else max(0.0, budget_s - plan_s)
    simulate = 1 if best.prediction.simulated_iteration_s else 0
    families = plan_families(cluster, profile, global_batch,
                             replace(options, sync=best.sync, simulate_top_k=simulate, time_budget_s=left))
    return Compared(best, families, plan_s, time.perf_counter() - start - plan_s)

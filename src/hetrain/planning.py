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

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from hetrain.cluster import Cluster
from hetrain.plan import Plan
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planner import plan as planner_plan
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
    global batch tried: what a plan is compared with (``hetrain plan``'s table, the demo's runs)."""
    out = []
    for strategy, label in FAMILIES:
        try:
            found = plan_with_simulator(cluster, profile, global_batch,
                                        replace(options, strategy=strategy, global_batch_choices=()))
        except PlannerError as e:
            out.append(FamilyPlan(strategy, label, None, e))
            continue
        out.append(FamilyPlan(strategy, label, found))
    return out

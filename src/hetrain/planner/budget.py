"""The planner's time budget: a clock, the cost of a simulation estimated from the ones done, and the report.

``search.plan`` screens and searches with the closed forms, then hands candidates to the
scoring function (the simulator) one at a time while ``TimeBudget.fits`` says the next
ones' estimated cost fits in what is left::

    |<------------------------------ time_budget_s ------------------------------>|
    | screen + exact search | sim 1 | sim 2 | sim 3 | ... | sim k |  next: est > left, stop
                                 ^ always, where any budget is left (its cost is unknown)

    | screen + exact search, past the budget ......................... | sim of the closed forms' best |
                                                  ^ no budget left: the chosen plan is simulated all the same

A simulation's cost is taken as proportional to its plan's size (``simulation_size``: the
forward and backward of every stage and micro-batch, and each device's sync), at the
dearest rate per unit of size seen so far. The estimate can only be wrong about the
one simulation it lets start, so the budget is exceeded by at most one simulation: that one,
or the chosen plan's where the search left no budget for any (``PlannerReport.past_budget_s``).

``PlannerReport`` is what the planner did ("screened 18,432, searched 40, simulated 12"),
recorded in ``Plan.options["planner_report"]``; the elapsed seconds are the caller's to
measure and print (``format_planner_report``), so that a plan made within its budget is
the same data on every run.

Example:
    >>> budget = TimeBudget(10.0)
    >>> budget.fits([])  # nothing to simulate fits any budget that is left
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hetrain.plan import Plan


def simulation_size(plan: Plan) -> int:
    """The plan's size for the simulator, in actions roughly: a forward and a backward per stage and
    micro-batch, and one sync per device used."""
    return sum(2 * len(vw.stages) * vw.micro_batches for vw in plan.virtual_workers) + len(plan.devices_used)


#: a simulation is started only where this times its estimate fits in what is left: one simulation's seconds
#: vary with the host's load by a few tens of percent, and making its plan (not timed with it) adds to it, so
#: a planning that started its last simulation on the bare estimate overran its budget by that much
ESTIMATE_HEADROOM = 1.5


class TimeBudget:
    """The clock of one planning, and what each of its simulations cost.

    Args:
        budget_s: seconds from now the planning may take; None: no limit.
        clock: a function returning seconds (``time.perf_counter``), for tests that set the time.
    """

    def __init__(self, budget_s: float | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s = budget_s
        self.clock = clock
        self.start_s = clock()
        self.simulations = 0
        self.simulated_s = 0.0
        self.seconds_per_size = 0.0  # the dearest simulation so far, per unit of simulation_size
        #: a closed-form score found already elsewhere (another TP degree's plan): a search none of whose
        #: candidates could beat it, optimistically, stops after screening (``search.NotBetter``)
        self.must_beat: float | None = None

    def elapsed_s(self) -> float:
        return self.clock() - self.start_s

    def left_s(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed_s()

    def estimate_s(self, plans: Sequence[Plan]) -> float:
        """Seconds that simulating ``plans`` would take, at the dearest rate seen (0 before any simulation)."""
        return self.seconds_per_size * sum(simulation_size(p) for p in plans)

    def fits(self, plans: Sequence[Plan]) -> bool:
        """Whether simulating ``plans`` fits in what is left: the first simulation of a planning whenever any
        budget is left (nothing says yet what one costs), the others where their estimate, with
        ``ESTIMATE_HEADROOM``, fits."""
        left = self.left_s()
        if math.isinf(left):
            return True
        if not plans:
            return left >= 0
        return left > 0 and (self.simulations == 0 or ESTIMATE_HEADROOM * self.estimate_s(plans) <= left)

    def timed(self, score: Callable[[Plan], float]) -> Callable[[Plan], float]:
        """``score``, counting its calls and the seconds each took per unit of plan size."""
        def timed_score(plan: Plan) -> float:
            start = self.clock()
            seconds = score(plan)
            took_s = self.clock() - start
            self.simulations += 1
            self.simulated_s += took_s
            self.seconds_per_size = max(self.seconds_per_size, took_s / max(1, simulation_size(plan)))
            return seconds
        return timed_score


@dataclass(frozen=True)
class PlannerReport:
    """What one planning did, recorded in ``Plan.options["planner_report"]``.

    Attributes:
        screened: candidates (formation, schedule, global batch) scored with fast partitions.
        searched: of those, the best searched exactly (every device order and bottleneck cap).
        simulated: candidates scored by the scoring function (the simulator), at the profile's medians.
        simulations: every call of the scoring function: the candidates, the robust draws and the sync modes.
        stopped_by: why no more candidates were simulated: ``"time budget"``, ``"simulate_top_k"``,
            ``"closed form"`` (no candidate left could win), ``"all candidates"``, ``"no scoring function"``.
        time_budget_s: the budget it was given (None: no limit).
        past_budget_s: the seconds the chosen plan's simulation took where the budget had stopped the simulations
            before it (the chosen plan is always simulated, ``search._simulated_past_budget``); None where it was
            simulated within the budget (or not at all: no scoring function, ``simulate_top_k=0``). Recorded
            only where set, so that a plan made within its budget is the same data on every run.
    """

    screened: int
    searched: int
    simulated: int
    simulations: int
    stopped_by: str
    time_budget_s: float | None
    past_budget_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.past_budget_s is None:
            del out["past_budget_s"]
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> PlannerReport:
        return PlannerReport(int(data["screened"]), int(data["searched"]), int(data["simulated"]),
                             int(data["simulations"]), str(data["stopped_by"]),
                             None if data.get("time_budget_s") is None else float(data["time_budget_s"]),
                             None if data.get("past_budget_s") is None else float(data["past_budget_s"]))


def format_planner_report(report: PlannerReport, elapsed_s: float | None = None) -> str:
    """``"screened 18,432, searched 40, simulated 12 in 9.1 s (time budget 10 s; stopped by the time budget)"``.

    Example:
        >>> format_planner_report(PlannerReport(18432, 40, 12, 12, "time budget", 10.0), 9.1)
        'screened 18,432, searched 40, simulated 12 in 9.1 s (time budget 10 s; simulation stopped by the time budget)'
    """
    text = f"screened {report.screened:,}, searched {report.searched:,}, simulated {report.simulated:,}"
    if report.simulations > report.simulated:
        text += f" ({report.simulations:,} simulations with the draws and sync modes)"
    if elapsed_s is not None:
        text += f" in {elapsed_s:.1f} s"
    budget = "no time budget" if report.time_budget_s is None else f"time budget {report.time_budget_s:g} s"
    why = {"time budget": "the time budget", "simulate_top_k": "simulate_top_k",
           "closed form": "the closed form (no candidate left could win)", "all candidates": "the last candidate",
           "no scoring function": "having no scoring function"}.get(report.stopped_by, report.stopped_by)
    past = "" if report.past_budget_s is None else \
        f"; the chosen plan simulated past it in {report.past_budget_s:.1f} s"
    return f"{text} ({budget}; simulation stopped by {why}{past})"


def format_budget_overrun(budget_s: float | None, plan_s: float, rows_s: float,
                          past_budget_s: float | None = None) -> str:
    """One line where ``hetrain plan`` took longer than its time budget, saying what it took: the plan (and of it
    the chosen plan's simulation past the budget, where it ran one) and the comparison rows; "" within it:
    ``time budget 10 s: took 12.3 s (the plan 8.1 s, the chosen plan's simulation alone 2.1 s; the comparison
    rows 4.2 s)``.

    Example:
        >>> format_budget_overrun(10.0, 8.1, 4.2, 2.1).startswith("time budget 10 s: took 12.3 s (the plan 8.1 s")
        True
        >>> format_budget_overrun(10.0, 5.0, 1.0)
        ''
    """
    took_s = plan_s + rows_s
    if budget_s is None or took_s <= budget_s:
        return ""
    past = "" if past_budget_s is None else f", the chosen plan's simulation alone {past_budget_s:.1f} s"
    return f"time budget {budget_s:g} s: took {took_s:.1f} s (the plan {plan_s:.1f} s{past}; " \
           f"the comparison rows {rows_s:.1f} s)"

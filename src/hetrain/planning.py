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

or, where the host has a second CPU and the plan's sync mode is known before it is made (given, or ``auto``'s
bsp), the families beside the plan, in a forked process of their own (``FamiliesBeside``)::

    | the plan: PLAN_SHARE of it                   |
    | dp and pp: the rest of the budget, at once   |

The families' planning is the same either way (the same options and budget rules, the plan's sync mode); beside
the plan it only overlaps it. Where the plan's mode turns out other than the one guessed, or the process fails,
the families are planned here after the plan, as before. At 4096 devices the families take 3 to 6 s, a third
of ``hetrain plan``'s time (benchmarks/planner_scale.py).

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

import contextlib
import gc
import io
import os
import pickle
import select
import signal
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
    return plan.with_options({**plan.options, PLANNER_KEY: recorded})


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
        families_s: seconds the families added after the plan: all they took, or where they ran beside it
            (``beside``), the wait for them once the plan was made.
        beside: whether the families were planned beside the plan, in a process of their own.
    """

    plan: Plan
    families: list[FamilyPlan]
    plan_s: float
    families_s: float
    beside: bool = False

    @property
    def took_s(self) -> float:
        return self.plan_s + self.families_s


def plan_and_compare(cluster: Cluster, profile: ModelProfile, global_batch: int,
                     options: PlannerOptions, beside: bool | None = None) -> Compared:
    """The plan and the pure families within one time budget, ``options.time_budget_s``: the plan in
    ``PLAN_SHARE`` of it, the families (under the plan's sync mode, simulated where it is) in what is left.

    ``beside``: plan the families in a forked process while the plan is made (``FamiliesBeside``); None: where
    the host gives this process a second CPU and can fork. Either way they are planned with the same options.

    The plan records the whole budget, the one the user gave, in its planner options and report. Each
    planning's chosen plan is simulated whatever the budget left, so ``took_s`` can exceed it
    (``budget.format_budget_overrun`` says by what).
    """
    budget_s = options.time_budget_s
    start = time.perf_counter()
    if beside is None:
        beside = hasattr(os, "fork") and usable_cpus() > 1
    guess = options.sync if options.sync != "auto" else "bsp"  # what ``auto`` picks unless another mode is faster
    simulate = 0 if options.simulate_top_k == 0 else 1  # the plan is simulated unless nothing is
    ahead = FamiliesBeside.start(cluster, profile, global_batch, replace(
        options, sync=guess, simulate_top_k=simulate,
        time_budget_s=None if budget_s is None else (1 - PLAN_SHARE) * budget_s)) if beside else None
    try:
        share = None if budget_s is None else PLAN_SHARE * budget_s
        best = plan_with_simulator(cluster, profile, global_batch, replace(options, time_budget_s=share))
        plan_s = time.perf_counter() - start
        report = replace(PlannerReport.from_dict(best.options[REPORT_KEY]), time_budget_s=budget_s)
        best = record_planner_options(best.with_options({**best.options, REPORT_KEY: report.to_dict()}),
                                      options)
        families = None
        if ahead is not None and best.sync == guess and \
                bool(best.prediction.simulated_iteration_s) == bool(simulate):
            families = ahead.result(max(60.0, 3 * plan_s))
    finally:
        if ahead is not None:
            ahead.stop()
    if families is not None:
        return Compared(best, families, plan_s, time.perf_counter() - start - plan_s, beside=True)
    left = None if budget_s is None else max(0.0, budget_s - plan_s)
    simulate = 1 if best.prediction.simulated_iteration_s else 0
    families = plan_families(cluster, profile, global_batch,
                             replace(options, sync=best.sync, simulate_top_k=simulate, time_budget_s=left))
    return Compared(best, families, plan_s, time.perf_counter() - start - plan_s)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the system has one (Linux), else the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


class FamiliesBeside:
    """``plan_families`` in a forked child process, its result read back through a pipe.

    The planner is pure Python: a second process is the one way to use a second CPU. The child is forked (no
    pickling of the cluster and profile, no new interpreter), plans, writes its pickled ``FamilyPlan`` list and
    leaves with ``os._exit`` (no exit handlers of the parent run in it). Any failure of the child, a result not
    read in time, or one that does not unpickle, is None: the caller plans the families itself, so a family's
    refusal reaches the user from the same code as without the child.
    """

    def __init__(self, pid: int, fd: int, shared: dict[str, object], thaw: bool = True) -> None:
        self.pid, self.fd, self.shared, self.thaw = pid, fd, shared, thaw

    @staticmethod
    def start(cluster: Cluster, profile: ModelProfile, global_batch: int,
              options: PlannerOptions) -> FamiliesBeside | None:
        """Fork the child planning the families with ``options``; None where the fork fails."""
        read, write = os.pipe()
        # every object so far into the collector's permanent generation (``gc.freeze``) until ``stop``: a collection
        # writes to each object it scans, which would copy every page the two processes still share (at 4096
        # devices the plan ran 40% slower beside its child, after a first planning in the same process)
        thaw = gc.get_freeze_count() == 0  # a caller's own frozen objects stay frozen
        gc.freeze()
        try:
            pid = os.fork()
        except OSError:
            if thaw:
                gc.unfreeze()
            os.close(read)
            os.close(write)
            return None
        if pid == 0:  # the child: plan, write, leave without running the parent's exit handlers
            code = 1
            try:
                os.close(read)
                families = plan_families(cluster, profile, global_batch, options)
                with os.fdopen(write, "wb") as out:
                    _Shared(out, {id(cluster): "cluster", id(profile): "profile"}).dump(families)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        return FamiliesBeside(pid, read, {"cluster": cluster, "profile": profile}, thaw)

    def result(self, timeout_s: float) -> list[FamilyPlan] | None:
        """The child's families, read within ``timeout_s``; None where it failed or did not answer in time."""
        deadline = time.monotonic() + timeout_s
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None  # not answered in time: ``stop`` kills it
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            return None
        try:
            loader = pickle.Unpickler(io.BytesIO(b"".join(chunks)))
            loader.persistent_load = self.shared.__getitem__  # type: ignore[method-assign]
            families = loader.load()
        except Exception:  # a truncated or foreign result: plan the families here
            return None
        return families if isinstance(families, list) else None

    def stop(self) -> None:
        """Close the pipe; kill and reap the child where it is still running; let the collector scan the objects
        frozen at the fork again (unless the caller had frozen objects of its own)."""
        if self.thaw:
            gc.unfreeze()
        os.close(self.fd)
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0


class _Shared(pickle.Pickler):
    """A pickler that writes the objects of ``names`` (by id) as their names: the family plans' cluster and
    profile are the parent's own, which it hands back on loading (``FamiliesBeside.result``). A 4096-device
    cluster's link matrices alone are 256 MB per plan, which pickling took seconds to copy."""

    def __init__(self, out: Any, names: dict[int, str]) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.names = names

    def persistent_id(self, obj: Any) -> str | None:
        return self.names.get(id(obj))

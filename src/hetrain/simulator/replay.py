"""``simulate``: build each iteration's schedule, compile it, replay it, and summarise."""

from __future__ import annotations

import gc

from hetrain.plan import Plan
from hetrain.schedule import ActionKind, Schedule, build_schedule, sync_options, validate
from hetrain.simulator.compile import compile_program
from hetrain.simulator.engine import run_program
from hetrain.simulator.result import SimResult, build_result

#: iterations replayed for a sync mode whose iterations differ (the result is their average)
ASYNC_ITERATIONS = 12


def simulated_iterations(plan: Plan) -> int:
    """How many iterations ``simulate`` replays: 1 for ``bsp``; for the other modes enough to cover their periods."""
    if plan.sync == "bsp":
        return 1
    opts = sync_options(plan)
    period = opts.aggregate if plan.sync == "hybrid-ps" else opts.period
    return max(ASYNC_ITERATIONS, 3 * period, 2 * (opts.staleness + 1))


def simulate(plan: Plan, schedule: Schedule | None = None, iterations: int | None = None) -> SimResult:
    """Replay ``plan``'s iterations and time every action; the result is per iteration (an average over several
    for the sync modes other than ``bsp``, whose iterations differ and whose fast VWs may run ahead).

    Args:
        plan: the plan (cluster and profile included).
        schedule: the Actions of one iteration to replay; by default ``build_schedule(plan, t)`` for
            each iteration t. A schedule passed in is validated first and replayed once.
        iterations: how many iterations to replay (default ``simulated_iterations(plan)``).

    Raises:
        ScheduleError: an invalid schedule, or an action kind the simulator cannot time.

    Example:
        >>> r = simulate(plan)                                     # doctest: +SKIP
        >>> r.iteration_s, r.devices["n0:0"].bubble_fraction       # doctest: +SKIP
    """
    if schedule is None:
        n = simulated_iterations(plan) if iterations is None else iterations
        schedules = [build_schedule(plan, t, n) for t in range(n)]
        if plan.sync == "daso":
            schedules = [build_schedule(plan, t, n, None, t > 0 and any(
                a.kind is ActionKind.AVERAGE_START for acts in schedules[t - 1].values() for a in acts))
                for t in range(n)]
    else:
        validate(schedule, plan)
        schedules = [schedule]
    # The replay allocates one tuple per event and frees none: the cyclic garbage collector
    # would re-scan them over and over (a third of the time on 1024 devices) and find nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        program = compile_program(plan, schedules)
        return build_result(program, run_program(program))
    finally:
        if enabled:
            gc.enable()

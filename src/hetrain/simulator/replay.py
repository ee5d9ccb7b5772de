"""``simulate``: build each iteration's schedule, compile it, replay it, and summarise."""

from __future__ import annotations

import gc
from dataclasses import replace

from hetrain.plan import DeviceMemory, Plan, Prediction
from hetrain.schedule import (
    Schedule,
    ScheduleTemplates,
    advance_sync_state,
    build_schedule,
    build_schedule_templates,
    initial_sync_state,
    steady_sync_state,
    validate,
)
from hetrain.simulator.compile import compile_program
from hetrain.simulator.engine import run_program
from hetrain.simulator.fast_engine import run_program_fast
from hetrain.simulator.result import SimResult, build_result

#: iterations replayed for a sync mode whose iterations differ (the result is their average)
ASYNC_ITERATIONS = 12


def simulated_iterations(plan: Plan) -> int:
    """How many iterations ``simulate`` replays: 1 for the synchronous mode (``bsp``); for the other modes enough to
    cover their periods and their VWs' slack."""
    if plan.sync_mode.synchronous:
        return 1
    opts = plan.sync_options
    return max(ASYNC_ITERATIONS, 3 * plan.sync_mode.period(opts), 2 * (opts.staleness + 1))


def build_schedules(plan: Plan, n: int) -> list[Schedule]:
    """The schedules of iterations 0..n-1 of a run of ``n``: the sync state advanced after each
    (``schedule.advance_sync_state``, as the trainer does; the plan's DASO period throughout)."""
    state, out = initial_sync_state(plan), []
    for _ in range(n):
        out.append(build_schedule(plan, state, n))
        state = advance_sync_state(plan, state, n)
    return out


def build_schedule_templates_of(plan: Plan, n: int, steady: bool = False) -> list[ScheduleTemplates]:
    """``build_schedules(plan, n)`` as templates (``schedule.build_schedule_templates``): what ``simulate``
    compiles, each distinct device role's Actions built once rather than once per device. ``steady``: n iterations
    from the middle of a long run instead (``schedule.steady_sync_state``, no cool-down)."""
    state, out = (steady_sync_state(plan) if steady else initial_sync_state(plan)), []
    steps = None if steady else n
    for _ in range(n):
        out.append(build_schedule_templates(plan, state, steps))
        state = advance_sync_state(plan, state, steps)
    return out


def simulate(plan: Plan, schedule: Schedule | None = None, iterations: int | None = None,
             reference: bool = False) -> SimResult:
    """Replay ``plan``'s iterations and time every action; the result is per iteration (an average over several
    for the sync modes other than ``bsp``, whose iterations differ and whose fast VWs may run ahead).

    Args:
        plan: the plan (cluster and profile included).
        schedule: the Actions of one iteration to replay; by default ``build_schedules(plan, n)``
            (built as its templates, ``build_schedule_templates_of``).
            A schedule passed in is validated first and replayed once.
        iterations: replay the first ``iterations`` of a run that long, DASO's blocking warm-up and cool-down
            included (what the runtime runs in as many steps); default: ``simulated_iterations(plan)`` of a long
            run's steady middle (``schedule.steady_sync_state``), the per-iteration figure the closed form
            predicts and the planner ranks by.
        reference: replay with the reference engine (``engine.run_program``, one call per operation)
            rather than ``fast_engine.run_program_fast``; the same result, slower: for tests that compare them.

    Raises:
        ScheduleError: an invalid schedule, or an action kind the simulator cannot time.

    Example:
        >>> r = simulate(plan)                                     # doctest: +SKIP
        >>> r.iteration_s, r.devices["n0:0"].bubble_fraction       # doctest: +SKIP
    """
    # The schedules (one Action per step), the operations and the replay (one tuple per event) allocate
    # millions of objects and free none: the cyclic garbage collector would re-scan them over and over
    # (a third of the time on 1024 devices, 40% of the schedules' on 4096) and find nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        if schedule is None:
            n = simulated_iterations(plan) if iterations is None else iterations
            schedules: list[Schedule] | list[ScheduleTemplates] = build_schedule_templates_of(
                plan, n, steady=iterations is None)
        else:
            validate(schedule, plan)
            schedules = [schedule]
        program = compile_program(plan, schedules)
        return build_result(program, (run_program if reference else run_program_fast)(program))
    finally:
        if enabled:
            gc.enable()


def with_simulated_prediction(draft: Plan) -> Plan:
    """``draft`` with every predicted figure taken from one replay (a hand-built plan has no closed form,
    ``planner.baselines``):
    the iteration; its pipeline (to the last backward) and the rest after it, as the optimizer step
    (the longest, at most the rest) and sync; each VW's pipeline (to its last backward); each
    device's peak memory."""
    sim = simulate(draft)
    events = sim.timeline.devices
    rest = max(0.0, sim.iteration_s - sim.pipeline_s)
    optimizer_s = min(rest, max((e.end_s - e.start_s for evs in events.values() for e in evs
                                 if e.kind == "optimizer"), default=0.0))
    vws = tuple(replace(vw, predicted_pipeline_s=max(
        (e.end_s for d in vw.devices for e in events.get(d, ()) if e.kind == "backward"), default=0.0))
        for vw in draft.virtual_workers)
    memory = tuple(DeviceMemory(d.device, d.peak_memory_bytes, d.capacity_bytes) for d in sim.devices.values())
    pred = Prediction(iteration_s=sim.iteration_s, samples_per_s=sim.samples_per_s, pipeline_s=sim.pipeline_s,
                      sync_s=rest - optimizer_s, optimizer_s=optimizer_s,
                      memory=memory, simulated_iteration_s=sim.iteration_s)
    return replace(draft, virtual_workers=vws, prediction=pred)

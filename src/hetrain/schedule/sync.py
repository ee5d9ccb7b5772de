"""The sync actions that end each device's iteration, by sync mode, and the state that decides them.

``bsp`` ends every iteration alike: the all-reduce of every gradient bucket, started during the last
backward (``add_bsp_sync``), then STEP. The other modes differ from one iteration to the next (periodic
averages, pushes, DASO's warm-up and cool-down), so ``build_sync_actions`` reads a ``SyncState`` that
the simulator and the trainer both advance after every iteration (``advance_sync_state``).
docs/sync.md describes each mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hetrain.plan import Plan
from hetrain.schedule.actions import Action, ActionKind, BucketSync, SegmentSync, Step
from hetrain.sync_layout import Bucket

K = ActionKind


def add_bsp_sync(actions: list[Action], buckets: Sequence[Bucket]) -> list[Action]:
    """Add the all-reduce of every bucket, in the order given, and STEP.

    Each bucket's ALLREDUCE_START goes right after the last backward (its
    all-reduce starts during that backward, once its gradients are final); the
    ALLREDUCE_WAITs, in the same order, and STEP go at the end.
    """
    if not buckets:
        return [*actions, Step()]
    # the last backward, looked for from the end (only sends follow it)
    last_b = next((k for k in range(len(actions) - 1, -1, -1) if actions[k].kind is K.B), len(actions) - 1)
    starts = [BucketSync(K.ALLREDUCE_START, segment=b.segment, bucket=b.index) for b in buckets]
    waits = [BucketSync(K.ALLREDUCE_WAIT, segment=b.segment, bucket=b.index) for b in buckets]
    return [*actions[:last_b + 1], *starts, *actions[last_b + 1:], *waits, Step()]


def owned_segments(plan: Plan) -> dict[str, list[int]]:
    """Per device, the segments it synchronises: those it owns with at least one other device
    (``SyncLayout.owned_segments_by_device``). A segment held by one device only has nothing to reduce."""
    return plan.layout.owned_segments_by_device()


def buckets_by_device(plan: Plan) -> dict[str, list[Bucket]]:
    """Per device, the buckets it all-reduces in the order it starts them (``SyncLayout.buckets_by_device``)."""
    return plan.layout.buckets_by_device()


@dataclass(frozen=True)
class SyncState:
    """Where the sync mode stands when an iteration begins; ``advance_sync_state`` moves it on.

    The simulator and the trainer both start from ``initial_sync_state`` and call
    ``advance_sync_state`` after every iteration, so they run the same actions (``build_schedule``).

    Attributes:
        iteration: the 0-based index of the coming iteration.
        period: DASO's k, iterations between global averages, which it adapts when the loss plateaus
            (``SyncMode.adaptive``, ``runtime.sync.daso``): the trainer sets it with ``dataclasses.replace``;
            the simulator keeps the plan's. The other modes' period is the plan's (``SyncMode.period``).
        merge_pending: a non-blocking DASO average was started by the previous iteration and is
            merged in this one.
    """

    iteration: int = 0
    period: int = 4
    merge_pending: bool = False


def initial_sync_state(plan: Plan) -> SyncState:
    """The state before iteration 0: the plan's period, nothing pending."""
    return SyncState(0, plan.sync_options.period, False)


def steady_sync_state(plan: Plan) -> SyncState:
    """The state of a long run's first steady iteration: past a posted mode's blocking warm-up (DASO's), which
    with its cool-down is a cost per run, not per iteration. The simulator's prediction starts here and runs no
    cool-down, as the closed form counts neither (``planner.sync.estimate_mode_sync_time``); before it, the
    4 blocking iterations of 12 replayed put DASO 15-20% above its closed form (benchmarks/closed_form_modes.py).
    It starts just after a period's merge, so that whole periods from there hold each average they start and
    its merge (for k = 1 the last merge falls after them)::

        k = 4, warm-up 2:   0 1 | 2 3S 4M | 5 6 7S 8M 9 10 11S 12M ...     S: AVERAGE_START, M: AVERAGE_MERGE
                       blocking ^          ^ the steady replay starts here
    """
    start = initial_sync_state(plan)
    if not plan.sync_mode.posted:
        return start
    i = plan.sync_options.warmup
    return replace(start, iteration=i + (1 - i) % start.period)


def is_global_sync(plan: Plan, state: SyncState) -> bool:
    """Whether the iteration of ``state`` ends with the mode's periodic exchange across VWs: every
    ``SyncMode.period`` iterations, or ``state.period`` where the mode adapts it."""
    mode = plan.sync_mode
    every = state.period if mode.adaptive else mode.period(plan.sync_options)
    return (state.iteration + 1) % every == 0


def is_daso_blocking(plan: Plan, state: SyncState, steps: int | None) -> bool:
    """Whether DASO averages globally and blocking in this iteration: the warm-up and the cool-down."""
    opts = plan.sync_options
    i = state.iteration
    return i < opts.warmup or (steps is not None and i >= steps - opts.cooldown)


def advance_sync_state(plan: Plan, state: SyncState, steps: int | None = None) -> SyncState:
    """The state after the iteration of ``state``: the next iteration, and whether it merges an average this one
    posted (a mode that posts its average, on a period boundary outside the warm-up and the cool-down)."""
    started = plan.sync_mode.posted and not is_daso_blocking(plan, state, steps) and is_global_sync(plan, state)
    return SyncState(state.iteration + 1, state.period, started)


def build_sync_actions(plan: Plan, device: str, state: SyncState | None = None,
                       steps: int | None = None, owned: Mapping[str, list[int]] | None = None) -> list[Action]:
    """The sync actions of ``device`` that end the iteration of ``state`` under ``plan.sync`` (STEP included)::

        synchronous (bsp)     every bucket all-reduced, then STEP (the same every iteration)
        local mean            LOCAL_ALLREDUCE of the segments shared on the node, before STEP
        parameter servers     STEP, then PUSH and PULL on a period boundary (wsp: every iteration, one wave)
        average, blocking     STEP, then AVERAGE on a period boundary (local-sgd)
        average, posted       STEP, AVERAGE_MERGE of last iteration's, then AVERAGE_START on a period
                              boundary, or AVERAGE in the warm-up and the cool-down (daso)

    ``state`` defaults to ``initial_sync_state(plan)``; ``steps`` (the run's length) places DASO's cool-down;
    ``owned`` is ``owned_segments(plan)`` where the caller has it already (``build_schedule``, once per plan).
    """
    mode = plan.sync_mode
    if mode.synchronous:
        return add_bsp_sync([], plan.layout.device_buckets(device))
    state = initial_sync_state(plan) if state is None else state
    shared = (owned_segments(plan) if owned is None else owned).get(device, [])

    def each(kind: ActionKind, segs: Sequence[int]) -> list[Action]:
        return [SegmentSync(kind, segment=s) for s in sorted(segs, reverse=True)]

    out = [*(each(K.LOCAL_ALLREDUCE, plan.layout.local_segments(device)) if mode.local_mean else []), Step()]
    if mode.parameter_servers:
        return out + ([*each(K.PUSH, shared), *each(K.PULL, shared)] if is_global_sync(plan, state) else [])
    if not mode.posted:
        return out + (each(K.AVERAGE, shared) if is_global_sync(plan, state) else [])
    if state.merge_pending:
        out += each(K.AVERAGE_MERGE, shared)
    if is_daso_blocking(plan, state, steps):
        out += each(K.AVERAGE, shared)
    elif is_global_sync(plan, state):
        out += each(K.AVERAGE_START, shared)
    return out

"""Generators: the compute order of each stage, then the sends, receives and sync actions added.

``GENERATORS[plan.schedule]`` gives each stage's forwards and backwards (``gpipe``, ``one_f_one_b``,
``one_f_one_b_eager``);
``add_p2p`` joins consecutive stages with sends and receives; ``build_schedule`` does both for every
virtual worker and ends each device's iteration with its sync actions (``hetrain.schedule.sync``);
``build_schedule_templates`` does it once per distinct device role (``hetrain.schedule.templates``).

Example:
    >>> [str(a) for a in one_f_one_b(m=3, p=2)[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetrain.plan import Plan
from hetrain.schedule.actions import Action, ActionKind, Compute, Schedule, ScheduleError, Transfer
from hetrain.schedule.sync import SyncState, add_bsp_sync, buckets_by_device, build_sync_actions, owned_segments
from hetrain.schedule.templates import DeviceRole, ScheduleTemplates

K = ActionKind


def _f(j: int, i: int) -> Compute:
    return Compute(K.F, stage=j, micro_batch=i)


def _b(j: int, i: int) -> Compute:
    return Compute(K.B, stage=j, micro_batch=i)


def gpipe(m: int, p: int) -> list[list[Compute]]:
    """Compute order of each of ``p`` stages under GPipe: all m forwards, then all m backwards.

    Stage j holds the activations of all m micro-batches (Huang et al., 2019)::

        stage 0: 0F0 0F1 0F2 0B0 0B1 0B2
        stage 1: 1F0 1F1 1F2 1B0 1B1 1B2
    """
    return [[*(_f(j, i) for i in range(m)), *(_b(j, i) for i in range(m))] for j in range(p)]


def one_f_one_b(m: int, p: int) -> list[list[Compute]]:
    """Compute order of each of ``p`` stages under 1F1B (PipeDream-Flush, Narayanan et al., 2021).

    Stage j runs ``min(p - j - 1, m)`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards, so it holds
    at most ``p - j`` micro-batches' activations::

        stage 0: 0F0 0F1 0B0 0F2 0B1 0B2
        stage 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    return [_warm_then_alternate(j, m, min(p - j - 1, m)) for j in range(p)]


def one_f_one_b_eager(m: int, p: int) -> list[list[Compute]]:
    """1F1B with one more warm-up forward on every stage but the last, so each of them holds at most
    ``p - j + 1`` micro-batches' activations (the last one still 1)::

        stage 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        stage 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

    In 1F1B's steady state stage j runs the forward of a micro-batch, then the backward of the one it sent
    on ``p - j - 1`` forwards earlier, whose gradient comes back through every later stage: the stages run
    in lockstep, and each transfer on the way out and back, and any stage slower than the rest, holds up
    every stage before it. One micro-batch more in flight gives each stage a forward's worth of slack to
    absorb them: the next stage's input is sent before this stage waits for a gradient. The simulator tells
    where that pays (``planner.search``, which replays the best plans under it under ``--schedule auto``).
    """
    return [_warm_then_alternate(j, m, min(p - j - (j == p - 1), m)) for j in range(p)]


def _warm_then_alternate(j: int, m: int, warmup: int) -> list[Compute]:
    """Stage j's ``warmup`` forwards, then one forward and one backward in turn, then the backwards left."""
    order = [_f(j, i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [_f(j, warmup + k), _b(j, k)]
    order += [_b(j, i) for i in range(m - warmup, m)]
    return order


#: ``Plan.schedule`` -> generator of the compute order per stage
GENERATORS: dict[str, Callable[[int, int], list[list[Compute]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-eager": one_f_one_b_eager}


def add_p2p(compute: Sequence[Compute], prev_device: str | None, next_device: str | None) -> list[Action]:
    """Insert sends and receives around one stage's compute actions.

    A receive goes right before the compute that needs it (RECV_F before F of a
    stage with a predecessor, RECV_B before B of a stage with a successor); a
    send right after the compute that produced it.
    """
    return _add_p2p(compute, prev_device is not None, next_device is not None, prev_device, next_device)


def _add_p2p(compute: Sequence[Compute], has_prev: bool, has_next: bool,
             prev_device: str | None, next_device: str | None) -> list[Action]:
    """``add_p2p`` for a stage with a predecessor / successor or not; the transfers name ``prev_device`` /
    ``next_device`` as their peers (None in a template: ``hetrain.schedule.templates``)."""
    out: list[Action] = []
    append, f_kind = out.append, K.F
    # positional arguments: a Transfer built per micro-batch and stage boundary, millions on a large plan
    for a in compute:
        j, i = a.stage, a.micro_batch
        if a.kind is f_kind:
            if has_prev:
                append(Transfer(K.RECV_F, j, i, prev_device))
            append(a)
            if has_next:
                append(Transfer(K.SEND_F, j, i, next_device))
        else:  # B
            if has_next:
                append(Transfer(K.RECV_B, j, i, next_device))
            append(a)
            if has_prev:
                append(Transfer(K.SEND_B, j, i, prev_device))
    return out


def build_schedule(plan: Plan, state: SyncState | None = None, steps: int | None = None) -> Schedule:
    """Every device's Actions for the iteration of ``state`` (default: the first) of ``plan``.

    Each VW gets its own pipeline from ``GENERATORS[plan.schedule]`` (its own
    stage count p and micro-batch count m); sends and receives join its stages;
    then every device runs its sync mode's actions (``build_sync_actions``):
    for ``bsp`` it all-reduces its segments' gradient buckets, started during its
    last backward (``add_bsp_sync``), and steps, the same every iteration;
    the other modes differ from one iteration to the next (periodic averages,
    pushes), hence the sync state (``SyncState``, ``advance_sync_state``).
    Devices that run alike share their Actions' template (``build_schedule_templates``).

    Raises:
        ScheduleError: a schedule or sync mode with no generator.
    """
    return build_schedule_templates(plan, state, steps).schedule()


def build_schedule_templates(plan: Plan, state: SyncState | None = None,
                             steps: int | None = None) -> ScheduleTemplates:
    """``build_schedule``'s Actions, each distinct template built once (``hetrain.schedule.templates``).

    A device's Actions depend on its VW's micro-batch count m and stage count p, its stage j (whether it
    has a predecessor and a successor follows from j and p), its neighbours (the transfers' peers, filled
    in per device) and its sync actions (for ``bsp``, the (segment, bucket) of each bucket it all-reduces,
    in order; for the other modes, the actions ``build_sync_actions`` gives it): the template's key.

    Raises:
        ScheduleError: a schedule or sync mode with no generator.
    """
    if plan.schedule not in GENERATORS:
        raise ScheduleError(f"no generator for schedule {plan.schedule!r}; known: {', '.join(GENERATORS)}")
    generate = GENERATORS[plan.schedule]
    orders: dict[tuple[int, int], list[list[Compute]]] = {}
    keys: dict[tuple[object, ...], int] = {}
    templates: list[list[Action]] = []
    roles: dict[str, DeviceRole] = {}
    bsp = plan.sync_mode.synchronous
    buckets = buckets_by_device(plan) if bsp else {}
    owned = owned_segments(plan) if not bsp else {}
    for vw in plan.virtual_workers:
        m, p, devices = vw.micro_batches, len(vw.stages), vw.devices
        if (m, p) not in orders:
            orders[(m, p)] = generate(m, p)
        for j, compute in enumerate(orders[(m, p)]):
            device = devices[j]
            if bsp:  # bucket all-reduces interleaved with the last backward
                mine = buckets.get(device, [])
                sync: list[Action] = []
                key: tuple[object, ...] = (m, p, j, tuple((b.segment, b.index) for b in mine))
            else:
                mine, sync = [], build_sync_actions(plan, device, state, steps, owned)
                key = (m, p, j, tuple(sync))
            k = keys.get(key)
            if k is None:
                k = keys[key] = len(templates)
                actions = _add_p2p(compute, j > 0, j < p - 1, None, None)
                templates.append(add_bsp_sync(actions, mine) if bsp else [*actions, *sync])
            roles[device] = DeviceRole(k, devices[j - 1] if j > 0 else None, devices[j + 1] if j < p - 1 else None)
    return ScheduleTemplates(templates, roles)

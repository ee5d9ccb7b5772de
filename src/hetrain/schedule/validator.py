"""``validate``: a schedule checked against its plan before anything runs it.

The static checks look at each device's actions on their own (stage, micro-batch, peer, segment,
bucket; every F, B and STEP present; bucket starts in one order per process group); then
``Interpreter`` executes the dependencies abstractly. The first problem raises a ScheduleError
whose message holds the grid with ``<-- ERROR HERE``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetrain.plan import Plan
from hetrain.schedule.actions import P2P_KINDS, Action, ActionKind, BucketSync, Compute, SegmentSync, Transfer
from hetrain.schedule.grid import schedule_error
from hetrain.schedule.interpret import Interpreter
from hetrain.schedule.roles import StageRole, action_ident, device_roles
from hetrain.sync_layout import Segment

K = ActionKind


def _static_problem(a: Action, role: StageRole, num_buckets: Sequence[int], owned: set[int], device: str) -> str | None:
    """What is wrong with action ``a`` on its own, or None."""
    match a:
        case Compute() | Transfer():
            if a.stage != role.j:
                return f"{a} names stage {a.stage}, but {device} holds stage {role.j}"
            if not 0 <= a.micro_batch < role.m:
                return f"{a}: micro-batch {a.micro_batch} is outside 0..{role.m - 1} of VW{role.vw}"
            if isinstance(a, Transfer):
                return _peer_problem(a, role)
        case SegmentSync() | BucketSync():
            if not 0 <= a.segment < len(num_buckets):
                return f"{a}: the plan has segments 0..{len(num_buckets) - 1}"
            if a.segment not in owned:
                return f"{a}: {device} does not hold segment {a.segment}"
            if isinstance(a, BucketSync) and not 0 <= a.bucket < num_buckets[a.segment]:
                return f"{a}: segment {a.segment} has buckets 0..{num_buckets[a.segment] - 1}"
    return None


def _peer_problem(a: Transfer, role: StageRole) -> str | None:
    """What is wrong with the peer of send or receive ``a``, or None."""
    offset, _ = P2P_KINDS[a.kind]
    want = role.next if offset > 0 else role.prev
    if want is None:
        return f"{a}: stage {role.j} of VW{role.vw} has no stage {role.j + offset}"
    if a.peer != want:
        return f"{a}: the peer must be {want} (stage {role.j + offset} of VW{role.vw}), not {a.peer}"
    return None


def validate(schedule: Mapping[str, Sequence[Action]], plan: Plan) -> None:
    """Check that ``schedule`` runs ``plan`` to the end.

    Static: every device of the plan has actions and no other device does;
    each action names its device's stage, an existing micro-batch and the right
    peer; every stage has one F and one B per micro-batch and one STEP. Then the
    dependencies are executed abstractly: a device runs its actions in order; a
    RECV waits for the matching SEND (same kind, micro-batch and pair of
    devices); an ALLREDUCE waits for every owner of its segment; F needs its
    RECV_F, B needs its F and RECV_B, a send needs the compute it ships,
    ALLREDUCE and STEP need every backward. ALLREDUCE_START does not wait; an
    ALLREDUCE_WAIT waits until every owner of its segment has started the
    bucket, and the owners of one set of segments must start their buckets in
    the same order (one process group runs its collectives in issue order). If
    nothing can run while actions remain, that is a deadlock. Every send must be
    received.

    Raises:
        ScheduleError: the first problem, with the step-by-device grid and ``<-- ERROR HERE``.
    """
    roles = device_roles(plan)
    segments = plan.segments()
    num_buckets = [len(seg.buckets) for seg in segments]
    owners = {s: set(seg.owners) for s, seg in enumerate(segments)}
    _check_static(schedule, roles, num_buckets, owners)
    _check_start_order(schedule, roles, segments)
    node_of = {d.name: d.node for d in plan.cluster.devices}
    Interpreter(schedule, roles, owners, node_of, plan.sync_mode.synchronous, num_buckets).run()


def _check_static(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, StageRole], num_buckets: Sequence[int],
                  owners: Mapping[int, set[str]]) -> None:
    """``validate``'s static checks: the devices, each action on its own, no action twice, every F, B and STEP."""
    owned: dict[str, set[int]] = {}
    for s, devs in owners.items():
        for dev in devs:
            owned.setdefault(dev, set()).add(s)
    for dev in roles:
        if dev not in schedule:
            raise schedule_error(schedule, roles, None, None, f"{dev} holds stage {roles[dev].j} of "
                                 f"VW{roles[dev].vw} in the plan but has no actions")
    for dev, actions in schedule.items():
        if dev not in roles:
            raise schedule_error(schedule, roles, dev, 0, f"{dev} holds no stage in the plan")
        role = roles[dev]
        seen: dict[tuple[ActionKind, object], int] = {}
        for k, a in enumerate(actions):
            problem = _static_problem(a, role, num_buckets, owned.get(dev, set()), dev)
            if problem is not None:
                raise schedule_error(schedule, roles, dev, k, problem)
            key = (a.kind, action_ident(a))
            if key in seen:
                raise schedule_error(schedule, roles, dev, k, f"{a} appears twice (first at step {seen[key]})")
            seen[key] = k
        last = len(actions) - 1
        for kind in (K.F, K.B):
            missing = [i for i in range(role.m) if (kind, i) not in seen]
            if missing:
                raise schedule_error(schedule, roles, dev, last, f"{dev} never runs "
                                     f"{Compute(kind, role.j, missing[0])} ({len(missing)} {kind.value} "
                                     "action(s) missing)")
        if (K.STEP, None) not in seen:
            raise schedule_error(schedule, roles, dev, last, f"{dev} has no STEP")


def _check_start_order(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, StageRole],
                       segments: Sequence[Segment]) -> None:
    """The owners of each owner set start its buckets in one order (their all-reduces share one process group)."""
    first: dict[tuple[str, ...], tuple[str, list[tuple[int, int]]]] = {}  # owner set -> (device, its starts)
    for dev, actions in schedule.items():
        mine: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        for a in actions:
            if isinstance(a, BucketSync) and a.kind is K.ALLREDUCE_START:
                mine.setdefault(tuple(segments[a.segment].owners), []).append((a.segment, a.bucket))
        for group, order in mine.items():
            if group not in first:
                first[group] = (dev, order)
                continue
            other, want = first[group]
            if order != want:
                k = next((n for n, (x, y) in enumerate(zip(order, want, strict=False)) if x != y),
                         min(len(order), len(want)))
                got = f"seg{order[k][0]} bucket{order[k][1]}" if k < len(order) else "nothing"
                exp = f"seg{want[k][0]} bucket{want[k][1]}" if k < len(want) else "nothing"
                step = [n for n, a in enumerate(actions) if a.kind is K.ALLREDUCE_START][:len(order)]
                message = (f"the owners of {', '.join(group)} start their bucket all-reduces in different orders: "
                           f"{dev} starts {got} where {other} starts {exp} (start number {k}); the all-reduces of "
                           "one set of owners share a process group, which must see them in one order")
                raise schedule_error(schedule, roles, dev, step[min(k, len(step) - 1)] if step else None, message)

"""Schedules as data: the Actions every device runs in one iteration.

A schedule is generated once from a Plan (DESIGN.md decision 2) and consumed,
unchanged, by the validator, the simulator and the runtime. Its language is
small: ``1F0`` is the forward of micro-batch 0 on stage 1, ``1B3`` a backward,
``SEND_F 1->2 mb0 to n0:2`` ships stage 1's activation of micro-batch 0 to the
device of stage 2, ``RECV_B 2->1 mb3 from n0:2`` waits for a gradient,
``ALLREDUCE_START seg2 bucket0`` posts the all-reduce of the gradients of the
first bucket (the last layers) of ``Plan.segments()[2]`` among the segment's
owners, ``ALLREDUCE_WAIT seg2 bucket0`` waits for it, ``STEP`` runs the
optimizer. Each form is one small class holding the fields its kinds need:
``Compute`` (F, B), ``Transfer`` (the sends and receives), ``SegmentSync`` (a
segment's ALLREDUCE, AVERAGE, PUSH...), ``BucketSync`` (ALLREDUCE_START,
ALLREDUCE_WAIT) and ``Step``; ``Action`` is their union, narrowed with
``match``. 1F1B with p = 2 stages and m = 3
micro-batches, as ``format_grid`` prints it::

    step | n0:0                      | n0:1
    -----+---------------------------+---------------------------
       0 | 0F0                       | RECV_F 0->1 mb0 from n0:0
       1 | SEND_F 0->1 mb0 to n0:1   | 1F0
       2 | 0F1                       | 1B0
       3 | SEND_F 0->1 mb1 to n0:1   | SEND_B 1->0 mb0 to n0:0
       4 | RECV_B 1->0 mb0 from n0:1 | RECV_F 0->1 mb1 from n0:0
       5 | 0B0                       | 1F1
       ...
      12 | STEP                      | STEP

Semantics (what the validator checks, the simulator times and the runtime must
do): a SEND is posted and does not hold the device (an ``isend`` whose handle
is waited on before the optimizer step); a RECV holds the device until the data
has arrived; an ALLREDUCE holds every owner of its segment until all of them
reach it and the collective completes.

Under ``bsp`` each segment is cut into gradient buckets (``SyncLayout``'s buckets: runs
of layers of about ``bucket_bytes``, the first one smaller, in reverse layer
order, as PyTorch's DistributedDataParallel buckets its gradients). The
``ALLREDUCE_START`` of every bucket follows the device's last backward: the
bucket's all-reduce starts *during* that backward, as soon as it has computed
the bucket's gradients (they are final then), and runs while the backward goes
on through the earlier layers; it does not hold the device. The
``ALLREDUCE_WAIT`` actions before STEP hold the device until their all-reduces
are done (one device of pure data parallelism, two buckets)::

    ... 0B2  ALLREDUCE_START seg0 bucket0  ALLREDUCE_START seg0 bucket1
        ALLREDUCE_WAIT seg0 bucket0  ALLREDUCE_WAIT seg0 bucket1  STEP

                     0B2, the last backward       WAITs       STEP
    device  |=========|=========|=========|...............|=====|
    link              |bucket0 all-reduce |bucket1 all-red|
                      ^ bucket 0's gradients are final here

Every device starts its buckets in decreasing segment order and, within a
segment, from the last layers to the first (the order their gradients become
final); the validator checks that the owners of each set of segments start
theirs in the same order, since collectives of one process group must be issued
in one order on all its members.

Example:
    >>> schedule = build_schedule(plan)            # doctest: +SKIP
    >>> validate(schedule, plan)                   # doctest: +SKIP
    >>> print(format_grid(schedule))               # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.sync_layout import Bucket, Segment


class ScheduleError(InputError):
    """A schedule that cannot run: the message holds a step-by-device grid marking the faulty action."""


class ActionKind(str, Enum):
    """What an Action does. Later sync modes add kinds (PUSH, PULL) to the groups below."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"
    LOCAL_ALLREDUCE = "LOCAL_ALLREDUCE"
    AVERAGE = "AVERAGE"
    AVERAGE_START = "AVERAGE_START"
    AVERAGE_MERGE = "AVERAGE_MERGE"
    PUSH = "PUSH"
    PULL = "PULL"
    ALLREDUCE_START = "ALLREDUCE_START"
    ALLREDUCE_WAIT = "ALLREDUCE_WAIT"


K = ActionKind
#: forward / backward of one micro-batch on one stage
COMPUTE_KINDS: frozenset[ActionKind] = frozenset({K.F, K.B})
#: point-to-point kinds -> (stage offset of the peer, is a send)
P2P_KINDS: dict[ActionKind, tuple[int, bool]] = {
    K.SEND_F: (+1, True), K.RECV_F: (-1, False), K.SEND_B: (-1, True), K.RECV_B: (+1, False),
}
#: the receive that matches each send, and back
COUNTERPART: dict[ActionKind, ActionKind] = {
    K.SEND_F: K.RECV_F, K.RECV_F: K.SEND_F, K.SEND_B: K.RECV_B, K.RECV_B: K.SEND_B,
}
#: kinds that act on one segment of layers (``Plan.segments()``); docs/sync.md says what each does
SEGMENT_KINDS: frozenset[ActionKind] = frozenset({K.ALLREDUCE, K.LOCAL_ALLREDUCE, K.AVERAGE, K.AVERAGE_START,
                                                  K.AVERAGE_MERGE, K.PUSH, K.PULL, K.ALLREDUCE_START,
                                                  K.ALLREDUCE_WAIT})
#: segment kinds that act on one gradient bucket of the segment (``Segment.buckets``)
BUCKET_KINDS: frozenset[ActionKind] = frozenset({K.ALLREDUCE_START, K.ALLREDUCE_WAIT})
#: segment kinds that hold every participant until all of them reach it (a blocking collective)
COLLECTIVE_KINDS: frozenset[ActionKind] = frozenset({K.ALLREDUCE, K.LOCAL_ALLREDUCE, K.AVERAGE})


def _check_kind(action: object, kind: ActionKind, allowed: frozenset[ActionKind]) -> None:
    """Raise unless ``kind`` is one of the kinds the class of ``action`` stands for."""
    if kind not in allowed:
        names = ", ".join(sorted(k.value for k in allowed))
        shown = kind.value if isinstance(kind, ActionKind) else repr(kind)
        raise ScheduleError(f"a {type(action).__name__} action is one of {names}, not {shown}")


@dataclass(frozen=True, slots=True)
class Compute:
    """``F`` or ``B``: the forward or backward of micro-batch ``micro_batch`` on stage ``stage``.

    Example:
        >>> str(Compute(ActionKind.B, stage=1, micro_batch=3))
        '1B3'
    """

    kind: ActionKind
    stage: int
    micro_batch: int

    def __post_init__(self) -> None:
        _check_kind(self, self.kind, COMPUTE_KINDS)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"


@dataclass(frozen=True, slots=True)
class Transfer:
    """``SEND_F``, ``RECV_F``, ``SEND_B`` or ``RECV_B`` of micro-batch ``micro_batch`` by stage ``stage``.

    Attributes:
        peer: the device sent to or received from; None where the text names none (``SEND_F 1->2 mb0``).

    Example:
        >>> str(Transfer(ActionKind.SEND_F, stage=1, micro_batch=0, peer="n0:2"))
        'SEND_F 1->2 mb0 to n0:2'
    """

    kind: ActionKind
    stage: int
    micro_batch: int
    peer: str | None = None

    def __post_init__(self) -> None:
        _check_kind(self, self.kind, _TRANSFER_KINDS)

    def __str__(self) -> str:
        src, dst = self.stages_joined
        text = f"{self.kind.value} {src}->{dst} mb{self.micro_batch}"
        if self.peer is not None:
            text += f" {'to' if self.is_send else 'from'} {self.peer}"
        return text

    @property
    def is_send(self) -> bool:
        """Whether it sends (``SEND_F``, ``SEND_B``) rather than receives."""
        return P2P_KINDS[self.kind][1]

    @property
    def stages_joined(self) -> tuple[int, int]:
        """(sending stage, receiving stage)."""
        offset, is_send = P2P_KINDS[self.kind]
        j = self.stage
        return (j, j + offset) if is_send else (j + offset, j)

    def named_peer(self) -> str:
        """``peer``, which a schedule to run names (``validate`` checks it).

        Raises:
            ScheduleError: the action names no peer.
        """
        if self.peer is None:
            raise ScheduleError(f"{self} names no peer device; a schedule to run names it ('... to n0:2')")
        return self.peer


@dataclass(frozen=True, slots=True)
class SegmentSync:
    """A sync action on the whole of segment ``segment`` (an index into ``Plan.segments()``): ``ALLREDUCE``,
    ``LOCAL_ALLREDUCE``, ``AVERAGE``, ``AVERAGE_START``, ``AVERAGE_MERGE``, ``PUSH`` or ``PULL``.

    Example:
        >>> str(SegmentSync(ActionKind.ALLREDUCE, segment=2))
        'ALLREDUCE seg2'
    """

    kind: ActionKind
    segment: int

    def __post_init__(self) -> None:
        _check_kind(self, self.kind, _WHOLE_SEGMENT_KINDS)

    def __str__(self) -> str:
        return f"{self.kind.value} seg{self.segment}"


@dataclass(frozen=True, slots=True)
class BucketSync:
    """``ALLREDUCE_START`` or ``ALLREDUCE_WAIT`` of bucket ``bucket`` (an index into
    ``plan.segments()[segment].buckets``) of segment ``segment``.

    Example:
        >>> str(BucketSync(ActionKind.ALLREDUCE_START, segment=2, bucket=0))
        'ALLREDUCE_START seg2 bucket0'
    """

    kind: ActionKind
    segment: int
    bucket: int

    def __post_init__(self) -> None:
        _check_kind(self, self.kind, BUCKET_KINDS)

    def __str__(self) -> str:
        return f"{self.kind.value} seg{self.segment} bucket{self.bucket}"


@dataclass(frozen=True, slots=True)
class Step:
    """``STEP``: the optimizer step."""

    kind: ActionKind = ActionKind.STEP

    def __post_init__(self) -> None:
        _check_kind(self, self.kind, _STEP_KINDS)

    def __str__(self) -> str:
        return self.kind.value


_TRANSFER_KINDS: frozenset[ActionKind] = frozenset(P2P_KINDS)
_WHOLE_SEGMENT_KINDS: frozenset[ActionKind] = SEGMENT_KINDS - BUCKET_KINDS
_STEP_KINDS: frozenset[ActionKind] = frozenset({K.STEP})

#: One step of one device: enough to execute it with only the Plan at hand. Each class holds the fields its
#: kinds need; ``match`` on the class (or ``isinstance``) narrows an Action to them.
#:
#: Example:
#:     >>> parse_action("1B3")
#:     Compute(kind=<ActionKind.B: 'B'>, stage=1, micro_batch=3)
Action: TypeAlias = Compute | Transfer | SegmentSync | BucketSync | Step


_COMPUTE_RE = re.compile(r"^(\d+)([A-Z])(\d+)$")
_P2P_RE = re.compile(r"^([A-Z_]+) (\d+)->(\d+) mb(\d+)(?: (to|from) (\S+))?$")
_SEGMENT_RE = re.compile(r"^([A-Z_]+) seg(\d+)(?: bucket(\d+))?$")


def parse_action(text: str) -> Action:
    """The Action that ``str(action)`` printed: ``"1F0"``, ``"SEND_F 1->2 mb0 to n0:2"``, ``"STEP"``.

    Raises:
        ScheduleError: text that is none of the forms, naming the forms.
    """
    s = text.strip()
    forms = ("'1F0', '1B3', 'SEND_F 1->2 mb0 to n0:2', 'RECV_B 2->1 mb3 from n0:2', 'ALLREDUCE seg2', "
             "'ALLREDUCE_START seg2 bucket0', 'PUSH seg0', 'STEP'")
    if (mt := _COMPUTE_RE.match(s)) and mt.group(2) in ActionKind.__members__:
        kind = ActionKind(mt.group(2))
        if kind in COMPUTE_KINDS:
            return Compute(kind, stage=int(mt.group(1)), micro_batch=int(mt.group(3)))
    if (mt := _P2P_RE.match(s)) and mt.group(1) in ActionKind.__members__:
        kind = ActionKind(mt.group(1))
        if kind in P2P_KINDS:
            src, dst = int(mt.group(2)), int(mt.group(3))
            offset, is_send = P2P_KINDS[kind]
            j = src if is_send else dst
            if (dst if is_send else src) != j + offset:
                raise ScheduleError(f"{text!r}: {kind.value} joins stage j and j{offset:+d}, not {src}->{dst}")
            if mt.group(5) is not None and (mt.group(5) == "to") != is_send:
                raise ScheduleError(f"{text!r}: a {kind.value} names its peer with {'to' if is_send else 'from'}")
            return Transfer(kind, stage=j, micro_batch=int(mt.group(4)), peer=mt.group(6))
    if (mt := _SEGMENT_RE.match(s)) and mt.group(1) in ActionKind.__members__:
        kind = ActionKind(mt.group(1))
        if kind in BUCKET_KINDS and mt.group(3) is not None:
            return BucketSync(kind, segment=int(mt.group(2)), bucket=int(mt.group(3)))
        if kind in _WHOLE_SEGMENT_KINDS and mt.group(3) is None:
            return SegmentSync(kind, segment=int(mt.group(2)))
    if s == K.STEP.value:
        return Step()
    raise ScheduleError(f"cannot read action {text!r}; actions look like {forms}")


#: the Actions of each device for one iteration, keyed by device name
Schedule = dict[str, list[Action]]


def schedule_to_dict(schedule: Mapping[str, Sequence[Action]]) -> dict[str, list[str]]:
    """``{device: ["0F0", "SEND_F 0->1 mb0 to n0:1", ...]}``: the JSON form of a schedule."""
    return {dev: [str(a) for a in actions] for dev, actions in schedule.items()}


def parse_schedule(data: Mapping[str, Sequence[str]]) -> Schedule:
    """Read back what ``schedule_to_dict`` wrote."""
    return {str(dev): [parse_action(t) for t in texts] for dev, texts in data.items()}


# ---------------------------------------------------------------------------
# generators: compute order per stage, then communication and sync added
# ---------------------------------------------------------------------------


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
    out = []
    for j in range(p):
        warmup = min(p - j - 1, m)
        order = [_f(j, i) for i in range(warmup)]
        for k in range(m - warmup):
            order += [_f(j, warmup + k), _b(j, k)]
        order += [_b(j, i) for i in range(m - warmup, m)]
        out.append(order)
    return out


#: ``Plan.schedule`` -> generator of the compute order per stage
GENERATORS: dict[str, Callable[[int, int], list[list[Compute]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def add_p2p(compute: Sequence[Compute], prev_device: str | None, next_device: str | None) -> list[Action]:
    """Insert sends and receives around one stage's compute actions.

    A receive goes right before the compute that needs it (RECV_F before F of a
    stage with a predecessor, RECV_B before B of a stage with a successor); a
    send right after the compute that produced it.
    """
    out: list[Action] = []
    for a in compute:
        j, i = a.stage, a.micro_batch
        if a.kind is K.F:
            if prev_device is not None:
                out.append(Transfer(K.RECV_F, stage=j, micro_batch=i, peer=prev_device))
            out.append(a)
            if next_device is not None:
                out.append(Transfer(K.SEND_F, stage=j, micro_batch=i, peer=next_device))
        else:  # B
            if next_device is not None:
                out.append(Transfer(K.RECV_B, stage=j, micro_batch=i, peer=next_device))
            out.append(a)
            if prev_device is not None:
                out.append(Transfer(K.SEND_B, stage=j, micro_batch=i, peer=prev_device))
    return out


def add_bsp_sync(actions: list[Action], buckets: Sequence[Bucket]) -> list[Action]:
    """Add the all-reduce of every bucket, in the order given, and STEP.

    Each bucket's ALLREDUCE_START goes right after the last backward (its
    all-reduce starts during that backward, once its gradients are final); the
    ALLREDUCE_WAITs, in the same order, and STEP go at the end.
    """
    if not buckets:
        return [*actions, Step()]
    last_b = max((k for k, a in enumerate(actions) if a.kind is K.B), default=len(actions) - 1)
    starts = [BucketSync(K.ALLREDUCE_START, segment=b.segment, bucket=b.index) for b in buckets]
    waits = [BucketSync(K.ALLREDUCE_WAIT, segment=b.segment, bucket=b.index) for b in buckets]
    return [*actions[:last_b + 1], *starts, *actions[last_b + 1:], *waits, Step()]


def owned_segments(plan: Plan) -> dict[str, list[int]]:
    """Per device, the segments it synchronises: those it owns with at least one other device
    (``SyncLayout.owned_segments``). A segment held by one device only has nothing to reduce."""
    out: dict[str, list[int]] = {}
    for s, seg in enumerate(plan.layout.segments):
        if seg.shared:
            for dev in seg.owners:
                out.setdefault(dev, []).append(s)
    return out


@dataclass(frozen=True)
class SyncState:
    """Where the sync mode stands when an iteration begins; ``advance_sync_state`` moves it on.

    The simulator and the trainer both start from ``initial_sync_state`` and call
    ``advance_sync_state`` after every iteration, so they run the same actions (``build_schedule``).

    Attributes:
        iteration: the 0-based index of the coming iteration.
        period: k of ``local-sgd`` and ``daso``: iterations between global averages. DASO adapts
            it when the loss plateaus (``runtime.modes.DasoRate``): the trainer sets it with
            ``dataclasses.replace``; the simulator keeps the plan's.
        merge_pending: a non-blocking DASO average was started by the previous iteration and is
            merged in this one.
    """

    iteration: int = 0
    period: int = 4
    merge_pending: bool = False


def initial_sync_state(plan: Plan) -> SyncState:
    """The state before iteration 0: the plan's period, nothing pending."""
    return SyncState(0, plan.sync_options.period, False)


def is_global_sync(plan: Plan, state: SyncState) -> bool:
    """Whether the iteration of ``state`` ends with the mode's periodic global sync."""
    every = plan.sync_options.aggregate if plan.sync == "hybrid-ps" else state.period
    return (state.iteration + 1) % every == 0


def is_daso_blocking(plan: Plan, state: SyncState, steps: int | None) -> bool:
    """Whether DASO averages globally and blocking in this iteration: the warm-up and the cool-down."""
    opts = plan.sync_options
    i = state.iteration
    return i < opts.warmup or (steps is not None and i >= steps - opts.cooldown)


def advance_sync_state(plan: Plan, state: SyncState, steps: int | None = None) -> SyncState:
    """The state after the iteration of ``state``: the next iteration, and whether it merges a DASO
    average this one started (a non-blocking average, on a period boundary outside warm-up and cool-down)."""
    started = plan.sync == "daso" and not is_daso_blocking(plan, state, steps) and is_global_sync(plan, state)
    return SyncState(state.iteration + 1, state.period, started)


def build_sync_actions(plan: Plan, device: str, state: SyncState | None = None,
                       steps: int | None = None) -> list[Action]:
    """The sync actions of ``device`` that end the iteration of ``state`` under ``plan.sync`` (STEP included).

    ``state`` defaults to ``initial_sync_state(plan)``; ``steps`` (the run's length) places DASO's cool-down.
    """
    state = initial_sync_state(plan) if state is None else state
    shared = owned_segments(plan).get(device, [])
    down = sorted(shared, reverse=True)

    def each(kind: ActionKind, segs: Sequence[int]) -> list[Action]:
        return [SegmentSync(kind, segment=s) for s in sorted(segs, reverse=True)]

    mode = plan.sync
    if mode == "bsp":
        return add_bsp_sync([], plan.layout.device_buckets(device))
    if mode == "wsp":  # every iteration is one wave: local step, push the wave's update, pull within D
        return [Step(), *each(K.PUSH, down), *each(K.PULL, down)]
    if mode == "local-sgd":
        return [Step(), *(each(K.AVERAGE, down) if is_global_sync(plan, state) else [])]
    local = each(K.LOCAL_ALLREDUCE, plan.layout.local_segments(device))
    if mode == "hybrid-ps":
        glob = [*each(K.PUSH, down), *each(K.PULL, down)] if is_global_sync(plan, state) else []
        return [*local, Step(), *glob]
    if mode == "daso":
        out = [*local, Step()]
        if state.merge_pending:
            out += each(K.AVERAGE_MERGE, down)
        if is_daso_blocking(plan, state, steps):
            out += each(K.AVERAGE, down)
        elif is_global_sync(plan, state):
            out += each(K.AVERAGE_START, down)
        return out
    raise ScheduleError(f"sync mode {mode!r} has no schedule; known: bsp, wsp, hybrid-ps, daso, local-sgd")


def build_schedule(plan: Plan, state: SyncState | None = None, steps: int | None = None) -> Schedule:
    """Every device's Actions for the iteration of ``state`` (default: the first) of ``plan``.

    Each VW gets its own pipeline from ``GENERATORS[plan.schedule]`` (its own
    stage count p and micro-batch count m); sends and receives join its stages;
    then every device runs its sync mode's actions (``build_sync_actions``):
    for ``bsp`` it all-reduces its segments' gradient buckets, started during its
    last backward (``add_bsp_sync``), and steps, the same every iteration;
    the other modes differ from one iteration to the next (periodic averages,
    pushes), hence the sync state (``SyncState``, ``advance_sync_state``).

    Raises:
        ScheduleError: a schedule or sync mode with no generator.
    """
    if plan.schedule not in GENERATORS:
        raise ScheduleError(f"no generator for schedule {plan.schedule!r}; known: {', '.join(GENERATORS)}")
    generate = GENERATORS[plan.schedule]
    orders: dict[tuple[int, int], list[list[Compute]]] = {}
    out: Schedule = {}
    for vw in plan.virtual_workers:
        m, p, devices = vw.micro_batches, len(vw.stages), vw.devices
        if (m, p) not in orders:
            orders[(m, p)] = generate(m, p)
        for j, compute in enumerate(orders[(m, p)]):
            prev_device = devices[j - 1] if j > 0 else None
            next_device = devices[j + 1] if j < p - 1 else None
            actions = add_p2p(compute, prev_device, next_device)
            if plan.sync == "bsp":  # bucket all-reduces interleaved with the last backward
                out[devices[j]] = add_bsp_sync(actions, plan.layout.device_buckets(devices[j]))
            else:
                out[devices[j]] = [*actions, *build_sync_actions(plan, devices[j], state, steps)]
    return out


# ---------------------------------------------------------------------------
# the text grid
# ---------------------------------------------------------------------------

ERROR_MARK = "<-- ERROR HERE"


def format_grid(schedule: Mapping[str, Sequence[Action]], devices: Sequence[str] | None = None,
                steps: range | None = None, marks: Mapping[tuple[str, int], str] | None = None) -> str:
    """A step-by-device table of the schedule: columns are devices, rows steps.

    Args:
        schedule: the schedule.
        devices: the columns (default: every device, in schedule order).
        steps: the rows (default: all).
        marks: text appended to cells, keyed by (device, step), e.g. ``ERROR_MARK``.
    """
    cols = list(schedule) if devices is None else list(devices)
    depth = max((len(schedule[d]) for d in cols), default=0)
    rows = range(depth) if steps is None else steps
    marks = marks or {}

    def cell(dev: str, k: int) -> str:
        actions = schedule[dev]
        text = str(actions[k]) if 0 <= k < len(actions) else ""
        if (dev, k) in marks:
            text = f"{text}  {marks[(dev, k)]}" if text else marks[(dev, k)]
        return text

    table = [[cell(d, k) for d in cols] for k in rows]
    widths = [max([len(d), *(len(r[c]) for r in table)]) for c, d in enumerate(cols)]
    step_w = max(4, len(str(max(rows, default=0))))
    lines = [(f"{'step':>{step_w}} | " + " | ".join(d.ljust(w) for d, w in zip(cols, widths, strict=True))).rstrip(),
             "-" * (step_w + 1) + "+" + "+".join("-" * (w + 2) for w in widths)]
    if len(rows) and rows[0] > 0:
        lines.append(f"{'...':>{step_w}} |")
    for k, r in zip(rows, table, strict=True):
        lines.append(f"{k:>{step_w}} | " + " | ".join(t.ljust(w) for t, w in zip(r, widths, strict=True)).rstrip())
    if len(rows) and rows[-1] < depth - 1:
        lines.append(f"{'...':>{step_w}} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# validation: static checks, then the dependencies executed abstractly
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Role:
    """Where a device sits in the plan."""

    vw: int
    j: int
    p: int
    m: int
    prev: str | None
    next: str | None
    vw_devices: tuple[str, ...]


def _roles(plan: Plan) -> dict[str, _Role]:
    out = {}
    for v, vw in enumerate(plan.virtual_workers):
        devs = tuple(vw.devices)
        p = len(devs)
        for j, dev in enumerate(devs):
            out[dev] = _Role(v, j, p, vw.micro_batches, devs[j - 1] if j > 0 else None,
                             devs[j + 1] if j < p - 1 else None, devs)
    return out


_MAX_GRID_COLUMNS = 8
_MAX_GRID_ROWS = 40


def _fail(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, _Role], device: str | None,
          step: int | None, message: str, also: Mapping[tuple[str, int], str] | None = None) -> ScheduleError:
    """A ScheduleError whose message is ``message`` above the grid, the failing cell marked."""
    marks = dict(also or {})
    if device is not None and step is not None:
        marks[(device, step)] = ERROR_MARK
    cols = list(schedule)
    if len(cols) > _MAX_GRID_COLUMNS and device is not None and device in roles:
        # the failing device's VW around it, then the other devices the marks name
        vw_devs = [d for d in roles[device].vw_devices if d in schedule]
        k = vw_devs.index(device) if device in vw_devs else 0
        lo = max(0, min(k - _MAX_GRID_COLUMNS // 2, len(vw_devs) - _MAX_GRID_COLUMNS))
        cols = vw_devs[lo:lo + _MAX_GRID_COLUMNS]
        cols += [d for d, _ in marks if d not in cols and d in schedule][:max(0, _MAX_GRID_COLUMNS - len(cols))]
    elif len(cols) > _MAX_GRID_COLUMNS:
        keep = cols[:_MAX_GRID_COLUMNS]
        if device is not None and device in schedule and device not in keep:
            keep[-1] = device  # the failing device always gets a column
        cols = keep
    depth = max((len(schedule[d]) for d in cols), default=0)
    rows = range(depth)
    if depth > _MAX_GRID_ROWS and step is not None:
        lo = max(0, min(step - _MAX_GRID_ROWS + 6, depth - _MAX_GRID_ROWS))
        rows = range(lo, lo + _MAX_GRID_ROWS)
    shown = f" ({len(cols)} of {len(schedule)} devices)" if len(cols) < len(schedule) else ""
    where = f"{device} step {step}: " if device is not None and step is not None else ""
    grid = format_grid(schedule, cols, rows, marks) if cols else "(empty schedule)"
    return ScheduleError(f"invalid schedule: {where}{message}\n\nschedule{shown}:\n{grid}")


def _static_problem(a: Action, role: _Role, num_buckets: Sequence[int], owned: set[int], device: str) -> str | None:
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


def _peer_problem(a: Transfer, role: _Role) -> str | None:
    """What is wrong with the peer of send or receive ``a``, or None."""
    offset, _ = P2P_KINDS[a.kind]
    want = role.next if offset > 0 else role.prev
    if want is None:
        return f"{a}: stage {role.j} of VW{role.vw} has no stage {role.j + offset}"
    if a.peer != want:
        return f"{a}: the peer must be {want} (stage {role.j + offset} of VW{role.vw}), not {a.peer}"
    return None


def _ident(a: Action) -> object:
    """What tells two actions of one kind on one device apart: the micro-batch, the segment, or (segment, bucket)."""
    if isinstance(a, (Compute, Transfer)):
        return a.micro_batch
    if isinstance(a, SegmentSync):
        return a.segment
    if isinstance(a, BucketSync):
        return (a.segment, a.bucket)
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
    roles = _roles(plan)
    segments = plan.segments()
    num_buckets = [len(seg.buckets) for seg in segments]
    owners = {s: set(seg.owners) for s, seg in enumerate(segments)}
    _check_static(schedule, roles, num_buckets, owners)
    _check_start_order(schedule, roles, segments)
    node_of = {d.name: d.node for d in plan.cluster.devices}
    _Interpreter(schedule, roles, owners, node_of, plan.sync == "bsp", num_buckets).run()


def _check_static(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, _Role], num_buckets: Sequence[int],
                  owners: Mapping[int, set[str]]) -> None:
    """``validate``'s static checks: the devices, each action on its own, no action twice, every F, B and STEP."""
    owned: dict[str, set[int]] = {}
    for s, devs in owners.items():
        for dev in devs:
            owned.setdefault(dev, set()).add(s)
    for dev in roles:
        if dev not in schedule:
            raise _fail(schedule, roles, None, None, f"{dev} holds stage {roles[dev].j} of VW{roles[dev].vw} "
                        "in the plan but has no actions")
    for dev, actions in schedule.items():
        if dev not in roles:
            raise _fail(schedule, roles, dev, 0, f"{dev} holds no stage in the plan")
        role = roles[dev]
        seen: dict[tuple[ActionKind, object], int] = {}
        for k, a in enumerate(actions):
            problem = _static_problem(a, role, num_buckets, owned.get(dev, set()), dev)
            if problem is not None:
                raise _fail(schedule, roles, dev, k, problem)
            key = (a.kind, _ident(a))
            if key in seen:
                raise _fail(schedule, roles, dev, k, f"{a} appears twice (first at step {seen[key]})")
            seen[key] = k
        last = len(actions) - 1
        for kind in (K.F, K.B):
            missing = [i for i in range(role.m) if (kind, i) not in seen]
            if missing:
                raise _fail(schedule, roles, dev, last, f"{dev} never runs {Compute(kind, role.j, missing[0])} "
                            f"({len(missing)} {kind.value} action(s) missing)")
        if (K.STEP, None) not in seen:
            raise _fail(schedule, roles, dev, last, f"{dev} has no STEP")


def _check_start_order(schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, _Role],
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
                raise _fail(schedule, roles, dev, step[min(k, len(step) - 1)] if step else None,
                            f"the owners of {', '.join(group)} start their bucket all-reduces in different orders: "
                            f"{dev} starts {got} where {other} starts {exp} (start number {k}); the all-reduces of "
                            "one set of owners share a process group, which must see them in one order")


_SendKey = tuple[ActionKind, str, str, int]  # (send kind, sender, receiver, micro-batch)


class _Interpreter:
    """``validate``'s dynamic part: every device runs its actions in order until one must wait (a RECV
    for its SEND, a collective for its members, an ALLREDUCE_WAIT for its bucket's starts); what
    completes a wait makes the waiting devices runnable again. The messages are built only on
    failure: this runs once per action of the cluster.
    """

    def __init__(self, schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, _Role],
                 owners: Mapping[int, set[str]], node_of: Mapping[str, str] | None = None, bsp: bool = True,
                 num_buckets: Sequence[int] = ()) -> None:
        self.schedule = schedule
        self.roles = roles
        self.owners = owners
        self.nodes = node_of or {}
        self.bsp = bsp
        self.num_buckets = num_buckets
        self.pc = dict.fromkeys(schedule, 0)
        self.done: dict[str, set[tuple[ActionKind, object]]] = {dev: set() for dev in schedule}
        self.backwards = dict.fromkeys(schedule, 0)  # backwards done per device
        self.posted: dict[_SendKey, int] = {}  # send key -> step of the send
        self.received: set[_SendKey] = set()
        self.waiting: dict[_SendKey, str] = {}
        self.arrived: dict[tuple[ActionKind, int, str], set[str]] = {}  # (kind, segment, node or "") -> devices
        self.started: dict[tuple[int, int], set[str]] = {}  # (segment, bucket) -> devices that started it
        self.bucket_waiters: dict[tuple[int, int], list[str]] = {}
        self.runnable = deque(schedule)

    def run(self) -> None:
        """Run every device as far as it goes; raise on a deadlock or a send never received."""
        while self.runnable:
            self._advance(self.runnable.popleft())
        stuck = [dev for dev in self.schedule if self.pc[dev] < len(self.schedule[dev])]
        if stuck:
            raise self._deadlock(stuck)
        for sent, k in self.posted.items():
            if sent not in self.received:
                kind, src, dst, i = sent
                recv = Transfer(COUNTERPART[kind], self.roles[dst].j, i, src)
                raise self._fail(src, k, f"{self.schedule[src][k]} is never received: {dst} has no {recv}")

    def _fail(self, dev: str | None, k: int | None, message: str,
              also: Mapping[tuple[str, int], str] | None = None) -> ScheduleError:
        return _fail(self.schedule, self.roles, dev, k, message, also)

    def _advance(self, dev: str) -> None:
        """Run ``dev``'s actions from where it stands until one must wait or none remain."""
        actions = self.schedule[dev]
        mine = self.done[dev]
        k = self.pc[dev]
        while k < len(actions):
            a = actions[k]
            match a:
                case Compute():
                    self._compute(dev, k, a)
                case Transfer():
                    if not self._transfer(dev, k, a):
                        break
                case _:
                    if not self._sync(dev, k, a):
                        break
            mine.add((a.kind, _ident(a)))
            k += 1
        self.pc[dev] = k

    def _compute(self, dev: str, k: int, a: Compute) -> None:
        """F needs its RECV_F; B needs its F and its RECV_B."""
        role, mine, i = self.roles[dev], self.done[dev], a.micro_batch
        if a.kind is K.F:
            if role.prev is not None and (K.RECV_F, i) not in mine:
                raise self._fail(dev, k, f"{a} runs before its input arrives: no "
                                 f"{Transfer(K.RECV_F, role.j, i, role.prev)} precedes it (missing receive)")
            return
        if (K.F, i) not in mine:
            raise self._fail(dev, k, f"{a} runs before {Compute(K.F, role.j, i)} (F before B for every micro-batch)")
        if role.next is not None and (K.RECV_B, i) not in mine:
            raise self._fail(dev, k, f"{a} runs before its gradient arrives: no "
                             f"{Transfer(K.RECV_B, role.j, i, role.next)} precedes it (missing receive)")
        self.backwards[dev] += 1

    def _transfer(self, dev: str, k: int, a: Transfer) -> bool:
        """A send is posted (after the compute it ships); a receive goes on once its send is posted."""
        i = a.micro_batch
        if a.is_send:
            source = K.F if a.kind is K.SEND_F else K.B
            if (source, i) not in self.done[dev]:
                raise self._fail(dev, k, f"{a} sends what {Compute(source, self.roles[dev].j, i)} has not "
                                 "computed yet")
            key: _SendKey = (a.kind, dev, a.named_peer(), i)
            self.posted[key] = k
            if key in self.waiting:
                self.runnable.append(self.waiting.pop(key))
            return True
        key = (COUNTERPART[a.kind], a.named_peer(), dev, i)
        if key not in self.posted:
            self.waiting[key] = dev
            return False
        self.received.add(key)
        return True

    def _sync(self, dev: str, k: int, a: SegmentSync | BucketSync | Step) -> bool:
        """Sync actions and STEP come after every backward; whether ``a`` went on or must wait."""
        role = self.roles[dev]
        if self.backwards[dev] < role.m:
            missing = next(b for b in range(role.m) if (K.B, b) not in self.done[dev])
            raise self._fail(dev, k, f"{a} comes before {Compute(K.B, role.j, missing)}: "
                             "gradients are complete only after every backward")
        match a:
            case Step():
                if self.bsp:
                    self._check_reduced(dev, k)
                return True
            case BucketSync():
                return self._bucket(dev, k, a)
            case SegmentSync():  # the asynchronous kinds (PUSH, PULL...) wait for no one here
                return self._collective(dev, a) if a.kind in COLLECTIVE_KINDS else True

    def _check_reduced(self, dev: str, k: int) -> None:
        """Under bsp, STEP comes after every shared segment of ``dev`` is all-reduced (whole or bucket by bucket)."""
        mine, num_buckets = self.done[dev], self.num_buckets
        left = sorted(s for s, devs in self.owners.items() if dev in devs and len(devs) > 1
                      and (K.ALLREDUCE, s) not in mine
                      and not all((K.ALLREDUCE_WAIT, (s, b)) in mine for b in range(num_buckets[s])))
        if left:
            s = left[0]
            b = next(b for b in range(num_buckets[s]) if (K.ALLREDUCE_WAIT, (s, b)) not in mine)
            raise self._fail(dev, k, f"STEP before ALLREDUCE_WAIT seg{s} bucket{b} (or ALLREDUCE seg{s}): {dev} "
                             f"shares segment {s} with {', '.join(sorted(self.owners[s] - {dev}))}")

    def _bucket(self, dev: str, k: int, a: BucketSync) -> bool:
        """ALLREDUCE_START goes on; ALLREDUCE_WAIT waits until every owner of the segment started the bucket."""
        sb = (a.segment, a.bucket)
        if a.kind is K.ALLREDUCE_START:
            there = self.started.setdefault(sb, set())
            there.add(dev)
            if len(there) == len(self.owners[a.segment]):
                self.runnable.extend(self.bucket_waiters.pop(sb, []))
            return True
        if (K.ALLREDUCE_START, sb) not in self.done[dev]:
            raise self._fail(dev, k, f"{a} comes before its {BucketSync(K.ALLREDUCE_START, *sb)} on {dev}")
        if len(self.started.get(sb, ())) < len(self.owners[a.segment]):
            self.bucket_waiters.setdefault(sb, []).append(dev)
            return False
        return True

    def _collective(self, dev: str, a: SegmentSync) -> bool:
        """A blocking collective: ``dev`` waits until every member arrived; the last to arrive completes it for all."""
        kind, s = a.kind, a.segment
        if kind is K.LOCAL_ALLREDUCE:  # the owners on dev's node
            members = {o for o in self.owners[s] if self.nodes.get(o) == self.nodes.get(dev)}
        else:
            members = set(self.owners[s])
        at = (kind, s, self.nodes.get(dev, "") if kind is K.LOCAL_ALLREDUCE else "")
        there = self.arrived.setdefault(at, set())
        there.add(dev)
        if len(there) < len(members):
            return False
        for other in there - {dev}:  # the collective completes for all owners
            self.done[other].add((kind, s))
            self.pc[other] += 1
            self.runnable.append(other)
        return True

    def _deadlock(self, stuck: list[str]) -> ScheduleError:
        """Explain why the first stuck device cannot go on."""
        dev = stuck[0]
        k = self.pc[dev]
        a = self.schedule[dev][k]
        also = {(d, self.pc[d]): "<-- blocked" for d in stuck if d != dev}
        match a:
            case Transfer():
                return self._fail(dev, k, f"deadlock: {a} waits for {self._missing_send(dev, a)}", also)
            case BucketSync():
                came = set(self.started.get((a.segment, a.bucket), set()))
                verb = "start"
            case SegmentSync():
                came = set().union(*(devs for (kind, s, _), devs in self.arrived.items()
                                     if kind is a.kind and s == a.segment))
                verb = "reach"
            case _:  # F, B and STEP never wait
                return self._fail(dev, k, f"deadlock: {a} cannot run", also)
        pc, schedule = self.pc, self.schedule
        absent = sorted(self.owners[a.segment] - came)
        where = "; ".join(
            f"{d} is at step {pc[d]} ({schedule[d][pc[d]]})" if pc[d] < len(schedule[d]) else f"{d} finished without it"
            for d in absent[:4])
        return self._fail(dev, k, f"deadlock: {a} waits for {', '.join(absent)} to {verb} it: {where}", also)

    def _missing_send(self, dev: str, a: Transfer) -> str:
        """The send receive ``a`` of ``dev`` waits for, and why it never comes."""
        peer = a.named_peer()
        send = Transfer(COUNTERPART[a.kind], self.roles[peer].j, a.micro_batch, dev)
        theirs = self.schedule[peer]
        at = [n for n, b in enumerate(theirs) if b == send]
        if not at:
            why = f"{peer} never sends it (missing {send} on {peer})"
        elif self.pc[peer] < len(theirs):
            why = f"{peer} would send it at step {at[0]} but is itself blocked at step {self.pc[peer]} " \
                  f"({theirs[self.pc[peer]]})"
        else:
            why = f"{peer} finished without sending it"
        return f"{send} and {why}"

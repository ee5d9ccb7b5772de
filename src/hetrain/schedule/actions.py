"""The action language: the kinds of Action, one small class per form, and their text.

``str(action)`` prints an Action (``1F0``, ``SEND_F 1->2 mb0 to n0:2``, ``ALLREDUCE_START seg2 bucket0``,
``STEP``) and ``parse_action`` reads it back; ``schedule_to_dict`` and ``parse_schedule`` do the same for
a whole ``Schedule``. ``hetrain.schedule``'s docstring says what each kind does.

Example:
    >>> str(parse_action("SEND_F 1->2 mb0 to n0:2"))
    'SEND_F 1->2 mb0 to n0:2'
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from hetrain.errors import InputError


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

    def __str__(self) -> str:  # the simulator prints one per receive it waits on: kept to one table lookup
        name, offset, word = _TRANSFER_TEXT[self.kind]
        j = self.stage
        src, dst = (j, j + offset) if word == " to " else (j + offset, j)
        if self.peer is None:
            return f"{name} {src}->{dst} mb{self.micro_batch}"
        return f"{name} {src}->{dst} mb{self.micro_batch}{word}{self.peer}"

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
#: per transfer kind: its text, the peer's stage offset, the word before the peer (``Transfer.__str__``)
_TRANSFER_TEXT: dict[ActionKind, tuple[str, int, str]] = {
    k: (k.value, offset, " to " if is_send else " from ") for k, (offset, is_send) in P2P_KINDS.items()}
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

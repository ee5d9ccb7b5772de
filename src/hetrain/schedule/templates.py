"""Schedules shared among devices: each distinct list of Actions built once, its peers filled in per device.

At scale most devices run what many others run: on 128 identical VWs of 32 stages, the device of stage j of
every VW has the same compute order, the same transfers and the same buckets to all-reduce. What differs is
only the peer its sends and receives name, and that is always its predecessor or successor in its VW::

    template of stage j (m = 2, 1F1B, middle stage)      device n3:1 (VW 5)      device n7:1 (VW 9)
    RECV_F j-1->j mb0                                     ... from n3:0           ... from n7:0
    jF0                                                   jF0                     jF0
    SEND_F j->j+1 mb0                                     ... to n3:2             ... to n7:2
    ...                                                   (prev n3:0, next n3:2)  (prev n7:0, next n7:2)

A template is a device's Actions with those peers left out (``Transfer.peer`` None): a send or receive
forward-going to the next stage (``SEND_F``, ``RECV_B``) names the device's ``next_device``, one going back
(``RECV_F``, ``SEND_B``) its ``prev_device``. ``ScheduleTemplates.actions(device)`` fills them in and gives
the device's Actions exactly as building them for it alone would; a consumer that reads the template
directly (the simulator's compiler) does the same substitution.

Example:
    >>> from hetrain.schedule.actions import ActionKind, Compute, Transfer
    >>> shared = ScheduleTemplates([[Transfer(ActionKind.RECV_F, 1, 0), Compute(ActionKind.F, 1, 0)]],
    ...                            {"n0:1": DeviceRole(0, "n0:0", None)})
    >>> [str(a) for a in shared.actions("n0:1")]
    ['RECV_F 0->1 mb0 from n0:0', '1F0']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hetrain.schedule.actions import Action, ActionKind, Schedule, Transfer

K = ActionKind
#: transfer kinds whose peer is the next stage's device; the others' is the previous stage's
TO_NEXT: frozenset[ActionKind] = frozenset({K.SEND_F, K.RECV_B})


class DeviceRole(NamedTuple):
    """Which template a device runs, and the devices its template's transfers name.

    Attributes:
        template: an index into ``ScheduleTemplates.templates``.
        prev_device: the device of the stage before it in its VW (None on the first stage, or where the
            template's transfers name their peers themselves).
        next_device: the device of the stage after it (None on the last stage, or as above).
    """

    template: int
    prev_device: str | None
    next_device: str | None


def fill_peers(actions: Sequence[Action], prev_device: str | None, next_device: str | None) -> list[Action]:
    """``actions`` with each transfer that names no peer naming ``next_device`` (``SEND_F``, ``RECV_B``) or
    ``prev_device`` (``RECV_F``, ``SEND_B``); every other action is the same object."""
    out: list[Action] = []
    append = out.append
    for a in actions:
        if isinstance(a, Transfer) and a.peer is None:
            kind = a.kind
            append(Transfer(kind, a.stage, a.micro_batch, next_device if kind in TO_NEXT else prev_device))
        else:
            append(a)
    return out


@dataclass(frozen=True)
class ScheduleTemplates:
    """One iteration's schedule, as its distinct templates and each device's role.

    Attributes:
        templates: the distinct lists of Actions; transfers among them may name no peer (see the module).
        roles: per device, in the schedule's order of devices, its template and its neighbours.
    """

    templates: list[list[Action]]
    roles: Mapping[str, DeviceRole]

    @classmethod
    def of(cls, schedule: Mapping[str, Sequence[Action]]) -> ScheduleTemplates:
        """A schedule built some other way (passed in, edited): every device its own template, its Actions
        as they are (their transfers name their peers)."""
        return cls([list(actions) for actions in schedule.values()],
                   {dev: DeviceRole(k, None, None) for k, dev in enumerate(schedule)})

    def actions(self, device: str) -> list[Action]:
        """The Actions of ``device``, its peers filled in.

        Raises:
            KeyError: a device with no Actions.
        """
        role = self.roles[device]
        return fill_peers(self.templates[role.template], role.prev_device, role.next_device)

    def schedule(self) -> Schedule:
        """Every device's Actions, peers filled in: what ``build_schedule`` returns."""
        return {dev: self.actions(dev) for dev in self.roles}

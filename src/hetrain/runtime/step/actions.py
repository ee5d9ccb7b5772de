"""This rank's Actions of each iteration, the ones the simulator replays for its device.

Which sync actions an iteration ends with follows from the sync state (``schedule.SyncState``): ``next``
puts DASO's k into it (``runtime.sync.daso``), builds the iteration's Actions from it, validates each kind
of iteration the first time it comes, and moves the state on (``schedule.advance_sync_state``), as the
simulator does (``simulator.build_schedules``)::

    state(i) ── DASO's k ──► build_schedule(plan, state, steps)[device] ── validated once per kind ──► executor
       └──────────────── advance_sync_state ──► state(i + 1)

A mode whose iterations all end alike (``SyncMode.same_every_iteration``: bsp, wsp) builds its Actions once.

Example:
    >>> actions = StepActions(plan, role.device, daso=None)   # doctest: +SKIP
    >>> actions.start(step)                                   # doctest: +SKIP
    >>> it = actions.next(steps)    # it.actions to run, it.sync_actions for the metrics   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from hetrain.plan import Plan
from hetrain.runtime.sync.daso import DasoAdaptation
from hetrain.schedule import (
    Action,
    advance_sync_state,
    build_schedule,
    build_sync_actions,
    initial_sync_state,
    validate,
)


class Iteration(NamedTuple):
    """One iteration's Actions on this rank.

    Attributes:
        actions: what the executor runs.
        sync_actions: its sync actions as text (the metrics' ``sync_actions``).
        period: the sync state's period they were built with (DASO's k).
    """

    actions: list[Action]
    sync_actions: tuple[str, ...]
    period: int


class StepActions:
    """The sync state of ``plan`` on ``device`` and the Actions of each iteration (module docstring).

    Args:
        plan: the plan.
        device: this rank's device in it.
        daso: DASO's adaptive k (``SyncMode.adaptive``); None: the plan's period throughout.
    """

    def __init__(self, plan: Plan, device: str, daso: DasoAdaptation | None = None) -> None:
        self._plan = plan
        self._device = device
        self._daso = daso
        self._schedules: dict[tuple[str, ...], list[Action]] = {}  # this device's Actions, by its sync actions
        self.state = initial_sync_state(plan)

    def start(self, step: int) -> None:
        """The state at ``step`` (a resumed run starts with no DASO average in flight)."""
        self.state = replace(initial_sync_state(self._plan), iteration=step)

    def next(self, steps: int) -> Iteration:
        """The Actions of the coming iteration of a run of ``steps``; the state moves on to the one after."""
        plan = self._plan
        state = self.state if self._daso is None else self._daso.apply(self.state)
        if plan.sync_mode.same_every_iteration and self._schedules:  # the same actions every iteration
            ((key, actions),) = self._schedules.items()
        else:
            key = tuple(str(a) for a in build_sync_actions(plan, self._device, state, steps))
            if key not in self._schedules:
                schedule = build_schedule(plan, state, steps)
                validate(schedule, plan)
                self._schedules[key] = schedule[self._device]
            actions = self._schedules[key]
        self.state = advance_sync_state(plan, state, steps)
        return Iteration(actions, key, state.period)


__all__ = ["Iteration", "StepActions"]

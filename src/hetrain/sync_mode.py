"""The sync modes' rules, written once: one ``SyncMode`` per mode, looked up by its name.

A plan stores its mode by name (``Plan.sync``, plan.json's ``"sync"`` section); the name is turned into
its ``SyncMode`` where it is read (``sync_mode``, ``Plan.sync_mode``), and every consumer (the sync layout,
the schedule, the planner's closed forms, the simulator, the runtime) asks that object, never the name::

    mode       across VWs, once per period                    period     local mean  posted  adapts
    bsp        gradients all-reduced (buckets)                1          -           -       -
    wsp        updates pushed to parameter servers, pulled    1 (wave)   -           -       -
    hybrid-ps  the same                                       aggregate  yes         -       -
    daso       weights averaged                               period     yes         yes     yes
    local-sgd  weights averaged                               period     -           -       -

docs/sync.md describes each mode. Pure Python: the planning side and the runtime both read it.

Example:
    >>> mode = sync_mode("hybrid-ps")
    >>> mode.parameter_servers, mode.local_mean, mode.period_option
    (True, True, 'aggregate')
    >>> sync_mode("ssp")
    Traceback (most recent call last):
    ...
    hetrain.sync_mode.SyncModeError: sync mode must be one of bsp, wsp, hybrid-ps, daso, local-sgd, got 'ssp'
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, Protocol

from hetrain.errors import InputError

#: a sync mode's name, as plans and the command line write it
SyncModeName = Literal["bsp", "wsp", "hybrid-ps", "daso", "local-sgd"]


class SyncModeError(InputError):
    """A sync mode name that is not one of ``SYNC_MODES``."""


class Exchange(Enum):
    """What a mode's VWs exchange across the segment's owners."""

    #: every gradient bucket all-reduced among the owners each iteration: every VW steps on the global mean
    GRADIENTS = "gradients"
    #: each VW's update pushed to the segment's parameter-server shard, the global weights pulled back
    PUSH_PULL = "push-pull"
    #: the owners' weights averaged, weighted by mini-batch
    AVERAGE = "average"


class PeriodOptions(Protocol):
    """The sync options a mode's period and slack are read from (``sync_layout.SyncOptions``)."""

    @property
    def period(self) -> int: ...

    @property
    def aggregate(self) -> int: ...

    @property
    def staleness(self) -> int: ...


@dataclass(frozen=True)
class SyncMode:
    """One sync mode's rules.

    Attributes:
        name: the mode's name in plans and on the command line.
        exchange: what crosses VWs (``Exchange``).
        period_option: the sync option that sets the iterations from one exchange to the next (``period``,
            ``aggregate``); None: every iteration (bsp's all-reduce, wsp's wave).
        local_mean: each iteration, a segment's gradients are averaged among its owners on one node
            (LOCAL_ALLREDUCE) before the step: node mates step alike, on the node's mean.
        posted: the global average is posted without blocking (AVERAGE_START) and merged the next iteration
            (AVERAGE_MERGE), except in the warm-up and the cool-down, where it blocks (DASO).
        adaptive: the period adapts to the loss while training (DASO's adaptive global sync rate,
            ``runtime.sync.daso``); the simulator and the planner keep the plan's.
    """

    name: SyncModeName
    exchange: Exchange
    period_option: Literal["period", "aggregate"] | None = None
    local_mean: bool = False
    posted: bool = False
    adaptive: bool = False

    @property
    def synchronous(self) -> bool:
        """Whether every VW steps on the global mean of the gradients, in lockstep (bsp): the iterations take
        the same time, and a VW never runs ahead of another."""
        return self.exchange is Exchange.GRADIENTS

    @property
    def parameter_servers(self) -> bool:
        """Whether each shared segment has a parameter-server shard on one of its owners (its waves: one per
        push)."""
        return self.exchange is Exchange.PUSH_PULL

    @property
    def averages(self) -> bool:
        """Whether the VWs' weights are averaged (AVERAGE, or DASO's posted one)."""
        return self.exchange is Exchange.AVERAGE

    @property
    def same_every_iteration(self) -> bool:
        """Whether every iteration ends with the same sync actions (no period, nothing posted)."""
        return self.period_option is None and not self.posted

    @property
    def supports_clipping(self) -> bool:
        """Whether gradients can be clipped by the global norm: only where they are summed across VWs before the
        step (``runtime.step.clip``)."""
        return self.synchronous

    @property
    def supports_fp16(self) -> bool:
        """Whether fp16's loss scaling can run: its overflow verdict skips a step on every rank at once, which
        needs VWs that step together (``runtime.step.loss_scale``)."""
        return self.synchronous

    @property
    def supports_ties_across_devices(self) -> bool:
        """Whether tied weights held by different devices can have their gradients summed: only where they are
        summed across VWs before the step (``runtime.step.tied``)."""
        return self.synchronous

    def period(self, options: PeriodOptions) -> int:
        """Iterations from one exchange across VWs to the next, as ``options`` set it: 1 without a
        ``period_option``; DASO's is the start of what it adapts."""
        return 1 if self.period_option is None else int(getattr(options, self.period_option))

    def overlap_iterations(self, options: PeriodOptions) -> int:
        """Iterations of compute the exchange across VWs may hide behind (docs/sync.md's closed forms): D for
        parameter servers (D waves of slack), 1 for a posted average (started after one iteration's step and
        merged, waited for, after the next one's: ``schedule.build_sync_actions``, the runtime's
        ``_average_merge``; whatever the period k), 0 for a blocking one; bsp's bucket all-reduces hide behind
        the backward instead."""
        if self.parameter_servers:
            return options.staleness
        return 1 if self.posted else 0


#: every sync mode, in the order plans and the command line list them
MODES: tuple[SyncMode, ...] = (
    SyncMode("bsp", Exchange.GRADIENTS),
    SyncMode("wsp", Exchange.PUSH_PULL),
    SyncMode("hybrid-ps", Exchange.PUSH_PULL, "aggregate", local_mean=True),
    SyncMode("daso", Exchange.AVERAGE, "period", local_mean=True, posted=True, adaptive=True),
    SyncMode("local-sgd", Exchange.AVERAGE, "period"),
)
#: their names
SYNC_MODES: tuple[str, ...] = tuple(m.name for m in MODES)
_BY_NAME: dict[str, SyncMode] = {m.name: m for m in MODES}


def sync_mode(name: str, where: str = "") -> SyncMode:
    """The ``SyncMode`` called ``name``.

    Args:
        name: a mode's name (``Plan.sync``, ``--sync``).
        where: what gave the name (a file and field, a flag), put before the message.

    Raises:
        SyncModeError: an unknown name, in one line naming it and the known ones.
    """
    mode = _BY_NAME.get(name)
    if mode is None:
        raise SyncModeError(f"{where + ': ' if where else ''}sync mode must be one of {', '.join(SYNC_MODES)}, "
                            f"got {name!r}")
    return mode


__all__ = ["MODES", "SYNC_MODES", "Exchange", "PeriodOptions", "SyncMode", "SyncModeError", "SyncModeName",
           "sync_mode"]

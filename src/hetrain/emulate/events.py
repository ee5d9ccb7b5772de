"""Scripted changes to an emulated cluster while a job runs: ``[[emulation.event]]`` in the cluster file.

A heterogeneous cluster changes under a job: a GPU throttles, a shared link slows, a spot
node goes away or comes back. Each event happens ``at_s`` seconds after the job starts::

    [[emulation.event]]
    at_s = 30
    device = "slow:1"
    cpu_share = 0.15            # the device computes at this share of a CPU from now on

    [[emulation.event]]
    at_s = 45
    node = "slow"
    nic = "100Mbit/s"           # the node's NIC, both directions, is shaped to this rate

    [[emulation.event]]
    at_s = 60
    node = "slow"
    action = "kill"             # SIGKILL every process of the node ("stop" / "resume": SIGSTOP / SIGCONT)

    [[emulation.event]]
    at_s = 90
    node = "spare"
    action = "start"            # the node's torchrun starts now, not with the job (it joins late)

A node killed by an event is expected to go: its exit does not fail the job. A node with a
``start`` event is left out of the job's start, unless an earlier event killed it (then it comes
back). Where a node is killed or starts late the nodes rendezvous elastically (``--nnodes MIN:MAX``,
MIN the nodes no event takes away). Each event is logged when it happens, with what it changed.
Events need what the emulation has: ``cpu_share`` a throttled device (cgroups), ``nic`` shaping.

Example:
    >>> events = parse_events([{"at_s": 5, "device": "n0:1", "cpu_share": 0.5}])
    >>> events[0].describe()
    'at 5 s: device n0:1 cpu_share 0.5'
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hetrain.emulate.settings import EmulationError
from hetrain.units import UnitError, format_bandwidth, parse_bandwidth

Kind = Literal["cpu_share", "nic", "kill", "stop", "resume", "start"]
ACTIONS: tuple[str, ...] = ("kill", "stop", "resume", "start")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "resume": signal.SIGCONT}
MAX_EVENTS = 1000


@dataclass(frozen=True)
class EmulationEvent:
    """One scripted change: ``kind`` on ``target`` (a device name for ``cpu_share``, else a node name)."""

    at_s: float
    kind: Kind
    target: str
    value: float | None = None  # the cpu share, or the NIC's bytes/s

    def describe(self) -> str:
        if self.kind == "cpu_share":
            what = f"device {self.target} cpu_share {self.value:g}"
        elif self.kind == "nic":
            what = f"node {self.target} nic {format_bandwidth(self.value or 0.0)}"
        else:
            what = f"node {self.target} {self.kind}"
        return f"at {self.at_s:g} s: {what}"

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "kind": self.kind, "target": self.target, "value": self.value}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EmulationEvent:
        """The form ``to_dict`` writes (the run's state file)."""
        return EmulationEvent(float(data["at_s"]), data["kind"], str(data["target"]),
                              None if data.get("value") is None else float(data["value"]))


def _event(raw: Any, k: int) -> EmulationEvent:
    where = f"[[emulation.event]] {k}"
    if not isinstance(raw, Mapping):
        raise EmulationError(f"{where}: must be a table, got {raw!r}")
    at = raw.get("at_s")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not (math.isfinite(at) and at >= 0):
        raise EmulationError(f"{where}: at_s must be a number of seconds >= 0, got {at!r}")
    keys = set(raw) - {"at_s"}
    if "device" in raw:
        if keys != {"device", "cpu_share"}:
            raise EmulationError(f"{where}: a device event takes device and cpu_share, got {sorted(keys)}")
        device, share = raw["device"], raw["cpu_share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 64:
            raise EmulationError(f"{where}: cpu_share must be a number in (0, 64], got {share!r}")
        return EmulationEvent(float(at), "cpu_share", str(device), float(share))
    if "node" not in raw:
        raise EmulationError(f"{where}: name a device (with cpu_share) or a node (with nic or action)")
    node = raw["node"]
    if keys == {"node", "nic"}:
        try:
            rate = parse_bandwidth(raw["nic"], f"{where} nic")
        except UnitError as e:
            raise EmulationError(str(e)) from None
        return EmulationEvent(float(at), "nic", str(node), rate)
    if keys == {"node", "action"}:
        action = raw["action"]
        if action not in ACTIONS:
            raise EmulationError(f"{where}: action must be one of {', '.join(ACTIONS)}, got {action!r}")
        return EmulationEvent(float(at), action, str(node))
    raise EmulationError(f"{where}: a node event takes node with nic, or node with action; got {sorted(keys)}")


def parse_events(raw: Any) -> tuple[EmulationEvent, ...]:
    """The events of ``[[emulation.event]]``, in time order (stable for equal times); ``check_targets``
    checks their names against the cluster.

    Raises:
        EmulationError: a bad value (named, with the value); a node started by two events.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_EVENTS:
        raise EmulationError(f"[[emulation.event]] must be a list of at most {MAX_EVENTS} tables, got {raw!r}")
    events = sorted((_event(r, k) for k, r in enumerate(raw)), key=lambda e: e.at_s)
    started = [e.target for e in events if e.kind == "start"]
    twice = sorted({n for n in started if started.count(n) > 1})
    if twice:
        raise EmulationError(f"[[emulation.event]]: node(s) {', '.join(twice)} started more than once")
    return tuple(events)


def check_targets(events: Sequence[EmulationEvent], devices: Collection[str], nodes: Collection[str]) -> None:
    """Refuse an event naming a device or node the cluster does not have (named, with what it has).

    Raises:
        EmulationError: the first such event.
    """
    for e in events:
        known, what = (devices, "device") if e.kind == "cpu_share" else (nodes, "node")
        if e.target not in known:
            raise EmulationError(f"[[emulation.event]] {e.describe()}: {what} {e.target!r} is not in the cluster; "
                                 f"its {what}s: {', '.join(sorted(known))}")


def late_nodes(events: Sequence[EmulationEvent]) -> set[str]:
    """Nodes left out of the job's start: each joins at its ``start`` event. A node killed before its
    ``start`` (``events`` in time order) is there from the start: it goes and comes back."""
    killed: set[str] = set()
    late: set[str] = set()
    for e in events:
        if e.kind == "kill":
            killed.add(e.target)
        elif e.kind == "start" and e.target not in killed:
            late.add(e.target)
    return late


def absent_nodes(events: Sequence[EmulationEvent]) -> set[str]:
    """Nodes the job must be able to run without: those started late and those killed."""
    return late_nodes(events) | {e.target for e in events if e.kind == "kill"}


def signal_pids(pids: Sequence[int], kind: str) -> int:
    """Send ``kind``'s signal (kill, stop, resume) to each pid; how many received it."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, SIGNALS[kind])
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    return sent


__all__ = ["ACTIONS", "EmulationEvent", "absent_nodes", "check_targets", "late_nodes", "parse_events", "signal_pids"]

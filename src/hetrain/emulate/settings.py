"""Emulation settings: the ``[emulation]`` table of a cluster file.

``parse_cluster`` accepts the table and ignores it; this module reads it::

    [emulation]
    cpu_period = "10ms"     # cgroup CPU period; short, so throttling is smooth
    cpu_scale = 1.0         # every cpu_share is multiplied by this (0.5: fit 4 devices on 2 cores)
    throttle = "auto"       # "auto": cgroups if possible, else warn; "cgroup": refuse without; "off"
    isolate_comm = true     # only a rank's main thread is throttled; its communication threads are not
    # comm_weight = 2       # cgroup v1: those threads in one cgroup of this weight (unset: each weighs 1024)
    keep_awake = true       # idle CPUs poll instead of halting while a job runs
    shape = true            # shape NICs and [[link]]s with tc; false: unshaped veths
    shape_intra = false     # also shape each node's loopback at its intra_link rate
    rdzv_port = 29400       # c10d rendezvous port on the first node's address
    join_timeout = "120s"   # how long torchrun waits for every node to join
    max_restarts = 0        # torchrun --max-restarts: restarts of a node's workers after a failure
    last_call_timeout = "30s"   # elastic rendezvous (a node killed or started late): the wait for more
    keep_alive_interval = "5s"  # nodes once MIN are there; a dead node is dropped after
    keep_alive_max_attempt = 3  # keep_alive_interval x keep_alive_max_attempt

    [[emulation.event]]     # scripted changes while a job runs (``emulate.events``)
    at_s = 30
    device = "slow:1"
    cpu_share = 0.15

Every key is optional. docs/emulate.md describes what each does.

Example:
    >>> parse_emulation_settings({"cpu_period": "20ms", "cpu_scale": 0.5}).cpu_period_s
    0.02
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hetrain.errors import RunError
from hetrain.units import UnitError, parse_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

if TYPE_CHECKING:
    from hetrain.emulate.events import EmulationEvent

Throttle = Literal["auto", "cgroup", "off"]
THROTTLE_CHOICES: tuple[str, ...] = ("auto", "cgroup", "off")


class EmulationError(RunError):
    """The emulated cluster cannot be built, run or removed; the message says why and what to do."""


@dataclass(frozen=True)
class EmulationSettings:
    """How a cluster file is emulated on one host.

    Attributes:
        cpu_period_s: cgroup CPU period (s). A device with share ``c`` may run ``c * period``
            of CPU time per period; 10 ms keeps the stalls short. Raised for a device whose
            quota would fall under the kernel's 1 ms minimum.
        cpu_scale: factor applied to every ``cpu_share`` (keeps the ratios, changes the total).
        throttle: ``"auto"`` uses cgroups where it can and warns where it cannot;
            ``"cgroup"`` refuses to run without them; ``"off"`` never throttles.
        pin_cpus: pin each throttled device's process to one of the host's CPUs, spreading the
            shares evenly (``emulate.emulator.assign_cpus``), so that two devices on one CPU never
            take turns with the scheduler moving them between CPUs: run-to-run speed varies less.
        fill_idle: give each device throttled below one CPU an idle filler, a process in its
            cgroup that spins at idle priority and uses the quota the device leaves idle
            (``emulate.rankwrap.start_filler``), so that the device computes at its share after
            a pause as back to back, as a GPU does, instead of banking quota while it waits.
        isolate_comm: throttle only each rank's main thread, the one that computes (one torch
            thread); its other threads (Gloo's transport and work threads, which move and sum the
            messages) go to the run's unthrottled cgroup (``emulate.rankwrap.start_comm_mover``;
            cgroup v1 only, where a thread can leave its process's cgroup). A GPU's compute does not
            slow down while NCCL or a copy engine moves its messages; a throttled rank's whole
            process did, by the CPU its transfers took (its backward ran 15-30% slower than
            profiled while its gradients were all-reduced).
        comm_weight: where ``isolate_comm`` moves the threads. ``None`` (the default): into the run's
            cgroup, where each thread weighs 1024, as much as a device's cgroup, so on a CPU its quotas
            and fillers keep busy they take part of a device's quota while they run. A number (2 to
            262144): into the run's child cgroup ``comm`` with that ``cpu.shares``; 2, the kernel's
            least, honours every quota first and moves messages in what the quotas leave
            (``emulate.cgroups``; docs/emulate.md has the measured trade-off).
        keep_awake: while a job runs, ask the kernel for a CPU wake-up latency of 0 µs (PM QoS,
            ``emulate.keepawake``), so an idle CPU polls instead of halting between a device's
            quota periods. A halted virtual CPU wakes slowly: a device at share 0.2 alone on its
            CPU computed 15% slower without it, so its speed hung on what else ran on the host.
        shape: shape node NICs and ``[[link]]`` overrides with tc (htb).
        shape_intra: also shape each node's loopback (all its intra-node traffic, both
            directions together) at its ``intra_link`` bandwidth.
        rdzv_port: c10d rendezvous port, on the first node's address.
        join_timeout_s: how long each torchrun waits for all nodes to join the rendezvous.
        max_restarts: torchrun's ``--max-restarts`` on every node: after a failure (a node killed), the
            survivors restart their workers this many times (elastic training, docs/elastic.md).
        last_call_timeout_s: where the rendezvous is elastic (an event kills a node or starts one late),
            how long a round waits for more nodes once the fewest it may run with are there (torchrun's
            ``last_call_timeout``; whole seconds).
        keep_alive_interval_s: there, how often each node's agent tells the rendezvous it is alive
            (whole seconds); a node silent for ``keep_alive_max_attempt`` of them is dropped from it.
        keep_alive_max_attempt: see ``keep_alive_interval_s``.
        events: scripted changes while a job runs (``emulate.events``), in time order.
    """

    cpu_period_s: float = 0.010
    cpu_scale: float = 1.0
    throttle: Throttle = "auto"
    pin_cpus: bool = True
    fill_idle: bool = True
    isolate_comm: bool = True
    comm_weight: int | None = None
    keep_awake: bool = True
    shape: bool = True
    shape_intra: bool = False
    rdzv_port: int = 29400
    join_timeout_s: float = 120.0
    max_restarts: int = 0
    last_call_timeout_s: float = 30.0  # torchrun's defaults
    keep_alive_interval_s: float = 5.0
    keep_alive_max_attempt: int = 3
    events: tuple[EmulationEvent, ...] = ()

    def __post_init__(self) -> None:
        if not 0.001 <= self.cpu_period_s <= 1.0:
            raise EmulationError(f"[emulation] cpu_period must be between 1ms and 1s, got {self.cpu_period_s:g} s")
        if not 0 < self.cpu_scale <= 64:
            raise EmulationError(f"[emulation] cpu_scale must be in (0, 64], got {self.cpu_scale!r}")
        if self.throttle not in THROTTLE_CHOICES:
            raise EmulationError(f"[emulation] throttle must be one of {', '.join(THROTTLE_CHOICES)}, "
                                 f"got {self.throttle!r}")
        if self.comm_weight is not None and not 2 <= self.comm_weight <= 262144:
            raise EmulationError(f"[emulation] comm_weight must be an integer in [2, 262144] (cgroup v1 "
                                 f"cpu.shares), got {self.comm_weight!r}")
        if not 1 <= self.rdzv_port <= 65535:
            raise EmulationError(f"[emulation] rdzv_port must be a port number, got {self.rdzv_port!r}")
        if not 0 <= self.max_restarts <= 100:
            raise EmulationError(f"[emulation] max_restarts must be an integer in [0, 100], got {self.max_restarts!r}")
        if not self.join_timeout_s >= 1:
            raise EmulationError(f"[emulation] join_timeout must be at least 1s, got {self.join_timeout_s:g} s")
        for key, value in (("last_call_timeout", self.last_call_timeout_s),
                           ("keep_alive_interval", self.keep_alive_interval_s)):
            if not 1 <= value <= 3600:
                raise EmulationError(f"[emulation] {key} must be between 1s and 3600s, got {value:g} s")
        if not 1 <= self.keep_alive_max_attempt <= 100:
            raise EmulationError(f"[emulation] keep_alive_max_attempt must be an integer in [1, 100], "
                                 f"got {self.keep_alive_max_attempt!r}")

    def with_overrides(self, **changes: Any) -> EmulationSettings:
        """A copy with the given fields replaced; ``None`` values are ignored (unset CLI flags)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_period_s": self.cpu_period_s, "cpu_scale": self.cpu_scale, "throttle": self.throttle,
                "pin_cpus": self.pin_cpus, "fill_idle": self.fill_idle, "isolate_comm": self.isolate_comm,
                "comm_weight": self.comm_weight,
                "keep_awake": self.keep_awake, "shape": self.shape,
                "shape_intra": self.shape_intra, "rdzv_port": self.rdzv_port, "join_timeout_s": self.join_timeout_s,
                "max_restarts": self.max_restarts, "last_call_timeout_s": self.last_call_timeout_s,
                "keep_alive_interval_s": self.keep_alive_interval_s,
                "keep_alive_max_attempt": self.keep_alive_max_attempt, "events": [e.to_dict() for e in self.events]}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EmulationSettings:
        """The SI form written by ``to_dict`` (the run's state file)."""
        from hetrain.emulate.events import EmulationEvent

        fields = dict(data)
        fields["events"] = tuple(EmulationEvent.from_dict(e) for e in fields.get("events", ()))
        return EmulationSettings(**fields)


_KEYS = {"cpu_period", "cpu_scale", "throttle", "pin_cpus", "fill_idle", "isolate_comm", "keep_awake", "shape",
         "shape_intra", "rdzv_port", "join_timeout", "max_restarts", "last_call_timeout", "keep_alive_interval",
         "keep_alive_max_attempt", "event", "comm_weight"}


def parse_emulation_settings(table: Mapping[str, Any] | None) -> EmulationSettings:
    """Settings from the ``[emulation]`` table of a cluster file (``None``: the defaults).

    Raises:
        EmulationError: an unknown key, or a value of the wrong kind (named, with the value).
    """
    if table is None:
        return EmulationSettings()
    if not isinstance(table, Mapping):
        raise EmulationError(f"[emulation] must be a table, got {table!r}")
    extra = set(table) - _KEYS
    if extra:
        raise EmulationError(f"[emulation]: unknown keys {sorted(extra)}; known: {sorted(_KEYS)}")
    out: dict[str, Any] = {}
    for key, field in (("cpu_period", "cpu_period_s"), ("join_timeout", "join_timeout_s"),
                       ("last_call_timeout", "last_call_timeout_s"), ("keep_alive_interval", "keep_alive_interval_s")):
        if key in table:
            try:
                out[field] = parse_time(table[key], f"[emulation] {key}")
            except UnitError as e:
                raise EmulationError(str(e)) from None
    if "cpu_scale" in table:
        value = table["cpu_scale"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EmulationError(f"[emulation] cpu_scale must be a number, got {value!r}")
        out["cpu_scale"] = float(value)
    for key in ("shape", "shape_intra", "pin_cpus", "fill_idle", "isolate_comm", "keep_awake"):
        if key in table:
            if not isinstance(table[key], bool):
                raise EmulationError(f"[emulation] {key} must be true or false, got {table[key]!r}")
            out[key] = table[key]
    if "throttle" in table:
        out["throttle"] = str(table["throttle"])
    if "rdzv_port" in table:
        port = table["rdzv_port"]
        if isinstance(port, bool) or not isinstance(port, int):
            raise EmulationError(f"[emulation] rdzv_port must be an integer, got {port!r}")
        out["rdzv_port"] = port
    for key in ("max_restarts", "keep_alive_max_attempt", "comm_weight"):
        if key in table:
            count = table[key]
            if isinstance(count, bool) or not isinstance(count, int):
                raise EmulationError(f"[emulation] {key} must be an integer, got {count!r}")
            out[key] = count
    if "event" in table:
        from hetrain.emulate.events import parse_events  # events.py reads EmulationError from here

        out["events"] = parse_events(table["event"])
    return EmulationSettings(**out)


def load_emulation_settings(path: str | Path) -> EmulationSettings:
    """The ``[emulation]`` table of the cluster file at ``path`` (defaults where it has none).

    Raises:
        EmulationError: unreadable file, or an invalid ``[emulation]`` table (message starts with the path).
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise EmulationError(f"cannot read cluster file {p}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise EmulationError(f"{p}: not valid TOML: {e}") from None
    try:
        return parse_emulation_settings(data.get("emulation"))
    except EmulationError as e:
        raise EmulationError(f"{p}: {e}") from None

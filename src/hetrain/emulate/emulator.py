"""``EmulatedCluster``: bring an emulated cluster up, run jobs on it, take it down.

    with EmulatedCluster(load_cluster("c.toml"), load_emulation_settings("c.toml")) as em:
        print(em.describe())
        status = em.launch(["python", "-m", "hetrain.profiler.network", "-o", "measured.toml"])

Every run has a random 6-hex-digit id; its namespaces and cgroups are named
``hetrain-emu-<id>-...`` and a state file ``/run/hetrain-emulate/<id>.json``
records what it is. ``remove_run(id)`` removes all of it by that prefix (it needs
nothing but the id, so it also cleans up after a launcher that was killed), and
``list_runs()`` finds every run's leftovers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from hetrain.cluster import Cluster, parse_cluster
from hetrain.emulate.cgroups import (
    COMM_GROUP,
    CgroupRoot,
    create_comm_cgroup,
    create_device_cgroup,
    estimate_quota,
    find_cpu_cgroups,
    list_run_dirs,
    remove_run_dir,
    run_dir,
    set_cpu_share,
)
from hetrain.emulate.events import EmulationEvent, check_targets, signal_pids
from hetrain.emulate.keepawake import can_keep_awake
from hetrain.emulate.launch import signals_deferred
from hetrain.emulate.network import (
    NETNS_DIR,
    NetworkPlan,
    apply_network_plan,
    build_network_plan,
    list_namespaces,
    namespace_pids,
    nic_change_commands,
    remove_namespaces,
    run_command,
    run_id_of,
    safe_name,
)
from hetrain.emulate.settings import EmulationError, EmulationSettings
from hetrain.units import format_bandwidth

STATE_DIR = Path("/run/hetrain-emulate")  # one JSON file per run (a system path, tmpfs, root only)
LATENCY_NOTE = ("latency is not emulated: links are shaped with tc htb, which limits bandwidth only "
                "(delay needs tc netem, which hetrain emulate does not use); the file's latencies are ignored")


def check_permissions(action: str = "up") -> None:
    """Raise EmulationError saying what to do where namespaces and cgroups cannot be made.

    Args:
        action: the subcommand, for the message (``run`` can also go rootless, the others cannot).
    """
    if os.geteuid() != 0:
        from hetrain.emulate.rootless import probe_user_namespaces

        why = probe_user_namespaces()
        if action == "run":
            other = (f"Without root, `hetrain emulate run` runs inside a user namespace, but {why}." if why else "")
        else:
            other = ("Without root, only `hetrain emulate run` works (inside a user namespace"
                     + (f", which this host refuses: {why})." if why else ")."))
        raise EmulationError(
            f"hetrain emulate {action} needs root: it creates network namespaces, veth pairs, a bridge, tc qdiscs "
            "and cgroups. Run it as root (for example `sudo -E $(command -v hetrain) emulate ...`), or in a "
            f"container started with --cap-add NET_ADMIN --cap-add SYS_ADMIN. {other}".rstrip())
    missing = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise EmulationError(f"hetrain emulate needs the commands {', '.join(missing)} (packages iproute2 and "
                             "util-linux); install them and try again")


@dataclass(frozen=True)
class DeviceThrottle:
    """How one emulated device is throttled: its cgroup's ``cgroup.procs``, or None (unthrottled)."""

    device: str
    cpu_share: float | None
    procs_file: Path | None = None
    quota_us: int | None = None
    period_us: int | None = None


@dataclass
class EmulatedCluster:
    """A cluster emulated on this host: namespaces, shaped links, device cgroups.

    Args:
        cluster: what to emulate; each node becomes a network namespace, each device one rank
            process whose CPU is limited to its ``cpu_share`` (times ``settings.cpu_scale``).
        settings: the ``[emulation]`` table (``load_emulation_settings``); defaults if None.
        run_id: 6 hex digits; drawn at random if empty.
        source: the cluster file's path, for ``status``.
        log: where problems met while tearing down go (default: stderr).

    Use it as a context manager, or call ``up()`` and ``down()``; ``down()`` is safe to call
    twice and after a failed ``up()``.
    """

    cluster: Cluster
    settings: EmulationSettings = field(default_factory=EmulationSettings)
    run_id: str = ""  # empty: drawn at random
    source: str | None = None
    log: Callable[[str], None] | None = None
    network: NetworkPlan = field(init=False)
    throttles: tuple[DeviceThrottle, ...] = field(init=False, default=())
    cgroup_root: CgroupRoot | None = field(init=False, default=None)
    notes: list[str] = field(init=False, default_factory=list)
    is_up: bool = field(init=False, default=False)
    owner: bool = field(init=False, default=True)  # False when attached to a run that another command made

    def __post_init__(self) -> None:
        self.run_id = self.run_id or secrets.token_hex(3)
        if self.settings is None:
            self.settings = EmulationSettings()
        self.network = build_network_plan(self.cluster, self.settings, self.run_id)
        check_targets(self.settings.events, [d.name for d in self.cluster.devices],
                      [n.name for n in self.cluster.nodes])

    # --- bring up / take down ----------------------------------------------

    def up(self, keep: bool = False) -> EmulatedCluster:
        """Create namespaces, links, shaping and cgroups. On any failure, removes what it made and raises.

        What could not be emulated as asked (compute not throttled, more CPU asked for than the
        host has) is in ``notes``, and in ``describe()``.

        Args:
            keep: record the run as kept up (``hetrain emulate up``): no launcher owns it.

        Raises:
            EmulationError: not permitted, a tool missing, or a command that failed (named).
        """
        if self.is_up:
            return self
        check_permissions()
        taken = [ns for ns in list_namespaces() if run_id_of(ns) == self.run_id]
        if taken or (STATE_DIR / f"{self.run_id}.json").exists():
            raise EmulationError(f"run id {self.run_id} is already in use on this host "
                                 f"(see `hetrain emulate status`); pick another or let one be drawn")
        try:
            self._save_state(keep)
            apply_network_plan(self.network)
            self._make_cgroups()
            self.is_up = True
            self._save_state(keep)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Remove this run's processes, namespaces, veths, bridge, cgroups and state file.

        Returns the problems met (also logged); [] when everything went.
        """
        with signals_deferred():
            problems = remove_run(self.run_id)
        for p in problems:
            self._log(f"warning: {p}")
        self.is_up = False
        return problems

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.owner:
            self.down()

    # --- jobs -----------------------------------------------------------------

    def launch(self, command: Sequence[str], timeout_s: float | None = None,
               stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
        """Run ``command`` under one torchrun per node (see ``hetrain.emulate.launch``); its exit status."""
        from hetrain.emulate.launch import launch_job

        if not self.is_up:
            raise EmulationError(f"emulated cluster {self.run_id} is not up; call up() first")
        return launch_job(self, command, timeout_s=timeout_s, stdout=stdout, stderr=stderr)

    @staticmethod
    def attach(run_id: str, log: Callable[[str], None] | None = None) -> EmulatedCluster:
        """The emulated cluster of a run that is up (``hetrain emulate up``), to launch jobs on it.

        Leaving its ``with`` block does not take it down (its owner, or ``hetrain emulate down``, does).
        """
        state = load_state(run_id)
        if state is None:
            known = ", ".join(r.run_id for r in list_runs()) or "none"
            raise EmulationError(f"no emulated cluster with run id {run_id!r} is up (runs: {known})")
        em = EmulatedCluster(parse_cluster(state["cluster"]), EmulationSettings.from_dict(state["settings"]),
                             run_id=run_id, source=state.get("source"), log=log)
        em.throttles = tuple(
            DeviceThrottle(t["device"], t["cpu_share"], Path(t["procs_file"]) if t["procs_file"] else None,
                           t.get("quota_us"), t.get("period_us"))
            for t in state.get("throttles", []))
        em.notes = list(state.get("notes", []))
        missing = [ns for ns in em.network.namespaces if ns not in list_namespaces()]
        if missing:
            raise EmulationError(f"run {run_id} is incomplete: namespaces {', '.join(missing)} are gone; "
                                 f"remove it with `hetrain emulate down {run_id}`")
        em.is_up, em.owner = True, False
        return em

    # --- what a node's torchrun needs -----------------------------------------

    def node_cpus(self, k: int) -> list[list[int]]:
        """The CPUs of node k's devices by local rank (``[]``: not pinned); see ``assign_cpus``."""
        throttled = {t.device for t in self.throttles if t.procs_file}
        if not self.settings.pin_cpus or not throttled:
            return [[] for _ in self.cluster.nodes[k].devices]
        pins = assign_cpus([(t.device, t.cpu_share) for t in self.throttles if t.device in throttled and t.cpu_share],
                           sorted(os.sched_getaffinity(0)))
        return [[pins[d.name]] if d.name in pins else [] for d in self.cluster.nodes[k].devices]

    def keeps_awake(self) -> bool:
        """Whether a job keeps the host's CPUs out of sleep states (``keep_awake``, ``emulate.keepawake``):
        where the setting is on and some device is throttled."""
        return self.settings.keep_awake and any(t.procs_file for t in self.throttles)

    def node_fillers(self, k: int) -> list[bool]:
        """Whether node k's devices, by local rank, get an idle filler (``fill_idle``): those throttled
        below one CPU (a quota of a whole CPU per period banks nothing a pinned process could use)."""
        by_name = {t.device: t for t in self.throttles}
        out = []
        for d in self.cluster.nodes[k].devices:
            t = by_name.get(d.name)
            out.append(bool(self.settings.fill_idle and t and t.procs_file and t.cpu_share and t.cpu_share < 1.0))
        return out

    def node_comm_targets(self, k: int) -> list[str]:
        """Where node k's ranks, by local rank, move their threads other than the main one (``isolate_comm``):
        the ``tasks`` file of the run's cgroup (or of its ``comm`` child where ``comm_weight`` is set:
        ``create_comm_cgroup``) for a throttled device under cgroup v1, else ``""`` (not moved)."""
        root = self.cgroup_root
        if not (self.settings.isolate_comm and root is not None and root.version == 1):
            return ["" for _ in self.cluster.nodes[k].devices]
        group = run_dir(root, self.run_id)
        tasks = str((group / COMM_GROUP if self.settings.comm_weight is not None else group) / "tasks")
        return [tasks if procs else "" for procs in self.node_cgroups(k)]

    def node_cgroups(self, k: int) -> list[str]:
        """``cgroup.procs`` of node k's devices by local rank (``""``: unthrottled)."""
        by_name = {t.device: t for t in self.throttles}
        out = []
        for d in self.cluster.nodes[k].devices:
            t = by_name.get(d.name)
            out.append(str(t.procs_file) if t and t.procs_file else "")
        return out

    def netns_path(self, k: int) -> str:
        return f"{NETNS_DIR}/{self.network.nodes[k].namespace}"

    # --- changes while a job runs (emulate.events) ------------------------------

    def apply_event(self, event: EmulationEvent) -> str:
        """Make one scripted change now; what it did, for the log.

        Raises:
            EmulationError: the emulation cannot make it (an unthrottled device, an unshaped NIC).
        """
        if event.kind == "cpu_share":
            assert event.value is not None
            return self._set_cpu_share(event.target, event.value)
        k = [n.name for n in self.cluster.nodes].index(event.target)
        if event.kind == "nic":
            assert event.value is not None
            if not self.settings.shape:
                raise EmulationError(f"{event.describe()}: shape = false, so NICs are not shaped and cannot change")
            for cmd in nic_change_commands(self.network, k, event.value):
                run_command(cmd)
            return f"node {event.target}'s NIC shaped to {format_bandwidth(event.value)} each way"
        pids = namespace_pids(self.network.nodes[k].namespace)
        sent = signal_pids(pids, event.kind)
        return f"node {event.target}: {event.kind} sent to {sent} process(es)"

    def _set_cpu_share(self, device: str, share: float) -> str:
        throttle = next((t for t in self.throttles if t.device == device), None)
        if throttle is None or throttle.procs_file is None or self.cgroup_root is None:
            raise EmulationError(f"device {device} is not throttled (no cpu_share, or no cgroups here): its share "
                                 "cannot change")
        scaled = share * self.settings.cpu_scale
        quota_us, period_us = set_cpu_share(throttle.procs_file.parent, self.cgroup_root.version, scaled,
                                            self.settings.cpu_period_s)
        before = throttle.cpu_share
        self.throttles = tuple(replace(t, cpu_share=scaled, quota_us=quota_us, period_us=period_us)
                               if t.device == device else t for t in self.throttles)
        return f"device {device}: cpu share {before:g} -> {scaled:g} ({quota_us} us per {period_us} us)"

    def describe(self) -> str:
        """The emulated cluster in words: nodes, addresses, shaped rates, CPU quotas, what is not emulated."""
        c, net = self.cluster, self.network
        counts = f"{len(c.nodes)} node{'s' * (len(c.nodes) != 1)}, {c.num_devices} device{'s' * (c.num_devices != 1)}"
        lines = [f"emulated cluster {c.name!r}, run {self.run_id}: {counts}"
                 + (f" ({self.cgroup_root.describe()})" if self.cgroup_root else "")]
        by_name = {t.device: t for t in self.throttles}
        pins = {d.name: cpus for k, n in enumerate(c.nodes) for d, cpus in zip(n.devices, self.node_cpus(k),
                                                                                  strict=True)}
        for node, nn in zip(c.nodes, net.nodes, strict=True):
            nic = format_bandwidth(node.nic.bandwidth_bytes_per_s) if self.settings.shape else "unshaped"
            intra = f"  intra {format_bandwidth(node.intra_link.bandwidth_bytes_per_s)} (lo)" \
                if self.settings.shape_intra else ""
            lines.append(f"  node {node.name:<10} netns {nn.namespace}  {nn.address}  nic {nic}{intra}")
            for d in node.devices:
                t = by_name.get(d.name)
                if t and t.procs_file and t.quota_us and t.period_us:
                    cpu = (f"cpu_share {t.cpu_share:g}: {t.quota_us / 1000:g} ms CPU per "
                           f"{t.period_us / 1000:g} ms")
                elif d.cpu_share is not None and not self.is_up:
                    cpu = f"cpu_share {d.cpu_share * self.settings.cpu_scale:g}"
                elif d.cpu_share is not None:
                    cpu = f"cpu_share {d.cpu_share * self.settings.cpu_scale:g}: NOT enforced"
                else:
                    cpu = "no cpu_share: unthrottled"
                pinned = pins.get(d.name)
                lines.append(f"    {d.name:<14} {cpu}" + (f", pinned to CPU {pinned[0]}" if pinned else ""))
        if len(c.nodes) > 1:
            lines.append("  links between nodes (each direction):")
            overridden = {frozenset(nl.nodes) for nl in c.node_links}
            for a in range(len(c.nodes)):
                for b in range(a + 1, len(c.nodes)):
                    bw = c.node_link(a, b).bandwidth_bytes_per_s
                    why = "[[link]]" if frozenset((c.nodes[a].name, c.nodes[b].name)) in overridden else "slower NIC"
                    rate = format_bandwidth(bw) if self.settings.shape else "unshaped"
                    lines.append(f"    {c.nodes[a].name} <-> {c.nodes[b].name}: {rate} ({why})")
        intra = ("each node's loopback, shaped at its intra_link rate (both directions and all pairs share it)"
                 if self.settings.shape_intra else "each node's loopback, unshaped")
        lines.append(f"  intra-node links: {intra}")
        lines.append(f"  {LATENCY_NOTE}")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    # --- internals --------------------------------------------------------------

    def _log(self, message: str) -> None:
        if self.log is not None:
            self.log(message)
        else:
            print(f"hetrain emulate: {message}", file=sys.stderr, flush=True)

    def _warn(self, message: str) -> None:
        self.notes.append(message)  # shown by describe(), which `run` and `up` print first

    def _make_cgroups(self) -> None:
        scale = self.settings.cpu_scale
        wanted = [(k, d) for k, n in enumerate(self.cluster.nodes) for d in n.devices if d.cpu_share is not None]
        plain = tuple(DeviceThrottle(d.name, None if d.cpu_share is None else d.cpu_share * scale)
                      for d in self.cluster.devices)
        self.throttles = plain
        total = sum((d.cpu_share * scale if d.cpu_share is not None else 1.0) for d in self.cluster.devices)
        cpus = os.cpu_count() or 1
        if wanted and self.settings.throttle != "off" and total > cpus + 1e-9:
            self._warn(f"warning: the devices ask for {total:g} CPUs in all and this host has {cpus}: they "
                       f"compete, so each gets less than its cpu_share (set cpu_scale = "
                       f"{math.floor(100 * cpus / total) / 100:g} in "
                       "[emulation] to keep the ratios and fit the host)")
        if not wanted:
            self.notes.append("no device has a cpu_share: compute is not throttled")
            return
        if self.settings.throttle == "off":
            self._warn("WARNING: throttle = off: cpu_share is NOT enforced; every device runs at full host speed")
            return
        root, reason = find_cpu_cgroups()
        made: list[DeviceThrottle] = []
        try:
            if root is None:
                raise OSError(reason)
            for k, d in wanted:
                share = float(d.cpu_share) * scale  # type: ignore[arg-type]
                key = f"{k}-{safe_name(d.node)}-{d.name.rsplit(':', 1)[1]}"
                procs = create_device_cgroup(root, self.run_id, key, share, self.settings.cpu_period_s)
                quota_us, period_us = estimate_quota(share, self.settings.cpu_period_s)
                made.append(DeviceThrottle(d.name, share, procs, quota_us, period_us))
            if self.settings.isolate_comm and root.version == 1 and self.settings.comm_weight is not None:
                create_comm_cgroup(root, self.run_id, self.settings.comm_weight)
        except OSError as e:
            why = f"{e.filename}: {e.strerror}" if e.strerror else str(e)
            if root is not None:
                remove_run_dir(run_dir(root, self.run_id))
                why = f"{root.describe()}: {why}"
            if self.settings.throttle == "cgroup":
                raise EmulationError(f"cannot throttle compute (throttle = \"cgroup\"): {why}. Run as root on a "
                                     "host with the cgroup cpu controller, or set throttle = \"auto\"") from None
            self._warn(f"WARNING: cpu_share is NOT enforced: {why}. Every device runs at full host speed, so "
                       "compute heterogeneity is not emulated (run as root with the cgroup cpu controller)")
            return
        self.cgroup_root = root
        if self.settings.isolate_comm:
            self.notes.append("each rank's threads but its main one (communication) run outside its quota "
                              "(isolate_comm" + (f", in a cgroup of weight {self.settings.comm_weight})"
                                                 if self.settings.comm_weight is not None else ")")
                              if root.version == 1 else
                              "isolate_comm is not honoured on cgroup v2 (a process's threads share one cgroup "
                              "there): each device's communication spends its quota")
        by_name = {t.device: t for t in made}
        self.throttles = tuple(by_name.get(t.device, t) for t in plain)
        if self.settings.keep_awake:
            unable = can_keep_awake()
            self.notes.append("while a job runs, the CPUs are kept out of sleep states between quota periods "
                              "(keep_awake)" if unable is None else f"keep_awake is not honoured: {unable}")

    def _save_state(self, keep: bool) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "run_id": self.run_id,
            "cluster": self.cluster.to_dict(),
            "settings": self.settings.to_dict(),
            "source": self.source,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "launcher_pid": None if keep else os.getpid(),
            "up": self.is_up,
            "throttles": [{"device": t.device, "cpu_share": t.cpu_share,
                           "procs_file": str(t.procs_file) if t.procs_file else None,
                           "quota_us": t.quota_us, "period_us": t.period_us} for t in self.throttles],
            "notes": self.notes,
        }
        path = STATE_DIR / f"{self.run_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)


# ---------------------------------------------------------------------------
# runs on this host: find, describe, remove
# ---------------------------------------------------------------------------


def load_state(run_id: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((STATE_DIR / f"{run_id}.json").read_text())
        return data
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class RunStatus:
    """What exists of one run: its state file (if any), namespaces, cgroups, processes."""

    run_id: str
    state: dict[str, Any] | None
    namespaces: tuple[str, ...]
    cgroups: tuple[Path, ...]
    processes: int

    @property
    def owner_alive(self) -> bool:
        pid = (self.state or {}).get("launcher_pid")
        return bool(pid) and Path(f"/proc/{pid}").exists()

    def describe(self) -> str:
        st = self.state or {}
        cluster = st.get("cluster", {}).get("name", "?")
        if not st:
            how = "leftover (no state file): remove with `hetrain emulate down`"
        elif st.get("launcher_pid") is None:
            how = "kept up by `hetrain emulate up`"
        elif self.owner_alive:
            how = f"in use by launcher pid {st['launcher_pid']}"
        else:
            how = f"leftover of launcher pid {st['launcher_pid']}, which is gone: remove with `hetrain emulate down`"
        lines = [f"run {self.run_id}: cluster {cluster!r} from {st.get('source') or '?'}, "
                 f"created {st.get('created', '?')}; {how}",
                 f"  {len(self.namespaces)} namespaces, {len(self.cgroups)} cgroup trees, "
                 f"{self.processes} processes inside"]
        lines += [f"  netns {ns}" for ns in self.namespaces]
        lines += [f"  cgroup {p}" for p in self.cgroups]
        return "\n".join(lines)


def list_runs() -> list[RunStatus]:
    """Every run with anything left on this host: state files, namespaces or cgroups named ``hetrain-emu-*``."""
    namespaces: dict[str, list[str]] = {}
    for ns in list_namespaces():
        rid = run_id_of(ns)
        if rid:
            namespaces.setdefault(rid, []).append(ns)
    cgroups = list_run_dirs()
    states = {}
    with contextlib.suppress(OSError):
        for f in STATE_DIR.glob("*.json"):
            state = load_state(f.stem)
            if state is not None:
                states[f.stem] = state
    out = []
    for rid in sorted(set(namespaces) | set(cgroups) | set(states)):
        nss = tuple(sorted(namespaces.get(rid, [])))
        procs = sum(len(namespace_pids(ns)) for ns in nss)
        out.append(RunStatus(rid, states.get(rid), nss, tuple(cgroups.get(rid, [])), procs))
    return out


def remove_run(run_id: str) -> list[str]:
    """Remove everything of run ``run_id`` by its name prefix: processes, namespaces, cgroups, state file.

    Needs nothing but the id, so it also cleans up after a launcher that was killed.
    Returns the problems met, [] when everything went.
    """
    problems = remove_namespaces(run_id)
    for path in list_run_dirs().get(run_id, []):
        problems += remove_run_dir(path)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{run_id}.json").unlink()
    return problems


def assign_cpus(shares: Sequence[tuple[str, float]], cpus: Sequence[int]) -> dict[str, int]:
    """One CPU per device, the largest shares first, each on the CPU with the least share so far.

    Example:
        >>> assign_cpus([("fast:0", 0.6), ("fast:1", 0.6), ("slow:0", 0.2), ("slow:1", 0.2)], [0, 1])
        {'fast:0': 0, 'fast:1': 1, 'slow:0': 0, 'slow:1': 1}
    """
    if not cpus:
        return {}
    load = dict.fromkeys(cpus, 0.0)
    out = {}
    for name, share in sorted(shares, key=lambda x: -x[1]):
        cpu = min(cpus, key=lambda c: load[c])
        out[name] = cpu
        load[cpu] += share
    return {name: out[name] for name, _ in shares}

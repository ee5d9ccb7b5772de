"""The emulated network: one namespace per node, a bridge in a hub namespace, tc shaping.

Picture for two nodes, run id ``1a2b3c``::

    netns hetrain-emu-1a2b3c-0-fast        netns hetrain-emu-1a2b3c-hub        netns hetrain-emu-1a2b3c-1-slow
    ┌──────────────────────────┐          ┌───────────────────────────┐       ┌──────────────────────────┐
    │ ranks of node fast       │          │                           │       │ ranks of node slow       │
    │ lo (intra-node traffic)  │          │           br0             │       │ lo (intra-node traffic)  │
    │ nic 10.213.0.100/16 ─────┼── veth ──┼─ v0 ──────┘ └────── v1 ───┼─ veth─┼─ nic 10.213.0.101/16     │
    │  egress: htb, NIC rate   │          │ egress of v0: htb into    │       │  egress: htb, NIC rate   │
    │  (+ a class per [[link]])│          │ fast; v1: into slow       │       │                          │
    └──────────────────────────┘          └───────────────────────────┘       └──────────────────────────┘

Traffic from node a to node b is shaped twice: leaving a (its ``nic`` egress, a's
NIC rate) and entering b (the hub port's egress toward b, b's NIC rate), so a
pair gets ``min(nic_a, nic_b)`` and a NIC is shared by all the node's flows in
each direction. A ``[[link]]`` between a and b gets its own htb class on both
sides, picked by the peer's address (u32 filter on destination at a, on source
at b): that pair gets the link's rate and does not share the NICs. Latency is
not emulated (no netem); intra-node traffic stays on the namespace's loopback.

Nothing here touches the root namespace: the addresses, the bridge and the
routes exist only inside this run's namespaces, and the subnet reaches nothing
outside them. Node k gets ``10.213.{k // 100}.{100 + k % 100}``: the addresses
sort as strings in node order, so torchrun's c10d rendezvous (which orders
nodes by address) gives node k the k-th block of global ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hetrain.cluster import Cluster
from hetrain.emulate.settings import EmulationError, EmulationSettings

PREFIX = "hetrain-emu-"  # every namespace and cgroup of every run starts with this
NIC = "nic"              # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"           # the switch, inside the hub namespace
NETNS_DIR = "/run/netns"  # where `ip netns` keeps its names (a system path)
_COMMAND_TIMEOUT_S = 20.0

Command = tuple[str, ...]


def node_address(k: int) -> str:
    """The address of node ``k``: 10.213.0.100, 10.213.0.101, ... (string order = node order)."""
    return f"10.213.{k // 100}.{100 + k % 100}"


def safe_name(name: str) -> str:
    """A node name as it may appear in a namespace or cgroup name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "_"


def hub_namespace(run_id: str) -> str:
    return f"{PREFIX}{run_id}-hub"


def node_namespace(run_id: str, k: int, node_name: str) -> str:
    return f"{PREFIX}{run_id}-{k}-{safe_name(node_name)}"


def run_id_of(name: str) -> str | None:
    """The run id in a namespace or cgroup name made here; None for any other name."""
    m = re.fullmatch(rf"{re.escape(PREFIX)}([0-9a-f]{{6}})(?:-.*)?", name)
    return m.group(1) if m else None


@dataclass(frozen=True)
class NodeNet:
    """One node's place in the emulated network.

    Attributes:
        name: the node's name in the cluster file.
        namespace: its network namespace (``/run/netns/<namespace>``).
        address: its IPv4 address on the ``nic`` interface inside the namespace.
        hub_port: the other end of its veth, a port of the bridge in the hub namespace.
        nic_bytes_per_s: the rate its NIC is shaped to, each direction.
        link_bytes_per_s: rates of its ``[[link]]`` overrides, by peer node name.
    """

    name: str
    namespace: str
    address: str
    hub_port: str
    nic_bytes_per_s: float
    link_bytes_per_s: dict[str, float]


@dataclass(frozen=True)
class NetworkPlan:
    """Namespaces, addresses and the ``ip``/``tc`` commands that build them, in order."""

    run_id: str
    hub: str
    nodes: tuple[NodeNet, ...]
    commands: tuple[Command, ...]

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.hub, *(n.namespace for n in self.nodes))


def _rate(bytes_per_s: float) -> str:
    return f"{round(bytes_per_s * 8)}bit"


#: largest and smallest GSO segment the emulated NICs send (``gso_max_size``); see ``gso_size``
GSO_MAX, GSO_MIN = 65536, 8192


def gso_size(slowest_bytes_per_s: float) -> int:
    """The GSO segment size every emulated NIC is capped to: half a millisecond at the slowest shaped
    rate, between 8 KB and 64 KB.

    htb lets a class send ``burst`` bytes at once after a pause and needs the burst to hold at least a
    segment or two. With the kernel's default 64 KB segments the burst is >= 128 KB, and a 128 KB
    message then crosses a "50 Mbit/s" link in ~1 ms instead of 21 ms: small messages (a pipeline's
    activations) would see a far faster link than the one described. Capping the segments lets the
    burst shrink to 16 KB on slow links, where a 128 KB message measured 19.5 ms.

    Example:
        >>> gso_size(50e6 / 8), gso_size(1e9 / 8)
        (8192, 62500)
    """
    return int(min(GSO_MAX, max(GSO_MIN, round(slowest_bytes_per_s * 0.5e-3))))


def _htb_class(ns: str, dev: str, classid: str, bytes_per_s: float, gso: int, verb: str = "add") -> Command:
    # burst: at least two GSO segments, else 1 ms at the rate. quantum (the DRR share
    # between sibling classes) kept in htb's sane range to avoid its "quantum is big" warning.
    burst = max(2 * gso, round(bytes_per_s * 1e-3))
    quantum = min(200_000, max(1600, round(bytes_per_s / 10)))
    return ("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:", "classid", classid, "htb",
            "rate", _rate(bytes_per_s), "burst", str(burst), "cburst", str(burst), "quantum", str(quantum))


def _shaping(ns: str, dev: str, default_bytes_per_s: float, by_peer: Sequence[tuple[str, float]],
             match: str, gso: int) -> list[Command]:
    """htb on ``dev``: class 1:1 (default) at the NIC rate, class 1:1k per peer address ``match``-ed."""
    cmds: list[Command] = [
        ("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"),
        _htb_class(ns, dev, "1:1", default_bytes_per_s, gso),
    ]
    for j, (peer_address, rate) in enumerate(by_peer):
        classid = f"1:{10 + j:x}"
        cmds.append(_htb_class(ns, dev, classid, rate, gso))
        cmds.append(("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                     "u32", "match", "ip", match, f"{peer_address}/32", "flowid", classid))
    return cmds


def build_network_plan(cluster: Cluster, settings: EmulationSettings, run_id: str) -> NetworkPlan:
    """The namespaces, addresses and commands that emulate ``cluster``'s network (pure; runs nothing).

    Example:
        >>> plan = build_network_plan(load_cluster("examples/clusters/small-hetero.toml"),  # doctest: +SKIP
        ...                           EmulationSettings(), "1a2b3c")
        >>> [n.address for n in plan.nodes]                                                # doctest: +SKIP
        ['10.213.0.100', '10.213.0.101']
    """
    if not re.fullmatch(r"[0-9a-f]{6}", run_id):
        raise EmulationError(f"run id must be 6 hex digits, got {run_id!r}")
    hub = hub_namespace(run_id)
    index = {n.name: k for k, n in enumerate(cluster.nodes)}
    overrides: dict[int, dict[int, float]] = {k: {} for k in range(len(cluster.nodes))}
    for nl in cluster.node_links:
        a, b = index[nl.nodes[0]], index[nl.nodes[1]]
        overrides[a][b] = overrides[b][a] = nl.link.bandwidth_bytes_per_s
    nodes = tuple(
        NodeNet(name=n.name, namespace=node_namespace(run_id, k, n.name), address=node_address(k),
                hub_port=f"v{k}", nic_bytes_per_s=n.nic.bandwidth_bytes_per_s,
                link_bytes_per_s={cluster.nodes[p].name: bw for p, bw in sorted(overrides[k].items())})
        for k, n in enumerate(cluster.nodes))
    cmds: list[Command] = [
        ("ip", "netns", "add", hub),
        ("ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"),
        ("ip", "-n", hub, "link", "set", BRIDGE, "up"),
    ]
    for node in nodes:
        ns = node.namespace
        cmds += [
            ("ip", "netns", "add", ns),
            ("ip", "-n", ns, "link", "set", "lo", "up"),
            ("ip", "-n", hub, "link", "add", node.hub_port, "type", "veth", "peer", "name", NIC, "netns", ns),
            ("ip", "-n", hub, "link", "set", node.hub_port, "master", BRIDGE),
            ("ip", "-n", hub, "link", "set", node.hub_port, "up"),
            ("ip", "-n", ns, "addr", "add", f"{node.address}/16", "dev", NIC),
            ("ip", "-n", ns, "link", "set", NIC, "up"),
        ]
    if settings.shape:
        # one segment cap for every NIC: a node's segments meet the burst of every node they reach
        gso = gso_size(min([n.nic_bytes_per_s for n in nodes] + [bw for o in overrides.values() for bw in o.values()]))
        for k, node in enumerate(nodes):
            cmds += [("ip", "-n", node.namespace, "link", "set", NIC, "gso_max_size", str(gso)),
                     ("ip", "-n", hub, "link", "set", node.hub_port, "gso_max_size", str(gso))]
            peers = [(node_address(p), bw) for p, bw in sorted(overrides[k].items())]
            cmds += _shaping(node.namespace, NIC, node.nic_bytes_per_s, peers, "dst", gso)  # leaving the node
            cmds += _shaping(hub, node.hub_port, node.nic_bytes_per_s, peers, "src", gso)   # entering the node
    if settings.shape_intra:
        for node, n in zip(nodes, cluster.nodes, strict=True):
            rate = n.intra_link.bandwidth_bytes_per_s
            burst = max(4 * 65536, round(rate * 1e-3))  # lo carries 64 KB segments
            cmds.append(("tc", "-n", node.namespace, "qdisc", "add", "dev", "lo", "root", "tbf",
                         "rate", _rate(rate), "burst", str(burst), "latency", "100ms"))
    return NetworkPlan(run_id, hub, nodes, tuple(cmds))


def nic_change_commands(plan: NetworkPlan, k: int, bytes_per_s: float) -> list[Command]:
    """The commands that reshape node ``k``'s NIC (class 1:1 both ways: leaving it and entering it) to
    ``bytes_per_s`` while it runs; its ``[[link]]`` classes keep their rates."""
    rates = [n.nic_bytes_per_s for n in plan.nodes] + [bw for n in plan.nodes for bw in n.link_bytes_per_s.values()]
    gso = gso_size(min(rates))  # the segment cap the plan set up (build_network_plan)
    node = plan.nodes[k]
    return [_htb_class(node.namespace, NIC, "1:1", bytes_per_s, gso, "change"),
            _htb_class(plan.hub, node.hub_port, "1:1", bytes_per_s, gso, "change")]


# ---------------------------------------------------------------------------
# running the commands
# ---------------------------------------------------------------------------


def run_command(cmd: Sequence[str]) -> str:
    """Run one ``ip``/``tc`` command; EmulationError with the command and its stderr if it fails."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise EmulationError(f"`{cmd[0]}` is not installed (it comes with iproute2 / util-linux)") from None
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{' '.join(cmd)}` did not finish within {_COMMAND_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def apply_network_plan(plan: NetworkPlan) -> None:
    """Build the namespaces, bridge, veths and shaping; raises EmulationError at the first failure
    (the caller removes what was made, by the run's prefix)."""
    for cmd in plan.commands:
        run_command(cmd)


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def namespace_pids(namespace: str) -> list[int]:
    """Processes inside a namespace (``ip netns pids``); [] if it is gone."""
    try:
        out = run_command(("ip", "netns", "pids", namespace))
    except EmulationError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_pids(pids: Sequence[int], wait_s: float = 5.0) -> list[int]:
    """SIGKILL each pid (all of them processes of this run) and wait for them to go; returns the survivors."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has finished
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def remove_namespaces(run_id: str) -> list[str]:
    """Kill every process inside this run's namespaces, then delete them (the veths and bridge go with them).

    Returns the namespaces that could not be deleted (with why), [] when all went.
    """
    mine = [ns for ns in list_namespaces() if run_id_of(ns) == run_id]
    problems = []
    for _ in range(3):  # a process may fork while we kill: look again
        pids = [p for ns in mine for p in namespace_pids(ns)]
        if not pids:
            break
        kill_pids(pids)
    for ns in sorted(mine, key=lambda n: n.endswith("-hub")):  # nodes first, the hub last
        try:
            run_command(("ip", "netns", "del", ns))
        except EmulationError as e:
            problems.append(str(e))
    return problems

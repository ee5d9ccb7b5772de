"""Which part of the plan each rank runs: devices are matched to ranks by host and local rank.

torchrun may number ranks differently after a restart, so a rank is never
identified by its number alone. Each rank names its device ``"<node>:<LOCAL_RANK>"``,
the node being its host (``HETRAIN_NODE``, else the host name); the names are
all-gathered and matched to the plan's devices::

    ranks:   0 -> n0:0   1 -> n0:1   2 -> n1:0   3 -> n1:1
    plan:    VW0  n0:0 [0..3) ──► n1:0 [3..6)        (n0:1 unused: it idles)
             VW1  n1:1 [0..6)

On one host, or wherever no rank sets ``HETRAIN_NODE``, the host names need not be the
plan's node names: ``match_hosts`` renames hosts to nodes when they pair up one to one
by shape (as many hosts as nodes, each host with as many ranks as its node has devices)
and the pairing is unambiguous, so ``torchrun --standalone`` runs a one-node plan as it is.

Everything here but ``local_device_name`` and ``node_from_host`` is pure: tests drive it with lists of names.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hetrain.errors import RunError
from hetrain.plan import Plan, Stage


class RoleError(RunError):
    """The processes of the job do not match the plan's devices."""


def local_node_name(rank: int) -> str:
    """This rank's node: ``HETRAIN_NODE`` (one name, or a comma-separated list indexed by rank), else the host name.

    ``HETRAIN_HOST`` (what ``hetrain discover`` reads) is honoured the same way when
    ``HETRAIN_NODE`` is not set, so a cluster found by discovery matches here.
    """
    for var in ("HETRAIN_NODE", "HETRAIN_HOST"):
        override = os.environ.get(var, "").strip()
        if not override:
            continue
        names = [n.strip() for n in override.split(",")]
        if len(names) == 1:
            return names[0]
        if rank >= len(names) or not names[rank]:
            raise RoleError(f"{var} lists {len(names)} nodes ({override!r}) but has none for rank {rank}")
        return names[rank]
    return socket.gethostname()


def node_from_host() -> bool:
    """Whether this rank's node is its host name (neither ``HETRAIN_NODE`` nor ``HETRAIN_HOST`` set)."""
    return not any(os.environ.get(var, "").strip() for var in ("HETRAIN_NODE", "HETRAIN_HOST"))


def device_name(node: str, local_rank: int) -> str:
    """The plan's name of the device a process drives: ``"<node>:<local_rank>"``."""
    return f"{node}:{local_rank}"


def local_device_name(rank: int, local_rank: int) -> str:
    """The device this process drives, as the plan names it."""
    return device_name(local_node_name(rank), local_rank)


@dataclass(frozen=True)
class Role:
    """What one rank does in a plan.

    Attributes:
        rank: the process's rank in the default process group.
        device: its device name in the plan (``"n0:1"``).
        vw: index of its virtual worker, or None when the plan leaves the device unused.
        j: its stage index in the VW (0 when unused).
        stage: its stage (None when unused).
        num_stages: p, the VW's stage count.
        prev_device, next_device: the devices of stages j - 1 and j + 1, if any.
        prev_rank, next_rank: their ranks.
        mini_batch_sizes: every VW's mini-batch, in VW order (how a global batch is cut).
        micro_batch_sizes: this VW's micro-batch sizes, i = 0..m-1.
        global_batch: N, samples per iteration over all VWs.
        lead: the stage's device in the plan (its TP group's first; the schedule's Actions are named by it).
        tp_rank: this rank's index in its stage's TP group (0 without TP).
        tp_ranks: the ranks of the stage's TP group, in the group's order (this rank alone without TP).
        send_f_ranks: the ranks of stage j + 1 this rank sends its activations to ("every rank sends its copy":
            receiver r of a group of k' takes its input from rank r mod k of this group of k).
        split_prev / split_next: the stage before / after runs at this stage's TP degree (> 1): the boundary
            moves a k-th per rank and is all-gathered (``step.tp_transfer``); else every rank sends its copy.
        send_b_ranks: the ranks of stage j - 1 this rank sends its input gradients to (rank j' of that group
            takes them from rank j' mod k of this group).

    ``prev_rank`` is the rank this one receives its activations from, ``next_rank`` the one it receives its
    output gradients from (with TP, one member of the neighbouring group; ``tp_transfers``).
    """

    rank: int
    device: str
    vw: int | None
    j: int
    stage: Stage | None
    num_stages: int
    prev_device: str | None
    next_device: str | None
    prev_rank: int | None
    next_rank: int | None
    mini_batch_sizes: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    global_batch: int
    lead: str = ""
    tp_rank: int = 0
    tp_ranks: tuple[int, ...] = ()
    send_f_ranks: tuple[int, ...] = ()
    send_b_ranks: tuple[int, ...] = ()
    split_prev: bool = False
    split_next: bool = False

    @property
    def tp(self) -> int:
        """The TP degree of this rank's stage (1: no TP)."""
        return max(1, len(self.tp_ranks))

    @property
    def used(self) -> bool:
        """Whether the plan gives this rank's device a stage."""
        return self.stage is not None

    @property
    def is_first(self) -> bool:
        return self.used and self.j == 0

    @property
    def is_last(self) -> bool:
        return self.used and self.j == self.num_stages - 1


def _describe_world(plan: Plan, reported: Sequence[str]) -> str:
    nodes = "; ".join(f"{n.name} ({', '.join(d.name for d in n.devices)})" for n in plan.cluster.nodes)
    ranks = ", ".join(f"rank {r} -> {d}" for r, d in enumerate(reported))
    used = ", ".join(plan.devices_used)
    return (f"the plan's cluster {plan.cluster.name!r} has nodes {nodes}; the plan uses {used}.\n"
            f"The {len(reported)} rank(s) reported: {ranks}.\n"
            "A rank's device is '<node>:<LOCAL_RANK>', its node HETRAIN_NODE or else the host name; "
            "set HETRAIN_NODE, or start one process per device of the plan.")


def assign_ranks(plan: Plan, reported: Sequence[str]) -> dict[str, int]:
    """Device name -> rank, from the device each rank reported (``reported[rank]``).

    Every reported device must be a device of the plan's cluster, no two ranks may
    report the same device, and every device the plan uses needs a rank. Devices of
    the cluster that the plan leaves unused may have a rank (it idles) or not.

    Raises:
        RoleError: every mismatch, then the plan's nodes and devices and what each rank reported.

    Example:
        >>> assign_ranks(plan, ["n0:0", "n0:1"])     # doctest: +SKIP
        {'n0:0': 0, 'n0:1': 1}
    """
    known = {d.name for d in plan.cluster.devices}
    problems: list[str] = []
    owner: dict[str, int] = {}
    for rank, dev in enumerate(reported):
        if dev not in known:
            problems.append(f"rank {rank} reports device {dev}, which is not in the plan's cluster")
        elif dev in owner:
            problems.append(f"ranks {owner[dev]} and {rank} both report device {dev}")
        else:
            owner[dev] = rank
    for v, vw in enumerate(plan.virtual_workers):
        for j, s in enumerate(vw.stages):
            for dev in s.devices:
                if dev not in owner:
                    problems.append(f"no rank drives {dev} (stage {j} of VW{v}, layers [{s.first_layer}, "
                                    f"{s.end_layer}){f', TP group of {s.device}' if s.tp > 1 else ''})")
    if problems:
        listed = "\n  ".join(problems)
        raise RoleError(f"the world does not match the plan:\n  {listed}\n{_describe_world(plan, reported)}")
    return owner


def match_hosts(plan: Plan, reported: Sequence[str]) -> tuple[list[str], str | None]:
    """``reported`` with host names replaced by the plan's node names where they pair up by shape, and a
    line saying how (None when nothing was renamed).

    Nothing is renamed when every reported device is in the plan's cluster already, or when the
    hosts do not pair up with the nodes one to one by rank count = device count (``assign_ranks``
    then names the mismatch). Hosts named as a node of the plan keep that node.

    Raises:
        RoleError: hosts that pair up only ambiguously (two nodes of the same device count): which host
            is which node needs ``HETRAIN_NODE``.

    Example:
        >>> match_hosts(plan, ["box:0", "box:1"])     # doctest: +SKIP
        (['n0:0', 'n0:1'], 'hosts matched to the plan's nodes by their device counts: box -> n0 (2 ranks)')
    """
    known = {d.name for d in plan.cluster.devices}
    if all(dev in known for dev in reported):
        return list(reported), None
    ranks: dict[str, set[str]] = {}  # host -> its local ranks, hosts in the order of their first rank
    for dev in reported:
        host, _, local = dev.rpartition(":")
        ranks.setdefault(host, set()).add(local)
    sizes = {n.name: len(n.devices) for n in plan.cluster.nodes}
    if len(ranks) != len(sizes) or any(locals_ != {str(i) for i in range(len(locals_))} for locals_ in ranks.values()):
        return list(reported), None
    node_of = {h: h for h in ranks if h in sizes}
    free_nodes = [n for n in sizes if n not in node_of]
    for host in (h for h in ranks if h not in node_of):
        fits = [n for n in free_nodes if sizes[n] == len(ranks[host])]
        if not fits:
            return list(reported), None
        if len(fits) > 1:
            raise RoleError(f"host {host} ({len(ranks[host])} ranks) could be any of the plan's nodes "
                            f"{', '.join(fits)} ({sizes[fits[0]]} devices each): set HETRAIN_NODE on each host to "
                            "its node's name")
        node_of[host] = fits[0]
        free_nodes.remove(fits[0])
    renamed = [device_name(node_of[h], int(local)) for h, _, local in (d.rpartition(":") for d in reported)]
    pairs = ", ".join(f"{h} -> {n} ({len(ranks[h])} rank(s))" for h, n in node_of.items() if h != n)
    return renamed, f"hosts matched to the plan's nodes by their device counts: {pairs}"


def tp_transfers(k_from: int, k_to: int) -> dict[int, tuple[int, ...]]:
    """Who sends to whom between a group of ``k_from`` ranks and the next of ``k_to`` ("every rank sends its copy"):
    sender index -> the receivers' indices. Receiver r takes its copy from sender r mod ``k_from``; the copies are
    the same tensor (activations and their gradients are replicated across a TP group at a stage's bounds)::

        k_from 2, k_to 2:  0 -> (0,)    1 -> (1,)
        k_from 2, k_to 1:  0 -> (0,)    1 -> ()
        k_from 1, k_to 2:  0 -> (0, 1)

    Example:
        >>> tp_transfers(1, 4)
        {0: (0, 1, 2, 3)}
    """
    return {j: tuple(r for r in range(k_to) if r % k_from == j) for j in range(k_from)}


def build_roles(plan: Plan, reported: Sequence[str]) -> list[Role]:
    """Every rank's Role (``result[rank]``), given the device each rank reported.

    A member of a stage's TP group gets the stage's role; its neighbours are the members of the
    neighbouring groups that ``tp_transfers`` pairs it with.

    Raises:
        RoleError: the world does not match the plan (see ``assign_ranks``).
    """
    rank_of = assign_ranks(plan, reported)
    sizes = tuple(vw.mini_batch for vw in plan.virtual_workers)
    where: dict[str, tuple[int, int, int]] = {}
    for v, vw in enumerate(plan.virtual_workers):
        for j, s in enumerate(vw.stages):
            for t, dev in enumerate(s.devices):
                where[dev] = (v, j, t)
    roles = []
    for rank, dev in enumerate(reported):
        if dev not in where:
            roles.append(Role(rank, dev, None, 0, None, 0, None, None, None, None, sizes, (), plan.global_batch,
                              lead=dev))
            continue
        v, j, t = where[dev]
        roles.append(_used_role(plan, rank_of, rank, dev, v, j, t, sizes))
    return roles


def _used_role(plan: Plan, rank_of: dict[str, int], rank: int, dev: str, v: int, j: int, t: int,
               sizes: tuple[int, ...]) -> Role:
    """The Role of ``dev``, member ``t`` of the TP group (or the device) of stage ``j`` of VW ``v``."""
    vw = plan.virtual_workers[v]
    stage = vw.stages[j]
    prev = vw.stages[j - 1] if j > 0 else None
    nxt = vw.stages[j + 1] if j < len(vw.stages) - 1 else None
    prev_dev = prev.devices[t % prev.tp] if prev is not None else None  # forward: receiver t <- sender t mod k
    next_dev = nxt.devices[t % nxt.tp] if nxt is not None else None  # backward: mirrored
    send_f = tuple(rank_of[nxt.devices[r]] for r in tp_transfers(stage.tp, nxt.tp)[t]) if nxt is not None else ()
    send_b = tuple(rank_of[prev.devices[r]] for r in tp_transfers(stage.tp, prev.tp)[t]) if prev is not None else ()
    return Role(
        rank, dev, v, j, stage, len(vw.stages), prev_dev, next_dev,
        rank_of[prev_dev] if prev_dev is not None else None,
        rank_of[next_dev] if next_dev is not None else None,
        sizes, tuple(vw.micro_batch_sizes), plan.global_batch,
        lead=stage.device, tp_rank=t, tp_ranks=tuple(rank_of[d] for d in stage.devices) if stage.tp > 1 else (),
        send_f_ranks=send_f, send_b_ranks=send_b,
        split_prev=prev is not None and stage.tp > 1 and prev.tp == stage.tp,
        split_next=nxt is not None and stage.tp > 1 and nxt.tp == stage.tp,
    )

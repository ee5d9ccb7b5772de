"""Which part of the plan each rank runs: devices are matched to ranks by host and local rank.

torchrun may number ranks differently after a restart, so a rank is never
identified by its number alone. Each rank names its device ``"<node>:<LOCAL_RANK>"``,
the node being its host (``HETRAIN_NODE``, else the host name); the names are
all-gathered and matched to the plan's devices::

    ranks:   0 -> n0:0   1 -> n0:1   2 -> n1:0   3 -> n1:1
    plan:    VW0  n0:0 [0..3) ──► n1:0 [3..6)        (n0:1 unused: it idles)
             VW1  n1:1 [0..6)

Everything here but ``local_device_name`` is pure: tests drive it with lists of names.
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
            if s.device not in owner:
                problems.append(f"no rank drives {s.device} (stage {j} of VW{v}, layers [{s.first_layer}, "
                                f"{s.end_layer}))")
    if problems:
        listed = "\n  ".join(problems)
        raise RoleError(f"the world does not match the plan:\n  {listed}\n{_describe_world(plan, reported)}")
    return owner


def build_roles(plan: Plan, reported: Sequence[str]) -> list[Role]:
    """Every rank's Role (``result[rank]``), given the device each rank reported.

    Raises:
        RoleError: the world does not match the plan (see ``assign_ranks``).
    """
    rank_of = assign_ranks(plan, reported)
    sizes = tuple(vw.mini_batch for vw in plan.virtual_workers)
    where: dict[str, tuple[int, int]] = {}
    for v, vw in enumerate(plan.virtual_workers):
        for j, s in enumerate(vw.stages):
            where[s.device] = (v, j)
    roles = []
    for rank, dev in enumerate(reported):
        if dev not in where:
            roles.append(Role(rank, dev, None, 0, None, 0, None, None, None, None, sizes, (), plan.global_batch))
            continue
        v, j = where[dev]
        vw = plan.virtual_workers[v]
        devs = vw.devices
        prev_dev = devs[j - 1] if j > 0 else None
        next_dev = devs[j + 1] if j < len(devs) - 1 else None
        roles.append(Role(
            rank, dev, v, j, vw.stages[j], len(devs), prev_dev, next_dev,
            rank_of[prev_dev] if prev_dev is not None else None,
            rank_of[next_dev] if next_dev is not None else None,
            sizes, tuple(vw.micro_batch_sizes), plan.global_batch,
        ))
    return roles

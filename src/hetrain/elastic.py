"""Re-plan on a changed world: the cluster of the devices present, the plan's own planner options, a new plan.

When a job restarts (``torchrun --nnodes MIN:MAX --max-restarts N``) with devices other
than its plan's, the runtime (``runtime.lifecycle.restart``) hands this module the devices present
and gets back a plan for them, made the way the old one was::

    plan.json (cluster, profile, options)      devices present: n0:0 cpu, n0:1 cpu, n2:0 cpu
          │                                              │
          └──► build_world_cluster: survivors keep their figures and links;
               a new node's devices come from the catalog by type, its links
               are the saved cluster's slowest (recorded as assumed)
                     │
                     ▼
               planner_options_of(plan) ──► plan_with_simulator ──► new Plan
               (strategy, objective, schedule, sync mode and options,
                optimizer, global batch: as the old plan has them)

Everything here is pure and deterministic: the same plan and the same devices give the
same new plan, byte for byte (``plan_digest``), on every rank. Nothing imports torch.

Example:
    >>> present = [PresentDevice("n0:0", "cpu"), PresentDevice("n0:1", "cpu")]   # doctest: +SKIP
    >>> replanned = replan(plan, present, from_step=40)                           # doctest: +SKIP
    >>> replanned.change.describe()                                               # doctest: +SKIP
    'lost n0:2'
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from hetrain.catalog import lookup_device_type
from hetrain.cluster import Cluster, Device, Link, Node
from hetrain.errors import RunError
from hetrain.plan import Plan
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planning import PLANNER_KEY, plan_with_simulator

#: the key of ``Plan.options`` that says how a re-planned plan came about (``Replanned.record``)
REPLAN_KEY = "replan"


class ReplanError(RunError):
    """The devices present cannot run the model (or their types are unknown); the message says what is missing."""


@dataclass(frozen=True)
class PresentDevice:
    """One device of the world that is there now.

    Attributes:
        name: ``"<node>:<local rank>"``, as the rank that drives it reports it.
        type_name: its device type (``cpu``, a catalog name such as ``A100-40GB``); read only for a device
            the saved cluster does not know.
    """

    name: str
    type_name: str

    @property
    def node(self) -> str:
        return self.name.rpartition(":")[0]

    @property
    def local_index(self) -> int:
        tail = self.name.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0


@dataclass(frozen=True)
class WorldChange:
    """What differs between the plan's cluster and the devices present.

    Attributes:
        lost: devices of the saved cluster that are not present, in the cluster's order.
        added: devices present that the saved cluster does not have, in the new cluster's order.
        assumed_links: nodes new to the cluster, whose intra link and NIC were assumed (the saved
            cluster's slowest), not measured.
    """

    lost: tuple[str, ...]
    added: tuple[str, ...]
    assumed_links: tuple[str, ...] = ()

    def describe(self) -> str:
        """``"lost n0:2; added n2:0, n2:1 (links of n2 assumed: the slowest of the saved cluster)"``."""
        parts = []
        if self.lost:
            parts.append(f"lost {', '.join(self.lost)}")
        if self.added:
            parts.append(f"added {', '.join(self.added)}")
        text = "; ".join(parts) or "no device lost or added"
        if self.assumed_links:
            text += (f" (links of {', '.join(self.assumed_links)} assumed: the slowest of the saved cluster, "
                     "not measured)")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"lost": list(self.lost), "added": list(self.added), "assumed_links": list(self.assumed_links)}


@dataclass(frozen=True)
class Replanned:
    """A plan made for the devices present, and what changed.

    Attributes:
        plan: the new plan; ``plan.options["replan"]`` holds ``record``.
        change: the devices lost and added.
        digest: ``plan_digest(plan)``: what ranks compare to know they all run the same plan.
    """

    plan: Plan
    change: WorldChange
    digest: str

    @property
    def record(self) -> Mapping[str, Any]:
        """What the new plan records of its making: the change, the step, the old plan's prediction."""
        return dict(self.plan.options.get(REPLAN_KEY, {}))


def made_by_planner(plan: Plan) -> bool:
    """Whether the plan records how it was made (the planner's objective and strategy), so it can be re-made."""
    return "objective" in plan.options and "strategy" in plan.options


def world_differs(plan: Plan, reported: Sequence[str]) -> bool:
    """Whether the devices ranks report are not the plan's: one outside its cluster, or one it uses absent.

    Two ranks reporting the same device is not a changed world (``roles.assign_ranks`` refuses it).
    """
    known = {d.name for d in plan.cluster.devices}
    present = set(reported)
    return any(d not in known for d in reported) or any(d not in present for d in plan.devices_used)


#: candidates a re-plan simulates where the plan does not say how many its planning simulated
DETERMINISTIC_TOP_K = 3


def planner_options_of(plan: Plan) -> PlannerOptions:
    """The planner options ``plan`` was made with, for the same global batch and sync mode.

    From ``options["planner"]`` where the plan has it (``planning.record_planner_options``: every option),
    else from what every planner's plan records: strategy, objective, critical batch, and, where
    ``--sync auto`` chose the mode, its staleness penalty and samples to target. Either way the
    plan's own fields win: its schedule, sync mode and options, optimizer. The sync mode is the one
    the plan runs (not chosen again), so the mode's state carries over; no other global batch is
    tried (``global_batch_choices`` empty). No time budget: every rank must make the same plan, so the
    re-plan simulates as many candidates as the plan's planning did (``planner_report``), whatever the clock.

    Raises:
        ReplanError: a recorded option this planner refuses, naming it.
    """
    o = plan.options
    known = {f.name for f in fields(PlannerOptions)}
    kwargs: dict[str, Any] = {"strategy": o.get("strategy", "auto"), "objective": o.get("objective", "throughput")}
    if o.get("critical_batch") is not None:
        kwargs["critical_batch"] = float(o["critical_batch"])
    choice = o.get("sync_choice")
    if isinstance(choice, Mapping):
        kwargs["staleness_penalty"] = float(choice.get("staleness_penalty", 0.0))
        kwargs["target_samples"] = float(choice.get("target_samples", 1e6))
    recorded = o.get(PLANNER_KEY)
    if isinstance(recorded, Mapping):
        kwargs.update({k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in known})
    kwargs.update(schedule=plan.schedule, sync=plan.sync, sync_options=plan.sync_options, optimizer=plan.optimizer,
                  global_batch_choices=())
    # Every rank re-plans, and their plans must be one (check_same_plan): no clock may cut the search. So no
    # time budget, and as many candidates simulated as the plan's own planning did (3 where it does not say).
    report = o.get("planner_report")
    if kwargs.get("simulate_top_k") is None:
        simulated = report.get("simulated") if isinstance(report, Mapping) else None
        kwargs["simulate_top_k"] = simulated if isinstance(simulated, int) and simulated >= 0 else DETERMINISTIC_TOP_K
    kwargs["time_budget_s"] = None
    try:
        return PlannerOptions(**kwargs)
    except (TypeError, ValueError) as e:
        raise ReplanError(f"the plan's options.{PLANNER_KEY} cannot be used to re-plan: {e}") from None


def _slowest(links: Sequence[Link]) -> Link:
    """The link of least bandwidth (the larger latency on a tie): what a node of unknown links is assumed to have."""
    return min(links, key=lambda k: (k.bandwidth_bytes_per_s, -k.latency_s))


def _catalog_device(dev: PresentDevice, index: int) -> Device:
    try:
        t = lookup_device_type(dev.type_name)
    except KeyError:
        raise ReplanError(f"device {dev.name} is new to the plan's cluster and its type {dev.type_name!r} is not in "
                          "the catalog (hetrain.catalog): set HETRAIN_DEVICE_TYPE on its rank to a catalog type, or "
                          "plan anew with a cluster file that describes it") from None
    return Device(dev.name, dev.node, index, t.name, t.peak_fp32_flops, t.peak_fp16_flops, t.memory_bytes,
                  t.memory_bandwidth_bytes_per_s, peak_bf16_flops=t.peak_bf16_flops)


def build_world_cluster(saved: Cluster, present: Sequence[PresentDevice]) -> tuple[Cluster, WorldChange]:
    """The cluster of the devices present, from the saved one.

    Surviving devices keep their figures, surviving nodes their intra link and NIC, and the
    ``[[link]]`` overrides between two surviving nodes stay. A device the saved cluster lacks takes
    the catalog's figures for its reported type; a node it lacks takes the slowest intra link and
    the slowest NIC of the saved cluster (recorded in ``WorldChange.assumed_links``). Saved nodes
    come first in their order, then new nodes by name; devices within a node by local index.

    Raises:
        ReplanError: no device present, or a new device of a type the catalog does not know.
    """
    if not present:
        raise ReplanError(f"no device is present of the plan's cluster {saved.name!r}")
    by_node: dict[str, list[PresentDevice]] = {}
    for dev in sorted(present, key=lambda d: (d.node, d.local_index, d.name)):
        by_node.setdefault(dev.node, []).append(dev)
    saved_nodes = {n.name: n for n in saved.nodes}
    order = [n.name for n in saved.nodes if n.name in by_node] + sorted(n for n in by_node if n not in saved_nodes)
    intra = _slowest([n.intra_link for n in saved.nodes])
    nic = _slowest([n.nic for n in saved.nodes])
    nodes: list[Node] = []
    added: list[str] = []
    index = 0
    for name in order:
        old = saved_nodes.get(name)
        old_devices = {d.name: d for d in old.devices} if old is not None else {}
        here = {d.name for d in by_node[name]}
        devices: list[Device] = []
        for kept_dev in (d for d in (old.devices if old else ()) if d.name in here):  # in the saved order
            devices.append(replace(kept_dev, index=index))
            index += 1
        for new_dev in (d for d in by_node[name] if d.name not in old_devices):  # then new ones, by local index
            devices.append(_catalog_device(new_dev, index))
            added.append(new_dev.name)
            index += 1
        nodes.append(Node(name, tuple(devices), old.intra_link if old else intra, old.nic if old else nic))
    kept = set(order)
    links = tuple(nl for nl in saved.node_links if all(n in kept for n in nl.nodes))
    here_all = {d.name for d in present}
    lost = tuple(d.name for d in saved.devices if d.name not in here_all)
    change = WorldChange(lost, tuple(added), tuple(n for n in order if n not in saved_nodes))
    return Cluster(saved.name, tuple(nodes), links), change


def plan_digest(plan: Plan) -> str:
    """A short hash of the plan's JSON (keys sorted): equal on two ranks iff they hold the same plan."""
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predicted_samples_per_s(plan: Plan) -> float:
    """The plan's predicted samples/s: the simulator's where the plan has it, else the closed form's."""
    pred = plan.prediction
    return plan.global_batch / pred.simulated_iteration_s if pred.simulated_iteration_s else pred.samples_per_s


def replan(plan: Plan, present: Sequence[PresentDevice], from_step: int = 0) -> Replanned:
    """A plan for the devices present, made as ``plan`` was (``planner_options_of``), same global batch.

    Args:
        plan: the plan the job was started with; its cluster, profile and options are used.
        present: the devices there now.
        from_step: the step training resumes from (recorded in the new plan).

    Returns:
        The new plan, with ``options["replan"]``: the change, ``from_step``, the old plan's devices
        and predicted samples/s, and the options it was made with.

    Raises:
        ReplanError: the model fits no arrangement of the devices present (the planner's reason, with the
            memory needed and available), or a new device's type is unknown.
    """
    cluster, change = build_world_cluster(plan.cluster, present)
    return replan_on_cluster(plan, cluster, change, from_step)


def replan_on_cluster(plan: Plan, cluster: Cluster, change: WorldChange, from_step: int = 0) -> Replanned:
    """A plan for ``cluster``, made as ``plan`` was, with ``plan``'s profile and global batch (``replan``'s work,
    also for a cluster with a slowed device: ``drift.slowed_plan``).

    Raises:
        ReplanError: the model fits no arrangement of the cluster's devices (the planner's reason).
    """
    try:  # recorded in the new plan too, so that it can be re-made as it was
        new = plan_with_simulator(cluster, plan.profile, plan.global_batch, planner_options_of(plan))
    except PlannerError as e:
        raise ReplanError(f"the {cluster.num_devices} device(s) present ({', '.join(d.name for d in cluster.devices)}"
                          f"; {change.describe()}) cannot run the plan's model at global batch {plan.global_batch}: "
                          f"{e}") from None
    record = {**change.to_dict(), "from_step": from_step, "previous_devices": plan.devices_used,
              "previous_samples_per_s": predicted_samples_per_s(plan)}
    new = new.with_options({**new.options, REPLAN_KEY: record})
    return Replanned(new, change, plan_digest(new))


def check_same_plan(digests: Sequence[str]) -> None:
    """Refuse re-planned plans that differ between ranks (``digests[rank]``; an entry starting ``error:`` is a
    rank whose re-planning failed, with its message).

    Raises:
        ReplanError: naming each rank's digest, or the first failure.
    """
    failed = [(r, d) for r, d in enumerate(digests) if d.startswith("error:")]
    if failed:
        r, d = failed[0]
        why = d.removeprefix("error:").strip()
        if len(failed) == len(digests) and len({f for _, f in failed}) == 1:  # every rank alike: its own reason
            raise ReplanError(why)
        raise ReplanError(f"re-planning failed on rank {r}: {why}")
    if len(set(digests)) > 1:
        by_rank = ", ".join(f"rank {r} {d}" for r, d in enumerate(digests))
        raise ReplanError(f"the ranks re-planned differently (plan digests {by_rank}): the planner must see the "
                          "same plan file and devices everywhere; start every rank from the same plan.json")


def describe_replan(replanned: Replanned) -> str:
    """One line: what changed and the new plan's shape and prediction."""
    p = replanned.plan
    sps = predicted_samples_per_s(p)
    old = replanned.record.get("previous_samples_per_s")
    was = f" (was {old:.1f})" if isinstance(old, (int, float)) and old > 0 else ""
    return (f"the world changed ({replanned.change.describe()}): re-planned for {len(p.devices_used)} device(s), "
            f"{p.strategy} ({p.formation}), {len(p.virtual_workers)} VW(s), {p.schedule}, sync {p.sync}, global batch "
            f"{p.global_batch}, predicted {sps:.1f} samples/s{was}, plan {replanned.digest}")

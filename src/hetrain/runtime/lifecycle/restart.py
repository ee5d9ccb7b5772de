"""A job restarted on a changed world: the devices present, a plan for them that every rank agrees on.

``job.build_job`` calls ``replan_world`` after the ranks' device names are all-gathered.
When the names are not the plan's (a device it uses is gone, or a device it does not
know is there) and re-planning is on, every rank, in the same order::

    1. types     all_gather_object: each rank's device type (``local_device_type``)
    2. plan      hetrain.elastic.replan: the cluster of the devices present, the plan's own options,
                 the saved profile, the same global batch (pure, deterministic)
    3. agree     all_gather_object: each rank's plan digest (or its error); any difference or
                 failure stops every rank with the same one-line error (no rank waits on another)
    4. record    rank 0 writes the new plan beside the checkpoint, CKPT/plans/plan-step{N}.json,
                 and prints one line

Every rank plans by itself (the planner is deterministic given its inputs); step 3 checks it.
The Trainer then resumes from the newest intact checkpoint (``runtime.state.resume``, found
before re-planning: its step is the step re-planned at) under the new plan: checkpoints hold
every layer under its global name, so any plan loads them (``runtime.state.stage_state``).

A rank's device type: ``HETRAIN_DEVICE_TYPE`` when set (emulation), else a GPU's catalog name
(``torch.cuda.get_device_name``, ``profiler.layers.describe_device``), else ``cpu``. It is read
only for devices the saved cluster does not know; the others keep the cluster's figures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.drift import DRIFT_KIND, base_digest_of, drift_factors_of
from hetrain.elastic import (
    REPLAN_KEY,
    PresentDevice,
    ReplanError,
    Replanned,
    WorldChange,
    check_same_plan,
    describe_replan,
    made_by_planner,
    plan_digest,
    predicted_samples_per_s,
    replan,
    world_differs,
)
from hetrain.plan import Plan, load_plan
from hetrain.runtime.config import REPLAN_MODES
from hetrain.runtime.lifecycle.roles import device_name


@dataclass(frozen=True)
class ReplanPolicy:
    """Whether and where a changed world is re-planned.

    Attributes:
        mode: ``auto`` or ``world`` (re-plan when the plan was made by the planner; ``auto`` also watches for
            drift) or ``off`` (refuse, as ``roles`` does).
        checkpoint_dir: where the checkpoint is resumed from; the new plan goes to its ``plans/``.
    """

    mode: str = "auto"
    checkpoint_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in REPLAN_MODES:
            raise ValueError(f"replan must be one of {', '.join(REPLAN_MODES)}, got {self.mode!r}")


def local_device_type(device: torch.device) -> str:
    """This rank's device type: ``HETRAIN_DEVICE_TYPE``, else the GPU's catalog name, else ``cpu``."""
    named = os.environ.get("HETRAIN_DEVICE_TYPE", "").strip()
    if named:
        return named
    if device.type == "cuda":
        from hetrain.profiler.layers import describe_device

        return describe_device(device)[0]
    return "cpu"


def plan_path(checkpoint_dir: Path, step: int) -> Path:
    """Where the plan re-made at ``step`` is written: ``CKPT/plans/plan-step{step}.json``."""
    return checkpoint_dir / "plans" / f"plan-step{step}.json"


def newest_replanned(checkpoint_dir: Path, reached: int | None) -> tuple[int, Path] | None:
    """The newest plan re-made beside the checkpoint at a step the checkpoint resumed from has ``reached``:
    ``(step, CKPT/plans/plan-step{step}.json)``, or None (also when ``reached`` is None: no checkpoint)."""
    found = []
    for path in (checkpoint_dir / "plans").glob("plan-step*.json"):
        tail = path.stem.removeprefix("plan-step")
        if tail.isdigit() and reached is not None and int(tail) <= reached:
            found.append((int(tail), path))
    return max(found) if found else None


def adopt_drift_plan(plan: Plan, names: Sequence[str], checkpoint_dir: Path | None,
                     reached: int | None) -> Replanned | None:
    """The drift plan a restarted job runs instead of ``plan`` (plan.json), or None.

    It is the newest plan re-made beside the checkpoint at a step the checkpoint resumed from has ``reached``
    (``newest_replanned``) when that plan was made on
    drift (``options.replan.kind == "drift"``) from this very ``plan`` (its ``base_digest``), and the devices
    reported are its devices. Else None: ``plan`` runs, re-planned as on any restart when the world changed
    (the drift's slowdown is then forgotten). Reads files only: the same on every rank of a shared directory.
    """
    if checkpoint_dir is None:
        return None
    newest = newest_replanned(checkpoint_dir, reached)
    if newest is None:
        return None
    drifted = load_plan(newest[1])
    record = drifted.options.get(REPLAN_KEY)
    if not (isinstance(record, dict) and record.get("kind") == DRIFT_KIND
            and record.get("base_digest") == base_digest_of(plan) and not world_differs(drifted, names)):
        return None
    return Replanned(drifted, WorldChange((), ()), plan_digest(drifted))


def _one_host_as_node(plan: Plan, reported: Sequence[str], from_hosts: bool) -> list[str]:
    """With host names for nodes (no ``HETRAIN_NODE``), one host and a one-node plan: the host is that node."""
    hosts = {d.rpartition(":")[0] for d in reported}
    if not from_hosts or len(hosts) != 1 or len(plan.cluster.nodes) != 1:
        return list(reported)
    node = plan.cluster.nodes[0].name
    return [device_name(node, int(d.rpartition(":")[2])) for d in reported]


def describe_drift(plan: Plan) -> str:
    """``"n0:1 x3.00 slower; predicted 255.7 samples/s"``: a drift plan's slowdowns and prediction."""
    slow = ", ".join(f"{d} x{f:.2f}" for d, f in sorted(drift_factors_of(plan).items()))
    return f"slowdown {slow or 'none'}; predicted {predicted_samples_per_s(plan):.1f} samples/s under it"


def _gather(value: Any, world: int, what: str) -> list[Any]:
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, value)
    except RuntimeError as e:
        raise ReplanError(f"re-planning: the {world} ranks did not all send {what} (a rank failed or never "
                          f"started): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return out


def replan_world(plan: Plan, reported: Sequence[str], rank: int, device: torch.device,
                 policy: ReplanPolicy | None, from_hosts: bool = False,
                 resumed: int | None = None) -> tuple[list[str], Replanned | None]:
    """Re-plan when the devices reported are not the plan's and the policy allows; collective over the job then.

    Args:
        plan: the plan the job was started with.
        reported: every rank's device name (``reported[rank]``), after ``roles.match_hosts``.
        rank: this rank.
        device: this rank's torch device.
        policy: None or mode ``off``: never re-plan (``roles.assign_ranks`` refuses a changed world).
        from_hosts: whether the nodes are host names (no ``HETRAIN_NODE``).
        resumed: the step of the checkpoint the job resumes from (``runtime.state.resume``); None: none.

    Returns:
        (the device names, renamed when one host stands for a one-node plan's node; the new plan and what
        changed, or None when the plan stands)

    Raises:
        ReplanError: on every rank alike: the model fits no arrangement of the devices present (memory
            needed and available), a new device's type is unknown, or the ranks' plans differ.
    """
    if policy is None or policy.mode == "off" or not made_by_planner(plan):
        return list(reported), None
    names = _one_host_as_node(plan, reported, from_hosts)
    world = len(names)
    adopted = (adopt_drift_plan(plan, names, policy.checkpoint_dir, resumed) if len(set(names)) == len(names)
               else None)
    if adopted is not None:  # a drift switch's restart: its plan, which every rank read from the same file
        check_same_plan([str(d) for d in _gather(adopted.digest, world, "the drift plan's digest they read")])
        if rank == 0:
            print(f"hetrain: resuming under the plan re-made on drift, {policy.checkpoint_dir}/plans/"
                  f"plan-step{adopted.record.get('from_step')}.json (plan {adopted.digest}; "
                  f"{describe_drift(adopted.plan)})", flush=True)
        return names, adopted
    if len(set(names)) != len(names) or not world_differs(plan, names):
        return list(reported), None
    types = _gather(local_device_type(device), world, "their device types")  # 1
    present = [PresentDevice(n, str(t)) for n, t in zip(names, types, strict=True)]
    step = resumed or 0
    replanned: Replanned | None = None
    try:  # 2: a failure is shared in step 3, so that no rank waits for one that gave up
        replanned = replan(plan, present, step)
        mine = replanned.digest
    except Exception as e:
        mine = f"error: {e}"
    check_same_plan([str(d) for d in _gather(mine, world, "their re-planned plan's digest")])  # 3
    assert replanned is not None
    if rank == 0:  # 4
        where = "no --checkpoint-dir: not written"
        if policy.checkpoint_dir is not None:
            path = plan_path(policy.checkpoint_dir, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            replanned.plan.save(path)
            where = f"written to {path}"
        print(f"hetrain: {describe_replan(replanned)}; resuming at step {step}; {where}", flush=True)
    return names, replanned

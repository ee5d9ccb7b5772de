"""A rank's start-up: join the job, find its role, create the job's process groups, build its stage.

``build_job`` does all of it, in one order, and returns a ``Job``: what the
Trainer's step loop needs (role, groups, health, schedule, and on a used rank
the stage module, optimizer, sync, transport and executor)::

    1. join        init_distributed: the default process group (NCCL with CUDA, else Gloo)
    2. report      all_gather_object: every rank's device name "<node>:<LOCAL_RANK>"
       (resume)    with a checkpoint directory: the newest intact checkpoint, the ranks sharing the check of
                   its files (``runtime.state.resume``, collective); rank 0 names any newer one passed over
       (re-plan)   a world other than the plan's, re-planning on: a new plan (``runtime.lifecycle.restart``, collective)
    3. roles       build_roles: ranks matched to the plan's devices (pure, same result everywhere)
    4. schedule    build_schedule + validate (pure)
    5. health      Health(rank, reported).start(): heartbeats; its store keys count instances
    6. groups      new_group: forward, backward (CUDA only), work; then segment groups (with TP: one per
                   owner set of each TP member), mode groups, tied-weight groups, TP groups
    7. stage       used ranks only: layers (a TP stage's split by ``runtime.tp``), GradientSync, optimizer
                   (over this rank's ranges where the plan shards a segment: ``runtime.sync.shard``),
                   Transport, Recorder, ModeSync, Executor
                   (and TiedGrads, when the model ties layers' weights: the first pre-step hook, which the
                   Trainer installs with the others, ``runtime.step.hooks``)

Steps 1, 2 (with the resume and re-plan) and 6 are collective over the whole job: ``all_gather_object`` and
every ``new_group`` call (even for a group the rank is not in) must be issued by
every rank, in the same order, or ranks pair up the wrong calls and hang or get
each other's groups. Step 5 must come in the same place on every rank too, because
``Health`` (and so the store keys of its beats) is numbered by creation order.
Unused ranks therefore run steps 1 to 6 like everyone else and skip only step 7,
which issues no collective over the job.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.distributed.device import DeviceError, choose_device
from hetrain.distributed.health import Health
from hetrain.distributed.store import attempt_store
from hetrain.distributed.work import first_line as _first_line
from hetrain.plan import Plan
from hetrain.runtime.lifecycle.restart import ReplanPolicy, replan_world
from hetrain.runtime.lifecycle.roles import Role, RoleError, build_roles, local_device_name, match_hosts, node_from_host
from hetrain.runtime.report.metrics import Recorder
from hetrain.runtime.state.resume import ResumePoint, find_resume
from hetrain.runtime.step.executor import Executor, LossFn, StageModule
from hetrain.runtime.step.p2p import Transport, early_receives
from hetrain.runtime.step.tied import Tie, TiedGrads, build_tie_groups
from hetrain.runtime.sync.allreduce import GradientSync, SegmentGroups, build_segment_groups
from hetrain.runtime.sync.modes import ModeSync, build_mode_groups
from hetrain.runtime.sync.shard import ShardedOptimizer, ShardedState, is_sharded
from hetrain.runtime.tp import build_tp_groups, build_tp_mesh, parallelize_stage, tp_stage_layers
from hetrain.schedule import Action, build_schedule, validate

if TYPE_CHECKING:
    from hetrain.elastic import Replanned

LayersFn = Callable[[int, int], Sequence[nn.Module]]
OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
DEFAULT_TIMEOUT_S = 300.0


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, int, torch.device]:
    """Join the job's default process group if not done yet: NCCL with CUDA, else Gloo.

    Under torchrun (``RANK`` set) every rank joins; without it, a world of one
    process. The device is ``cuda:LOCAL_RANK`` with NCCL, else the CPU
    (``HETRAIN_DEVICE``: see ``hetrain.distributed.device``).

    Returns:
        (rank, world size, local rank, device)
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend, _ = choose_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            store = attempt_store(timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    rank = dist.get_rank()
    if "LOCAL_RANK" not in os.environ:
        local_rank = rank
    on_cuda = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    return rank, dist.get_world_size(), local_rank, device


@dataclass(frozen=True)
class Groups:
    """The job's process groups, created by every rank in the order of the fields (``build_groups``).

    Attributes:
        forward: activations between pipeline neighbours (SEND_F / RECV_F), over the used ranks.
        backward: their gradients (SEND_B / RECV_B); the forward group itself under Gloo.
        work: the used ranks' own collectives: losses, validation loss, timeline, DASO's loss.
        segments: from ``sync.build_segment_groups``: each owner set's all-reduce.
        modes: from ``modes.build_mode_groups``: parameter-server and node groups of the sync mode.
        tied: from ``tied.build_tie_groups``: one per tie of weights held by different ranks.
        tp: from ``tp.build_tp_groups``: this rank's TP group, by its stage's lead device (empty without TP).
    """

    forward: Any
    backward: Any
    work: Any
    segments: SegmentGroups
    modes: dict[tuple[str, int], Any]
    tied: tuple[Any, ...] = ()
    tp: dict[str, Any] = field(default_factory=dict)


def build_groups(plan: Plan, rank_of: dict[str, int], used_ranks: list[int], device: torch.device,
                 timeout_s: float, tied: Sequence[Tie] = ()) -> Groups:
    """Create every process group of the job; collective over the job: every rank calls it, in the same place."""
    timeout = timedelta(seconds=timeout_s)
    forward = dist.new_group(used_ranks, timeout=timeout)
    # NCCL runs all operations of a pair of ranks in a group on one stream, so activations and
    # gradients get a group each (or a send could queue behind a receive); Gloo needs one
    backward = dist.new_group(used_ranks, timeout=timeout) if device.type == "cuda" else forward
    work = dist.new_group(used_ranks, timeout=timeout)
    segments = build_segment_groups(plan, rank_of, timeout_s)
    modes = build_mode_groups(plan, rank_of, timeout_s)
    tie_groups = tuple(build_tie_groups(plan, rank_of, tied, timeout_s))
    return Groups(forward, backward, work, segments, modes, tie_groups, build_tp_groups(plan, rank_of, timeout_s))


@dataclass(frozen=True)
class StageParts:
    """What a used rank runs: its stage of the model and the machinery around it (``build_stage``).

    Attributes:
        module: the stage's layers, parameters named ``layers.{k}.…`` by global layer index.
        optimizer: over the module's parameters.
        sync: the segments' gradient all-reduce among their owners.
        transport: sends and receives to the pipeline neighbours.
        recorder: the measured timeline's events.
        modes: the sync mode's state (None under ``bsp``).
        executor: runs the rank's Actions of an iteration.
        tied: sums the tied copies' gradients at STEP, the first pre-step hook (``runtime.step.hooks``); None: no
            ties here.
    """

    module: StageModule
    optimizer: torch.optim.Optimizer
    sync: GradientSync
    transport: Transport
    recorder: Recorder
    modes: ModeSync | None
    executor: Executor
    tied: TiedGrads | None = None


@dataclass(frozen=True)
class Job:
    """Everything one rank knows after start-up (``build_job``).

    Attributes:
        plan: the plan.
        rank, world: this process's rank and the world size.
        device: the torch device this rank computes on.
        reported: every rank's device name, by rank.
        role: this rank's part in the plan.
        rank_of: plan device name -> rank.
        actions: the plan's schedule (``bsp``: every iteration's), by device.
        health: heartbeats and peer errors.
        used_ranks: the ranks of the plan's devices, ascending.
        groups: the job's process groups.
        stage: this rank's stage and its machinery; None on a rank the plan leaves unused.
        timeout_s: the longest any distributed wait may take.
        replanned: how ``plan`` was re-made for a changed world (``runtime.lifecycle.restart``); None: the plan given.
        resume: the checkpoint every rank resumes from (``runtime.state.resume``); None: none (no checkpoint
            directory, or no complete checkpoint in it).
    """

    plan: Plan
    rank: int
    world: int
    device: torch.device
    reported: list[str]
    role: Role
    rank_of: dict[str, int]
    actions: dict[str, list[Action]]
    health: Health
    used_ranks: list[int]
    groups: Groups
    stage: StageParts | None
    timeout_s: float
    replanned: Replanned | None = None
    resume: ResumePoint | None = None

    @property
    def report_rank(self) -> int:
        """The rank that writes metrics, the timeline and the progress bar: the lowest used rank."""
        return self.used_ranks[0]

    def wait(self, work: Any, what: str) -> None:
        """Wait for an asynchronous collective among the used ranks; a failure or timeout names the peers.

        Raises:
            PeerError: the collective failed or did not finish within ``timeout_s``.
        """
        self.health.wait(work, what, self.used_ranks, self.timeout_s)


def join_job(timeout_s: float) -> tuple[int, int, torch.device, list[str], bool]:
    """Steps 1 and 2: join the default process group and all-gather every rank's device name.

    Returns:
        (rank, world size, device, device names by rank, whether every rank's node is its host name)

    Raises:
        RoleError: the job could not be joined, or not every rank reported, within ``timeout_s``.
    """
    try:
        rank, world, local_rank, device = init_distributed(timeout_s)
    except DeviceError:
        raise
    except RuntimeError as e:
        raise RoleError(f"rank {os.environ.get('RANK', 0)} could not join the job within {timeout_s:g} s "
                        f"(MASTER_ADDR {os.environ.get('MASTER_ADDR')}, MASTER_PORT "
                        f"{os.environ.get('MASTER_PORT')}): {_first_line(e)}") from None
    reported: list[Any] = [None] * world
    try:
        dist.all_gather_object(reported, (local_device_name(rank, local_rank), node_from_host()))
    except RuntimeError as e:
        raise RoleError(f"rank {rank}: the {world} ranks did not all report their device within "
                        f"{timeout_s:g} s (a rank failed or never started): {_first_line(e)}") from None
    return rank, world, device, [str(d[0]) for d in reported], all(d[1] for d in reported)


def build_stage(plan: Plan, role: Role, device: torch.device, groups: Groups, rank_of: dict[str, int],
                health: Health, layers_fn: LayersFn, optimizer_fn: OptimizerFn, loss_fn: LossFn,
                timeout_s: float, tied: Sequence[Tie] = (), wait: Any = None) -> StageParts:
    """Step 7, on a used rank: build its layers (each from its own seed) and the machinery that runs them.

    Raises:
        ValueError: ``layers_fn`` returned the wrong number of layers.
    """
    stage = role.stage
    assert stage is not None
    layers = list(layers_fn(stage.first_layer, stage.end_layer))
    if len(layers) != stage.end_layer - stage.first_layer:
        raise ValueError(f"layers_fn({stage.first_layer}, {stage.end_layer}) returned {len(layers)} layers, "
                         f"expected {stage.end_layer - stage.first_layer}")
    names, where = [layer.name for layer in plan.profile.layers], f"stage {role.j} of VW{role.vw}"
    if stage.tp > 1:  # a traced block runs in its checked module form (runtime.tp)
        layers = tp_stage_layers(layers, stage.first_layer, names, where, stage.tp)
    module = StageModule(layers, stage.first_layer, stage.recompute).to(device)
    by_index = {k: module[k] for k in stage.layers}
    if stage.tp > 1:  # each layer split by its block type's rule over the stage's mesh (runtime.tp)
        mesh = build_tp_mesh(stage, rank_of, groups.tp[stage.device], device)
        parallelize_stage(by_index, names, where, mesh)
    sync = GradientSync(plan, by_index, groups.segments, rank_of, health, timeout_s, tp_member=role.tp_rank)
    sync.broadcast_weights()  # replicas start equal, whatever the user's build function drew
    optimizer: torch.optim.Optimizer
    if is_sharded(plan):  # ZeRO: the optimizer steps this rank's ranges of the sharded segments (runtime.sync.shard)
        shards = ShardedState(plan, sync, role.device, rank_of, health, timeout_s)
        optimizer = ShardedOptimizer(optimizer_fn(shards.optimizer_params(module)), shards)
    else:
        optimizer = optimizer_fn(list(module.parameters()))
    transport = Transport(health, groups.forward, groups.backward, device, timeout_s, plan.precision)
    recorder = Recorder(role.device, device if device.type == "cuda" else None)
    modes = None
    if not plan.sync_mode.synchronous:  # the relaxed modes' actions (runtime.sync.modes)
        modes = ModeSync(plan, role.device, sync, groups.segments, groups.modes, rank_of, health, timeout_s)
    executor = Executor(role, module, loss_fn, transport, sync, optimizer, health, recorder, device, modes,
                        plan.precision, early_receives(plan, role.device))
    executor.tp_group = groups.tp.get(stage.device) if stage.tp > 1 else None
    tied_grads = TiedGrads(tied, plan, role.device, module, groups.tied, wait) if tied else None
    return StageParts(module, optimizer, sync, transport, recorder, modes, executor, tied_grads)


def build_job(plan: Plan, layers_fn: LayersFn, optimizer_fn: OptimizerFn, loss_fn: LossFn,
              timeout_s: float = DEFAULT_TIMEOUT_S, tied: Sequence[Tie] = (),
              replan: ReplanPolicy | None = None, checkpoint_dir: Path | None = None) -> Job:
    """Everything this rank needs to train ``plan``, built in the order of the module docstring.

    Call it on every rank of the job with the same plan: it is collective over the job. With
    ``replan`` (mode ``auto``), a world other than the plan's gets a new plan (``Job.plan``). With
    ``checkpoint_dir``, the checkpoint to resume from is found once for every rank (``Job.resume``).

    Raises:
        CheckpointError: every checkpoint in ``checkpoint_dir`` is damaged (one line naming the files).
        RoleError: the job could not be formed, or its processes do not match the plan's devices.
        ReplanError: re-planning a changed world failed (the model does not fit the devices present...).
        DeviceError: this rank's device cannot be used.
        ValueError: ``layers_fn`` returned the wrong number of layers.
    """
    rank, world, device, reported, from_hosts = join_job(timeout_s)  # 1, 2
    resume = find_resume(checkpoint_dir, timeout_s) if checkpoint_dir is not None else None
    notice = None if resume is None else resume.notice()
    if notice is not None and rank == 0:
        print(f"hetrain: {notice}", flush=True)
    reported, matched = match_hosts(plan, reported) if from_hosts else (reported, None)  # 3
    reported, replanned = replan_world(plan, reported, rank, device, replan, from_hosts,
                                       None if resume is None else resume.step)
    if replanned is not None:
        plan = replanned.plan
    roles = build_roles(plan, reported)
    role = roles[rank]
    rank_of = {r.device: r.rank for r in roles}
    actions = build_schedule(plan)  # 4
    validate(actions, plan)
    health = Health(rank, reported)  # 5
    health.start()
    used_ranks = sorted(rank_of[d] for d in plan.devices_used)
    if matched and rank == used_ranks[0]:  # the reporting rank
        print(f"hetrain: {matched}", flush=True)
    groups = build_groups(plan, rank_of, used_ranks, device, timeout_s, tied)  # 6

    def wait(work: Any, what: str) -> None:  # Job.wait, before the Job exists
        health.wait(work, what, used_ranks, timeout_s)

    try:  # the user's layers are built here: a rank that cannot posts why, for the others to name it
        stage = (build_stage(plan, role, device, groups, rank_of, health, layers_fn, optimizer_fn, loss_fn,
                             timeout_s, tied, wait)
                 if role.used else None)  # 7
    except Exception as e:
        health.post_error(str(e))
        health.linger(min(timeout_s, 3 * health.period_s + 2))  # the store's host: let the others read it
        raise
    return Job(plan, rank, world, device, reported, role, rank_of, actions, health, used_ranks, groups, stage,
               timeout_s, replanned, resume)


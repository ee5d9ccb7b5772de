"""One stage's share of a checkpoint: what it writes, and how it comes back on resume.

A checkpoint (``runtime.state.checkpoint``) holds every layer once, under its global
name ``layers.{k}.…``. A layer held by several devices (its segment's owners) is
written by the first owner only (a TP stage's lead, its split tensors gathered whole: the same names and
shapes as without TP, so a plan of any TP degree loads any checkpoint)::

    segment [0..3) owners (n0:0, n1:0)   ->  n0:0 writes layers.0..2, n1:0 writes none of them
    parameter-server shards              ->  their host writes ps.layers.{k}.… (``modes.PS_PREFIX``)

Resuming loads this stage's names from the checkpoint the job resumes from (the newest
intact one, ``runtime.state.resume``), whatever plan wrote it, with the optimizer state of
each parameter found there. Where the plan shards a segment's optimizer state (ZeRO,
``runtime.sync.shard``) the lead still writes whole per-parameter state, gathered from the
owners, and each owner cuts its range out of it on resume: sharded and unsharded plans load
each other's checkpoints.

Example:
    >>> meta = checkpoint_meta(plan, step, loss)                                    # doctest: +SKIP
    >>> save_stage(directory, step, module, optimizer, plan, "n0:1", {}, meta, timeout_s=300)
    >>> restored = restore_stage(directory, module, optimizer, "n0:1")              # on resume
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.health import beat_counter
from hetrain.distributed.work import PeerError
from hetrain.plan import Plan
from hetrain.runtime.state.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir_name,
)
from hetrain.runtime.sync.shard import ShardedOptimizer
from hetrain.runtime.tp import full_state, local_like

if TYPE_CHECKING:
    from hetrain.distributed.health import Health

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


class Restored(NamedTuple):
    """A checkpoint a stage was loaded from: its directory's step and its metadata (``checkpoint_meta``)."""

    step: int
    meta: dict[str, Any]


def owned_names(plan: Plan, module: nn.Module, device: str) -> set[str]:
    """The names ``device`` writes: those of its layers whose segment's lead (``Segment.lead``) is ``device``."""
    first_owner = {}
    for seg in plan.segments():
        for k in range(seg.first_layer, seg.end_layer):
            first_owner[k] = seg.lead
    out = set()
    for name in module.state_dict():
        m = _LAYER_RE.match(name)
        if m and first_owner.get(int(m.group(1))) == device:
            out.add(name)
    return out


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state per parameter, by the parameter's global name, on the CPU."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return {name_of[id(p)]: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                             for k, v in full_state(st).items()}
            for p, st in optimizer.state.items() if id(p) in name_of}


def checkpoint_meta(plan: Plan, step: int, loss: float | None) -> dict[str, Any]:
    """The metadata a checkpoint of ``step`` carries (the same on every rank)."""
    meta = {"step": step, "loss": loss, "model": plan.model, "global_batch": plan.global_batch,
            "samples_seen": step * plan.global_batch, "devices": plan.devices_used, "optimizer": plan.optimizer}
    if plan.profile.split_points:  # a traced model's cut, so that export --to-hf names its layers alike
        meta["split_points"] = list(plan.profile.split_points)
    return meta


def save_stage(directory: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
               device: str, mode_tensors: dict[str, torch.Tensor], meta: dict[str, Any], timeout_s: float) -> None:
    """Write this stage's share of checkpoint ``step``; collective over the job (``save_checkpoint``).

    Args:
        mode_tensors: tensors of the sync mode this rank writes (``ModeSync.checkpoint_state``).
        meta: from ``checkpoint_meta``, with anything the mode adds.
    """
    # a TP stage's split tensors gathered whole (every member of the group, in one order), as without TP
    tensors = {n: t.detach().cpu() for n, t in full_state(module.state_dict()).items()}
    # sharded (ZeRO): the owners' ranges gathered on each segment's lead, whole per parameter (runtime.sync.shard)
    states = (optimizer.state_by_name(module) if isinstance(optimizer, ShardedOptimizer)
              else optimizer_state(module, optimizer))
    save_checkpoint(directory, step, {**tensors, **mode_tensors}, states, meta,
                    owned_names=owned_names(plan, module, device) | set(mode_tensors), timeout_s=timeout_s)


def latest_step(directory: Path) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None."""
    found = latest_checkpoint(directory)
    return None if found is None else found[0]


def restore_stage(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
                  device: str, optimizer_name: str | None = None, step: int | None = None) -> Restored | None:
    """Load this stage and its optimizer state from checkpoint ``step`` (default: the newest complete one), if any.

    Returns:
        The checkpoint's step and metadata; None when there is no checkpoint.

    Args:
        optimizer_name: the plan's optimizer (``Plan.optimizer``); a checkpoint that records another
            (``checkpoint_meta``) is refused, its state being of another kind (SGD's momentum, AdamW's moments).
        step: the checkpoint to load: the job's (``Job.resume``, the newest intact one, the same on every rank).
            None: the newest complete one, whose files are checked as they are read (a damaged one is refused).

    Raises:
        CheckpointError: the checkpoint lacks a tensor of this stage, or holds one (or its optimizer state)
            of another shape than the stage's (a model of other settings): names the checkpoint, the
            tensor and both shapes; or it was written under another optimizer.
    """
    if step is None:
        step = latest_step(directory)
    if step is None:
        return None
    own = module.state_dict()
    names = list(own)
    tensors, saved_optimizer_state, meta = load_checkpoint(directory, names, step)
    saved_by = meta.get("optimizer")
    if optimizer_name is not None and saved_by is not None and saved_by != optimizer_name:
        raise CheckpointError(f"checkpoint step {step} in {directory} was trained with optimizer {saved_by}, but "
                              f"the plan's is {optimizer_name}: its state is of another kind; train with a plan "
                              f"of {saved_by} (hetrain plan --optimizer {saved_by}), or use another --checkpoint-dir")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint step {step} in {directory} lacks {len(missing)} tensor(s) of "
                              f"{device}'s stage, e.g. {missing[:3]}")
    params = dict(module.named_parameters())
    shapes = [(repr(n), tensors[n].shape, own[n].shape) for n in names]
    shapes += [(f"the optimizer state {k!r} of {n!r}", v.shape, params[n].shape)
               for n, state in saved_optimizer_state.items() if n in params
               for k, v in state.items() if _per_element(k, v)]
    _check_shapes(f"checkpoint step {step} ({directory / step_dir_name(step)})", device, shapes)
    module.load_state_dict({n: local_like(tensors[n], own[n]) for n in names})  # a TP stage: its shards
    if isinstance(optimizer, ShardedOptimizer):  # ZeRO: this rank's ranges cut out of the whole state
        optimizer.load_state_by_name(module, saved_optimizer_state)
        return Restored(step, meta)
    for name, p in params.items():
        if name in saved_optimizer_state:
            optimizer.state[p] = {k: (local_like(v, p) if _per_element(k, v) else
                                      v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v)
                                  for k, v in saved_optimizer_state[name].items()}
    return Restored(step, meta)


def resume_together(health: Health, rank: int, world: int, timeout_s: float, restore: Callable[[], None],
                    resuming: bool = True) -> None:
    """Run ``restore`` (this rank's share of a resume), then wait until every rank of the job has run its own.

    ``resuming`` False: no checkpoint to resume from, only the start to pass together, so that a rank whose
    stage could not be built (``runtime.lifecycle.job.build_job`` posts why) is named by the others before training.

    A rank that cannot resume (a checkpoint of other shapes) posts its error and leaves; the others
    stop here naming it, instead of meeting a closed connection once training starts::

        rank 0:  restore_stage -> CheckpointError   post it, leave with it
        rank 1:  restore_stage -> ok                barrier "resumed": rank 0 failed -> PeerError naming rank 0

    Raises:
        Exception: what ``restore`` raised, on its own rank (posted to the others first).
        PeerError: on the other ranks, naming the rank that failed and the first line of its error, or a
            rank that fell silent.
    """
    try:
        restore()
    except Exception as e:
        health.post_error(str(e))
        health.linger(min(timeout_s, 3 * health.period_s + 2))  # the store's host: let the others read it
        raise
    if health.store is None:  # a world without a job store: nothing to wait for
        return
    barrier = Barrier(health.store, rank, world, timeout_s, beats=beat_counter(health.store),
                      name=health.name)
    try:
        barrier.sync("resumed", "the resume from the checkpoint" if resuming else "the start of training")
    except BarrierError as e:
        if e.failed:
            r = min(e.failed)
            raise PeerError(f"{health.name(rank)} stops: {health.name(r)} could not "
                            f"{'resume' if resuming else 'start'}: "
                            f"{(e.failed[r].strip().splitlines() or [''])[0]}") from None
        raise health.peer_error(f"waiting for every rank to {'resume from the checkpoint' if resuming else 'start'}",
                                e.late + e.silent,
                                e) from None


def _per_element(key: str, value: Any) -> bool:
    """Whether an optimizer state entry holds one number per element of its parameter (AdamW's ``exp_avg``,
    SGD's ``momentum_buffer``), so has the parameter's shape; ``step`` and other scalars do not."""
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0


def _check_shapes(where: str, device: str, shapes: list[tuple[str, torch.Size, torch.Size]]) -> None:
    """Refuse a ``(what, shape in the checkpoint, shape in the stage)`` whose shapes differ (a checkpoint of a
    model of other settings), in one line naming the checkpoint (``where``), the first such tensor, both shapes."""
    wrong = [(what, held, need) for what, held, need in shapes if held != need]
    if wrong:
        what, held, need = wrong[0]
        more = f" (and {len(wrong) - 1} more tensor(s) of other shapes)" if len(wrong) > 1 else ""
        raise CheckpointError(f"{where} holds {what} of shape {list(held)}, but {device}'s stage has shape "
                              f"{list(need)}{more}: the checkpoint is of a model of other settings (--set, "
                              "config.json); resume with the settings it was saved with, or use another "
                              "--checkpoint-dir")

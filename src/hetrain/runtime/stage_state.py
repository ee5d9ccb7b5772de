"""One stage's share of a checkpoint: what it writes, and how it comes back on resume.

A checkpoint (``runtime.checkpoint``) holds every layer once, under its global
name ``layers.{k}.…``. A layer held by several devices (its segment's owners) is
written by the first owner only::

    segment [0..3) owners (n0:0, n1:0)   ->  n0:0 writes layers.0..2, n1:0 writes none of them
    parameter-server shards              ->  their host writes ps.layers.{k}.… (``modes.PS_PREFIX``)

Resuming loads this stage's names from the newest complete checkpoint, whatever
plan wrote it, with the optimizer state of each parameter found there.

Example:
    >>> meta = checkpoint_meta(plan, step, loss)                                    # doctest: +SKIP
    >>> save_stage(directory, step, module, optimizer, plan, "n0:1", {}, meta, timeout_s=300)
    >>> restored = restore_stage(directory, module, optimizer, "n0:1")              # on resume
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from hetrain.plan import Plan
from hetrain.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

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
    return {name_of[id(p)]: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            for p, st in optimizer.state.items() if id(p) in name_of}


def checkpoint_meta(plan: Plan, step: int, loss: float | None) -> dict[str, Any]:
    """The metadata a checkpoint of ``step`` carries (the same on every rank)."""
    return {"step": step, "loss": loss, "model": plan.model, "global_batch": plan.global_batch,
            "samples_seen": step * plan.global_batch, "devices": plan.devices_used}


def save_stage(directory: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
               device: str, mode_tensors: dict[str, torch.Tensor], meta: dict[str, Any], timeout_s: float) -> None:
    """Write this stage's share of checkpoint ``step``; collective over the job (``save_checkpoint``).

    Args:
        mode_tensors: tensors of the sync mode this rank writes (``ModeSync.checkpoint_state``).
        meta: from ``checkpoint_meta``, with anything the mode adds.
    """
    tensors = {n: t.detach().cpu() for n, t in module.state_dict().items()}
    save_checkpoint(directory, step, {**tensors, **mode_tensors}, optimizer_state(module, optimizer), meta,
                    owned_names=owned_names(plan, module, device) | set(mode_tensors), timeout_s=timeout_s)


def latest_step(directory: Path) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None."""
    found = latest_checkpoint(directory)
    return None if found is None else found[0]


def restore_stage(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
                  device: str) -> Restored | None:
    """Load this stage and its optimizer state from the newest complete checkpoint, if any.

    Returns:
        The checkpoint's step and metadata; None when there is no checkpoint.

    Raises:
        ValueError: the checkpoint lacks a tensor of this stage.
    """
    step = latest_step(directory)
    if step is None:
        return None
    names = list(module.state_dict())
    tensors, saved_optimizer_state, meta = load_checkpoint(directory, names, step)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint step {step} in {directory} lacks {len(missing)} tensor(s) of "
                         f"{device}'s stage, e.g. {missing[:3]}")
    module.load_state_dict({n: tensors[n] for n in names})
    for name, p in module.named_parameters():
        if name in saved_optimizer_state:
            optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v)
                                  for k, v in saved_optimizer_state[name].items()}
    return Restored(step, meta)

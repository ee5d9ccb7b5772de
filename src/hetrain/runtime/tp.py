"""Tensor parallelism (TP) of a stage's layers, run by torch's own DTensor TP: one rule per block type.

Why hetrain wraps torch here rather than hand it the model: ``parallelize_module`` parallelises one
module on one mesh, with one degree. A hetrain plan gives each stage its own TP degree (a pair of one
device type in one node, one device of another elsewhere), so each stage gets a mesh of its own (its TP
group, ``build_tp_groups``), and the stage's layers are parallelised one by one with the rule of their
block type. Everything inside a layer is torch's: the DTensor parameters, the column- and row-parallel
styles, the all-reduces that Megatron calls f and g::

    block (Megatron layout, Shoeybi et al. 2019):
      x (whole) ─► LN ─► QKV  column-parallel (each rank its heads) ─► attention on the local heads
                      ─► proj row-parallel ─► all-reduce ─► + x
                  ─► LN ─► up (and gate) column-parallel ─► act ─► down row-parallel ─► all-reduce ─► + x

A layer without a rule (the embeddings; the final norm and LM head) stays whole on every rank of the
group: identical inputs give identical outputs and gradients. A stage's input and output are therefore
whole on every rank, and the ranks of neighbouring groups pair up to move them (``roles.tp_transfers``).

Rules (``RULES``), by the block's class name:

    Block (hetrain.models.gpt)          attn.qkv fused column-parallel (q, k, v each split alike: a strided
                                        shard), attn.proj row-parallel; mlp.0 column-, mlp.2 row-parallel;
                                        its attention views its heads as -1 (the local count)
    LlamaDecoderLayer,                  self_attn.q_proj, k_proj, v_proj column-parallel (their biases with
    MistralDecoderLayer,                them: Qwen2's), o_proj row-parallel; mlp.gate_proj, up_proj column-,
    Qwen2DecoderLayer (transformers)    down_proj row-parallel; attention views its heads as -1

A Hugging Face model's layers are traced graphs of aten ops (``models.trace``) with the head counts written into
them and no ``nn.Linear`` modules for torch's styles to wrap. A TP stage runs each traced block in its module form
instead (``models.hf_blocks``): the model's own decoder layer on the traced layer's input tuple, checked against
the traced layer before it runs (``tp_stage_layers``); the embedding and head stay traced and whole. A block
without a form (GPT-2's ``GPT2Block``, whose fused QKV is a ``Conv1D`` that ColwiseParallel does not split), and
any other layer type without a rule, is refused by name in a stage of TP > 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hetrain.errors import InputError
from hetrain.models import hf_blocks
from hetrain.models.spec import SpecError
from hetrain.plan import Plan, Stage

# torch.distributed.tensor (DTensor and its TP styles) is imported where a TP stage is parallelised, not here:
# about a second of CPU at every rank's start (it brings sympy), for the ranks of a plan without TP too
if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle


class TPError(InputError):
    """A plan's TP stage that hetrain does not run: a block type without a rule, or a feature that TP lacks."""


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor, without importing torch's DTensor package: there is none before it is imported."""
    package = sys.modules.get("torch.distributed.tensor")
    return package is not None and isinstance(t, package.DTensor)


Rule: TypeAlias = "Callable[[nn.Module, int], dict[str, ParallelStyle]]"


def _gpt_block(block: nn.Module, k: int) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hetrain.runtime.tp_styles import FusedColwiseParallel

    heads = int(block.attn.heads)  # type: ignore[union-attr, arg-type]  # models.gpt.Block's attention
    _require_divisible(block, "attention heads", heads, k)
    return {"attn.qkv": FusedColwiseParallel(3), "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def _hf_decoder(layer: nn.Module, k: int) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert isinstance(layer, hf_blocks.BlockModule)  # a traced block's module form (tp_stage_layers)
    decoder, path = layer.decoder, layer.form.path
    config: Any = decoder.get_submodule("self_attn").config  # transformers' attention keeps its config
    heads = int(config.num_attention_heads)
    _require_divisible(decoder, "attention heads", heads, k)
    _require_divisible(decoder, "key-value heads", int(getattr(config, "num_key_value_heads", None) or heads), k)
    _require_divisible(decoder, "MLP channels", int(config.intermediate_size), k)
    styles: dict[str, ParallelStyle] = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    styles |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
               "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    return {f"{path}.{name}": style for name, style in styles.items()}


#: block class name -> its rule (module docstring)
RULES: Mapping[str, Rule] = {"Block": _gpt_block, **{kind: _hf_decoder for kind in sorted(hf_blocks.FORM_CLASSES)}}

#: layer class names that stay whole on every rank of a TP group (hetrain.models.gpt's embedding and head)
WHOLE = frozenset({"Embedding", "Head"})


def _require_divisible(block: nn.Module, what: str, count: int, k: int) -> None:
    if count % k:
        raise TPError(f"a {type(block).__name__} block has {count} {what}, which TP {k} cannot split evenly; "
                      f"plan with a TP degree that divides {count} (--max-tp)")


def check_tp(plan: Plan, tied: Sequence[Any] = ()) -> None:
    """Refuse, before any process group, a plan with TP stages that hetrain does not run yet, in one line: a sync
    mode other than bsp, or tied weights in a TP stage. (Recompute sets and bf16 / fp16 run: every rank of a group
    recomputes, and casts, alike; tests/distributed/test_runtime_tp.py.)

    Raises:
        TPError: naming the first TP stage and what it cannot do.
    """
    tp_stages = [(v, j, s) for v, vw in enumerate(plan.virtual_workers) for j, s in enumerate(vw.stages) if s.tp > 1]
    if not tp_stages:
        return
    v, j, s = tp_stages[0]
    where = f"stage {j} of VW{v} runs TP {s.tp}"
    if plan.sync != "bsp":
        raise TPError(f"sync mode {plan.sync} does not run TP stages yet ({where}); plan with --max-tp 1 or --sync bsp")
    tied_layers = {k for tie in tied for k, _ in tie}
    for v, j, s in tp_stages:
        if tied_layers & set(s.layers):
            raise TPError(f"tied weights do not run in TP stages yet (stage {j} of VW{v} runs TP {s.tp} and holds "
                          f"tied layers {sorted(tied_layers & set(s.layers))}); plan with --max-tp 1")


def build_tp_groups(plan: Plan, rank_of: Mapping[str, int], timeout_s: float) -> dict[str, Any]:
    """One process group per TP group of the plan, by the stage's lead device (the groups this rank is in).

    Collective over the job: every rank creates every group, in the plan's stage order.
    """
    timeout = timedelta(seconds=timeout_s)
    me = dist.get_rank()
    groups: dict[str, Any] = {}
    for vw in plan.virtual_workers:
        for s in vw.stages:
            if s.tp > 1:
                ranks = [rank_of[d] for d in s.devices]
                group = dist.new_group(sorted(ranks), timeout=timeout)
                if me in ranks:
                    groups[s.device] = group
    return groups


def build_tp_mesh(stage: Stage, rank_of: Mapping[str, int], group: Any, device: torch.device) -> DeviceMesh:
    """The stage's 1-D mesh over its TP group, its coordinates in the group's order (member t holds shard t)."""
    ranks = [rank_of[d] for d in stage.devices]
    return DeviceMesh.from_group(group, device.type, mesh=torch.tensor(ranks, dtype=torch.int64))


def block_type(layer: nn.Module) -> str:
    """The class name that selects ``layer``'s rule: its own class, or a module form's decoder layer's."""
    if isinstance(layer, hf_blocks.BlockModule):
        return type(layer.decoder).__name__
    return type(layer).__name__


def _runs_as_tp(layer: nn.Module) -> bool:
    """Whether a TP stage runs ``layer``: by its rule, whole, or (a traced block) by its module form's rule."""
    kind = block_type(layer)
    form = getattr(layer, "tp_form", None)
    return (kind in WHOLE or kind in RULES or form == hf_blocks.WHOLE
            or (isinstance(form, hf_blocks.ModuleForm) and form.kind in RULES))


def check_rules(layers: Mapping[int, nn.Module], names: Sequence[str], where: str, k: int) -> None:
    """Refuse a layer of a TP stage that has no rule and does not stay whole (``RULES``, ``WHOLE``).

    A traced layer (``hetrain.models.trace``: a Hugging Face model or a user's module cut by torch.export) is
    a graph of aten ops over the model's parameters, not the model's block modules: it runs in a TP stage whole
    (a Hugging Face model's embedding and head) or in its module form (``hf_blocks``: Llama, Mistral, Qwen2
    blocks), and is refused otherwise, with the reason its model gave.

    Raises:
        TPError: naming the stage, the layer and its type, in one line.
    """
    for i, layer in layers.items():
        if _runs_as_tp(layer):
            continue
        kind = block_type(layer)
        form = getattr(layer, "tp_form", None)
        if isinstance(form, str):
            raise TPError(f"{where} runs TP {k}, but its layer {i} ({names[i]}) cannot run as TP: {form}; plan with "
                          "--max-tp 1")
        why = (" (a traced graph of the model's forward: it keeps no block modules for torch's TP styles)"
               if kind == "TracedLayer" else "")
        raise TPError(f"{where} runs TP {k}, but its layer {i} ({names[i]}) is a {kind}{why}, which has no TP "
                      f"rule (rules: {', '.join(sorted(RULES))}); plan with --max-tp 1")


def tp_stage_layers(layers: Sequence[nn.Module], first: int, names: Sequence[str], where: str,
                    k: int) -> list[nn.Module]:
    """A TP stage's layers as it runs them: each traced block in its module form (``hf_blocks``), checked against
    the traced layer with the stage's own weights; every other layer as it was built.

    Call it before the layers are placed in the stage (the form takes the traced layer's place).

    Raises:
        TPError: a layer without a rule (``check_rules``), or a module form that differs from its traced layer.
    """
    check_rules(dict(enumerate(layers, start=first)), names, where, k)
    out: list[nn.Module] = []
    for layer in layers:
        form = getattr(layer, "tp_form", None)
        if not isinstance(form, hf_blocks.ModuleForm):
            out.append(layer)
            continue
        try:
            out.append(form.build(layer))
        except SpecError as e:
            raise TPError(f"{where}: {e}") from None
    return out


def parallelize_stage(layers: Mapping[int, nn.Module], names: Sequence[str], where: str, mesh: DeviceMesh) -> None:
    """Parallelise each layer of a TP stage with its block type's rule; layers in ``WHOLE`` stay whole.

    Args:
        layers: the stage's layers by global index.
        names: every layer's name in the model's profile (for messages).
        where: the stage, for messages (``"stage 0 of VW1"``).
        mesh: the stage's TP mesh.

    Raises:
        TPError: a layer of a type without a rule (``check_rules``), before any layer is changed.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    k = mesh.size()
    check_rules(layers, names, where, k)
    for layer in layers.values():
        rule = RULES.get(block_type(layer))
        if rule is not None:
            parallelize_module(layer, mesh, rule(layer, k))


def full_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every DTensor gathered whole (``full_tensor``: collective over its mesh, in this order)."""
    return {n: (t.full_tensor() if is_dtensor(t) else t) for n, t in tensors.items()}


def local_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole tensor ``whole`` where ``like`` is a DTensor (its placements, cut locally: no
    collective); ``whole`` itself otherwise."""
    if not is_dtensor(like):
        return whole
    from torch.distributed.tensor import distribute_tensor  # imported already: ``like`` is a DTensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


__all__ = ["RULES", "WHOLE", "TPError", "block_type", "build_tp_groups", "build_tp_mesh", "check_rules", "check_tp",
           "full_state", "is_dtensor", "local_like", "parallelize_stage", "tp_stage_layers"]

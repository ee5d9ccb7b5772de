"""Module forms of a transformers model's decoder blocks: what a TP stage runs in place of a traced block.

A traced block (``hetrain.models.trace``) is a graph of aten ops with the model's head counts written into it
as constants (Llama's ``repeat_kv`` expands keys to ``(B, 2, 2, T, 8)`` and reshapes them to ``(B, 4, T, 8)``),
and it holds no ``nn.Linear`` modules, so torch's ColwiseParallel / RowwiseParallel have nothing to wrap and
a rank's local heads would not fit its shapes. A TP stage therefore runs the model's own decoder layer
(``LlamaDecoderLayer``, whose attention views its heads as ``-1``: the local count), in a module form
(``BlockModule``) that takes the tuple the traced layer takes and returns the tuple it returns::

    traced layer k:   x = (mask, cos, sin, h)  ->  (mask, cos, sin, h')
    module form:      h' = decoder(x[3], attention_mask=x[0], position_embeddings=(x[1], x[2]))

The form holds the decoder layer under the path the traced layer names its parameters by (``model.layers.0``),
the same parameter objects, so checkpoints, sync and clipping see the same names.

Which element is which (``BlockForm``) is found where the model is resolved (``find_forms``): the model's own
forward runs with a hook on each decoder layer, and the hidden state and the rotary cos and sin it is given are
found by value among the traced layer's inputs; the mask is the one other input the traced graph reads; the
outputs passed through are read from the traced graph. Every form is then checked (``check_form``): the module
form and the traced layer run on that sample and must agree within 1e-5 of the outputs' magnitude, once there
and again where a stage builds it with its own weights (``ModuleForm.build``). A block the form does not fit is
not run as TP: the reason is kept (``find_forms``) and a TP stage holding it is refused with it.

Example:
    >>> forms = find_forms(model, cut, (ids,), "hf:llama", hf_forward)   # doctest: +SKIP
    >>> forms[1].hidden, forms[1].mask, forms[1].cos, forms[1].sin     # doctest: +SKIP
    (0, 1, 2, 3)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from hetrain.models.spec import SpecError
from hetrain.models.trace import TracedCut, _max_diff, _tensors

#: decoder layer classes called as ``layer(h, attention_mask=m, position_embeddings=(cos, sin)) -> h'``
FORM_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})

#: the ``tp_form`` of a traced layer that is no block (embedding, head): it stays whole on every rank of a TP group
WHOLE = "whole"


@dataclass(frozen=True)
class BlockForm:
    """Where a decoder layer's arguments sit in its traced layer's input, and what the traced layer returns.

    Attributes:
        path: the decoder layer's module path in the model (``model.layers.0``).
        hidden: the hidden state's index in the input tuple; None where the input is the hidden state alone.
        mask: the attention mask's index, or None where the traced layer reads none.
        cos: the rotary cos's index.
        sin: the rotary sin's index.
        outputs: per element of the output tuple, the input index it passes on, or None for the new hidden
            state; empty where the output is the new hidden state alone.
        sample: an input the traced layer took in the resolved model's forward: what ``check_form`` runs.
    """

    path: str
    hidden: int | None
    mask: int | None
    cos: int
    sin: int
    outputs: tuple[int | None, ...]
    sample: Any


class BlockModule(nn.Module):
    """A decoder layer run on a traced layer's input tuple (``BlockForm``), under its path in the model."""

    def __init__(self, decoder: nn.Module, form: BlockForm) -> None:
        super().__init__()
        parent: nn.Module = self
        *outer, leaf = form.path.split(".")
        for part in outer:  # empty modules down to the decoder layer, so its parameters keep the model's names
            child = nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, decoder)
        self.form = form

    @property
    def decoder(self) -> nn.Module:
        """The model's own decoder layer."""
        return self.get_submodule(self.form.path)

    def forward(self, x: Any) -> Any:
        f = self.form
        h = x if f.hidden is None else x[f.hidden]
        mask = None if f.mask is None else x[f.mask]
        out = self.decoder(h, attention_mask=mask, position_embeddings=(x[f.cos], x[f.sin]))
        if isinstance(out, tuple):  # transformers before 4.54 returned (hidden, ...)
            out = out[0]
        if not f.outputs:
            return out
        return tuple(out if i is None else x[i] for i in f.outputs)

    def extra_repr(self) -> str:
        return f"{type(self.decoder).__name__} at {self.form.path}"


def check_form(module: BlockModule, traced: nn.Module, what: str, rtol: float = 1e-5) -> None:
    """Run ``module`` and ``traced`` on the form's sample in eval mode; refuse a difference.

    Raises:
        SpecError: the parameters differ by name or object, or the outputs by more than ``rtol`` of their
            largest magnitude (``what``: the block, for the message).
    """
    kind = type(module.decoder).__name__
    mine = {n: id(p) for n, p in module.named_parameters()}
    theirs = {n: id(p) for n, p in traced.named_parameters()}
    if mine != theirs:
        raise SpecError(f"cannot run {what} ({kind}) as TP: its module form holds other parameters than the traced "
                        f"layer ({sorted(set(mine) ^ set(theirs))[:3] or 'copies of them'})")
    modes = [m.training for m in (module, traced)]
    module.eval()
    traced.eval()
    try:
        with torch.no_grad():
            diff, scale = _max_diff(_tensors(traced(module.form.sample)), _tensors(module(module.form.sample)))
    finally:
        module.train(modes[0])
        traced.train(modes[1])
    if not diff <= rtol * scale:
        raise SpecError(f"cannot run {what} ({kind}) as TP: its module form differs from the traced forward by "
                        f"{diff:.3g} (of outputs up to {scale:.3g})")


class ModuleForm:
    """What a traced block keeps (as its ``tp_form``) to be run as TP: its decoder layer and form."""

    def __init__(self, decoder: nn.Module, form: BlockForm, what: str) -> None:
        self.decoder, self.form, self.what = decoder, form, what

    @property
    def kind(self) -> str:
        """The decoder layer's class name (``LlamaDecoderLayer``): what selects its TP rule."""
        return type(self.decoder).__name__

    def build(self, traced: nn.Module) -> BlockModule:
        """The module form, checked against ``traced`` (``check_form``) with the weights they share."""
        module = BlockModule(self.decoder, self.form)
        check_form(module, traced, self.what)
        return module


def find_forms(model: nn.Module, cut: TracedCut, example: tuple[Any, ...], what: str,
               forward: Callable[..., Any]) -> dict[int, BlockForm | str]:
    """Each block layer's form (layers ``1..n`` of ``cut``, cut at the model's decoder layers), each checked; or
    why it has none, in words that follow "cannot run <block> as TP: ".

    Args:
        model: the model ``cut`` was traced from, its parameters the ones ``cut``'s layers hold.
        example: the model's inputs (token ids) to find and check the forms on.
        what: the model, for messages.
    """
    paths = list(cut.names[1:-1])
    blocks = {k: model.get_submodule(p) for k, p in enumerate(paths, start=1)}
    forms: dict[int, BlockForm | str] = {
        k: f"it is a {type(b).__name__}, which has no module form (forms: {', '.join(sorted(FORM_CLASSES))})"
        for k, b in blocks.items() if type(b).__name__ not in FORM_CLASSES}
    if len(forms) == len(blocks):  # nothing to run the model for
        return forms
    given = _capture(model, [b for k, b in blocks.items() if k not in forms], example, forward)
    inputs = _layer_inputs(cut.layers, example)
    for k, block in blocks.items():
        if k in forms:
            continue
        name = f"{what} block {k}"
        try:
            form = _form_of(cut.layers[k], paths[k - 1], given[id(block)], inputs[k], name)
            check_form(BlockModule(block, form), cut.layers[k], name)
        except SpecError as e:
            forms[k] = str(e).split(" as TP: ", 1)[-1]
            continue
        except Exception as e:  # the decoder layer refused the form's arguments: no TP for it, training is unchanged
            first = (str(e).strip().splitlines() or [""])[0]
            forms[k] = f"its decoder layer cannot run on the traced layer's inputs ({type(e).__name__}: {first})"
            continue
        forms[k] = form
    return forms


def _capture(model: nn.Module, blocks: Sequence[nn.Module], example: tuple[Any, ...],
             forward: Callable[..., Any]) -> dict[int, dict[str, Any]]:
    """What each of ``blocks`` is given in the model's own forward (``forward(model, *example)``, eval mode):
    hidden state, mask, cos, sin."""
    given: dict[int, dict[str, Any]] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        cos_sin = kwargs.get("position_embeddings") or (None, None)
        given[id(module)] = {"hidden": hidden, "mask": kwargs.get("attention_mask"), "cos": cos_sin[0],
                             "sin": cos_sin[1]}

    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            forward(model, *example)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return given


def _layer_inputs(layers: Sequence[nn.Module], example: tuple[Any, ...]) -> list[Any]:
    """Each layer's input in the chained traced layers (eval mode): ``example`` for the first."""
    seen: list[Any] = [example]
    modes = [m.training for m in layers]
    for m in layers:
        m.eval()
    try:
        with torch.no_grad():
            seen.append(layers[0](*example))
            for layer in layers[1:-1]:
                seen.append(layer(seen[-1]))
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.train(mode)
    return seen


def _form_of(traced: nn.Module, path: str, given: dict[str, Any], x: Any, what: str) -> BlockForm:
    """Match what the decoder layer was given (``given``) with the traced layer's input ``x``; read its outputs."""
    assert isinstance(traced, fx.GraphModule)
    items = list(x) if isinstance(x, tuple) else [x]
    reads, outputs = _graph_io(traced, isinstance(x, tuple))
    at = {}
    for key in ("hidden", "cos", "sin"):
        found = [i for i, v in enumerate(items) if _same(given[key], v)]
        if len(found) != 1:
            raise SpecError(f"cannot run {what} as TP: its {key} is {len(found)} of the traced layer's inputs, not one")
        at[key] = found[0]
    rest = sorted(reads - set(at.values()))
    if len(rest) > 1 or (given["mask"] is not None and [i for i in rest if _same(given["mask"], items[i])] != rest):
        raise SpecError(f"cannot run {what} as TP: its traced layer reads inputs {rest} besides the hidden state and "
                        "the rotary cos and sin, which its decoder layer is not given as its mask")
    if [i for i in outputs if i is None] != [None]:
        raise SpecError(f"cannot run {what} as TP: its traced layer returns {outputs.count(None)} new values, not one")
    return BlockForm(path, at["hidden"] if isinstance(x, tuple) else None, rest[0] if rest else None, at["cos"],
                     at["sin"], outputs if len(outputs) > 1 else (), x)


def _graph_io(traced: fx.GraphModule, is_tuple: bool) -> tuple[set[int], tuple[int | None, ...]]:
    """The input indices the traced graph computes with, and per output the input index it passes on (or None)."""
    (x,) = [n for n in traced.graph.nodes if n.op == "placeholder"]
    output = next(n for n in traced.graph.nodes if n.op == "output")
    index = {n: n.args[1] for n in x.users if n.target is operator.getitem} if is_tuple else {x: 0}
    reads = {i for n, i in index.items() if any(u is not output for u in n.users)}
    values = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    return reads, tuple(index.get(v) if isinstance(v, fx.Node) else None for v in values)


def _same(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same values (within float32 rounding)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    diff, scale = _max_diff([a], [b])
    return diff <= 1e-6 * scale


__all__ = ["FORM_CLASSES", "WHOLE", "BlockForm", "BlockModule", "ModuleForm", "check_form", "find_forms"]

"""Cut any model into layers by tracing its own forward (``torch.export``), not by matching names.

The model's forward is captured once as an aten graph with ``torch.export.export`` (non-strict, the
batch and sequence dimensions symbolic), as ``torch.distributed.pipelining.pipeline()`` captures it
before its splitter. Every node of the graph knows the module it ran in (``nn_module_stack``), so the
graph is split where the user's split points begin::

    graph, in forward order:   embed · rotary · mask | block 0 | block 1 | ... | norm · soft-cap · lm_head
    layer:                     0                       1         2               n + 1

Each layer is an ``fx.GraphModule`` that runs exactly the nodes the model's forward runs between two
split points: scalings, soft-caps, residuals across children, model-level rotary tables and masks.
A value that a later layer needs besides the hidden state (a mask, the rotary cos/sin, a residual,
the token ids) travels with it: layer ``k`` returns every value still needed after it, as a tuple, and
layer ``k + 1`` takes that tuple (``hetrain.models.layers``: one argument, passed unchanged). Sizes
(the batch and sequence lengths, as symbolic ints) never travel: each layer reads them again from
a tensor it holds.

Why not pipelining's splitter as it is: ``pipeline()`` exports with static shapes (one micro-batch
size per trace, where a heterogeneous plan runs several), lets a stage read any earlier stage's
output (hetrain's stages form a chain: every value passes through each stage in between, and the
cost model counts its bytes there), and moves a parameter used in two stages to one of them (hetrain
keeps a copy in each and sums their gradients: ``hetrain.runtime.step.tied``).

Ops whose behaviour depends on ``module.training`` are fixed at trace time in an exported graph; the
graph runs them through ``ModeOp``, which reads the layer's own ``training`` flag, so ``.eval()``
turns dropout off as it does in the model.

A factory op (``arange``, ``ones``) creates its tensor on the device of the layer's input, not on the
device the model was traced on. ``hetrain.models.kept_cuts`` keeps a cut between runs.

Example:
    >>> cut = trace_cut(model, (ids,), repeated_blocks(model), what="net")   # doctest: +SKIP
    >>> [len(v) for v in cut.crossing]                                         # doctest: +SKIP
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from hetrain.models.spec import SpecError

Tie = tuple[tuple[int, str], ...]

#: the prefix the wrapper adds to every module path (``Wrapped``): stripped from the layers' names
_ROOT = "m"


class Wrapped(nn.Module):
    """``call(model, *args)`` as a module, so that ``torch.export`` captures it; the model is ``self.m``."""

    def __init__(self, model: nn.Module, call: Callable[..., Any]) -> None:
        super().__init__()
        self.m = model
        self._call = call

    def forward(self, *args: Any) -> Any:
        return self._call(self.m, *args)


class ModeOp(nn.Module):
    """An op whose train-time and eval-time arguments differ, run as ``module.training`` says.

    ``train_arg`` is the position of a boolean ``train`` argument (dropout, batch norm), set to
    ``self.training``; ``p_arg`` the position of a dropout probability, zero in eval mode.
    """

    def __init__(self, op: Any, train_arg: int | None = None, p_arg: int | None = None,
                 p_kwarg: str | None = None) -> None:
        super().__init__()
        self.op_name = str(op)  # "aten.dropout.default": by name, so that a saved cut pickles
        self.train_arg = train_arg
        self.p_arg = p_arg
        self.p_kwarg = p_kwarg

    @property
    def op(self) -> Any:
        found: Any = torch.ops
        for part in self.op_name.split("."):
            found = getattr(found, part)
        return found

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args_l = list(args)
        if self.train_arg is not None and self.train_arg < len(args_l):
            args_l[self.train_arg] = self.training
        if not self.training:
            if self.p_arg is not None and self.p_arg < len(args_l):
                args_l[self.p_arg] = 0.0
            if self.p_kwarg is not None and self.p_kwarg in kwargs:
                kwargs[self.p_kwarg] = 0.0
        return self.op(*args_l, **kwargs)

    def extra_repr(self) -> str:
        return str(self.op)


def _mode_op(node: fx.Node) -> ModeOp | None:
    """The ``ModeOp`` that runs ``node`` as the layer's mode says, or None where the mode does not matter."""
    aten = torch.ops.aten
    t = node.target
    if t in (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default):
        return ModeOp(t, train_arg=2)
    if t == aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return ModeOp(t, p_arg=4, p_kwarg="dropout_p") if p else None
    if t == aten.batch_norm.default:
        return ModeOp(t, train_arg=5)
    return None


@dataclass(frozen=True)
class TracedCut:
    """A model cut into layers by its trace.

    Attributes:
        layers: ``fx.GraphModule`` each; layer ``k``'s output is layer ``k + 1``'s one argument.
        names: one label per layer: the split point it begins at (``embed`` for the first, ``head``
            for what follows the last block by default).
        crossing: for each cut ``k`` (after layer ``k``), what crosses it: ``(name, shape, dtype)`` of
            each value, the shapes as traced.
    """

    layers: list[nn.Module]
    names: tuple[str, ...]
    crossing: tuple[tuple[tuple[str, tuple[int, ...], str], ...], ...]
    whole: fx.GraphModule | None = None  # the unsplit graph, to tell which layer a difference starts in


def repeated_blocks(model: nn.Module) -> list[str]:
    """The module paths of the model's repeated blocks: the children of its largest ``nn.ModuleList``
    (or ``nn.Sequential``) of modules of one class, by parameter count (a transformers
    model's decoder layers)."""
    best: tuple[int, list[str]] = (0, [])
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 1:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, [f"{path}.{name}" if path else name for name, _ in module.named_children()])
    return best[1]


def _module_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if path == _ROOT or path.startswith(_ROOT + "."):
            paths.append(path[len(_ROOT) + 1:])
    return paths


def _inside(paths: list[str], module: str) -> bool:
    return any(p == module or p.startswith(module + ".") for p in paths)


def _assign(gm: fx.GraphModule, split_points: Sequence[str], tail: bool, what: str) -> dict[fx.Node, int]:
    """Each compute node's layer: ``j + 1`` from split point ``j`` on (0 before the first), monotone in
    graph order; with ``tail``, the nodes after the last split point's module form one layer more."""
    part: dict[fx.Node, int] = {}
    current, last_seen = 0, -1
    n = len(split_points)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        paths = _module_paths(node)
        j = next((k for k in range(n) if _inside(paths, split_points[k])), None)
        if j is not None:
            if j + 1 < current:
                raise SpecError(f"{what}: its forward runs {split_points[j]} after {split_points[current - 1]}, which "
                                "the split points list after it (split points out of forward order, or a module "
                                "called twice): give --split-points in the order the forward runs them")
            current = j + 1
            last_seen = j
        elif tail and last_seen == n - 1 and current == n:
            current = n + 1  # past the last block: the head
        part[node] = current
    return part


def _is_size(node: Any) -> bool:
    """Whether ``node`` computes a size (a symbolic int or a python number), not a tensor."""
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool | int | float | bool)


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)
    return False


def trace_cut(model: nn.Module, example: tuple[Any, ...], split_points: Sequence[str], *, what: str,
              call: Callable[..., Any] | None = None, tail: bool = True,
              dynamic: Sequence[dict[int, Any] | None] | None = None) -> TracedCut:
    """Cut ``model``'s forward (``call(model, *example)``, default ``model(*example)``) at ``split_points``.

    Args:
        model: the whole model, its parameters the ones the layers will hold (not copied).
        example: inputs to trace with; their batch and sequence dimensions are traced as symbols
            (``dynamic``: per input, dim -> ``torch.export.Dim``; default: every dimension ``Dim.AUTO``).
        split_points: module paths (``model.layers.3``) where a new layer begins, in forward order.
        what: the model's name, for messages.
        tail: begin one more layer after the last split point's module (the head).

    Raises:
        SpecError: a forward that cannot be traced (naming the construct and the way out), a split
            point that is not a module of the model, or one that the forward runs out of order.
    """
    modules = dict(model.named_modules())
    for point in split_points:
        if point not in modules:
            near = [p for p in modules if p.endswith(point.rsplit(".", 1)[-1])][:3]
            raise SpecError(f"{what}: split point {point!r} is not a module of {type(model).__name__}"
                            + (f" (near: {', '.join(near)})" if near else ""))
    wrapped = Wrapped(model, call or (lambda m, *a: m(*a)))
    if dynamic is None:
        dynamic = [{d: torch.export.Dim.AUTO for d in range(x.dim())} if isinstance(x, torch.Tensor) else None
                   for x in example]
    try:
        ep = torch.export.export(wrapped, tuple(example), dynamic_shapes=(tuple(dynamic),), strict=False)
    except Exception as e:  # torch's own tracing errors, each named in one line with the way out
        raise SpecError(f"{what}: its forward cannot be traced ({_construct(e)}); make that part of its forward "
                        "free of data-dependent Python control flow, or pass its layers as a list (the forward "
                        "then chains them)") from e
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    _drop_guards(gm, example, what)
    part = _assign(gm, split_points, tail, what)
    names: dict[int, list[str]] = {}  # a tensor's names in the model: a tied one has several
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    cut = _split(gm, part, split_points, tail, what, names)
    for layer in cut.layers:
        _keep_transient(layer, model)
    return cut


def _drop_guards(gm: fx.GraphModule, example: tuple[Any, ...], what: str) -> None:
    """Replace the exported module's input guards by the one check they stand for here: that no size of the inputs
    was fixed by the trace (every dimension traced as a symbol). A size the forward fixes is refused; the rest of a
    graph's assumptions stay in it as its own ``_assert_scalar`` nodes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example, strict=False):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                raise SpecError(f"{what}: its forward fixes dimension {d} of its input to {size} (traced at "
                                f"{tuple(x.shape)}): a layer would run only at that size; make the forward take any "
                                "batch and sequence size")
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.recompile()


def _construct(e: BaseException) -> str:
    text = " ".join(str(e).split())
    name = type(e).__name__
    if "data-dependent" in text.lower() or "GuardOnDataDependent" in name:
        return f"data-dependent control flow: {name}: {text[:160]}"
    return f"{name}: {text[:200]}"


def _split(gm: fx.GraphModule, part: dict[fx.Node, int], split_points: Sequence[str], tail: bool,
           what: str, names: dict[int, list[str]]) -> TracedCut:
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    count = (max(part.values(), default=0) + 1) if part else 1
    count = max(count, len(split_points) + (2 if tail else 1))  # an empty layer is refused below
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        part[n] = 0
    part[output] = count - 1

    # what each layer needs from before it (tensors only: sizes are read again, params fetched again)
    defined_at = {n: part[n] for n in nodes if n in part and n is not output}
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if n not in part:
            continue
        for a in n.all_input_nodes:
            if a.op == "get_attr" or _is_size(a):
                continue
            last_use[a] = max(last_use.get(a, -1), part[n])
    order = {n: k for k, n in enumerate(nodes)}
    crossing: list[list[fx.Node]] = []
    for k in range(count - 1):
        live = [a for a, end in last_use.items() if defined_at.get(a, count) <= k < end]
        crossing.append(sorted(live, key=order.__getitem__))

    layers: list[nn.Module] = []
    for k in range(count):
        members = [n for n in nodes if part.get(n) == k and n.op not in ("placeholder", "output")]
        if not members and k not in (0, count - 1):
            raise SpecError(f"{what}: layer {k} ({_name(k, split_points, tail)}) runs no operation; split points "
                            "must each begin a module the forward runs")
        inputs = placeholders if k == 0 else crossing[k - 1]
        outputs = output.args[0] if k == count - 1 else tuple(crossing[k])
        layers.append(_build_layer(gm, members, inputs, outputs, k == 0, what, names))
    labels = tuple(_name(k, split_points, tail) for k in range(count))
    shown = tuple(tuple((n.name, tuple(int(s) if isinstance(s, int) else -1 for s in _shape(n)), _dtype(n))
                        for n in live) for live in crossing)
    return TracedCut(layers, labels, shown, gm)


def _shape(n: fx.Node) -> tuple[Any, ...]:
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _dtype(n: fx.Node) -> str:
    val = n.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else type(val).__name__


def _name(k: int, split_points: Sequence[str], tail: bool) -> str:
    if k == 0:
        return "embed"
    if k <= len(split_points):
        return split_points[k - 1]
    return "head"


def _build_layer(gm: fx.GraphModule, members: list[fx.Node], inputs: Sequence[fx.Node], outputs: Any,
                 first: bool, what: str, names: dict[int, list[str]]) -> fx.GraphModule:
    """One layer of the cut as a GraphModule of its own: ``members`` (the traced graph's nodes of the layer)
    copied in order, fed by ``inputs`` (the model's inputs for the ``first`` layer, else the values that
    cross the cut before it), returning ``outputs``."""
    builder = _LayerBuilder(gm, members, inputs, first, what, names)
    for n in members:
        builder.copy(n)
    return builder.finish(outputs)


class _LayerBuilder:
    """Copies one layer's nodes of the traced graph into a graph of its own (``_build_layer``).

    ``env`` maps a node of the traced graph to its copy; what a copied node needs from outside the layer is
    brought in by ``lookup``: a parameter or buffer fetched again (``attr``) or a size read again from a
    tensor the layer holds (``size``); anything else that does not reach the layer is refused.
    """

    def __init__(self, gm: fx.GraphModule, members: list[fx.Node], inputs: Sequence[fx.Node], first: bool,
                 what: str, names: dict[int, list[str]]) -> None:
        self.gm, self.first, self.what, self.names = gm, first, what, names
        self.member_set = set(members)
        self.tensor_inputs = list(inputs)
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.attrs: dict[str, Any] = {}
        self.modes: dict[str, nn.Module] = {}
        self.where: fx.Node | None = None
        if first or len(inputs) == 1:  # the model's own inputs, or the one value that crosses
            for n in inputs:
                self.env[n] = self.graph.placeholder(n.name)
                self.env[n].meta = dict(n.meta)
        else:  # one argument, the tuple the layer before returned
            x = self.graph.placeholder("x")
            for k, n in enumerate(inputs):
                self.env[n] = self.graph.call_function(operator.getitem, (x, k))
                self.env[n].meta = dict(n.meta)

    def attr(self, n: fx.Node) -> fx.Node:
        """A parameter or buffer of the model, under its name in the model (``_own_name``)."""
        target = str(n.target)
        value = fetch(self.gm, target)
        name = _own_name(target[len(_ROOT) + 1:] if target.startswith(_ROOT + ".") else target,
                         self.names.get(id(value), []),
                         [p for u in n.users if u in self.member_set for p in _module_paths(u)])
        self.attrs[name] = value
        node = self.graph.get_attr(name)
        node.meta = dict(n.meta)
        return node

    def size(self, n: fx.Node) -> fx.Node:
        """A size from before this layer, computed again from a tensor the layer holds."""
        if n.target == torch.ops.aten.sym_size.int and not self.first:
            want = n.meta.get("val")
            for t in self.tensor_inputs:
                for d, s in enumerate(_shape(t)):
                    if _same_size(s, want):
                        node = self.graph.call_function(torch.ops.aten.sym_size.int, (self.env[t], d))
                        node.meta = dict(n.meta)
                        return node
            raise SpecError(f"{self.what}: a size ({want}) crosses a cut that no tensor of the next layer has; "
                            "choose other split points")
        return self.graph.node_copy(n, self.lookup)

    def lookup(self, a: fx.Node) -> fx.Node:
        """The copy of ``a`` in this layer, brought in if it is a parameter, a buffer or a size."""
        if a in self.env:
            return self.env[a]
        if a.op == "get_attr":
            self.env[a] = self.attr(a)
        elif _is_size(a):
            self.env[a] = self.size(a)
        else:
            raise SpecError(f"{self.what}: value {a.name} is needed by a layer it does not reach; choose other "
                            "split points")
        return self.env[a]

    def device(self) -> fx.Node:
        """The device of the layer's first input, read once: what a factory op creates its tensor on."""
        if self.where is None:
            first_input = next(iter(self.env.values()))
            with self.graph.inserting_after(first_input):
                self.where = self.graph.call_function(getattr, (first_input, "device"))
        return self.where

    def copy(self, n: fx.Node) -> None:
        """Copy member ``n``: a mode op (``_mode_op``) as a module call, a factory op onto the layer's device."""
        if n.op == "call_module":
            self.attrs[str(n.target)] = fetch(self.gm, str(n.target))
        mode = _mode_op(n) if n.op == "call_function" else None
        if mode is not None:
            name = f"mode_{len(self.modes)}"
            self.modes[name] = mode
            new = self.graph.call_module(name, tuple(fx.map_arg(n.args, self.lookup)),
                                         dict(fx.map_arg(n.kwargs, self.lookup)))
            new.meta = dict(n.meta)
            self.env[n] = new
        elif n not in self.env:
            copied = self.env[n] = self.graph.node_copy(n, self.lookup)
            if isinstance(copied.kwargs.get("device"), torch.device):  # a factory op (arange, ones): where the
                copied.kwargs = {**copied.kwargs, "device": self.device()}  # layer runs, not where it was traced

    def finish(self, outputs: Any) -> fx.GraphModule:
        """The layer's GraphModule returning ``outputs`` (one value, not a tuple of one), dead code removed."""
        if isinstance(outputs, tuple) and len(outputs) == 1:
            outputs = outputs[0]
        self.graph.output(fx.map_arg(outputs, self.lookup))
        self.graph.eliminate_dead_code(is_impure_node=lambda node: node.op == "call_module" or node.is_impure())
        return fx.GraphModule({**self.attrs, **self.modes}, self.graph, class_name="TracedLayer")


def _own_name(traced: str, known: list[str], paths: list[str]) -> str:
    """A tensor's name in a layer: of its names in the model (a tied one has several), the one under the module
    that uses it here (GPT-2's ``transformer.wte.weight`` in the embed layer, ``lm_head.weight`` in the head)."""
    for name in known:
        if name.rpartition(".")[0] in paths:
            return name
    return known[0] if known and traced not in known else traced


def bind(layer: nn.Module, model: nn.Module) -> fx.GraphModule:
    """``layer``'s graph over ``model``'s own parameters and buffers (by the names the trace gave them).

    What the model does not hold (a ``ModeOp``, a constant the trace made) is copied from ``layer``, so the
    new layer's mode and attributes are its own.
    """
    assert isinstance(layer, fx.GraphModule)
    attrs: dict[str, Any] = {}
    for node in layer.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        try:
            attrs[target] = fetch(model, target)
        except AttributeError:
            attrs[target] = copy.deepcopy(fetch(layer, target))
    graph = fx.Graph()
    graph.output(graph.graph_copy(layer.graph, {}))
    bound = fx.GraphModule(attrs, graph, class_name="TracedLayer")
    _keep_transient(bound, model)
    return bound


def _keep_transient(layer: nn.Module, model: nn.Module) -> None:
    """A buffer the model does not save (rotary ``inv_freq``) is not saved by the layer either."""
    for name, _ in list(layer.named_buffers()):
        path, _, leaf = name.rpartition(".")
        try:
            owner = model.get_submodule(path)
        except AttributeError:
            continue
        if leaf in owner._non_persistent_buffers_set:
            layer.get_submodule(path)._non_persistent_buffers_set.add(leaf)


def check_cut(cut: TracedCut, model: nn.Module, example: tuple[Any, ...], call: Callable[..., Any], what: str,
              rtol: float = 1e-5) -> None:
    """Run the chained layers on ``example`` next to the model's own forward, in eval mode; refuse a difference.

    Raises:
        SpecError: the outputs differ by more than ``rtol`` of their largest magnitude, naming the first
            layer whose output differs from the traced graph's, and by how much.
    """
    modes = [m.training for m in (model, *cut.layers)]
    for m in (model, *cut.layers):
        m.eval()
    try:
        with torch.no_grad():
            ref = _tensors(call(model, *example))
            out = _tensors(run_chain(cut.layers, example))
            diff, scale = _max_diff(ref, out)
            if diff <= rtol * scale:
                return
            where = _first_differing(cut, example, rtol)
    finally:
        for m, mode in zip((model, *cut.layers), modes, strict=True):
            m.train(mode)
    raise SpecError(f"{what}: the cut layers differ from the model's own forward by {diff:.3g} (of outputs up to "
                    f"{scale:.3g}); {where}")


def run_chain(layers: Sequence[nn.Module], example: tuple[Any, ...]) -> Any:
    """The layers chained on the model's inputs: the first takes them, each next one the output before it."""
    x = layers[0](*example)
    for layer in layers[1:]:
        x = layer(x)
    return x


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _max_diff(ref: list[torch.Tensor], out: list[torch.Tensor]) -> tuple[float, float]:
    if len(ref) != len(out) or any(a.shape != b.shape for a, b in zip(ref, out, strict=True)):
        return float("inf"), 1.0
    diff = max((float((a.double() - b.double()).abs().max()) for a, b in zip(ref, out, strict=True) if a.numel()),
               default=0.0)
    scale = max((float(a.double().abs().max()) for a in ref if a.numel()), default=0.0)
    return diff, max(scale, 1.0)


def _first_differing(cut: TracedCut, example: tuple[Any, ...], rtol: float) -> str:
    """Which layer's output first differs from the unsplit graph's values, or that the graph itself differs."""
    if cut.whole is None:
        return "the layer it starts in is not known"
    seen: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            seen[n.name] = value
            return value

    Recorder(cut.whole).run(*example)
    x: Any = example
    for k, layer in enumerate(cut.layers[:-1]):
        x = layer(*x) if k == 0 else layer(x)
        ref = [seen[name] for name, _, _ in cut.crossing[k]]
        diff, scale = _max_diff(_tensors(ref), _tensors(x))
        if diff > rtol * scale:
            return f"the first to differ is layer {k} ({cut.names[k]}), by {diff:.3g}"
    return ("its traced graph already differs: the forward does something a trace does not hold (randomness, "
            "Python state, or control flow on the data); pass its layers as a list instead")


def untie(layers: list[nn.Module], hf_names: dict[int, list[str]]) -> tuple[Tie, ...]:
    """Give each layer its own copy of a parameter it shares with an earlier layer; return the ties.

    ``hf_names`` (id of a parameter -> its names in the whole model) gets the copies' ids too.
    """
    first_seen: dict[int, tuple[int, str]] = {}
    ties: dict[int, list[tuple[int, str]]] = {}
    for k, layer in enumerate(layers):
        for name, p in list(layer.named_parameters(remove_duplicate=False)):
            owner = first_seen.setdefault(id(p), (k, name))
            if owner[0] == k:
                continue
            copy = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            path, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(path), leaf, copy)
            if id(p) in hf_names:
                hf_names[id(copy)] = hf_names[id(p)]
            ties.setdefault(id(p), [owner]).append((k, name))
    return tuple(tuple(group) for group in ties.values())


def fetch(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["ModeOp", "TracedCut", "Wrapped", "bind", "check_cut", "fetch", "repeated_blocks", "run_chain", "trace_cut",
           "untie"]

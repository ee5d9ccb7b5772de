"""A model by name or by spec: the reference models and the user's own, behind one ``ModelSource``.

``resolve_model(text)`` takes what ``--model`` takes:

- a reference model's name (``hetrain.models.registry``: ``gpt-tiny``, ``mlp-digits``, ...), with
  ``--set`` overrides as keyword arguments;
- ``hf:DIR``, a local Hugging Face causal LM (or masked-LM encoder) directory (``hetrain.models.hf``);
- ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION`` (``hetrain.models.spec``): a function of no
  arguments that returns the model as

  - an ``nn.Sequential`` whose forward is ``nn.Sequential``'s (its children are the layers),
  - an ``nn.ModuleList``, or a list or tuple of ``nn.Module`` (the layers, in forward order),
  - a module without children (one layer),
  - any other module with children: its ``forward`` may do anything with them (a residual sum,
    a scale, a reshape), so it is traced and cut by its graph (``hetrain.models.trace``), with
    ``example_input()`` from the same file giving one micro-batch; refused without it.

Layer ``k``'s output is passed, as one argument and unchanged, to layer ``k + 1``
(``hetrain.models.layers``). The loss is the function module's ``loss_fn(output, target)``
(the mean over the micro-batch) if it defines one, else ``torch.nn.functional.cross_entropy``.

Weights (DESIGN.md decision 6): a user's function builds the whole model at once, so it is
called with torch's CPU generator seeded with ``seed`` (``torch.manual_seed(seed); build()``,
the caller's random state restored after), and a stage keeps its layers' slice. Every rank
and every plan thus starts from the same weights, and stages name their parameters
``layers.{k}.<param>`` by global index as for the reference models. The function must be
deterministic under a seed (no reads of other random sources), and every rank builds the
whole model once on the CPU before keeping its stage.

Example:
    >>> source = resolve_model("examples/own_model/model.py:build")     # doctest: +SKIP
    >>> source.num_layers, source.layer_names[:2]                        # doctest: +SKIP
    (5, ('linear0', 'relu1'))
    >>> stage = source.build_layers(2, 5, seed=0)                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetrain.models.spec import SpecError, call_spec, is_user_spec, load_function

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BuildFn = Callable[[int, int, int], list[nn.Module]]

_HOW = "return an nn.Sequential or a list of layers (nn.Module) in forward order"


@dataclass(frozen=True)
class TokenLimits:
    """What a token model takes: ids below ``vocab``, at most ``max_positions`` tokens per sample.

    Attributes:
        vocab: its vocabulary size.
        max_positions: the most tokens per sample it takes.
        field: the config field that sets ``max_positions``: ``seq_len`` for hetrain's gpt models
            (``--set seq_len=N``), ``n_positions`` or ``max_position_embeddings`` in a config.json.
        default_seq_len: the length it runs at when none is given (a gpt model's ``seq_len``); None
            where it must be given (an ``hf:DIR`` model: its maximum is far too long to default to).
    """

    vocab: int
    max_positions: int
    field: str
    default_seq_len: int | None = None


@dataclass(frozen=True)
class ModelSource:
    """What the commands need of a model, wherever it comes from.

    Attributes:
        name: the reference model's name or the spec, as given.
        num_layers: its layer count.
        layer_names: one label per layer.
        loss_fn: ``loss_fn(output_of_last_layer, targets)``, the micro-batch's mean loss.
        preset: the reference model's name, or None for a user's model.
        config: the reference model's overrides (``--set``); empty for a user's model.
        tied: parameters that are one in the model, each layer holding its own copy: each tie is
            ``((layer, name in the layer), ...)``; their gradients are summed before every
            optimizer step (``hetrain.runtime.step.tied``). Only ``hf:DIR`` models have ties.
        tokens: for a token model (a reference gpt model, an ``hf:DIR`` model), its vocabulary and
            longest sample; None for any other (``hetrain.data.seq_len``).
        split_points: the module names a traced model was cut at where they were given (``--split-points``),
            recorded in the profile so that ``hetrain train`` cuts it alike; empty for the default cut.
        masked_lm: an ``hf:DIR`` encoder trained as a masked LM: its data's labels are its targets as they are
            (not shifted), and token windows, which have no masked positions, are refused for it.
    """

    name: str
    num_layers: int
    layer_names: tuple[str, ...]
    loss_fn: LossFn
    preset: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    tied: tuple[tuple[tuple[int, str], ...], ...] = ()
    tokens: TokenLimits | None = None
    split_points: tuple[str, ...] = ()
    masked_lm: bool = False
    _build: BuildFn | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_layers(cls, layers_fn: Callable[[int, int], list[nn.Module]], loss_fn: LossFn, num_layers: int, *,
                  name: str = "layers") -> ModelSource:
        """A model given as a function building its layers ``[first, end)`` (the Trainer's Python API).

        The function initialises the layers itself (the Trainer's ``config.seed`` is not passed to it); every
        rank must build the same weights.

        Example:
            >>> m = ModelSource.of_layers(lambda a, b: [nn.Linear(4, 4)] * (b - a), nn.functional.mse_loss, 2)
            >>> len(m.build_layers(0, 2))
            2
        """
        return cls(name, num_layers, tuple(f"layer {k}" for k in range(num_layers)), loss_fn,
                   _build=lambda first, end, seed: layers_fn(first, end))

    def build_layers(self, first: int = 0, end: int | None = None, seed: int = 0) -> list[nn.Module]:
        """Layers ``[first, end)`` (all by default) on the CPU, with the weights they have in the whole model."""
        end = self.num_layers if end is None else end
        if not 0 <= first < end <= self.num_layers:
            raise ValueError(f"layer range [{first}, {end}) is not a non-empty part of the {self.num_layers} "
                             f"layers [0, {self.num_layers}) of {self.name}")
        assert self._build is not None
        return self._build(first, end, seed)


def cut_layers(model: Any, spec: str) -> list[nn.Module] | None:
    """The layers of what a model function returned, in forward order, where its structure says them exactly;
    None for a module whose own ``forward`` must be traced to be cut (``trace_user_model``).

    An ``nn.Sequential`` (whose forward is ``nn.Sequential``'s own: it chains its children), an
    ``nn.ModuleList``, a list of modules, or a module without children is cut here.

    Raises:
        SpecError: not a module or a list of modules, an empty list, or a layer (or parameter) in two places.
    """
    what = f"model function {spec} returned"
    if (isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward) \
            or isinstance(model, nn.ModuleList):
        layers = list(model)
    elif isinstance(model, list | tuple):
        layers = list(model)
        for k, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise SpecError(f"{what} a {type(model).__name__} whose item {k} is a {type(layer).__name__}, "
                                f"not an nn.Module; {_HOW}")
    elif isinstance(model, nn.Module):
        if any(True for _ in model.children()):
            return None  # its forward may do anything with its children (a skip, a scale): traced
        layers = [model]
    else:
        raise SpecError(f"{what} a {type(model).__name__}, not a model; {_HOW}")
    if not layers:
        raise SpecError(f"{what} an empty {type(model).__name__}; {_HOW}")
    _check_unshared(layers, what)
    return layers


def user_split_points(model: nn.Module) -> tuple[list[str], bool]:
    """Where a user's module is cut by default: before each of its repeated blocks and after the last (``tail``),
    or, with none, before each of its children but the first."""
    from hetrain.models.trace import repeated_blocks

    blocks = repeated_blocks(model)
    if blocks:
        return blocks, True
    return [name for name, _ in model.named_children()][1:], False


def _check_unshared(layers: list[nn.Module], what: str) -> None:
    """Every layer and every parameter in one place: a stage owns its layers' parameters outright."""
    seen_layer: dict[int, int] = {}
    seen_param: dict[int, int] = {}
    for k, layer in enumerate(layers):
        if id(layer) in seen_layer:
            raise SpecError(f"{what} the same module as layers {seen_layer[id(layer)]} and {k}; hetrain gives "
                            "every layer its own parameters: build a new module for each place")
        seen_layer[id(layer)] = k
        for name, param in layer.named_parameters():
            first = seen_param.setdefault(id(param), k)
            if first != k:
                raise SpecError(f"{what} layers {first} and {k} sharing parameter {name!r} (tied weights); "
                                "hetrain gives every layer its own parameters")


def _layer_names(layers: list[nn.Module]) -> tuple[str, ...]:
    return tuple(f"{type(m).__name__.lower()}{k}" for k, m in enumerate(layers))


def _call_seeded(fn: Callable[[], Any], spec: str, seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return call_spec(spec, fn, "model function")


def _example_input(module: Any, spec: str) -> tuple[Any, ...]:
    """One micro-batch of the model's inputs, from ``example_input()`` beside the model function."""
    make = getattr(module, "example_input", None)
    where = spec.rpartition(":")[0]
    if make is None or not callable(make):
        raise SpecError(f"{spec}: its model is a module whose own forward hetrain traces to cut it; define "
                        f"example_input() in {where}, returning one micro-batch of its input (a tensor, as "
                        "torch.distributed.pipelining asks for mb_args)")
    x = call_spec(spec, make, "example_input of")
    inputs = x if isinstance(x, tuple) else (x,)
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise SpecError(f"{spec}: example_input() in {where} returned {describe_shapes(x)}; it must return one "
                        "tensor, the input of the model's forward")
    return inputs


def _user_loss(module: Any, spec: str) -> LossFn:
    loss = getattr(module, "loss_fn", None)
    if loss is None:
        return F.cross_entropy
    if not callable(loss):
        raise SpecError(f"{spec}: loss_fn in its module is a {type(loss).__name__}, not a function "
                        "loss_fn(output, target) -> mean loss")
    fn: LossFn = loss
    return fn


def _resolve_user(spec: str, split_points: Sequence[str] = ()) -> ModelSource:
    fn, module = load_function(spec)
    model = _call_seeded(fn, spec, 0)
    layers = cut_layers(model, spec)
    if layers is None:
        return _resolve_traced(spec, fn, module, model, split_points)
    if split_points:
        raise SpecError(f"--split-points: model function {spec} returns its layers (a list or an nn.Sequential), "
                        "cut as given; split points are for a module whose forward is traced")
    n = len(layers)

    def build(first: int, end: int, seed: int) -> list[nn.Module]:
        built = cut_layers(_call_seeded(fn, spec, seed), spec)
        if built is None or len(built) != n:
            raise SpecError(f"model function {spec} returned {n} layers, then {len(built or [])}: it must return "
                            "the same model every call")
        return built[first:end]

    return ModelSource(spec, n, _layer_names(layers), _user_loss(module, spec), _build=build)


def _resolve_traced(spec: str, fn: Callable[[], Any], module: Any, model: nn.Module,
                    split_points: Sequence[str] = ()) -> ModelSource:
    """A user's module cut by tracing its own forward (``hetrain.models.trace``), checked against that forward."""
    from hetrain.models.trace import bind, check_cut, trace_cut, untie

    example = _example_input(module, spec)
    points, tail = (list(split_points), False) if split_points else user_split_points(model)
    cut = trace_cut(model, example, points, what=f"model function {spec}", tail=tail)
    check_cut(cut, model, example, lambda m, *a: m(*a), f"model function {spec}")
    templates = cut.layers
    ties = untie([bind(t, model) for t in templates], {})
    names = tuple(f"{type(model).__name__.lower()}{k}" for k in range(len(templates)))

    def build(first: int, end: int, seed: int) -> list[nn.Module]:
        built = _call_seeded(fn, spec, seed)
        if type(built) is not type(model):
            raise SpecError(f"model function {spec} returned {type(model).__name__}, then {type(built).__name__}: "
                            "it must return the same model every call")
        layers: list[nn.Module] = [bind(t, built) for t in templates]
        untie(layers, {})
        return layers[first:end]

    return ModelSource(spec, len(templates), names, _user_loss(module, spec), tied=ties,
                       split_points=tuple(split_points), _build=build)


def _resolve_preset(name: str, config: dict[str, Any]) -> ModelSource:
    from hetrain.models import registry
    from hetrain.models.gpt import GPTConfig

    spec = registry.get_spec(name, **config)  # an unknown name or setting: ValueError naming it
    c = spec.config
    tokens = TokenLimits(c.vocab, c.seq_len, "seq_len", c.seq_len) if isinstance(c, GPTConfig) else None

    def build(first: int, end: int, seed: int) -> list[nn.Module]:
        return registry.build_layers(name, first, end, seed=seed, **config)

    return ModelSource(name, spec.num_layers, tuple(registry.layer_names(name, **config)), registry.loss_fn(name),
                       preset=name, config=dict(config), tokens=tokens, _build=build)


def resolve_model(text: str, split_points: Sequence[str] = (), **config: Any) -> ModelSource:
    """The model ``--model`` names: a reference model (``config``: its overrides) or ``MODULE:FUNCTION``.

    A user's function is loaded and called once here, so a model that cannot be used is refused
    before anything else runs.

    Raises:
        SpecError: a user's model that cannot be loaded, built or cut (the message says which and how).
        ValueError: an unknown reference model or setting.
    """
    if not is_user_spec(text):
        if split_points:
            raise SpecError(f"--split-points: {text} is a reference model, cut into its own layers")
        return _resolve_preset(text, config)
    if text.startswith("hf:"):  # a local Hugging Face model directory (hetrain.models.hf)
        from hetrain.models.hf import resolve_hf

        if config:
            raise SpecError(f"--set {', '.join(sorted(config))}: settings apply to reference models only; "
                            f"{text} is built from its config.json")
        hf = resolve_hf(text, split_points or None)
        field_name, most = hf.max_positions
        return ModelSource(text, hf.num_layers, hf.layer_names, hf.loss_fn, tied=hf.tied,
                           tokens=TokenLimits(hf.vocab, most, field_name), split_points=tuple(split_points),
                           masked_lm=hf.masked_lm, _build=hf.build)
    if config:
        raise SpecError(f"--set {', '.join(sorted(config))}: settings apply to reference models only; "
                        f"{text} is built by its own function")
    return _resolve_user(text, split_points)


def check_model_on_batch(source: ModelSource, inputs: Any, targets: Any, data_name: str) -> None:
    """Run ``inputs`` (a batch of a few samples) through the whole model and its loss, without gradients.

    For a user's model and data, whose shapes hetrain cannot know, so that a mismatch is named
    before any process group rather than as a failed forward on some rank mid-step. Builds the
    whole model once more (seed 0) on the CPU.

    Raises:
        SpecError: a layer or the loss fails on the batch (the layer's index and name, the shapes).
    """
    layers = source.build_layers(seed=0)
    x = inputs
    with torch.no_grad():
        for k, layer in enumerate(layers):
            try:
                x = layer(x)
            except Exception as e:  # the user's code and shapes: any error is theirs, named in one line
                raise SpecError(f"model {source.name} on data {data_name}: layer {k} ({source.layer_names[k]}) "
                                f"fails on input {describe_shapes(x)}: {describe_error(e)}") from e
        try:
            loss = source.loss_fn(x, targets)
        except Exception as e:  # the user's code and shapes: any error is theirs, named in one line
            raise SpecError(f"model {source.name} on data {data_name}: the loss fails on output {describe_shapes(x)} "
                            f"and target {describe_shapes(targets)}: {describe_error(e)}") from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SpecError(f"model {source.name}: its loss_fn returned {describe_shapes(loss)}, not one number (the "
                        "mean loss of the micro-batch)")


def describe_shapes(x: Any) -> str:
    """A layer's input or output in a few words: ``(2, 16) float32``, a tuple of them, or its type's name."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe_shapes(t) for t in x) + ")"
    return type(x).__name__


def describe_error(e: BaseException) -> str:
    """An error raised by a user's code, in one line: ``KeyError: 'x'``, its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


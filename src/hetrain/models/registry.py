"""Reference models by name: build any range of layers, the loss, a synthetic batch.

Every model is a list of layers (see ``hetrain.models.layers``); a name picks a
preset shape, and keyword arguments override its fields::

    >>> layers = build_layers("gpt-tiny", first=2, end=4, seed=0)   # two blocks
    >>> num_layers("gpt-tiny"), num_layers("gpt-tiny", n_blocks=8)
    (6, 10)
    >>> x, y = sample_batch("gpt-tiny", 8, torch.Generator().manual_seed(0))
    >>> x.shape, y.shape
    (torch.Size([8, 64]), torch.Size([8, 64]))

Layer ``k`` is built under its own seed (``layers.layer_seed(seed, k)``), so
``build_layers(name, a, b, seed)`` equals ``build_layers(name, seed=seed)[a:b]``
weight for weight.

| name           | kind   | layers | input                  | shape                                         |
| -------------- | ------ | ------ | ---------------------- | --------------------------------------------- |
| gpt-tiny       | gpt    | 6      | ids (B, 64), vocab 96  | 4 blocks, hidden 128, 4 heads                 |
| gpt2-small     | gpt    | 14     | ids (B, 1024)          | 12 blocks, hidden 768, 12 heads, vocab 50257  |
| gpt2-medium    | gpt    | 26     | ids (B, 1024)          | 24 blocks, hidden 1024, 16 heads              |
| gpt2-large     | gpt    | 38     | ids (B, 1024)          | 36 blocks, hidden 1280, 20 heads              |
| gpt2-xl        | gpt    | 50     | ids (B, 1024)          | 48 blocks, hidden 1600, 25 heads              |
| resnet-digits  | resnet | 6      | (B, 1, 8, 8)           | widths 16, 32; 2 + 2 blocks                   |
| resnet18-cifar | resnet | 10     | (B, 3, 32, 32)         | ResNet-18 layout, GroupNorm                   |
| vgg-digits     | vgg    | 6      | (B, 1, 8, 8)           | 4 convs, 1 hidden fc                          |
| vgg11-cifar    | vgg    | 11     | (B, 3, 32, 32)         | VGG-11 (configuration A), fc 512, 512         |
| mlp-digits     | mlp    | 3      | (B, 1, 8, 8)           | hidden 256, 256                               |
| mlp-cifar      | mlp    | 5      | (B, 3, 32, 32)         | hidden 2048 × 4                               |
| vgg19          | vgg    | 19     | (B, 3, 224, 224)       | VGG-19 (configuration E), 1000 classes        |
| resnet50       | resnet | 18     | (B, 3, 224, 224)       | bottleneck 3-4-6-3, BatchNorm, 1000 classes   |
| resnet101      | resnet | 35     | (B, 3, 224, 224)       | bottleneck 3-4-23-3, BatchNorm                |
| resnet152      | resnet | 52     | (B, 3, 224, 224)       | bottleneck 3-8-36-3, BatchNorm                |
| mlp            | mlp    | 5      | (B, 784)               | hidden 4096 × 4                               |

The last five match ``hetrain.models.analytic``'s models of the same names layer
by layer (names, parameters); their BatchNorm (ResNets) makes outputs depend on
how a batch is cut into micro-batches, so exact-equality tests use the others.
The GPT-2 presets have an untied LM head, as ``analytic``'s GPT-2 profiles of the
same names, and no dropout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hetrain.models.cnn import (
    ResNetConfig,
    VGGConfig,
    build_resnet_layer,
    build_vgg_layer,
    resnet_layer_names,
    vgg_layer_names,
)
from hetrain.models.gpt import GPTConfig, build_gpt_layer, gpt_layer_names
from hetrain.models.layers import build_range
from hetrain.models.mlp import MLPConfig, build_mlp_layer, mlp_layer_names

Kind = Literal["gpt", "resnet", "vgg", "mlp"]
Config = GPTConfig | ResNetConfig | VGGConfig | MLPConfig
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_GPT2 = {"seq_len": 1024, "vocab": 50257}  # GPT-2's context and BPE vocabulary (Radford et al. 2019, table 2)

# VGG-19 is configuration E of Simonyan and Zisserman 2015, table 1; ResNets: He et al. 2016, table 1.
_VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")
_RESNET_IMAGENET: dict[str, Any] = {"widths": (64, 128, 256, 512), "bottleneck": True, "stem": "imagenet",
                                    "norm": "batch", "image_size": 224, "classes": 1000}

PRESETS: dict[str, Config] = {
    "gpt-tiny": GPTConfig(n_blocks=4, hidden=128, heads=4, seq_len=64, vocab=96),
    "gpt2-small": GPTConfig(n_blocks=12, hidden=768, heads=12, **_GPT2),
    "gpt2-medium": GPTConfig(n_blocks=24, hidden=1024, heads=16, **_GPT2),
    "gpt2-large": GPTConfig(n_blocks=36, hidden=1280, heads=20, **_GPT2),
    "gpt2-xl": GPTConfig(n_blocks=48, hidden=1600, heads=25, **_GPT2),
    "resnet-digits": ResNetConfig(widths=(16, 32), blocks=(2, 2), channels=1, image_size=8),
    "resnet18-cifar": ResNetConfig(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2)),
    "vgg-digits": VGGConfig(convs=(32, 32, "M", 64, 64, "M"), fcs=(128,), channels=1, image_size=8),
    "vgg11-cifar": VGGConfig(convs=(64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")),
    "mlp-digits": MLPConfig(hidden=(256, 256)),
    "mlp-cifar": MLPConfig(hidden=(2048,) * 4, input_shape=(3, 32, 32)),
    # The published ImageNet models and the analytic profiles' MLP, layer for layer as in hetrain.models.analytic.
    "vgg19": VGGConfig(convs=_VGG19, fcs=(4096, 4096), image_size=224, classes=1000),
    "resnet50": ResNetConfig(blocks=(3, 4, 6, 3), **_RESNET_IMAGENET),
    "resnet101": ResNetConfig(blocks=(3, 4, 23, 3), **_RESNET_IMAGENET),
    "resnet152": ResNetConfig(blocks=(3, 8, 36, 3), **_RESNET_IMAGENET),
    "mlp": MLPConfig(hidden=(4096,) * 4, input_shape=(784,)),
}


@dataclass(frozen=True)
class ModelSpec:
    """A preset with its overrides applied: what ``build_layers`` builds."""

    name: str
    config: Config

    @property
    def kind(self) -> Kind:
        if isinstance(self.config, GPTConfig):
            return "gpt"
        if isinstance(self.config, ResNetConfig):
            return "resnet"
        if isinstance(self.config, VGGConfig):
            return "vgg"
        return "mlp"

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index``, drawn from torch's global generator (``build_layers`` seeds it)."""
        c = self.config
        if isinstance(c, GPTConfig):
            return build_gpt_layer(c, index)
        if isinstance(c, ResNetConfig):
            return build_resnet_layer(c, index)
        if isinstance(c, VGGConfig):
            return build_vgg_layer(c, index)
        return build_mlp_layer(c, index)


def model_names() -> list[str]:
    """Names of the preset models."""
    return list(PRESETS)


def get_spec(name: str, **config: Any) -> ModelSpec:
    """The preset ``name`` with fields overridden by ``config`` (lists become tuples).

    Raises:
        ValueError: unknown name, unknown field, or a shape the model cannot take.
    """
    if name not in PRESETS:
        import difflib

        if name.endswith(".py"):
            raise ValueError(f"unknown model {name!r}: your own model is FILE.py:FUNCTION, the function in the "
                             f"file that returns it (e.g. {name}:build; docs/own-model.md)")
        near = difflib.get_close_matches(name.strip().lower(), list(PRESETS), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise ValueError(f"unknown model {name!r}{hint}; known models: {', '.join(PRESETS)}, or your own as "
                         "FILE.py:FUNCTION or MODULE:FUNCTION")
    preset = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(preset)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(
            f"model {name!r} has no setting {', '.join(unknown)}; its settings: {', '.join(sorted(fields))}"
        )
    values = {f: getattr(preset, f) for f in fields}
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
    return ModelSpec(name, type(preset)(**values))


def num_layers(name: str, **config: Any) -> int:
    """How many layers model ``name`` has."""
    return get_spec(name, **config).num_layers


def layer_names(name: str, **config: Any) -> list[str]:
    """One label per layer, e.g. ``["embedding", "block0", ..., "head"]``."""
    c = get_spec(name, **config).config
    if isinstance(c, GPTConfig):
        return gpt_layer_names(c)
    if isinstance(c, ResNetConfig):
        return resnet_layer_names(c)
    if isinstance(c, VGGConfig):
        return vgg_layer_names(c)
    return mlp_layer_names(c)


def build_layers(name: str, first: int = 0, end: int | None = None, seed: int = 0, **config: Any) -> list[nn.Module]:
    """Layers ``[first, end)`` of model ``name`` (all of them by default), on the CPU, in float32.

    Layer ``k`` is initialised from ``layer_seed(seed, k)`` alone, so any range
    has the weights those layers have in the whole model. Wrap the result in
    ``LayerRange(layers, first)`` for parameters named ``layers.{k}.<param>``.

    Example:
        >>> full = build_layers("mlp-digits", seed=1)
        >>> part = build_layers("mlp-digits", 1, 3, seed=1)
        >>> bool(torch.equal(full[1][0].weight, part[0][0].weight))
        True
    """
    spec = get_spec(name, **config)
    n = spec.num_layers
    end = n if end is None else end
    if not 0 <= first < end <= n:
        raise ValueError(f"layer range [{first}, {end}) is not a non-empty part of the {n} layers [0, {n}) of {name!r}")
    return build_range(spec.build_layer, first, end, seed)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    # (B, T, V) and (B, T) -> (B·T, V) and (B·T,): one prediction per position
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def _class_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction=reduction)  # (B, classes) and (B,)


def loss_fn(name: str, reduction: Literal["mean", "sum"] = "mean") -> LossFn:
    """``loss(output_of_last_layer, targets)``: cross-entropy over the vocabulary or the classes.

    With ``reduction="mean"`` a GPT's loss is averaged over every position of
    every sequence; use ``"sum"`` to weight micro-batches by their size yourself.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    kind = get_spec(name).kind
    return functools.partial(_lm_loss if kind == "gpt" else _class_loss, reduction=reduction)


def input_shape(name: str, **config: Any) -> tuple[int, ...]:
    """Shape of one input sample, without the batch dimension: ``(seq_len,)`` or ``(C, H, W)``."""
    c = get_spec(name, **config).config
    if isinstance(c, GPTConfig):
        return (c.seq_len,)
    if isinstance(c, MLPConfig):
        return c.input_shape
    return (c.channels, c.image_size, c.image_size)


def sample_batch(name: str, batch_size: int, generator: torch.Generator | None = None,
                 **config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(inputs, targets)`` batch of the model's shapes and dtypes.

    GPT: int64 token ids ``(B, T)`` and the same sequences shifted by one as
    targets. Image models: float32 ``(B, *input_shape)`` from N(0, 1) and int64
    class labels ``(B,)``. Deterministic for a seeded ``generator``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    c = get_spec(name, **config).config
    if isinstance(c, GPTConfig):
        ids = torch.randint(0, c.vocab, (batch_size, c.seq_len + 1), generator=generator)  # (B, T + 1)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # (B, T), (B, T)
    x = torch.randn((batch_size, *input_shape(name, **config)), generator=generator)
    y = torch.randint(0, c.classes, (batch_size,), generator=generator)
    return x, y

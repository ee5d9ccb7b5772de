"""Layer lists: per-layer seeded construction and stages that keep global layer names.

A model here is a ``list[nn.Module]``; layer ``k``'s output is passed, as one
argument and unchanged, to layer ``k + 1`` (a tensor, or a tuple of tensors that
the next layer unpacks itself). A stage holds the layers ``[first, end)``.

Layer identity is global (DESIGN.md decision 6):

- every layer is built under its own seed, ``layer_seed(seed, k)``, so building
  only layers 5..9 gives exactly the weights that building the whole model gives
  those layers;
- a stage's parameters are named ``layers.{k}.<param>`` with the global index ``k``,
  so a checkpoint written under one plan loads under another.

Example:
    >>> import torch
    >>> layers = [build_seeded(lambda: torch.nn.Linear(4, 4), seed=0, index=k) for k in range(3)]
    >>> stage = LayerRange(layers[1:], first=1)
    >>> sorted(stage.state_dict())[:2]
    ['layers.1.bias', 'layers.1.weight']
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def layer_seed(seed: int, index: int) -> int:
    """The seed layer ``index`` of a model seeded ``seed`` is initialised from.

    A hash of both numbers, so that neighbouring layers and neighbouring model
    seeds get unrelated random streams (``seed + index`` would make layer 1 of
    seed 0 equal to layer 0 of seed 1).
    """
    if index < 0:
        raise ValueError(f"layer index must be >= 0, got {index}")
    digest = hashlib.blake2b(f"hetrain-layer:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid torch.manual_seed argument


def build_seeded(make: Callable[[], M], seed: int, index: int) -> M:
    """Call ``make()`` with torch's CPU generator seeded with ``layer_seed(seed, index)``.

    The CPU generator's state is restored afterwards and no CUDA generator is
    touched, so building a layer does not disturb the caller's randomness. Build
    layers on the CPU (a CUDA generator draws other numbers) and move them after.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(layer_seed(seed, index))
        return make()


def build_range(build_layer: Callable[[int], nn.Module], first: int, end: int, seed: int) -> list[nn.Module]:
    """``[build_layer(k) for k in range(first, end)]``, layer ``k`` built under ``layer_seed(seed, k)``."""
    return [build_seeded(functools.partial(build_layer, k), seed, k) for k in range(first, end)]


def param_bytes(layer: nn.Module) -> int:
    """A layer's parameters as it holds them, in bytes (``numel * element_size``): what a profile's
    ``param_bytes`` counts (docs/profile.md), and what ``hetrain train`` checks a model's layers against."""
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def run_layers(layers: Sequence[nn.Module], x: Any) -> Any:
    """Run ``x`` through ``layers`` in order: each output is the next layer's one argument."""
    for layer in layers:
        x = layer(x)
    return x


class LayerRange(nn.Module):
    """The layers ``[first, first + len(layers))`` of a model, named by global index.

    ``state_dict()`` keys and ``named_parameters()`` are ``layers.{k}.<param>``
    with the global layer index ``k``; ``forward`` runs the layers in order.

    Args:
        layers: the stage's layers, in model order.
        first: global index of ``layers[0]``.
    """

    def __init__(self, layers: Sequence[nn.Module], first: int = 0) -> None:
        super().__init__()
        if first < 0:
            raise ValueError(f"first layer index must be >= 0, got {first}")
        self.first = first
        self.end = first + len(layers)
        self.layers = nn.ModuleDict({str(first + k): layer for k, layer in enumerate(layers)})

    def forward(self, x: Any) -> Any:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, index: int) -> nn.Module:
        """Layer by global index."""
        if not self.first <= index < self.end:
            raise IndexError(f"layer {index} is not in this stage's range [{self.first}, {self.end})")
        return self.layers[str(index)]

    def extra_repr(self) -> str:
        return f"first={self.first}, end={self.end}"


def named_parameters_global(layers: Sequence[nn.Module], first: int = 0) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``layers``, named ``layers.{k}.<param>``.

    The same names as ``LayerRange(layers, first).named_parameters()``.
    """
    for k, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            yield f"layers.{first + k}.{name}", param

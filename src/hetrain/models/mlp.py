"""Multi-layer perceptron as a layer list: one layer per Linear (with its ReLU).

Input ``(B, *input_shape)``, flattened by the first layer; output logits ``(B, classes)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an MLP classifier."""

    hidden: tuple[int, ...]
    """Width of each hidden layer (the model has ``len(hidden) + 1`` layers)."""
    input_shape: tuple[int, ...] = (1, 8, 8)
    """Shape of one input sample, without the batch dimension."""
    classes: int = 10
    """Output classes."""

    def __post_init__(self) -> None:
        if any(w < 1 for w in self.hidden) or not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(f"MLP widths and input shape must be positive, got {self.hidden}, {self.input_shape}")
        if self.classes < 1:
            raise ValueError(f"MLP classes must be >= 1, got {self.classes}")

    @property
    def num_layers(self) -> int:
        return len(self.hidden) + 1


def build_mlp_layer(config: MLPConfig, index: int) -> nn.Module:
    """Layer ``index``: Linear + ReLU for the hidden layers, a bare Linear for the last."""
    widths = [math.prod(config.input_shape), *config.hidden, config.classes]
    if not 0 <= index < config.num_layers:
        raise IndexError(f"MLP has layers 0..{config.num_layers - 1}, not {index}")
    parts: list[nn.Module] = [nn.Flatten()] if index == 0 else []  # (B, *input_shape) -> (B, prod(input_shape))
    parts.append(nn.Linear(widths[index], widths[index + 1]))
    if index < len(config.hidden):
        parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def mlp_layer_names(config: MLPConfig) -> list[str]:
    return [f"fc{j}" for j in range(config.num_layers)]

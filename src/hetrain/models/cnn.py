"""Image classifiers as layer lists: ResNets and VGG-like CNNs.

Both take images ``(B, channels, size, size)`` and return logits ``(B, classes)``.
Layers are split and named as in ``hetrain.models.analytic``, so a measured
profile and an analytic one of the same model line up layer by layer.

ResNet (He et al. 2016): [stem, residual block × sum(blocks), head], one layer
per residual block, named ``stem``, ``layer{i}.{k}`` (block k of group i, from 1),
``head``. Basic blocks (two 3x3 convolutions) with a 3x3 stem for small images
(the CIFAR layout of the paper's section 4.2), or bottleneck blocks (1x1, 3x3
with the stride, 1x1 to 4x the width) with the 7x7/2 stem and 3x3/2 max-pool of
ImageNet (table 1). Normalisation is GroupNorm by default rather than BatchNorm:
BatchNorm's statistics depend on how a mini-batch is cut into micro-batches, so
pipeline and data-parallel training would not match single-process training;
GroupNorm works per sample. ``norm="batch"`` gives the published architecture.

VGG (Simonyan and Zisserman 2015): one layer per convolution (conv, ReLU and the
max-pool that follows it, if any), named ``conv{block}_{k}``, then one layer per
fully connected layer, ``fc{blocks + 1}`` onwards (VGG-19: fc6, fc7, fc8).
No dropout, for the same reason as GroupNorm above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

GROUPS = 8  # GroupNorm groups, or fewer when the channels are not divisible by 8
EXPANSION = 4  # a bottleneck block's output has 4x its width (He et al. 2016, table 1)


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a ResNet."""

    widths: tuple[int, ...]
    """Width of each group of blocks (a bottleneck block outputs 4x); each group after the first halves the image."""
    blocks: tuple[int, ...]
    """Residual blocks in each group (one layer each)."""
    channels: int = 3
    """Input image channels."""
    image_size: int = 32
    """Input image height and width."""
    classes: int = 10
    """Output classes."""
    bottleneck: bool = False
    """Bottleneck blocks (ResNet-50 and deeper) instead of basic blocks."""
    stem: Literal["small", "imagenet"] = "small"
    """``small``: 3x3 convolution; ``imagenet``: 7x7/2 convolution and 3x3/2 max-pool."""
    norm: Literal["group", "batch"] = "group"
    """GroupNorm (independent of micro-batching) or BatchNorm (the published models)."""

    def __post_init__(self) -> None:
        if not self.widths or len(self.widths) != len(self.blocks):
            raise ValueError(f"ResNet needs one block count per width, got widths {self.widths}, blocks {self.blocks}")
        if min(self.widths) < 1 or min(self.blocks) < 1:
            raise ValueError(f"ResNet widths and blocks must be >= 1, got {self.widths}, {self.blocks}")
        if self.stem not in ("small", "imagenet") or self.norm not in ("group", "batch"):
            raise ValueError(f"ResNet stem must be 'small' or 'imagenet' and norm 'group' or 'batch', "
                             f"got {self.stem!r}, {self.norm!r}")
        reduction = 2 ** (len(self.widths) - 1) * (4 if self.stem == "imagenet" else 1)
        if self.image_size < reduction:
            raise ValueError(f"ResNet reduces the image {reduction}x; image_size {self.image_size} is too small")
        _check_positive("ResNet", channels=self.channels, image_size=self.image_size, classes=self.classes)

    @property
    def num_layers(self) -> int:
        return sum(self.blocks) + 2

    @property
    def out_channels(self) -> int:
        return self.widths[-1] * (EXPANSION if self.bottleneck else 1)


@dataclass(frozen=True)
class VGGConfig:
    """Shape of a VGG-like CNN: 3x3 convolutions, max-pools, fully connected layers."""

    convs: tuple[int | str, ...]
    """Output channels of each convolution, ``"M"`` for a 2x2 max-pool after the one before."""
    fcs: tuple[int, ...] = (512, 512)
    """Widths of the hidden fully connected layers (the output layer is added)."""
    channels: int = 3
    """Input image channels."""
    image_size: int = 32
    """Input image height and width."""
    classes: int = 10
    """Output classes."""

    def __post_init__(self) -> None:
        if not self.convs or not isinstance(self.convs[0], int):
            raise ValueError(f"VGG convs must start with a convolution width, got {self.convs}")
        for a, b in zip(self.convs, self.convs[1:], strict=False):
            if a == "M" and b == "M":
                raise ValueError(f"VGG convs has two max-pools in a row: {self.convs}")
        for c in self.convs:
            if c != "M" and not (isinstance(c, int) and c >= 1):
                raise ValueError(f"VGG convs entries must be positive ints or 'M', got {c!r}")
        pools = self.convs.count("M")
        if self.image_size % 2**pools:
            raise ValueError(f"VGG image_size {self.image_size} is not divisible by 2^{pools} (its max-pools)")
        if any(w < 1 for w in self.fcs):
            raise ValueError(f"VGG fc widths must be >= 1, got {self.fcs}")
        _check_positive("VGG", channels=self.channels, image_size=self.image_size, classes=self.classes)

    @property
    def conv_widths(self) -> list[int]:
        return [c for c in self.convs if isinstance(c, int)]

    @property
    def num_layers(self) -> int:
        return len(self.conv_widths) + len(self.fcs) + 1


def _check_positive(model: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{model} {name} must be >= 1, got {value}")


def _norm(channels: int, kind: str = "group") -> nn.Module:
    return nn.GroupNorm(math.gcd(channels, GROUPS), channels) if kind == "group" else nn.BatchNorm2d(channels)


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=kernel, stride=stride, padding=kernel // 2, bias=False)


class ResidualBlock(nn.Module):
    """``relu(body(x) + shortcut(x))``; the shortcut is ``x``, or a strided 1x1 projection.

    Basic body: conv3x3(stride)-norm-ReLU-conv3x3-norm. Bottleneck body:
    conv1x1-norm-ReLU-conv3x3(stride)-norm-ReLU-conv1x1(4x)-norm (the stride on
    the 3x3, as torchvision's ResNet "v1.5" and the analytic profile).
    """

    def __init__(self, c_in: int, width: int, stride: int, bottleneck: bool, norm: str) -> None:
        super().__init__()
        c_out = width * EXPANSION if bottleneck else width
        if bottleneck:
            self.body = nn.Sequential(
                _conv(c_in, width, 1), _norm(width, norm), nn.ReLU(),
                _conv(width, width, 3, stride), _norm(width, norm), nn.ReLU(),
                _conv(width, c_out, 1), _norm(c_out, norm),
            )
        else:
            self.body = nn.Sequential(
                _conv(c_in, c_out, 3, stride), _norm(c_out, norm), nn.ReLU(),
                _conv(c_out, c_out, 3), _norm(c_out, norm),
            )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                                          _norm(c_out, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, c_in, H, W) -> (B, c_out, H / stride, W / stride)
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet_block_shapes(config: ResNetConfig) -> list[tuple[int, int, int]]:
    """``(c_in, width, stride)`` of every residual block, in order."""
    shapes = []
    c_in = config.widths[0]
    for g, (width, count) in enumerate(zip(config.widths, config.blocks, strict=True)):
        for b in range(count):
            stride = 2 if g > 0 and b == 0 else 1
            shapes.append((c_in, width, stride))
            c_in = width * EXPANSION if config.bottleneck else width
    return shapes


def build_resnet_layer(config: ResNetConfig, index: int) -> nn.Module:
    """Layer ``index``: 0 the stem, then one residual block each, last the pooled classifier."""
    n_blocks = sum(config.blocks)
    c0, norm = config.widths[0], config.norm
    if index == 0:
        if config.stem == "imagenet":  # (B, C, H, W) -> (B, c0, H / 4, W / 4)
            return nn.Sequential(_conv(config.channels, c0, 7, 2), _norm(c0, norm), nn.ReLU(),
                                 nn.MaxPool2d(3, stride=2, padding=1))
        return nn.Sequential(_conv(config.channels, c0, 3), _norm(c0, norm), nn.ReLU())
    if index <= n_blocks:
        c_in, width, stride = resnet_block_shapes(config)[index - 1]
        return ResidualBlock(c_in, width, stride, config.bottleneck, norm)
    if index == n_blocks + 1:
        # (B, C, H, W) -> (B, C) -> (B, classes)
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(config.out_channels, config.classes))
    raise IndexError(f"ResNet has layers 0..{config.num_layers - 1}, not {index}")


def resnet_layer_names(config: ResNetConfig) -> list[str]:
    """``["stem", "layer1.0", "layer1.1", ..., "head"]`` (torchvision's block names)."""
    blocks = [f"layer{g}.{k}" for g, count in enumerate(config.blocks, start=1) for k in range(count)]
    return ["stem", *blocks, "head"]


def vgg_conv_shapes(config: VGGConfig) -> list[tuple[int, int, bool]]:
    """``(c_in, c_out, pooled)`` of every convolution, in order; ``pooled``: a max-pool follows."""
    shapes: list[tuple[int, int, bool]] = []
    c_in = config.channels
    for pos, entry in enumerate(config.convs):
        if isinstance(entry, int):
            pooled = pos + 1 < len(config.convs) and config.convs[pos + 1] == "M"
            shapes.append((c_in, entry, pooled))
            c_in = entry
    return shapes


def build_vgg_layer(config: VGGConfig, index: int) -> nn.Module:
    """Layer ``index``: one per convolution (with its pool), then one per fully connected layer."""
    convs = config.conv_widths
    if 0 <= index < len(convs):
        c_in, c_out, pooled = vgg_conv_shapes(config)[index]
        parts: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]
        if pooled:
            parts.append(nn.MaxPool2d(2))
        return nn.Sequential(*parts)
    fc = index - len(convs)
    side = config.image_size // 2 ** config.convs.count("M")
    widths = [convs[-1] * side * side, *config.fcs, config.classes]
    if fc == 0:  # (B, C, H, W) -> (B, C·H·W) -> (B, fcs[0])
        first: list[nn.Module] = [nn.Flatten(), nn.Linear(widths[0], widths[1])]
        return nn.Sequential(*first, nn.ReLU()) if config.fcs else nn.Sequential(*first)
    if 0 < fc < len(widths) - 1:
        linear = nn.Linear(widths[fc], widths[fc + 1])
        return nn.Sequential(linear, nn.ReLU()) if fc < len(config.fcs) else linear
    raise IndexError(f"VGG has layers 0..{config.num_layers - 1}, not {index}")


def vgg_layer_names(config: VGGConfig) -> list[str]:
    """``conv{block}_{k}`` per convolution (a block ends at a max-pool), then ``fc{blocks + 1}``...

    VGG-19: ``conv1_1 .. conv5_4, fc6, fc7, fc8``, the names of the paper and the analytic profile.
    """
    names, block, k = [], 1, 0
    for entry in config.convs:
        if entry == "M":
            block, k = block + 1, 0
        else:
            k += 1
            names.append(f"conv{block}_{k}")
    first_fc = block if config.convs[-1] == "M" else block + 1
    return [*names, *(f"fc{first_fc + j}" for j in range(len(config.fcs) + 1))]

"""Analytic model profiles: FLOPs and bytes from the architecture, no torch, no timing.

Each ``build_*`` function returns a :class:`~hetrain.profile.ModelProfile` whose
layers carry parameter bytes, forward FLOPs, output bytes and saved-activation
bytes per sample, computed from the layer shapes. No layer has measured times:
``hetrain.cost`` turns FLOPs and bytes into seconds by roofline, scaled by the
profile's ``compute_efficiency``.

Conventions used in every family:

- **FLOPs** are matrix-multiply / convolution FLOPs, 2 per multiply-accumulate.
  Element-wise work (norms, activations, softmax, pooling, residual adds) is not
  counted: it is memory-bound and the roofline's bytes term and the efficiency
  factor absorb it (the same choice as Narayanan et al. 2021, appendix).
- **saved bytes** of a layer = its input + the tensors created inside it that its
  backward reads. Its own output, where backward reads it (a final ReLU), is the
  next layer's input (the same storage) and is counted there, as Korthikanti et al.
  2022 count a transformer block's input and not its output. A dropout mask is a
  bool tensor, 1 byte per element; max-pool indices are int64.
- **bytes per element** ``e`` of activations follows ``precision``: 4 for fp32, 2 for fp16/bf16.
  The model input is counted in the training precision (GPT: int64 token ids).
  Parameters are counted in fp32 (``PARAM_BYTES``) whatever the precision: training keeps
  them there and computes in 16 bits under autocast (``hetrain.amp``).

Layer granularity (what a stage boundary may cut between):

    GPT     [embed] [block0] ... [block{L-1}] [head = final LN + LM head]
    VGG-19  [conv1_1] [conv1_2+pool] ... [conv5_4+pool] [fc6] [fc7] [fc8]   (19 layers)
    ResNet  [stem = conv7x7+BN+ReLU+maxpool] [layer1.0] ... [layer4.{n-1}] [head = avgpool+fc]
    MLP     [fc0] ... [fc{n-1}]    (Linear+ReLU; the last one a plain Linear)

Example:
    >>> from hetrain.models.analytic import build_profile
    >>> p = build_profile("gpt2-small")
    >>> p.num_layers, round(p.param_bytes / 2 / 1e6)
    (14, 124)
    >>> build_profile("gpt2-small", seq_len=512).layers[1].forward_flops_per_sample > 0
    True
"""

from __future__ import annotations

import difflib
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal

from hetrain.models.analytic_figures import (
    INT64_BYTES,
    MASK_BYTES,
    PARAM_BYTES,
    TRANSFORMER_EFFICIENCY,
    _bytes_per_element,
    _check_efficiency,
)
from hetrain.models.hf_analytic import build_hf_profile
from hetrain.profile import LayerProfile, ModelProfile, Precision, TPSplit

# Convnets: early convolutions have few channels and huge activations, and the
# BN / ReLU / pooling passes (not in the FLOP count) take a large share of a step,
# so they sit well below transformers. A rough figure; measuring replaces it.
CONVNET_EFFICIENCY = 0.35
# MLPs: chains of plain GEMMs, close to transformer blocks without attention.
MLP_EFFICIENCY = 0.5


class UnknownModelError(KeyError):
    """A model name not in the registry; the message suggests near names and lists all."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ---------------------------------------------------------------------------
# checks and small helpers
# ---------------------------------------------------------------------------


def _check_positive(**values: int) -> None:
    """ValueError naming the first value that is not a positive integer."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")




def _conv_out(size: int, k: int, stride: int, pad: int) -> int:
    """Output side of a convolution or pooling: ``floor((n + 2p - k) / s) + 1``."""
    return (size + 2 * pad - k) // stride + 1


def _conv_params(k: int, cin: int, cout: int, bias: bool) -> int:
    """Weights ``k*k*Cin*Cout`` (+ ``Cout`` biases)."""
    return k * k * cin * cout + (cout if bias else 0)


def _conv_flops(k: int, cin: int, cout: int, h_out: int, w_out: int) -> int:
    """``2 * k*k*Cin * Cout * H_out*W_out``: one MAC per weight per output pixel."""
    return 2 * k * k * cin * cout * h_out * w_out


# ---------------------------------------------------------------------------
# GPT
# ---------------------------------------------------------------------------


def gpt_block_params(hidden: int) -> int:
    """Parameters of one GPT-2 block: ``12h^2 + 13h``.

    attention: QKV ``3h^2 + 3h``, output projection ``h^2 + h``; MLP: ``h -> 4h``
    ``4h^2 + 4h``, ``4h -> h`` ``4h^2 + h``; two LayerNorms ``2 * 2h``.
    """
    h = hidden
    return (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h


def gpt_block_flops(hidden: int, seq_len: int) -> int:
    """Forward FLOPs of one GPT block for one sample: ``24 s h^2 + 4 s^2 h``.

    Narayanan et al. 2021, "Efficient large-scale language model training on GPU
    clusters using Megatron-LM", sec. 5.1 (F = 96 B s l h^2 (1 + s/6h + V/16lh) for
    forward + backward = 3x forward): QKV ``6 s h^2``, scores Q K^T ``2 s^2 h``,
    A V ``2 s^2 h``, projection ``2 s h^2``, MLP ``16 s h^2``.
    """
    s, h = seq_len, hidden
    return 24 * s * h * h + 4 * s * s * h


def gpt_block_saved_bytes(hidden: int, heads: int, seq_len: int, bytes_per_element: int) -> int:
    """Activation bytes one GPT block keeps for backward, per sample.

    Korthikanti et al. 2022, "Reducing activation recomputation in large transformer
    models", sec. 4.1: ``s h (34 + 5 a s / h)`` bytes in 16-bit, without tensor or
    sequence parallelism. Split by element type, per sample:

        16-bit tensors ``16 s h`` elements  (LN inputs 2, QKV input 1, Q and K 2, V 1,
                                             projection input 1, MLP 1 + 4 + 4)
        dropout masks  ``2 s h`` bytes      (attention output, MLP output)
        scores         ``2 a s^2`` elements (softmax output, dropout output)
        score mask     ``a s^2`` bytes      (attention dropout)

    so with ``e`` bytes per element: ``s h (16 e + 2) + a s^2 (2 e + 1)``; e = 2 gives
    the paper's 34 and 5, fp32 (e = 4) gives ``s h (66 + 9 a s / h)``. Fused
    attention (FlashAttention) keeps no ``s^2`` term; this is the unfused upper bound.
    """
    s, h, a, e = seq_len, hidden, heads, bytes_per_element
    return s * h * (16 * e + 2 * MASK_BYTES) + a * s * s * (2 * e + MASK_BYTES)


def gpt_block_tp_split(hidden: int, heads: int, seq_len: int, bytes_per_element: int) -> TPSplit:
    """How one GPT block splits over a TP group (Megatron-LM: Shoeybi et al. 2019, sec. 3).

    Column-parallel QKV and MLP up-projection (weights and biases split), row-parallel output projection and
    MLP down-projection (weights split, biases whole), attention by heads; the two LayerNorms whole.
    Split: ``12h^2 + 7h`` parameters, every matmul FLOP, and of the saved activations (Korthikanti et al. 2022,
    sec. 4.2: ``s h (10 + 24/t + 5 a s / (h t))`` in 16-bit) the ``12 s h`` elements and the scores; whole: the
    LN inputs and the inputs of the column-parallel matmuls (``4 s h`` elements) and the two dropout masks.
    Forward all-reduces the attention and MLP outputs: two of ``s h`` elements.
    """
    s, h, a, e = seq_len, hidden, heads, bytes_per_element
    return TPSplit(split_param_bytes=float((12 * h * h + 7 * h) * PARAM_BYTES),
                   split_flops_per_sample=float(gpt_block_flops(h, s)),
                   split_saved_bytes_per_sample=float(12 * s * h * e + a * s * s * (2 * e + MASK_BYTES)),
                   allreduce_bytes_per_sample=float(2 * s * h * e), allreduces=2)


def build_gpt_profile(num_layers: int, hidden: int, heads: int, seq_len: int, vocab: int,
                      precision: Precision = "fp16", name: str | None = None, *,
                      tie_embeddings: bool = True,
                      compute_efficiency: float = TRANSFORMER_EFFICIENCY) -> ModelProfile:
    """A GPT-style decoder (GPT-2 layout, pre-LN blocks, MLP width 4h) as a layer list.

    Layers: ``embed`` (token + position embedding), ``block0 .. block{L-1}``, ``head``
    (final LayerNorm + LM head, no bias). With ``tie_embeddings`` the LM head reuses
    the token embedding matrix (GPT-2): its parameters are counted once, in ``embed``,
    so totals match the published sizes; a plan that puts ``embed`` and ``head`` on
    different stages then holds a second copy the profile does not show. Without it
    the head owns its own ``V x h`` matrix.

    Args:
        num_layers: transformer blocks ``L``.
        hidden: width ``h``; must be divisible by ``heads``.
        heads: attention heads ``a``.
        seq_len: tokens per sample ``s`` (also the number of position embeddings).
        vocab: vocabulary size ``V``.
        precision: training precision; sets bytes per element.
        name: profile name (default ``"gpt-L{L}-h{h}"``).
        tie_embeddings: share the embedding matrix with the LM head.
        compute_efficiency: fraction of the roofline peak reached.

    Example:
        >>> p = build_gpt_profile(2, 64, 4, 32, 100, precision="fp32", tie_embeddings=False)
        >>> [layer.name for layer in p.layers]
        ['embed', 'block0', 'block1', 'head']
    """
    _check_positive(num_layers=num_layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)
    if hidden % heads:
        raise ValueError(f"heads ({heads}) must divide hidden ({hidden}), remainder {hidden % heads}")
    e = _bytes_per_element(precision)
    _check_efficiency(compute_efficiency)
    s, h, a, V = seq_len, hidden, heads, vocab
    activation = s * h * e  # (s, h) hidden states: what crosses every boundary but the last

    # token table (V, h) + position table (s, h); lookup and add: no matmul FLOPs.
    # Backward scatters gradients by token id, so it keeps only the ids (s,) int64.
    embed = LayerProfile(
        name="embed",
        param_bytes=float((V * h + s * h) * PARAM_BYTES),
        output_bytes_per_sample=float(activation),
        saved_bytes_per_sample=float(s * INT64_BYTES),
        forward_flops_per_sample=0.0,
    )
    block_params = gpt_block_params(h)
    blocks = [
        LayerProfile(
            name=f"block{k}",
            param_bytes=float(block_params * PARAM_BYTES),
            output_bytes_per_sample=float(activation),
            saved_bytes_per_sample=float(gpt_block_saved_bytes(h, a, s, e)),
            forward_flops_per_sample=float(gpt_block_flops(h, s)),
            tp=gpt_block_tp_split(h, a, s, e),
        )
        for k in range(num_layers)
    ]
    # final LN (2h) + LM head (h, V) without bias; logits (s, V).
    # FLOPs: 2 s h V (Narayanan et al. 2021: the V/(16 l h) term of F, forward part).
    # Saved: LN input (s, h), head input (s, h), and the log-softmax of the loss
    # (s, V), which autocast computes in fp32 whatever the training precision.
    head_params = 2 * h + (0 if tie_embeddings else h * V)
    head = LayerProfile(
        name="head",
        param_bytes=float(head_params * PARAM_BYTES),
        output_bytes_per_sample=float(s * V * e),
        saved_bytes_per_sample=float(2 * s * h * e + s * V * 4),
        forward_flops_per_sample=float(2 * s * h * V),
    )
    return ModelProfile(
        name=name if name is not None else f"gpt-L{num_layers}-h{hidden}",
        layers=(embed, *blocks, head),
        input_bytes_per_sample=float(s * INT64_BYTES),  # (s,) int64 token ids
        precision=precision,
        compute_efficiency=compute_efficiency,
    )


# ---------------------------------------------------------------------------
# VGG-19
# ---------------------------------------------------------------------------

# Simonyan & Zisserman 2015, "Very deep convolutional networks for large-scale image
# recognition", table 1, configuration E: conv 3x3 widths per block; "M" = 2x2 max-pool.
VGG19_CONFIG: tuple[tuple[int, ...], ...] = ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)
VGG_POOLED_SIDE = 7  # adaptive average pool to 7x7 before fc6 (torchvision's VGG)


def build_vgg19_profile(image_size: int = 224, batch_norm: bool = False, num_classes: int = 1000,
                        precision: Precision = "fp32", *,
                        compute_efficiency: float = CONVNET_EFFICIENCY) -> ModelProfile:
    """VGG-19 (configuration E) as 19 layers, one per weight layer.

    A layer is a 3x3 convolution (padding 1, bias) + [BatchNorm] + ReLU, with the
    block's 2x2 max-pool folded into the block's last convolution (so a stage
    boundary after it sends the pooled, 4x smaller tensor); then ``fc6`` (adaptive
    average pool to 7x7 + Linear 25088->4096 + ReLU + dropout), ``fc7`` (4096->4096
    + ReLU + dropout) and ``fc8`` (4096->classes). Parameters: 143.67M at 1000 classes.

    Args:
        image_size: input side (square); at least 32 (five 2x2 pools).
        batch_norm: BatchNorm after each convolution (VGG-19-BN: +2 params per channel).
        num_classes: outputs of fc8.
        precision: training precision.
        compute_efficiency: fraction of the roofline peak reached.

    Example:
        >>> p = build_vgg19_profile()
        >>> p.num_layers, round(p.param_bytes / 4 / 1e6, 1)
        (19, 143.7)
    """
    _check_positive(image_size=image_size, num_classes=num_classes)
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32 for VGG-19's five 2x2 pools, got {image_size}")
    e = _bytes_per_element(precision)
    _check_efficiency(compute_efficiency)
    layers: list[LayerProfile] = []
    cin, side = 3, image_size
    for block, widths in enumerate(VGG19_CONFIG, start=1):
        for k, cout in enumerate(widths, start=1):
            pooled = k == len(widths)
            pixels = side * side  # 3x3, stride 1, padding 1: (cout, side, side) out
            params = _conv_params(3, cin, cout, bias=True) + (2 * cout if batch_norm else 0)
            saved = cin * pixels * e  # conv input (cin, side, side)
            if batch_norm:
                saved += cout * pixels * e  # BN input = conv output (cout, side, side)
            out_side = side
            if pooled:
                out_side = _conv_out(side, 2, 2, 0)
                # ReLU output = max-pool input (cout, side, side) + int64 indices at pooled size
                saved += cout * pixels * e + cout * out_side * out_side * INT64_BYTES
            layers.append(LayerProfile(
                name=f"conv{block}_{k}",
                param_bytes=float(params * PARAM_BYTES),
                output_bytes_per_sample=float(cout * out_side * out_side * e),
                saved_bytes_per_sample=float(saved),
                forward_flops_per_sample=float(_conv_flops(3, cin, cout, side, side)),
            ))
            cin, side = cout, out_side
    flat = cin * VGG_POOLED_SIDE * VGG_POOLED_SIDE  # (512, 7, 7) -> 25088
    fc_shapes = ((flat, 4096), (4096, 4096), (4096, num_classes))
    for k, (n_in, n_out) in enumerate(fc_shapes):
        last = k == len(fc_shapes) - 1
        saved = n_in * e  # Linear input
        if k == 0:
            saved += cin * side * side * e  # adaptive average pool input (512, side, side)
        if not last:
            saved += n_out * e + n_out * MASK_BYTES  # ReLU output + dropout mask
        layers.append(LayerProfile(
            name=f"fc{6 + k}",
            param_bytes=float((n_in * n_out + n_out) * PARAM_BYTES),
            output_bytes_per_sample=float(n_out * e),
            saved_bytes_per_sample=float(saved),
            forward_flops_per_sample=float(2 * n_in * n_out),
        ))
    return ModelProfile(
        name="vgg19-bn" if batch_norm else "vgg19",
        layers=tuple(layers),
        input_bytes_per_sample=float(3 * image_size * image_size * e),  # (3, H, W) image
        precision=precision,
        compute_efficiency=compute_efficiency,
    )


# ---------------------------------------------------------------------------
# ResNet (bottleneck)
# ---------------------------------------------------------------------------

# He et al. 2016, "Deep residual learning for image recognition", table 1: bottleneck
# blocks per stage. Stride 2 sits on the 3x3 convolution (torchvision's "v1.5").
RESNET_BLOCKS: dict[int, tuple[int, int, int, int]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
RESNET_WIDTHS = (64, 128, 256, 512)  # bottleneck width per stage; output is 4x
RESNET_EXPANSION = 4


def _bottleneck(cin: int, width: int, stride: int, side: int, e: int, name: str) -> tuple[LayerProfile, int]:
    """One bottleneck block: 1x1 (cin->w), 3x3 (w->w, stride), 1x1 (w->4w), BN after each,
    ReLU after the first two and after the residual add; a 1x1 stride-s projection + BN
    on the shortcut when the shape changes. No conv biases. Returns (layer, output side).
    """
    cout = width * RESNET_EXPANSION
    out = _conv_out(side, 3, stride, 1)
    a_in, a_mid, a_out = side * side, out * out, out * out
    params = (_conv_params(1, cin, width, False) + 2 * width
              + _conv_params(3, width, width, False) + 2 * width
              + _conv_params(1, width, cout, False) + 2 * cout)
    flops = (_conv_flops(1, cin, width, side, side)
             + _conv_flops(3, width, width, out, out)
             + _conv_flops(1, width, cout, out, out))
    # input x (cin, side, side), shared by conv1, the shortcut and the add;
    # conv1 out = BN1 in, ReLU1 out = conv2 in: (w, side, side) each;
    # conv2 out = BN2 in, ReLU2 out = conv3 in: (w, out, out) each; conv3 out = BN3 in (4w, out, out).
    saved = cin * a_in + 2 * width * a_in + 2 * width * a_mid + cout * a_out
    if stride != 1 or cin != cout:
        params += _conv_params(1, cin, cout, False) + 2 * cout
        flops += _conv_flops(1, cin, cout, out, out)
        saved += cout * a_out  # projection out = its BN's input (4w, out, out)
    return LayerProfile(
        name=name,
        param_bytes=float(params * PARAM_BYTES),
        output_bytes_per_sample=float(cout * a_out * e),
        saved_bytes_per_sample=float(saved * e),
        forward_flops_per_sample=float(flops),
    ), out


def build_resnet_profile(depth: int = 50, image_size: int = 224, num_classes: int = 1000,
                         precision: Precision = "fp32", *,
                         compute_efficiency: float = CONVNET_EFFICIENCY) -> ModelProfile:
    """A bottleneck ResNet (50, 101 or 152) as a layer list: stem, one layer per block, head.

    ``stem``: 7x7/2 convolution 3->64 + BN + ReLU + 3x3/2 max-pool; ``layer{i}.{k}``:
    the k-th bottleneck block of stage i (torchvision's names); ``head``: global
    average pool + Linear 2048->classes. Parameters: 25.56M (50), 44.55M (101),
    60.19M (152) at 1000 classes.

    Args:
        depth: 50, 101 or 152.
        image_size: input side (square); at least 32 (total stride 32).
        num_classes: outputs of the final Linear.
        precision: training precision.
        compute_efficiency: fraction of the roofline peak reached.

    Example:
        >>> p = build_resnet_profile(50)
        >>> p.num_layers, round(p.param_bytes / 4 / 1e6, 1)
        (18, 25.6)
    """
    if depth not in RESNET_BLOCKS:
        raise ValueError(f"depth must be one of {sorted(RESNET_BLOCKS)}, got {depth!r}")
    _check_positive(image_size=image_size, num_classes=num_classes)
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32 for ResNet's total stride of 32, got {image_size}")
    e = _bytes_per_element(precision)
    _check_efficiency(compute_efficiency)

    conv_side = _conv_out(image_size, 7, 2, 3)  # (64, H/2, W/2)
    side = _conv_out(conv_side, 3, 2, 1)  # after max-pool: (64, H/4, W/4)
    conv_px, pool_px = conv_side * conv_side, side * side
    stem = LayerProfile(
        name="stem",
        param_bytes=float((_conv_params(7, 3, 64, False) + 2 * 64) * PARAM_BYTES),
        output_bytes_per_sample=float(64 * pool_px * e),
        # image (3, H, W) + BN input and ReLU output (64, H/2, W/2) + int64 pool indices
        saved_bytes_per_sample=float(3 * image_size**2 * e + 2 * 64 * conv_px * e + 64 * pool_px * INT64_BYTES),
        forward_flops_per_sample=float(_conv_flops(7, 3, 64, conv_side, conv_side)),
    )
    layers = [stem]
    cin = 64
    for i, (blocks, width) in enumerate(zip(RESNET_BLOCKS[depth], RESNET_WIDTHS, strict=True), start=1):
        for k in range(blocks):
            stride = 2 if k == 0 and i > 1 else 1
            layer, side = _bottleneck(cin, width, stride, side, e, f"layer{i}.{k}")
            layers.append(layer)
            cin = width * RESNET_EXPANSION
    layers.append(LayerProfile(
        name="head",
        param_bytes=float((cin * num_classes + num_classes) * PARAM_BYTES),
        output_bytes_per_sample=float(num_classes * e),
        # average-pool input (2048, side, side) + Linear input (2048,)
        saved_bytes_per_sample=float(cin * side * side * e + cin * e),
        forward_flops_per_sample=float(2 * cin * num_classes),
    ))
    return ModelProfile(
        name=f"resnet{depth}",
        layers=tuple(layers),
        input_bytes_per_sample=float(3 * image_size * image_size * e),  # (3, H, W) image
        precision=precision,
        compute_efficiency=compute_efficiency,
    )


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------

DEFAULT_MLP_SIZES = (784, 4096, 4096, 4096, 4096, 10)


def build_mlp_profile(sizes: Sequence[int] = DEFAULT_MLP_SIZES, precision: Precision = "fp32", *,
                      name: str = "mlp", compute_efficiency: float = MLP_EFFICIENCY) -> ModelProfile:
    """A multilayer perceptron: layer k is Linear(sizes[k] -> sizes[k+1]) + ReLU.

    The last layer is a plain Linear (its output is the logits). Per layer:
    parameters ``n_in n_out + n_out``, FLOPs ``2 n_in n_out``, saved the Linear
    input ``n_in`` elements (the ReLU output is the next layer's input).

    Example:
        >>> [layer.forward_flops_per_sample for layer in build_mlp_profile([4, 8, 2]).layers]
        [64.0, 32.0]
    """
    if isinstance(sizes, (str, bytes)) or len(sizes) < 2:
        raise ValueError(f"sizes needs at least 2 entries (input and output), got {sizes!r}")
    for k, n in enumerate(sizes):
        _check_positive(**{f"sizes[{k}]": n})
    e = _bytes_per_element(precision)
    _check_efficiency(compute_efficiency)
    layers = tuple(
        LayerProfile(
            name=f"fc{k}",
            param_bytes=float((n_in * n_out + n_out) * PARAM_BYTES),
            output_bytes_per_sample=float(n_out * e),
            saved_bytes_per_sample=float(n_in * e),
            forward_flops_per_sample=float(2 * n_in * n_out),
        )
        for k, (n_in, n_out) in enumerate(itertools.pairwise(sizes))
    )
    return ModelProfile(
        name=name,
        layers=layers,
        input_bytes_per_sample=float(sizes[0] * e),
        precision=precision,
        compute_efficiency=compute_efficiency,
    )


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------

# untied, as the GPT-2 models hetrain trains (``hetrain.models.registry``): the head holds its own V x h
# matrix, so plans count the memory the run takes (a tied head holds a copy too in hetrain's runtime,
# which sums the copies' gradients, ``hetrain.runtime.step.tied``, as Megatron-LM does on its last stage);
# ``build_profile("gpt2-small", tie_embeddings=True)`` counts the published sizes (124M, 355M, ...)
_GPT2 = {"seq_len": 1024, "vocab": 50257, "precision": "fp16", "tie_embeddings": False}

# Llama 2 (Touvron et al. 2023, "Llama 2: open foundation and fine-tuned chat models", table 1: context 4096; the
# sizes as in the published config.json of Llama-2-7b-hf and Llama-2-13b-hf), read by the same path as any
# transformers config.json (``hetrain.models.hf_analytic``): RMSNorm, SwiGLU, rotary positions, untied head.
_LLAMA2 = {"model_type": "llama", "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False}
LLAMA2_7B_CONFIG: dict[str, Any] = {**_LLAMA2, "hidden_size": 4096, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008}
LLAMA2_13B_CONFIG: dict[str, Any] = {**_LLAMA2, "hidden_size": 5120, "num_hidden_layers": 40,
                                     "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824}


def build_config_profile(config: dict[str, Any], seq_len: int | None = None, precision: Precision = "bf16",
                         name: str | None = None, *, attention: Literal["fused", "eager"] = "fused",
                         compute_efficiency: float = TRANSFORMER_EFFICIENCY) -> ModelProfile:
    """A transformers decoder's profile from its config.json fields (``hf_analytic.build_hf_profile``).

    Example:
        >>> build_config_profile(LLAMA2_7B_CONFIG, seq_len=2048).num_layers
        34
    """
    return build_hf_profile(config, seq_len, precision, name, attention=attention,
                            compute_efficiency=compute_efficiency)


# name -> (builder, its arguments). GPT-2 sizes: Radford et al. 2019, table 2
# (the 117M/345M/762M/1542M of the paper are 124M/355M/774M/1558M when counted exactly).
_PRESETS: dict[str, tuple[Callable[..., ModelProfile], dict[str, Any]]] = {
    # the char-level model trained on CPU: untied head (each layer its own module and seed)
    "gpt-tiny": (build_gpt_profile, {"num_layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 96,
                                     "precision": "fp32", "tie_embeddings": False}),
    "gpt2-small": (build_gpt_profile, {"num_layers": 12, "hidden": 768, "heads": 12, **_GPT2}),
    "gpt2-medium": (build_gpt_profile, {"num_layers": 24, "hidden": 1024, "heads": 16, **_GPT2}),
    "gpt2-large": (build_gpt_profile, {"num_layers": 36, "hidden": 1280, "heads": 20, **_GPT2}),
    "gpt2-xl": (build_gpt_profile, {"num_layers": 48, "hidden": 1600, "heads": 25, **_GPT2}),
    # GPT-3 2.7B (Brown et al. 2020, table 2.1: 32 layers, d_model 2560, 32 heads, context 2048; GPT-2's layout
    # and vocabulary, sec. 2.1), dense attention throughout (GPT-3's alternating locally banded layers are not
    # modelled); its head tied as published (2.65e9 parameters): nothing hetrain trains holds a second copy of it
    "gpt-2.7b": (build_gpt_profile, {"num_layers": 32, "hidden": 2560, "heads": 32, "seq_len": 2048,
                                     "vocab": 50257, "precision": "fp16", "tie_embeddings": True}),
    "llama2-7b": (build_config_profile, {"config": LLAMA2_7B_CONFIG}),
    "llama2-13b": (build_config_profile, {"config": LLAMA2_13B_CONFIG}),
    "vgg19": (build_vgg19_profile, {}),
    "resnet50": (build_resnet_profile, {"depth": 50}),
    "resnet101": (build_resnet_profile, {"depth": 101}),
    "resnet152": (build_resnet_profile, {"depth": 152}),
    "mlp": (build_mlp_profile, {}),
}
MODEL_NAMES: tuple[str, ...] = tuple(_PRESETS)


def build_profile(name: str, **overrides: Any) -> ModelProfile:
    """The analytic profile of a named model, with any builder argument overridden.

    Args:
        name: one of ``MODEL_NAMES`` (case-insensitive).
        **overrides: arguments of the family's ``build_*`` function, e.g.
            ``seq_len=512``, ``precision="fp32"``, ``compute_efficiency=0.3``.

    Raises:
        UnknownModelError: (a KeyError) unknown name, with near names and the list.
        ValueError: an override the builder does not take, or a bad value.

    Example:
        >>> build_profile("resnet50", image_size=112).name
        'resnet50'
        >>> build_profile("gpt2-small", precision="fp32").precision
        'fp32'
    """
    key = name.strip().lower()
    if key not in _PRESETS:
        near = difflib.get_close_matches(key, MODEL_NAMES, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
        raise UnknownModelError(f"unknown model {name!r}{hint}; known models: {', '.join(MODEL_NAMES)}")
    builder, args = _PRESETS[key]
    accepted = list(inspect.signature(builder).parameters)
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(f"model {key!r} takes no option {', '.join(repr(u) for u in unknown)}; "
                         f"its options: {', '.join(accepted)}")
    kwargs = {**args, **overrides}
    if "name" in accepted:
        kwargs.setdefault("name", key)
    return builder(**kwargs)

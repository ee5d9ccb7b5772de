"""Analytic profiles of transformers decoders from their config.json: FLOPs and bytes, no torch, no weights.

``hetrain plan --model hf:DIR`` plans from this profile: the config is read as JSON and the model is never
built, so a 70B model's config plans on a laptop. The layers are those hetrain's cut of the same config gives
(``hetrain.models.hf``), so a measured profile (``hetrain profile --model hf:DIR``) lines up with it layer by
layer::

    embed     token table (+ position table: GPT-2, OPT) (+ OPT's project_in)
    block1 .. blockL    one decoder block each
    head      final norm (+ OPT's project_out) + LM head (its own copy of a tied table, as the cut holds one)

Families (``model_type``): ``llama`` (Llama 1, 2, 3), ``mistral``, ``qwen2``, ``gpt_neox``, ``opt``, ``gpt2``.
Each family's optional fields take transformers' defaults for that class (``tie_word_embeddings``,
``attention_bias``, ``num_key_value_heads``, ...); its sizes must be in the file.

Conventions are ``hetrain.models.analytic``'s: parameters fp32 (``PARAM_BYTES``), activations ``e`` bytes by the
precision, matmul FLOPs only (Narayanan et al. 2021), saved bytes as Korthikanti et al. 2022 count them (sec. 4.1),
generalised to grouped-query attention (Ainslie et al. 2023: K and V of ``g`` heads), SwiGLU MLPs (Shazeer 2020:
gate, up and down; Touvron et al. 2023, sec. 2.2), biases where the family has them, learned position tables
(GPT-2, OPT) or rotary positions (no table; Su et al. 2021), GPT-NeoX's parallel attention and MLP (Black et al.
2022, sec. 2.1.1) and Mistral's sliding window (Jiang et al. 2023, sec. 2: attention FLOPs over ``min(s, W)`` keys
per query). Attention is ``fused`` by default (transformers' default SDPA kernel, FlashAttention: Dao et al. 2022,
which keeps the output and the row log-sum-exp, no ``s x s`` matrix), or ``eager`` (the unfused upper bound of
Korthikanti et al., the full ``s x s`` scores, masked where a window applies).

Example:
    >>> raw = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...        "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 32}
    >>> p = build_hf_profile(raw, seq_len=16)
    >>> [layer.name for layer in p.layers], hf_param_count(read_hf_shape(raw))
    (['embed', 'block1', 'block2', 'head'], 95040)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hetrain.models.analytic_figures import (
    INT64_BYTES,
    MASK_BYTES,
    PARAM_BYTES,
    TRANSFORMER_EFFICIENCY,
    _bytes_per_element,
    _check_efficiency,
)
from hetrain.models.spec import SpecError
from hetrain.profile import LayerProfile, ModelProfile, Precision, TPSplit

HF_PREFIX = "hf:"
Mlp = Literal["swiglu", "gelu", "relu"]
Attention = Literal["fused", "eager"]
ATTENTIONS: tuple[Attention, ...] = ("fused", "eager")
LSE_BYTES = 4  # FlashAttention's row log-sum-exp, fp32 per query and head (Dao et al. 2022, algorithm 2)
LOSS_BYTES = 4  # the loss's log-softmax of the logits: autocast computes it in fp32


def is_hf_spec(text: str) -> bool:
    """Whether ``--model`` names a local Hugging Face directory (``hf:DIR``)."""
    return text.startswith(HF_PREFIX)


@dataclass(frozen=True)
class DecoderShape:
    """What the profile needs of a decoder's config, read and checked (``read_hf_shape``).

    Attributes:
        family: the config's ``model_type``.
        hidden, num_layers, heads, kv_heads, head_dim, intermediate, vocab: the sizes ``h, L, a, g, d, I, V``.
        max_positions: ``(field, value)``: the config field bounding the tokens per sample.
        mlp: ``swiglu`` (gate, up, down), ``gelu`` or ``relu`` (up, down).
        norm_params: parameters of one norm: ``h`` (RMSNorm), ``2h`` (LayerNorm), 0 (no affine).
        qkv_bias, o_bias, mlp_bias: which linears have biases.
        position_rows: rows of a learned position table (0: rotary).
        embed_dim: width of the token table and LM head (OPT's ``word_embed_proj_dim``; else ``h``).
        final_norm: a norm after the last block.
        tied: the LM head shares the token table (``tie_word_embeddings``).
        parallel_residual: attention and MLP read the same input and are added once (GPT-NeoX).
        windows: per block, its sliding window, or None (full attention).
        attention_dropout, residual_dropout, embed_dropout: which dropouts have p > 0 (they keep masks).
    """

    family: str
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: tuple[str, int]
    mlp: Mlp
    norm_params: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    position_rows: int = 0
    embed_dim: int = 0
    final_norm: bool = True
    tied: bool = False
    parallel_residual: bool = False
    windows: tuple[int | None, ...] = ()
    attention_dropout: bool = False
    residual_dropout: bool = False
    embed_dropout: bool = False


# ---------------------------------------------------------------------------
# reading config.json
# ---------------------------------------------------------------------------

_REQUIRED = object()


class _Fields:
    """A config.json's fields, each read once with its check; errors name the file, the field and the value."""

    def __init__(self, raw: Mapping[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def _fail(self, key: str, why: str) -> SpecError:
        value = json.dumps(self.raw[key]) if key in self.raw else "missing"
        return SpecError(f"{self.where}: {key} is {value}; {why}")

    def _get(self, key: str, default: Any, what: str) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _REQUIRED:
            raise self._fail(key, f"a {self.raw.get('model_type')} config.json gives it ({what})")
        return default

    def count(self, key: str, default: Any = _REQUIRED, what: str = "a whole number >= 1") -> int:
        value = self._get(key, default, what)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._fail(key, f"it must be a whole number >= 1 ({what})")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default, "true or false")
        if not isinstance(value, bool):
            raise self._fail(key, "it must be true or false")
        return value

    def dropout(self, key: str, default: float) -> bool:
        """Whether a dropout probability is above 0 (the layer then keeps a mask)."""
        value = self._get(key, default, "a probability")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise self._fail(key, "it must be a probability in [0, 1)")
        return value > 0

    def choice(self, key: str, default: str, choices: Mapping[str, Mlp]) -> Mlp:
        value = self._get(key, default, "an activation")
        if value not in choices:
            raise self._fail(key, f"hetrain's analytic profile knows {', '.join(sorted(choices))}")
        return choices[value]


def _heads(f: _Fields, hidden: int, kv_default: int | None) -> tuple[int, int, int]:
    """``(a, g, d)``: attention heads, key/value heads (GQA: Ainslie et al. 2023) and head width."""
    heads = f.count("num_attention_heads", what="the number of attention heads")
    kv = f.count("num_key_value_heads", kv_default if kv_default is not None else heads, "the key/value heads")
    if heads % kv:
        raise f._fail("num_key_value_heads", f"it must divide num_attention_heads ({heads})")
    if "head_dim" not in f.raw or f.raw["head_dim"] is None:
        if hidden % heads:
            raise f._fail("num_attention_heads", f"it must divide hidden_size ({hidden}) where head_dim is not given")
        return heads, kv, hidden // heads
    return heads, kv, f.count("head_dim", what="the width of one attention head")


def _sizes(f: _Fields, layers_key: str = "num_hidden_layers", hidden_key: str = "hidden_size") -> tuple[int, int, int]:
    return (f.count(hidden_key, what="the width of the hidden states"),
            f.count(layers_key, what="the number of blocks"), f.count("vocab_size", what="the vocabulary size"))


def _read_llama_like(f: _Fields, family: str) -> DecoderShape:
    """Llama, Mistral, Qwen2: RMSNorm, SwiGLU, rotary positions; their biases and windows differ."""
    h, n, vocab = _sizes(f)
    # num_key_value_heads' default: Mistral's 8, Qwen2's 32, Llama's num_attention_heads (their config classes)
    heads, kv, d = _heads(f, h, {"mistral": 8, "qwen2": 32}.get(family))
    windows: tuple[int | None, ...] = (None,) * n
    qkv_bias = o_bias = mlp_bias = False
    if family == "llama":
        qkv_bias = o_bias = f.flag("attention_bias", False)
        mlp_bias = f.flag("mlp_bias", False)
    elif family == "mistral":
        # MistralConfig's sliding_window defaults to 4096; null in the file turns it off (Mistral 7B v0.2 on)
        off = "sliding_window" in f.raw and f.raw["sliding_window"] is None
        windows = (None if off else f.count("sliding_window", 4096, "the sliding window"),) * n
    else:  # qwen2: biased q, k, v (Bai et al. 2023, sec. 2.2); a window only with use_sliding_window
        qkv_bias = True
        windows = _qwen2_windows(f, n)
    return DecoderShape(
        family, h, n, heads, kv, d, f.count("intermediate_size", what="the MLP width"), vocab,
        ("max_position_embeddings", f.count("max_position_embeddings", what="the longest sample")),
        "swiglu", h, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, embed_dim=h,
        tied=f.flag("tie_word_embeddings", False), windows=windows,
        attention_dropout=f.dropout("attention_dropout", 0.0))


def _qwen2_windows(f: _Fields, n: int) -> tuple[int | None, ...]:
    """Qwen2's sliding window per layer, as its config class decides: ``layer_types`` where given, else blocks
    from ``max_window_layers`` on where ``use_sliding_window`` is set."""
    if not f.flag("use_sliding_window", False):
        return (None,) * n
    window = f.count("sliding_window", 4096, "the sliding window")
    types = f.raw.get("layer_types")
    if types is None:
        first = f.count("max_window_layers", 28, "the first windowed block")
        return tuple(window if k >= first else None for k in range(n))
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise f._fail("layer_types", f"it must list {n} of 'sliding_attention' or 'full_attention'")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _read_gpt_neox(f: _Fields, family: str) -> DecoderShape:
    """GPT-NeoX (Black et al. 2022): LayerNorm, fused QKV with biases, GeLU MLP with biases, rotary positions."""
    h, n, vocab = _sizes(f)
    heads = f.count("num_attention_heads", what="the number of attention heads")
    if h % heads:
        raise f._fail("num_attention_heads", f"it must divide hidden_size ({h})")
    bias = f.flag("attention_bias", True)
    return DecoderShape(
        family, h, n, heads, heads, h // heads, f.count("intermediate_size", what="the MLP width"), vocab,
        ("max_position_embeddings", f.count("max_position_embeddings", what="the longest sample")),
        "gelu", 2 * h, qkv_bias=bias, o_bias=bias, mlp_bias=True, embed_dim=h,
        tied=f.flag("tie_word_embeddings", False), windows=(None,) * n,
        parallel_residual=f.flag("use_parallel_residual", True),
        attention_dropout=f.dropout("attention_dropout", 0.0), residual_dropout=f.dropout("hidden_dropout", 0.0),
        embed_dropout=f.dropout("hidden_dropout", 0.0))


def _read_opt(f: _Fields, family: str) -> DecoderShape:
    """OPT (Zhang et al. 2022): LayerNorm, biased linears, ReLU MLP of ``ffn_dim``, a learned position table with
    2 extra rows (transformers' OPTLearnedPositionalEmbedding offset), projections where the token table is
    narrower than the blocks (``word_embed_proj_dim``)."""
    h, n, vocab = _sizes(f)
    heads = f.count("num_attention_heads", what="the number of attention heads")
    if h % heads:
        raise f._fail("num_attention_heads", f"it must divide hidden_size ({h})")
    bias = f.flag("enable_bias", True)
    positions = f.count("max_position_embeddings", what="the longest sample")
    final = f.flag("do_layer_norm_before", True) and not f.flag("_remove_final_layer_norm", False)
    return DecoderShape(
        family, h, n, heads, heads, h // heads, f.count("ffn_dim", what="the MLP width"), vocab,
        ("max_position_embeddings", positions),
        f.choice("activation_function", "relu", {"relu": "relu", "gelu": "gelu"}),
        2 * h if f.flag("layer_norm_elementwise_affine", True) else 0, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        position_rows=positions + 2, embed_dim=f.count("word_embed_proj_dim", h, "the token table's width"),
        final_norm=final, tied=f.flag("tie_word_embeddings", True), windows=(None,) * n,
        attention_dropout=f.dropout("attention_dropout", 0.0), residual_dropout=f.dropout("dropout", 0.1))


def _read_gpt2(f: _Fields, family: str) -> DecoderShape:
    """GPT-2 (Radford et al. 2019): LayerNorm, biased linears, GeLU MLP (``n_inner``, default 4h), a learned
    position table of ``n_positions`` rows, tied LM head, dropout after the embeddings, scores and residuals."""
    h, n, vocab = _sizes(f, "n_layer", "n_embd")
    heads = f.count("n_head", what="the number of attention heads")
    if h % heads:
        raise f._fail("n_head", f"it must divide n_embd ({h})")
    positions = f.count("n_positions", what="the longest sample")
    return DecoderShape(
        family, h, n, heads, heads, h // heads, f.count("n_inner", 4 * h, "the MLP width"), vocab,
        ("n_positions", positions), "gelu", 2 * h, qkv_bias=True, o_bias=True, mlp_bias=True,
        position_rows=positions, embed_dim=h, tied=f.flag("tie_word_embeddings", True), windows=(None,) * n,
        attention_dropout=f.dropout("attn_pdrop", 0.1), residual_dropout=f.dropout("resid_pdrop", 0.1),
        embed_dropout=f.dropout("embd_pdrop", 0.1))


_READERS: dict[str, Callable[[_Fields, str], DecoderShape]] = {
    "llama": _read_llama_like, "mistral": _read_llama_like, "qwen2": _read_llama_like,
    "gpt_neox": _read_gpt_neox, "opt": _read_opt, "gpt2": _read_gpt2,
}
HF_FAMILIES: tuple[str, ...] = tuple(_READERS)


def read_hf_shape(config: Mapping[str, Any], where: str = "config.json") -> DecoderShape:
    """The decoder shape of a config.json's fields (a dict as ``json.load`` gives it).

    Raises:
        SpecError: an unknown ``model_type``, a missing size, or a value of the wrong kind, in one line naming
            ``where`` (the file), the field and the value.
    """
    family = config.get("model_type")
    if family not in _READERS:
        raise SpecError(f"{where}: model_type is {json.dumps(family) if family is not None else 'missing'}; "
                        f"hetrain's analytic profile knows {', '.join(HF_FAMILIES)} (measure another model: "
                        "hetrain profile --model hf:DIR)")
    return _READERS[str(family)](_Fields(config, where), str(family))


def load_hf_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """``(fields, file)`` of a model directory's config.json (or of the file itself): JSON only, no weights.

    Raises:
        SpecError: no such directory or file, or a file that is not a JSON object (naming it).
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SpecError(f"{file} does not exist (hf:DIR takes a transformers model directory with config.json)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SpecError(f"{file} cannot be read as JSON: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    if not isinstance(raw, dict):
        raise SpecError(f"{file} is not a JSON object, got {type(raw).__name__}")
    return raw, str(file)


# ---------------------------------------------------------------------------
# figures per layer
# ---------------------------------------------------------------------------


def block_params(m: DecoderShape) -> tuple[int, int]:
    """``(all, split)`` parameters of one decoder block; ``split``: what Megatron's TP divides (Shoeybi et al.
    2019, sec. 3): the column-parallel Q, K, V and MLP up (and gate) projections with their biases, the
    row-parallel output and down projections without theirs; norms and the row-parallel biases are whole."""
    h, q, kv, inner = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.intermediate
    column = h * (q + 2 * kv) + (q + 2 * kv if m.qkv_bias else 0)
    ups = 2 if m.mlp == "swiglu" else 1  # SwiGLU: gate and up (Shazeer 2020)
    column += ups * (h * inner + (inner if m.mlp_bias else 0))
    row = q * h + inner * h
    whole = 2 * m.norm_params + (h if m.o_bias else 0) + (h if m.mlp_bias else 0)
    return column + row + whole, column + row


def block_flops(m: DecoderShape, seq_len: int, window: int | None) -> int:
    """Forward matmul FLOPs of one block for one sample (all of them split under TP).

    Narayanan et al. 2021, sec. 5.1, with ``a d`` query and ``g d`` key/value widths: Q, K, V ``2 s h (a d + 2 g d)``,
    scores and A V ``2 * 2 s s' a d`` with ``s' = min(s, W)`` keys per query under a window (Jiang et al. 2023),
    output projection ``2 s a d h``, MLP ``2 s h I`` per matrix (3 for SwiGLU, 2 otherwise). GPT-2 shapes give
    ``24 s h^2 + 4 s^2 h``.
    """
    s, h = seq_len, m.hidden
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    keys = s if window is None else min(s, window)
    matrices = 3 if m.mlp == "swiglu" else 2
    return 2 * s * h * (q + 2 * kv) + 4 * s * keys * q + 2 * s * q * h + matrices * 2 * s * h * m.intermediate


def block_saved_bytes(m: DecoderShape, seq_len: int, e: int, attention: Attention) -> tuple[int, int]:
    """``(all, split)`` activation bytes one block keeps for backward, per sample.

    Korthikanti et al. 2022, sec. 4.1, element by element (GPT-2 shapes, eager: ``s h (34 + 5 a s / h)`` at e = 2):
    whole on every TP rank (sec. 4.2): the norms' inputs (one when attention and MLP read the same input, GPT-NeoX's
    parallel residual), the inputs of the column-parallel Q K V and MLP up, the residual dropout masks; split: Q
    (``a d``), K and V (``g d`` each), the output projection's input (``a d``), the MLP's inner tensors (GeLU: its
    input and output, ``2 I``; ReLU: its output, ``I``; SwiGLU: gate, SiLU output, up, product, ``4 I``) and the
    attention's own: eager, the softmax output ``a s^2`` (+ dropout output and mask); fused, the log-sum-exp.
    """
    s, h = seq_len, m.hidden
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    norms = 1 if m.parallel_residual else 2
    whole = s * (norms + 2) * h * e + (2 * s * h * MASK_BYTES if m.residual_dropout else 0)
    inner = {"swiglu": 4, "gelu": 2, "relu": 1}[m.mlp] * m.intermediate
    split = s * (2 * q + 2 * kv + inner) * e
    if attention == "eager":  # the s x s scores (masked, not skipped, where a window applies)
        split += m.heads * s * s * (e + ((e + MASK_BYTES) if m.attention_dropout else 0))
    else:
        split += m.heads * s * LSE_BYTES
    return whole + split, split


def _embed_layer(m: DecoderShape, s: int, e: int) -> LayerProfile:
    """Token table ``(V, p)`` (+ position table, + ``project_in`` ``p x h``): lookups, no FLOPs but OPT's
    projection; backward keeps the ids ``(s,)`` int64 (+ the projection's input, + the dropout mask)."""
    h, p = m.hidden, m.embed_dim
    project = p != h
    params = m.vocab * p + m.position_rows * h + (p * h if project else 0)
    saved = s * INT64_BYTES + (s * p * e if project else 0) + (s * h * MASK_BYTES if m.embed_dropout else 0)
    return LayerProfile(name="embed", param_bytes=float(params * PARAM_BYTES), output_bytes_per_sample=float(s * h * e),
                        saved_bytes_per_sample=float(saved),
                        forward_flops_per_sample=float(2 * s * p * h if project else 0))


def _head_layer(m: DecoderShape, s: int, e: int) -> LayerProfile:
    """Final norm (+ ``project_out`` ``h x p``) + LM head ``(p, V)`` without bias; its own ``V x p`` matrix also
    where tied (the cut's head holds a copy, ``hetrain.models.hf``). FLOPs ``2 s p V`` (+ ``2 s h p``); saved:
    the norm's, the projection's and the head's inputs, and the loss's log-softmax ``(s, V)`` in fp32."""
    h, p, V = m.hidden, m.embed_dim, m.vocab
    project = p != h
    params = (m.norm_params if m.final_norm else 0) + (h * p if project else 0) + V * p
    saved = s * e * ((h if m.final_norm else 0) + (h if project else 0) + p) + s * V * LOSS_BYTES
    flops = 2 * s * p * V + (2 * s * h * p if project else 0)
    return LayerProfile(name="head", param_bytes=float(params * PARAM_BYTES),
                        output_bytes_per_sample=float(s * V * e), saved_bytes_per_sample=float(saved),
                        forward_flops_per_sample=float(flops))


#: the families whose blocks hetrain's runtime splits over a TP group (``runtime.tp``: their decoder layers run
#: in module form); the others' blocks get no ``TPSplit``, so the planner never puts them on a TP group, which
#: the runtime would refuse (GPT-2's fused ``Conv1D``, GPT-NeoX's and OPT's blocks have no rule yet)
TP_FAMILIES = frozenset({"llama", "mistral", "qwen2"})


def _block_layer(m: DecoderShape, k: int, s: int, e: int, attention: Attention) -> LayerProfile:
    params, split_params = block_params(m)
    saved, split_saved = block_saved_bytes(m, s, e, attention)
    flops = block_flops(m, s, m.windows[k] if m.windows else None)
    # Megatron's g operator all-reduces the attention and the MLP outputs (s x h each); a parallel residual adds
    # them before one all-reduce (Black et al. 2022, sec. 2.1.1)
    allreduces = 1 if m.parallel_residual else 2
    tp = None if m.family not in TP_FAMILIES else TPSplit(
        split_param_bytes=float(split_params * PARAM_BYTES), split_flops_per_sample=float(flops),
        split_saved_bytes_per_sample=float(split_saved),
        allreduce_bytes_per_sample=float(allreduces * s * m.hidden * e), allreduces=allreduces)
    return LayerProfile(name=f"block{k + 1}", param_bytes=float(params * PARAM_BYTES),
                        output_bytes_per_sample=float(s * m.hidden * e), saved_bytes_per_sample=float(saved),
                        forward_flops_per_sample=float(flops), tp=tp)


def hf_param_count(m: DecoderShape) -> int:
    """The model's parameters, a tied table counted once: what transformers' ``num_parameters()`` gives.

    The profile's layers hold one more ``V x p`` where the head is tied (each cut layer holds its own copy).
    """
    tied = m.vocab * m.embed_dim if m.tied else 0
    profile = build_shape_profile(m, seq_len=1, precision="fp32")
    return round(profile.param_bytes / PARAM_BYTES) - tied


def build_shape_profile(m: DecoderShape, seq_len: int | None = None, precision: Precision = "bf16",
                        name: str | None = None, *, attention: Attention = "fused",
                        compute_efficiency: float = TRANSFORMER_EFFICIENCY) -> ModelProfile:
    """The profile of a read decoder shape (``build_hf_profile`` reads it from a config)."""
    field, most = m.max_positions
    s = most if seq_len is None else seq_len
    if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= most:
        raise SpecError(f"seq_len {s!r}: the model takes 1 to {most} tokens per sample (its {field})")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    e = _bytes_per_element(precision)
    _check_efficiency(compute_efficiency)
    blocks = [_block_layer(m, k, s, e, attention) for k in range(m.num_layers)]
    return ModelProfile(name=name or m.family, layers=(_embed_layer(m, s, e), *blocks, _head_layer(m, s, e)),
                        input_bytes_per_sample=float(s * INT64_BYTES),  # (s,) int64 token ids
                        precision=precision, compute_efficiency=compute_efficiency, seq_len=s)


def build_hf_profile(config: Mapping[str, Any] | str | Path, seq_len: int | None = None,
                     precision: Precision = "bf16", name: str | None = None, *, attention: Attention = "fused",
                     compute_efficiency: float = TRANSFORMER_EFFICIENCY) -> ModelProfile:
    """The analytic profile of a transformers decoder from its config.json, without building it.

    Args:
        config: the config's fields (a dict), or a model directory / config.json path (``hf:`` prefix allowed).
        seq_len: tokens per sample (default: the config's longest, ``max_position_embeddings`` / ``n_positions``).
        precision: training precision (default bf16, as these models are trained in mixed precision).
        name: the profile's name (default: the directory's name, or the ``model_type``).
        attention: ``fused`` (default; transformers' SDPA / FlashAttention) or ``eager`` (unfused, ``s x s``).
        compute_efficiency: fraction of the roofline peak reached.

    Raises:
        SpecError: an unreadable file, an unknown family, a missing or bad field (naming file, field, value).
    """
    if isinstance(config, Mapping):
        raw, where = dict(config), "config.json"
    else:
        text = str(config)
        path = Path(text[len(HF_PREFIX):] if is_hf_spec(text) else text)
        raw, where = load_hf_config(path)
        if name is None:
            name = (path if path.is_dir() else path.parent).resolve().name
    shape = read_hf_shape(raw, where)
    return build_shape_profile(shape, seq_len, precision, name, attention=attention,
                               compute_efficiency=compute_efficiency)


__all__ = ["ATTENTIONS", "HF_FAMILIES", "HF_PREFIX", "DecoderShape", "block_flops", "block_params",
           "block_saved_bytes", "build_hf_profile", "build_shape_profile", "hf_param_count", "is_hf_spec",
           "load_hf_config", "read_hf_shape"]

"""GPT-like decoder as a layer list: [embedding, block × n_blocks, head].

Layer 0 maps token ids ``(B, T)`` to hidden states ``(B, T, C)``; each block is a
pre-LayerNorm transformer block (causal self-attention, then an MLP of width 4C
with GELU); the last layer is the final LayerNorm and the LM head, giving logits
``(B, T, V)``. This is the layer split of the analytic profiles: one layer for the
embedding, one per block, one for the head.

Differences from GPT-2 proper, chosen for pipelining: the LM head has its own
weight (GPT-2 ties it to the token embedding, which would tie the first and last
stage together) and there is no dropout (so that any split of a batch into
micro-batches gives the same gradients).

Initialisation follows GPT-2 (Radford et al. 2019, section 2.3): weights
N(0, 0.02), biases zero, and the two projections that write into the residual
stream scaled by 1/sqrt(2 · n_blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-like decoder."""

    n_blocks: int
    """Transformer blocks (the model has ``n_blocks + 2`` layers)."""
    hidden: int
    """Width C of the residual stream."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    seq_len: int
    """Longest sequence T (learned position embeddings)."""
    vocab: int
    """Vocabulary size V."""

    def __post_init__(self) -> None:
        for field_name in ("n_blocks", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT {field_name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"GPT hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def num_layers(self) -> int:
        return self.n_blocks + 2


class Embedding(nn.Module):
    """Token plus learned position embedding: ids ``(B, T)`` -> hidden ``(B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.token = nn.Embedding(config.vocab, config.hidden)
        self.position = nn.Embedding(config.seq_len, config.hidden)
        nn.init.normal_(self.token.weight, std=INIT_STD)
        nn.init.normal_(self.position.weight, std=INIT_STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(t, device=ids.device)  # (T,)
        out: torch.Tensor = self.token(ids) + self.position(positions)  # (B, T, C) + (T, C)
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads  # one head's width
        # the head count is read from the projection (-1), not kept: under tensor parallelism of degree k the
        # QKV projection gives each rank its C / k columns of each of q, k, v (hetrain.runtime.tp), its local heads
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 × (B, T, C)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, C / heads)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)  # (B, T, C)
        out: torch.Tensor = self.proj(y)
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden, 4 * config.hidden),
            nn.GELU(),
            nn.Linear(4 * config.hidden, config.hidden),
        )
        for linear in (self.attn.qkv, self.mlp[0]):
            _init_linear(linear, INIT_STD)
        residual_std = INIT_STD / math.sqrt(2 * config.n_blocks)
        for linear in (self.attn.proj, self.mlp[2]):
            _init_linear(linear, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        out: torch.Tensor = x + self.mlp(self.ln_mlp(x))  # (B, T, C)
        return out


class Head(nn.Module):
    """Final LayerNorm and the LM head: hidden ``(B, T, C)`` -> logits ``(B, T, V)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln(x))  # (B, T, V)
        return logits


def _init_linear(linear: nn.Module, std: float) -> None:
    assert isinstance(linear, nn.Linear)
    nn.init.normal_(linear.weight, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def build_gpt_layer(config: GPTConfig, index: int) -> nn.Module:
    """Layer ``index`` of the decoder, drawn from torch's global generator.

    ``registry.build_layers`` calls it under the layer's own seed.
    """
    if index == 0:
        return Embedding(config)
    if index <= config.n_blocks:
        return Block(config)
    if index == config.n_blocks + 1:
        return Head(config)
    raise IndexError(f"GPT with {config.n_blocks} blocks has layers 0..{config.num_layers - 1}, not {index}")


def gpt_layer_names(config: GPTConfig) -> list[str]:
    """``["embed", "block0", ..., "head"]``: the names of the analytic profile's layers."""
    return ["embed", *(f"block{j}" for j in range(config.n_blocks)), "head"]

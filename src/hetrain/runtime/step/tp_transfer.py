"""Scatter / gather of a stage boundary between two TP groups of one degree (Megatron-LM's optimisation between
pipeline stages: Narayanan et al. 2021, sec. 4.1).

A TP stage's output, and the gradient of its input, are whole on every rank of its group (Megatron's f and g
operators). Rank j of a group of k sends only its j-th part of each tensor (flattened, padded to k equal parts)
to rank j of the next group, which all-gathers the k parts over its own group, on the node's fast link::

    group s   rank 0: [a0 a1]  rank 1: [a0 a1]          (the same tensor on both)
                 │ a0              │ a1                  one k-th each, over the network
    group s+1 rank 0: a0 ──┐   rank 1: a1 ──┐
                           └── all-gather ──┘ ──► [a0 a1] on both, reshaped

so what crosses the network is one copy of the tensor, not k (the cost model's ``sent_bytes_per_sample``). Forward
sends start with a small int64 tensor of the whole tensors' shapes (the receiver does not know them); backward
needs none (the gradients are shaped like the outputs the receiver holds).

torch's pipelining has no such transfer between meshes of a TP degree each; this is hetrain's own, on
``torch.distributed`` (``all_gather`` over the group the TP layers use; its timeout is the group's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import RunError


def part_size(numel: int, k: int) -> int:
    """Elements of each of the k parts of a tensor of ``numel`` elements (the last padded)."""
    return -(-numel // k)


def part_of(t: torch.Tensor, k: int, j: int) -> torch.Tensor:
    """Part ``j`` of ``k`` of ``t`` flattened (zero-padded to ``k`` equal parts), contiguous."""
    flat = t.detach().reshape(-1)
    c = part_size(flat.numel(), k)
    lo, hi = min(j * c, flat.numel()), min((j + 1) * c, flat.numel())
    part = flat[lo:hi]
    if hi - lo < c:
        part = torch.cat([part, flat.new_zeros(c - (hi - lo))])
    return part.contiguous()


def shapes_tensor(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The shapes of ``tensors`` as one int64 tensor: ``[ndim, *shape]`` per tensor."""
    values: list[int] = []
    for t in tensors:
        values += [t.dim(), *t.shape]
    return torch.tensor(values, dtype=torch.int64, device=device)


def shapes_of(encoded: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes ``shapes_tensor`` encoded."""
    values = encoded.tolist()
    out, k = [], 0
    while k < len(values):
        n = int(values[k])
        out.append(tuple(int(v) for v in values[k + 1:k + 1 + n]))
        k += 1 + n
    return out


def scatter_parts(tensors: Sequence[torch.Tensor], k: int, j: int, with_shapes: bool) -> list[torch.Tensor]:
    """What rank ``j`` of a group of ``k`` sends of ``tensors``: their shapes first where asked, then its parts."""
    parts = [part_of(t, k, j) for t in tensors]
    if not with_shapes:
        return parts
    device = tensors[0].device if tensors else torch.device("cpu")
    return [shapes_tensor(tensors, device), *parts]


def gather_whole(parts: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], k: int, group: Any,
                 peers: Sequence[int] = (), what: object = "") -> list[torch.Tensor]:
    """The whole tensors of ``shapes`` from this rank's ``parts`` and the other ranks' of ``group`` (collective:
    every rank of the group calls it with its parts of the same tensors, in the same order). The group's own
    timeout bounds the wait; a failure or timeout is a RunError naming ``what`` and the group's ranks ``peers``."""
    out = []
    for part, shape in zip(parts, shapes, strict=True):
        pieces = [torch.empty_like(part) for _ in range(k)]
        try:
            dist.all_gather(pieces, part.contiguous(), group=group)
        except RuntimeError as e:
            raise RunError(f"{what}: the all-gather of a stage boundary over TP group ranks {list(peers)} failed "
                           f"or timed out: {e}") from e
        numel = 1
        for n in shape:
            numel *= n
        out.append(torch.cat(pieces)[:numel].reshape(shape))
    return out


def part_like(t: torch.Tensor, k: int) -> torch.Tensor:
    """An empty tensor shaped as one part of ``t`` (what a gradient part arrives in)."""
    return torch.empty(part_size(t.numel(), k), dtype=t.dtype, device=t.device)

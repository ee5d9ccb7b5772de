"""The parts a TP rank sends across a stage boundary between groups of one degree (``runtime.step.tp_transfer``):
k parts of each tensor make it whole again, a k-th of its bytes each."""

from __future__ import annotations

import torch

from hetrain.runtime.step.tp_transfer import part_like, part_of, part_size, scatter_parts, shapes_of, shapes_tensor


def test_k_parts_make_the_tensor_whole_again_and_each_is_a_kth() -> None:
    t = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)  # 30 elements: 4 parts of 8, the last padded
    parts = [part_of(t, 4, j) for j in range(4)]
    assert [p.numel() for p in parts] == [8, 8, 8, 8] and part_size(30, 4) == 8
    assert torch.equal(torch.cat(parts)[:30].reshape(2, 3, 5), t)
    assert torch.equal(parts[3][6:], torch.zeros(2))
    assert part_like(t, 4).shape == (8,) and part_like(t, 4).dtype == t.dtype


def test_a_forward_send_starts_with_the_shapes_of_its_whole_tensors() -> None:
    a, ids = torch.randn(2, 7, 16), torch.arange(14).reshape(2, 7)
    sent = scatter_parts([a, ids], 2, 1, with_shapes=True)
    assert shapes_of(sent[0]) == [(2, 7, 16), (2, 7)]
    assert torch.equal(sent[1], a.reshape(-1)[112:]) and torch.equal(sent[2], ids.reshape(-1)[7:])
    assert shapes_of(shapes_tensor([torch.zeros(())], torch.device("cpu"))) == [()]
    assert len(scatter_parts([a], 2, 0, with_shapes=False)) == 1

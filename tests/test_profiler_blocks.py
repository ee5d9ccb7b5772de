"""``measure_layers(..., min_time_s=...)``: layer times as means over blocks of back-to-back calls.

The block path is for processes under a CPU quota (emulated devices), where a single
call shorter than the quota left runs at full speed; here it must run (each layer and
size is timed for at least ``2 x repeats x min_time_s``: ``repeats`` pairs of a forward
block and a forward + backward block, whose medians it reports) and give times of the
same layers the single-call path gives.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from hetrain.profiler.layers import measure_layers


def test_block_timing_spans_min_time_and_reports_every_layer() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)]
    start = time.perf_counter()
    m = measure_layers(layers, torch.randn(1, 64), (2, 4), "cpu", repeats=1, warmup=0, min_time_s=0.02)
    took = time.perf_counter() - start
    assert took >= 3 * 2 * 2 * 0.02  # 3 layers x 2 sizes x (forward block + forward-backward block)
    for r in m.layers:
        assert [b for b, _, _ in r.times_s] == [2, 4]
        for _, fwd, bwd in r.times_s:
            assert fwd > 0 and bwd >= 0
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # left as found


def test_block_timing_takes_a_pair_of_blocks_per_repeat() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.ReLU()]
    start = time.perf_counter()
    m = measure_layers(layers, torch.randn(1, 64), (2,), "cpu", repeats=3, warmup=0, min_time_s=0.02,
                       optimizers=())
    took = time.perf_counter() - start
    assert took >= 2 * 3 * 2 * 0.02  # 2 layers x 3 repeats x (forward block + forward-backward block)
    assert all(fwd > 0 and bwd >= 0 for r in m.layers for _, fwd, bwd in r.times_s)


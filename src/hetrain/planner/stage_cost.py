"""Cost tables of every possible stage of a virtual worker, with recomputation.

For a VW whose devices are in a fixed order ``d_0 .. d_{p-1}``, stage ``j`` may
hold any layer range ``[k, l)``. This module builds, per position ``j``:

- ``time[k, l]``: forward + backward seconds per micro-batch of that stage on
  ``d_j``, including the recomputation needed to fit memory (``inf`` if even
  recomputing everything does not fit);
- ``recompute(k, l)``: the recompute set behind that figure.

Cost-balanced recomputation (Pipe-Torch, Zhang et al. 2020): when a stage does
not fit, recompute the layers that add the least time per byte saved until it
fits. The partition search then prefers cuts where that extra time lands on
stages with slack, so the bottleneck does not grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.cost import estimate_layer_times, estimate_weight_memory, in_flight
from hetrain.profile import ModelProfile

INF = float("inf")


@dataclass
class StageCosts:
    """Stage time and memory tables of one device at one position of a VW.

    Attributes:
        device: the device.
        n_in_flight: micro-batches whose activations the stage holds at once.
        time_s: (L+1, L+1) array, ``time_s[k, l]`` for layers ``[k, l)``, inf where
            infeasible or ``k >= l``.
        fwd_s / bwd_s: per-layer forward / backward seconds at micro-batch ``b``.
    """

    device: Device
    n_in_flight: int
    b: int
    time_s: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    _recompute: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def recompute(self, k: int, l: int) -> tuple[int, ...]:
        """The recompute set chosen for layers ``[k, l)`` (empty if it fits as is)."""
        return self._recompute.get((k, l), ())

    def forward_backward(self, k: int, l: int) -> tuple[float, float]:
        """(forward, backward incl. recomputation) seconds per micro-batch for ``[k, l)``."""
        rc = self.recompute(k, l)
        fwd = float(self.fwd_s[k:l].sum())
        bwd = float(self.bwd_s[k:l].sum()) + float(sum(self.fwd_s[i] for i in rc))
        return fwd, bwd


@dataclass
class ModelArrays:
    """Per-layer byte figures of a profile as arrays (shared by all stage tables)."""

    param: np.ndarray  # (L,) parameter bytes
    saved: np.ndarray  # (L,) activation bytes kept per sample
    input: np.ndarray  # (L,) input bytes per sample (previous layer's output)
    output: np.ndarray  # (L,) output bytes per sample
    weight_factor: float  # weight memory per parameter byte (params + grads + optimizer state)


def build_model_arrays(profile: ModelProfile, optimizer: str) -> ModelArrays:
    key = ("model_arrays", optimizer)
    cached = profile._cache.get(key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    layers = profile.layers
    out = np.array([x.output_bytes_per_sample for x in layers], dtype=float)
    arrays = ModelArrays(
        param=np.array([x.param_bytes for x in layers], dtype=float),
        saved=np.array([x.saved_bytes_per_sample for x in layers], dtype=float),
        input=np.concatenate([[profile.input_bytes_per_sample], out[:-1]]),
        output=out,
        # estimate_weight_memory is linear in parameter bytes: take its slope once.
        weight_factor=estimate_weight_memory(1.0, profile.bytes_per_element, optimizer),
    )
    profile._cache[key] = arrays
    return arrays


def _prefix(a: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(a)])


def _range_table(prefix: np.ndarray) -> np.ndarray:
    """``out[k, l] = prefix[l] - prefix[k]`` for all k, l."""
    return prefix[None, :] - prefix[:, None]  # (L+1, L+1)


def choose_recompute(fwd_s: np.ndarray, arrays: ModelArrays, k: int, l: int, b: int, n: int,
                     capacity_bytes: float) -> tuple[int, ...] | None:
    """Layers of ``[k, l)`` to recompute so the stage fits ``capacity_bytes``; None if impossible.

    Greedy by added time per byte saved: recomputing layer i adds its forward
    time ``fwd_s[i]`` to the backward pass and saves ``n * b * (saved_i - input_i)``
    bytes (it keeps only its input), but its activations come back for one
    micro-batch while it is recomputed (the transient ``b * saved_i``).
    """
    weights = arrays.weight_factor * float(arrays.param[k:l].sum())
    kept = float(arrays.saved[k:l].sum())
    need = weights + n * b * kept
    if need <= capacity_bytes:
        return ()
    gains = [(i, arrays.saved[i] - arrays.input[i]) for i in range(k, l)]
    candidates = sorted(((fwd_s[i] / g if fwd_s[i] > 0 else 0.0, i) for i, g in gains if g > 0))
    chosen: list[int] = []
    transient = 0.0
    for _, i in candidates:
        chosen.append(i)
        kept -= arrays.saved[i] - arrays.input[i]
        transient = max(transient, b * arrays.saved[i])
        if weights + n * b * kept + transient <= capacity_bytes:
            return tuple(sorted(chosen))
    return None


def build_stage_costs(profile: ModelProfile, devices: Sequence[Device], b: int, m: int, schedule: str,
                      optimizer: str, allow_recompute: bool = True) -> list[StageCosts]:
    """Stage tables for each position ``j`` of a VW over ``devices`` (in that order)."""
    arrays = build_model_arrays(profile, optimizer)
    p = len(devices)
    L = profile.num_layers
    weight_table = arrays.weight_factor * _range_table(_prefix(arrays.param))
    saved_table = _range_table(_prefix(arrays.saved))
    # A recomputed range keeps at least the inputs of its layers: the lower bound
    # of its activation memory, used to skip hopeless ranges without a greedy pass.
    floor_table = _range_table(_prefix(np.minimum(arrays.saved, arrays.input)))
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
    out = []
    for j, dev in enumerate(devices):
        fwd, bwd = estimate_layer_times(profile, dev, b)
        n = in_flight(schedule, m, p, j)
        time = _range_table(_prefix(fwd + bwd))
        mem = weight_table + n * b * saved_table
        fits = (mem <= dev.memory_bytes) & upper
        costs = StageCosts(dev, n, b, np.where(fits, time, INF), fwd, bwd)
        if allow_recompute:
            maybe = upper & ~fits & (weight_table + n * b * floor_table <= dev.memory_bytes)
            for k, l in zip(*np.nonzero(maybe), strict=True):
                rc = choose_recompute(fwd, arrays, int(k), int(l), b, n, dev.memory_bytes)
                if rc is not None:
                    costs.time_s[k, l] = time[k, l] + float(fwd[list(rc)].sum())
                    costs._recompute[(int(k), int(l))] = rc
        out.append(costs)
    return out


def link_time_table(cluster: Cluster, devices: Sequence[Device], arrays: ModelArrays, b: int) -> np.ndarray:
    """``c[j, k]``: activation + gradient transfer between positions j-1 and j when cut before layer k.

    Each is ``latency + b * output_bytes[k-1] / bandwidth`` (cost.estimate_p2p_time);
    row 0 is zero (no stage before the first).
    """
    p = len(devices)
    L = len(arrays.output)
    c = np.zeros((p, L + 1))
    for j in range(1, p):
        a, d = devices[j - 1].index, devices[j].index
        bw = float(cluster.bandwidth_bytes_per_s[a, d])
        lat = float(cluster.latency_s[a, d])
        boundary = np.concatenate([[0.0], arrays.output])  # bytes/sample crossing a cut before layer k
        c[j] = 2 * (lat + b * boundary / bw)
        c[j, 0] = INF  # a cut before layer 0 would leave stage j-1 empty
    return c

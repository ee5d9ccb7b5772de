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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.cost import estimate_layer_times, estimate_weight_memory, in_flight
from hetrain.profile import ModelProfile

INF = float("inf")


@dataclass
class StageCosts:
    """Stage time tables of one device holding ``n_in_flight`` micro-batches of size ``b``.

    Attributes:
        device: the device.
        n_in_flight: micro-batches whose activations the stage holds at once.
        time_s: (L+1, L+1) array, ``time_s[k, l]`` for layers ``[k, l)`` with the
            greedy recompute set where memory needs one; inf where infeasible, for
            ``k >= l``, and for ranges needing recomputation that were not worked
            out yet (``ensure_recompute``).
        full_s: the same with every useful layer recomputed where memory needs it:
            an upper bound of ``time_s`` over the same feasible ranges.
        fwd_s / bwd_s: per-layer forward / backward seconds at micro-batch ``b``.
    """

    device: Device
    n_in_flight: int
    b: int
    time_s: np.ndarray
    full_s: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    base_s: np.ndarray  # forward + backward without recomputation, every range
    pending: np.ndarray  # ranges that need recomputation and could fit with it
    arrays: ModelArrays
    recompute_order: np.ndarray
    recompute_prefix: np.ndarray
    done_up_to_s: float = -1.0

    def ensure_recompute(self, limit_s: float) -> None:
        """Work out the greedy recompute set of every pending range whose time without
        recomputation is at most ``limit_s`` (ranges above it cannot be in the answer)."""
        if limit_s <= self.done_up_to_s or not self.pending.any():
            return
        todo = self.pending & (self.base_s <= limit_s) & (self.base_s > self.done_up_to_s)
        if todo.any():
            _add_recompute(self, todo)
        self.done_up_to_s = limit_s

    def recompute(self, k: int, l: int, full: bool = False) -> tuple[int, ...]:
        """The recompute set chosen for layers ``[k, l)`` (empty if it fits as is).

        ``full``: the set behind ``full_s`` (every useful layer, where memory needs any).
        """
        if full:
            if not self.pending[k, l]:
                return ()
            chosen = self.recompute_order
        else:
            chosen = self.recompute_order[: int(self.recompute_prefix[k, l])]
        inside = chosen[(chosen >= k) & (chosen < l)]
        return tuple(int(i) for i in np.sort(inside))

    def forward_backward(self, k: int, l: int, full: bool = False) -> tuple[float, float]:
        """(forward, backward incl. recomputation) seconds per micro-batch for ``[k, l)``."""
        rc = self.recompute(k, l, full)
        fwd = float(self.fwd_s[k:l].sum())
        bwd = float(self.bwd_s[k:l].sum()) + float(self.fwd_s[list(rc)].sum())
        return fwd, bwd


@dataclass
class ModelArrays:
    """Per-layer byte figures of a profile as arrays (shared by all stage tables)."""

    param: np.ndarray  # (L,) parameter bytes
    saved: np.ndarray  # (L,) activation bytes kept per sample
    input: np.ndarray  # (L,) input bytes per sample (previous layer's output)
    output: np.ndarray  # (L,) output bytes per sample
    weight_factor: float  # weight memory per parameter byte (params + grads + optimizer state)
    # Range tables shared by every device: out[k, l] over layers [k, l).
    weight_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # weight memory
    saved_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # activation bytes per sample
    kept_full_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # ... all useful layers recomputed
    transient_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # largest useful layer's saved bytes
    upper: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))  # k < l
    useful: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # recomputing saves memory


def _range_max(values: np.ndarray) -> np.ndarray:
    """``out[k, l] = max(values[k:l])`` (0 for empty ranges)."""
    L = len(values)
    out = np.zeros((L + 1, L + 1))
    for k in range(L):
        out[k, k + 1:] = np.maximum.accumulate(values[k:])
    return out


def build_model_arrays(profile: ModelProfile, optimizer: str) -> ModelArrays:
    key = ("model_arrays", optimizer)
    cached = profile._cache.get(key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    layers = profile.layers
    out = np.array([x.output_bytes_per_sample for x in layers], dtype=float)
    param = np.array([x.param_bytes for x in layers], dtype=float)
    saved = np.array([x.saved_bytes_per_sample for x in layers], dtype=float)
    inputs = np.concatenate([[profile.input_bytes_per_sample], out[:-1]])
    # estimate_weight_memory is linear in parameter bytes: take its slope once.
    weight_factor = estimate_weight_memory(1.0, profile.bytes_per_element, optimizer)
    useful = saved - inputs > 0
    saved_table = _range_table(_prefix(saved))
    L = len(layers)
    arrays = ModelArrays(
        param=param, saved=saved, input=inputs, output=out, weight_factor=weight_factor,
        weight_table=weight_factor * _range_table(_prefix(param)),
        saved_table=saved_table,
        kept_full_table=saved_table - _range_table(_prefix(np.where(useful, saved - inputs, 0.0))),
        transient_table=_range_max(np.where(useful, saved, 0.0)),
        upper=np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1),
        useful=useful,
    )
    profile._cache[key] = arrays
    return arrays


def _prefix(a: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(a)])


def _range_table(prefix: np.ndarray) -> np.ndarray:
    """``out[k, l] = prefix[l] - prefix[k]`` for all k, l."""
    out: np.ndarray = prefix[None, :] - prefix[:, None]  # (L+1, L+1)
    return out


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


class StageTableCache:
    """LRU cache of stage tables keyed by (device figures, micro-batches in flight, b).

    A stage's table depends on its device and on how many micro-batches it holds,
    not on the rest of the VW, so one table serves every device order that puts
    that device where it holds that many (1F1B: position p - n).
    """

    def __init__(self, max_entries: int = 512) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[tuple[object, ...], StageCosts] = OrderedDict()

    def get(self, key: tuple[object, ...]) -> StageCosts | None:
        hit = self._data.get(key)
        if hit is not None:
            self._data.move_to_end(key)
        return hit

    def put(self, key: tuple[object, ...], value: StageCosts) -> None:
        self._data[key] = value
        if len(self._data) > self.max_entries:
            self._data.popitem(last=False)


def _build_one(profile: ModelProfile, arrays: ModelArrays, dev: Device, b: int, n: int,
               allow_recompute: bool) -> StageCosts:
    """The stage tables of ``dev`` holding ``n`` micro-batches of size ``b``."""
    L = profile.num_layers
    upper = arrays.upper
    fwd, bwd = estimate_layer_times(profile, dev, b)
    base = np.where(upper, _range_table(_prefix(fwd + bwd)), INF)
    fits = (arrays.weight_table + n * b * arrays.saved_table <= dev.memory_bytes) & upper
    time = np.where(fits, base, INF)
    order = recompute_order(fwd, arrays)
    full = time
    pending = np.zeros_like(fits)
    if allow_recompute and len(order):
        # Recompute every useful layer: each keeps only its input; the largest
        # recomputed layer's activations come back for one micro-batch.
        need_full = arrays.weight_table + n * b * arrays.kept_full_table + b * arrays.transient_table
        fits_full = upper & ~fits & (need_full <= dev.memory_bytes)
        full = np.where(fits_full, base + _range_table(_prefix(np.where(arrays.useful, fwd, 0.0))), time)
        pending = fits_full
    return StageCosts(dev, n, b, time.copy(), full, fwd, bwd, base, pending, arrays, order,
                      np.zeros((L + 1, L + 1), dtype=np.int64))


def recompute_order(fwd_s: np.ndarray, arrays: ModelArrays) -> np.ndarray:
    """Layers worth recomputing, cheapest first: added seconds per byte saved per sample."""
    gain = arrays.saved - arrays.input
    useful = gain > 0
    ratio = np.where(useful, fwd_s / np.where(useful, gain, 1.0), np.inf)
    order = np.argsort(ratio, kind="stable")
    out: np.ndarray = order[useful[order]]
    return out


def _add_recompute(costs: StageCosts, todo: np.ndarray) -> None:
    """``choose_recompute`` for every range in ``todo`` at once, a block of start layers at a time.

    For start k and every end l, take the layers of [k, l) in greedy order; the
    t-th row of the cumulative tables is the state after recomputing the first t
    of them (bytes saved, largest transient, seconds added). The first row that
    fits is the greedy's answer.
    """
    b, n, arrays, order = costs.b, costs.n_in_flight, costs.arrays, costs.recompute_order
    L = len(arrays.param)
    weight_table, saved_table = arrays.weight_table, arrays.saved_table
    gain = (arrays.saved - arrays.input)[order][:, None]  # (T, 1)
    transient = (b * arrays.saved)[order][:, None]
    added = costs.fwd_s[order][:, None]
    starts = np.nonzero(todo.any(axis=1))[0]
    # Process as many start layers at once as keep the (T, starts, L+1) arrays small.
    chunk = max(1, int(4_000_000 // max(1, len(order) * (L + 1))))
    ends = np.arange(L + 1)
    for c0 in range(0, len(starts), chunk):
        ks = starts[c0:c0 + chunk]
        o = order[:, None, None]
        inside = (o >= ks[None, :, None]) & (o < ends[None, None, :]) & todo[ks][None, :, :]  # (T, k, l)
        saved_t = np.cumsum(np.where(inside, gain[:, :, None], 0.0), axis=0)
        transient_t = np.maximum.accumulate(np.where(inside, transient[:, :, None], 0.0), axis=0)
        added_t = np.cumsum(np.where(inside, added[:, :, None], 0.0), axis=0)
        need = weight_table[ks][None] + n * b * (saved_table[ks][None] - saved_t) + transient_t
        fit = need <= costs.device.memory_bytes
        usable = fit.any(axis=0) & todo[ks]  # (k, l)
        first = np.argmax(fit, axis=0)  # (k, l)
        kk, ll = np.nonzero(usable)
        rows = ks[kk]
        costs.time_s[rows, ll] = costs.base_s[rows, ll] + added_t[first[kk, ll], kk, ll]
        costs.recompute_prefix[rows, ll] = first[kk, ll] + 1


def build_stage_costs(profile: ModelProfile, devices: Sequence[Device], b: int, m: int, schedule: str,
                      optimizer: str, allow_recompute: bool = True,
                      cache: StageTableCache | None = None) -> list[StageCosts]:
    """Stage tables for each position ``j`` of a VW over ``devices`` (in that order)."""
    arrays = build_model_arrays(profile, optimizer)
    p = len(devices)
    out = []
    for j, dev in enumerate(devices):
        n = in_flight(schedule, m, p, j)
        key = (dev.type_name, dev.peak_fp32_flops, dev.peak_fp16_flops, dev.memory_bytes,
               dev.memory_bandwidth_bytes_per_s, n, b, optimizer, allow_recompute)
        costs = cache.get(key) if cache is not None else None
        if costs is None:
            costs = _build_one(profile, arrays, dev, b, n, allow_recompute)
            if cache is not None:
                cache.put(key, costs)
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

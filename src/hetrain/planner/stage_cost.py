"""Cost tables of every possible stage of a virtual worker, with recomputation.

For a VW whose devices are in a fixed order ``d_0 .. d_{p-1}``, stage ``j`` may
hold any layer range ``[k, l)``. This module builds, per position ``j``:

- ``time[k, l]``: forward + backward seconds per micro-batch of that stage on
  ``d_j`` (the layers' times and the device's overhead per action, twice),
  including the recomputation needed to fit memory (``inf`` if even
  recomputing everything does not fit);
- ``recompute(k, l)``: the recompute set behind that figure.

Cost-balanced recomputation (Pipe-Torch, Zhang et al. 2020): when a stage does
not fit, recompute the layers that add the least time per byte saved until it
fits. The partition search then prefers cuts where that extra time lands on
stages with slack, so the bottleneck does not grow.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.cost import (
    ZERO2_IN_FLIGHT_BYTES,
    estimate_action_overhead,
    estimate_layer_times,
    estimate_optimizer_step_memory,
    estimate_weight_memory,
    in_flight,
    loss_memory_per_sample,
    tensor_budget,
)
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
        overhead_s: the device's overhead per action (``estimate_action_overhead``): ``time_s``
            holds it twice (a forward and a backward per micro-batch).
        budget_bytes: the largest tensor peak a stage may have on the device (``cost.tensor_budget``:
            its memory less the runtime's footprint and the margin).
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
    overhead_s: float = 0.0
    budget_bytes: float = 0.0
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
        fwd = float(self.fwd_s[k:l].sum()) + self.overhead_s
        bwd = float(self.bwd_s[k:l].sum()) + float(self.fwd_s[list(rc)].sum()) + self.overhead_s
        return fwd, bwd


@dataclass
class ModelArrays:
    """Per-layer byte figures of a profile as arrays (shared by all stage tables)."""

    param: np.ndarray  # (L,) parameter bytes
    saved: np.ndarray  # (L,) activation bytes kept per sample
    input: np.ndarray  # (L,) input bytes per sample (previous layer's output)
    output: np.ndarray  # (L,) output bytes per sample
    sent: np.ndarray  # (L,) bytes per sample one device sends of it (``ModelProfile.sent_bytes_per_sample``)
    weight_factor: float  # weight memory per parameter byte (params + grads + optimizer state)
    # Range tables shared by every device: out[k, l] over layers [k, l).
    weight_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # weight memory
    saved_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # activation bytes per sample
    kept_full_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # ... all useful layers recomputed
    transient_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # largest useful layer's saved bytes
    # The loss's bytes kept per sample in flight are in saved_table's column L (and kept_full_table's).
    loss_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # the loss's backward transient (l = L)
    step_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # weights + optimizer step transient
    upper: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))  # k < l
    useful: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # recomputing saves memory


def _range_max(values: np.ndarray) -> np.ndarray:
    """``out[k, l] = max(values[k:l])`` (0 for empty ranges)."""
    L = len(values)
    out = np.zeros((L + 1, L + 1))
    for k in range(L):
        out[k, k + 1:] = np.maximum.accumulate(values[k:])
    return out


def build_model_arrays(profile: ModelProfile, optimizer: str, reduce_copy: float = 0.0,
                       shares: tuple[float, ...] = (1.0, 1.0)) -> ModelArrays:
    """The model's per-layer figures as arrays and range tables, cached on the profile. ``reduce_copy``: the
    16-bit gradient copies per gradient byte a stage holds at the end of the iteration where its gradients are
    all-reduced in bf16 (``SyncOptions.reduce_copy``; 0 in fp32, or where no other replica shares them): they
    count in ``step_table`` with the optimizer step's transient (``cost.estimate_optimizer_step_memory``).
    ``shares``: (optimizer state, gradients) a stage keeps where its owners shard them (``SyncOptions.shard``;
    ``cost.estimate_stage_memory``): under ZeRO-2 a backward's whole gradients are transient at the activation
    peak, so ``weight_factor`` counts them there, and ``step_table`` does not; a third element True: the stage
    runs several micro-batches, and holds the whole gradients until its last backward
    (``cost.estimate_stage_memory``'s ``micro_batches``)."""
    key = ("model_arrays", optimizer, reduce_copy, shares)
    cached = profile._cache.get(key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    layers = profile.layers
    out = np.array([x.output_bytes_per_sample for x in layers], dtype=float)
    param = np.array([x.param_bytes for x in layers], dtype=float)
    saved = np.array([x.saved_bytes_per_sample for x in layers], dtype=float)
    inputs = np.concatenate([[profile.input_bytes_per_sample], out[:-1]])
    # estimate_weight_memory is linear in parameter bytes: take its slope once.
    state_share, grad_share = shares[0], shares[1]
    whole_grads = len(shares) > 2 and bool(shares[2])
    held = estimate_weight_memory(1.0, profile.bytes_per_element, optimizer, state_share, grad_share,
                                  profile.grad_bytes_per_element)
    weight_factor = held
    # ZeRO-2: the gradients of the buckets not yet reduced to their owners, during a backward
    # (cost.zero2_transient_bytes: min of the range's unkept share and the in-flight buckets or its largest layer)
    unkept = (1.0 - grad_share) * _range_table(_prefix(param))
    in_flight_grads = (0.0 if grad_share >= 1.0 else unkept if whole_grads else
                       np.minimum(unkept, np.maximum(ZERO2_IN_FLIGHT_BYTES, _range_max(param))))
    useful = saved - inputs > 0
    L = len(layers)
    # The loss lives on the stage that ends at layer L (cost.estimate_stage_memory).
    loss_kept, loss_transient = loss_memory_per_sample(profile)
    loss_table = np.zeros((L + 1, L + 1))
    loss_table[:L, L] = loss_transient
    last_column = np.zeros((L + 1, L + 1))
    last_column[:L, L] = loss_kept
    saved_table = _range_table(_prefix(saved)) + last_column
    arrays = ModelArrays(
        param=param, saved=saved, input=inputs, output=out, sent=out / profile.tp_degree,
        weight_factor=weight_factor,
        weight_table=weight_factor * _range_table(_prefix(param)) + in_flight_grads,
        saved_table=saved_table,
        kept_full_table=saved_table - _range_table(_prefix(np.where(useful, saved - inputs, 0.0))),
        transient_table=_range_max(np.where(useful, saved, 0.0)),
        loss_table=loss_table,
        step_table=(held + estimate_optimizer_step_memory(1.0, profile.bytes_per_element, optimizer,
                                                          reduce_copy, state_share))
        * _range_table(_prefix(param)),
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
    if arrays.step_table[k, l] > capacity_bytes:
        return None  # the optimizer step alone does not fit; recomputing cannot help
    weights = float(arrays.weight_table[k, l])
    kept = float(arrays.saved_table[k, l])
    loss = b * float(arrays.loss_table[k, l])
    need = weights + n * b * kept + loss
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
        if weights + n * b * kept + transient + loss <= capacity_bytes:
            return tuple(sorted(chosen))
    return None


class StageTableCache:
    """LRU cache of stage tables keyed by (device figures, micro-batches in flight, b).

    A stage's table depends on its device and on how many micro-batches it holds,
    not on the rest of the VW, so one table serves every device order that puts
    that device where it holds that many (1F1B: position p - n). The parts that do
    not depend on the in-flight count (times, and per range the most micro-batches
    that fit) are kept once per (device figures, b) and shared by every count.
    """

    def __init__(self, max_entries: int = 512) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[tuple[object, ...], StageCosts] = OrderedDict()
        self._devices: OrderedDict[tuple[object, ...], DeviceTables] = OrderedDict()
        self._stacks: OrderedDict[tuple[object, ...], KindTables] = OrderedDict()

    def get(self, key: tuple[object, ...]) -> StageCosts | None:
        hit = self._data.get(key)
        if hit is not None:
            self._data.move_to_end(key)
        return hit

    def put(self, key: tuple[object, ...], value: StageCosts) -> None:
        self._data[key] = value
        if len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def device_tables(self, key: tuple[object, ...], build: Callable[[], DeviceTables]) -> DeviceTables:
        hit = self._devices.get(key)
        if hit is None:
            hit = self._devices[key] = build()
            if len(self._devices) > self.max_entries:
                self._devices.popitem(last=False)
        else:
            self._devices.move_to_end(key)
        return hit

    def kind_tables(self, key: tuple[object, ...], build: Callable[[], KindTables]) -> KindTables:
        hit = self._stacks.get(key)
        if hit is None:
            hit = self._stacks[key] = build()
            if len(self._stacks) > self.max_entries:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(key)
        return hit


@dataclass
class DeviceTables:
    """What a device's stage tables share over every in-flight count ``n``, at micro-batch ``b``.

    ``fits_up_to[k, l]``: the most micro-batches ``[k, l)`` can hold without
    recomputation (weights + n * b * saved <= memory); ``full_fits_up_to`` the
    same with every useful layer recomputed; -1 where none fits, and for k >= l.
    """

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    base_s: np.ndarray  # forward + backward without recomputation, and 2 x overhead_s; inf for k >= l
    full_s: np.ndarray  # ... plus every useful layer's forward again
    order: np.ndarray
    fits_up_to: np.ndarray
    full_fits_up_to: np.ndarray | None  # None: recomputation off or useless
    overhead_s: float = 0.0  # per action (estimate_action_overhead)


def _most_in_flight(fixed: np.ndarray, per_n: np.ndarray, extra: np.ndarray, b: int, capacity: float,
                    upper: np.ndarray) -> np.ndarray:
    """Largest integer n with ``fixed + (n * b) * per_n + extra <= capacity`` per range; -1 if none.

    Exactly the n for which that inequality holds as evaluated in floating point
    (the quotient may be a rounding step off; one correction each way fixes it),
    so sharing these over n changes no table. Huge (1e15) where any n fits.
    """
    huge = 1e15

    def fits(n: np.ndarray) -> np.ndarray:
        out: np.ndarray = fixed + (n * b) * per_n + extra <= capacity
        return out

    room = capacity - fixed - extra
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.floor(np.where(per_n > 0, room / (b * per_n), np.where(room >= 0, huge, -1.0)))
    n = np.clip(n, -1.0, huge)
    bounded = (per_n > 0) & (n < huge)
    n = np.where(bounded & (n >= 0) & ~fits(n), n - 1, n)
    n = np.where(bounded & fits(n + 1), n + 1, n)
    out: np.ndarray = np.where(upper, np.maximum(n, -1.0), -1.0)
    return out


def _build_device(profile: ModelProfile, arrays: ModelArrays, dev: Device, b: int,
                  allow_recompute: bool) -> DeviceTables:
    """The tables of ``dev`` at micro-batch ``b`` that every in-flight count shares."""
    upper = arrays.upper
    fwd, bwd = estimate_layer_times(profile, dev, b)
    overhead = estimate_action_overhead(profile, dev)
    base = np.where(upper, _range_table(_prefix(fwd + bwd)) + 2 * overhead, INF)
    order = recompute_order(fwd, arrays)
    budget = tensor_budget(profile, dev)  # its memory less the runtime's footprint and the margin
    step_fits = arrays.step_table <= budget  # the optimizer step, once the activations are freed
    fits_up_to = np.where(step_fits, _most_in_flight(arrays.weight_table, arrays.saved_table, b * arrays.loss_table,
                                                     b, budget, upper), -1.0)
    full = base
    full_fits: np.ndarray | None = None
    if allow_recompute and len(order):
        # Recompute every useful layer: each keeps only its input; the largest
        # recomputed layer's activations come back for one micro-batch.
        full = base + _range_table(_prefix(np.where(arrays.useful, fwd, 0.0)))
        full_fits = np.where(step_fits, _most_in_flight(arrays.weight_table, arrays.kept_full_table,
                                                        b * (arrays.transient_table + arrays.loss_table), b,
                                                        budget, upper), -1.0)
    return DeviceTables(fwd, bwd, base, full, order, fits_up_to, full_fits, overhead)


def _build_one(profile: ModelProfile, arrays: ModelArrays, dev: Device, b: int, n: int,
               allow_recompute: bool, shared: DeviceTables | None = None) -> StageCosts:
    """The stage tables of ``dev`` holding ``n`` micro-batches of size ``b``."""
    L = profile.num_layers
    d = shared if shared is not None else _build_device(profile, arrays, dev, b, allow_recompute)
    fits = d.fits_up_to >= n
    time = np.where(fits, d.base_s, INF)
    full = time
    pending = np.zeros_like(fits)
    if d.full_fits_up_to is not None:
        pending = ~fits & (d.full_fits_up_to >= n)
        full = np.where(pending, d.full_s, time)
    return StageCosts(dev, n, b, time, full, d.fwd_s, d.bwd_s, d.base_s, pending, arrays, d.order,
                      np.zeros((L + 1, L + 1), dtype=np.int64), d.overhead_s, tensor_budget(profile, dev))


@dataclass
class KindTables:
    """The DeviceTables of a VW's distinct device kinds at one ``b``, stacked (u, L+1, L+1), flattened.

    Lets the partition search gather every stage's band in one indexing step
    (``full_at``) instead of building a table per (device, in-flight count).
    """

    kinds: list[DeviceTables]
    base_s: np.ndarray
    full_s: np.ndarray
    fits_up_to: np.ndarray
    full_fits_up_to: np.ndarray
    layer_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (u, L) forward + backward per layer

    def full_at(self, flat: np.ndarray, n: np.ndarray) -> np.ndarray:
        """``StageCosts.full_s`` at flat indices ``kind * (L+1)^2 + k * (L+1) + l``, for in-flight counts ``n``."""
        out: np.ndarray = np.where(n <= self.fits_up_to.take(flat), self.base_s.take(flat),
                                   np.where(n <= self.full_fits_up_to.take(flat), self.full_s.take(flat), INF))
        return out


def device_key(dev: Device, b: int, optimizer: str, allow_recompute: bool,
               reduce_copy: float = 0.0, shares: tuple[float, ...] = (1.0, 1.0)) -> tuple[object, ...]:
    """What a device's stage tables depend on, besides its in-flight count."""
    return (dev.type_name, dev.peak_fp32_flops, dev.peak_fp16_flops, dev.memory_bytes,
            dev.memory_bandwidth_bytes_per_s, b, optimizer, allow_recompute, reduce_copy, shares)


def build_kind_tables(profile: ModelProfile, devices: Sequence[Device], b: int, optimizer: str,
                      allow_recompute: bool, cache: StageTableCache | None,
                      reduce_copy: float = 0.0,
                      shares: tuple[float, ...] = (1.0, 1.0)) -> tuple[KindTables, list[int]]:
    """Stacked tables of the distinct device kinds of ``devices``, and each position's kind (``reduce_copy``,
    ``shares``: ``build_model_arrays``)."""
    arrays = build_model_arrays(profile, optimizer, reduce_copy, shares)
    keys = [device_key(d, b, optimizer, allow_recompute, reduce_copy, shares) for d in devices]
    index: dict[tuple[object, ...], int] = {}
    firsts: list[Device] = []
    for key, d in zip(keys, devices, strict=True):
        if key not in index:
            index[key] = len(index)
            firsts.append(d)
    kind_of = [index[k] for k in keys]

    def one(d: Device) -> DeviceTables:
        if cache is None:
            return _build_device(profile, arrays, d, b, allow_recompute)
        return cache.device_tables(device_key(d, b, optimizer, allow_recompute, reduce_copy, shares),
                                   functools.partial(_build_device, profile, arrays, d, b, allow_recompute))

    def stack() -> KindTables:
        kinds = [one(d) for d in firsts]
        none = np.full_like(kinds[0].fits_up_to, -1.0)
        return KindTables(kinds, np.stack([t.base_s for t in kinds]).ravel(),
                          np.stack([t.full_s for t in kinds]).ravel(),
                          np.stack([t.fits_up_to for t in kinds]).ravel(),
                          np.stack([none if t.full_fits_up_to is None else t.full_fits_up_to
                                    for t in kinds]).ravel(),
                          np.stack([t.fwd_s + t.bwd_s for t in kinds]))

    stack_key = tuple(index)
    return (stack() if cache is None else cache.kind_tables(stack_key, stack)), kind_of


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
    fits is the greedy's answer. Each block only looks at the ends it needs and
    the layers those ranges can contain (the partition search mostly asks for
    short ranges), which leaves every answer as it is: a layer outside every range
    of the block changes no row.
    """
    b, n, arrays, order = costs.b, costs.n_in_flight, costs.arrays, costs.recompute_order
    weight_table, saved_table = arrays.weight_table, arrays.saved_table
    gain_all = (arrays.saved - arrays.input)[order]  # (T,)
    transient_all = (b * arrays.saved)[order]
    added_all = costs.fwd_s[order]
    starts = np.nonzero(todo.any(axis=1))[0]
    # Start layers per block: at most 32, and (T, starts, L+1) arrays of at most 4M entries.
    chunk = max(1, min(32, 4_000_000 // max(1, len(order) * todo.shape[1])))
    for c0 in range(0, len(starts), chunk):
        ks = starts[c0:c0 + chunk]
        rows_todo = todo[ks]  # (k, L+1)
        cols = np.nonzero(rows_todo.any(axis=0))[0]
        lo, hi = int(ks[0]), int(cols[-1])  # every range of the block lies in [lo, hi)
        ends = np.arange(int(cols[0]), hi + 1)
        keep = np.nonzero((order >= lo) & (order < hi))[0]  # positions in the greedy order
        if not len(keep):
            continue  # no layer worth recomputing: none of these ranges can fit
        o = order[keep][:, None, None]
        block = rows_todo[:, ends]  # (k, l)
        inside = (o >= ks[None, :, None]) & (o < ends[None, None, :]) & block[None, :, :]  # (T', k, l)
        saved_t = np.cumsum(np.where(inside, gain_all[keep][:, None, None], 0.0), axis=0)
        transient_t = np.maximum.accumulate(np.where(inside, transient_all[keep][:, None, None], 0.0), axis=0)
        added_t = np.cumsum(np.where(inside, added_all[keep][:, None, None], 0.0), axis=0)
        need = (weight_table[ks][:, ends][None] + n * b * (saved_table[ks][:, ends][None] - saved_t) + transient_t
                + b * arrays.loss_table[ks][:, ends][None])
        fit = need <= costs.budget_bytes
        usable = fit.any(axis=0) & block  # (k, l)
        first = np.argmax(fit, axis=0)  # (k, l)
        kk, ll = np.nonzero(usable)
        rows, lcols = ks[kk], ends[ll]
        costs.time_s[rows, lcols] = costs.base_s[rows, lcols] + added_t[first[kk, ll], kk, ll]
        costs.recompute_prefix[rows, lcols] = keep[first[kk, ll]] + 1


def build_stage_costs(profile: ModelProfile, devices: Sequence[Device], b: int, m: int, schedule: str,
                      optimizer: str, allow_recompute: bool = True,
                      cache: StageTableCache | None = None, reduce_copy: float = 0.0,
                      shares: tuple[float, ...] = (1.0, 1.0)) -> list[StageCosts]:
    """Stage tables for each position ``j`` of a VW over ``devices`` (in that order; ``reduce_copy``,
    ``shares``: ``build_model_arrays``)."""
    arrays = build_model_arrays(profile, optimizer, reduce_copy, shares)
    p = len(devices)
    out = []
    for j, dev in enumerate(devices):
        n = in_flight(schedule, m, p, j)
        figures = device_key(dev, b, optimizer, allow_recompute, reduce_copy, shares)
        key = (*figures, n)
        costs = cache.get(key) if cache is not None else None
        if costs is None:
            shared = None if cache is None else cache.device_tables(
                figures, functools.partial(_build_device, profile, arrays, dev, b, allow_recompute))
            costs = _build_one(profile, arrays, dev, b, n, allow_recompute, shared)
            if cache is not None:
                cache.put(key, costs)
        out.append(costs)
    return out


def link_time_table(cluster: Cluster, devices: Sequence[Device], arrays: ModelArrays, b: int) -> np.ndarray:
    """``c[j, k]``: activation + gradient transfer between positions j-1 and j when cut before layer k.

    Each is ``latency + b * output_bytes[k-1] / bandwidth`` (cost.estimate_p2p_time);
    row 0 is zero (no stage before the first).
    """
    idx = np.array([d.index for d in devices])
    bw = cluster.bandwidth_bytes_per_s[idx[:-1], idx[1:]].astype(float)[:, None]  # (p-1, 1)
    lat = cluster.latency_s[idx[:-1], idx[1:]].astype(float)[:, None]
    boundary = np.concatenate([[0.0], arrays.sent])[None, :]  # bytes/sample crossing a cut before layer k
    c = np.zeros((len(devices), len(arrays.output) + 1))
    c[1:] = 2 * (lat + b * boundary / bw)
    c[1:, 0] = INF  # a cut before layer 0 would leave stage j-1 empty
    return c

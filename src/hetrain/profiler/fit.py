"""What measurements become: fitted time models, merged and scaled profiles, link fits.

Pure Python and numpy, no torch: the planner side may import it.

- ``fit_error``: how well the per-layer model of time against micro-batch size
  predicts sizes it was not fitted on. Two models: ``"piecewise"`` (linear between
  measured sizes, ``cost.interpolate_measurements``, what the planner uses) and
  ``"linear"`` (least-squares ``a + c·b`` per layer; Barrachina et al. fit a small
  model per kernel in the same spirit).
- ``merge_profiles``: profiles of one model measured on several device types -> one.
- ``scale_to``: figures for catalog device types never measured, derived by the
  roofline ratio of ``cost.estimate_layer_time`` and marked ``source = "scaled"``.
- ``fit_link``: ``latency + bytes / bandwidth`` (Hockney) from timed messages.

Example:
    >>> from hetrain.profile import Measurement
    >>> ms = [Measurement(b, 0.001 * b, 0.002 * b) for b in (1, 2, 4, 8)]
    >>> round(fit_linear([m.micro_batch for m in ms], [m.forward_s for m in ms]).slope, 6)
    0.001
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hetrain.catalog import lookup_device_type
from hetrain.cluster import Device
from hetrain.cost import estimate_layer_time, interpolate_measurements
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile, ProfileError

TimeModel = Literal["piecewise", "linear"]
TIME_MODELS: tuple[str, ...] = ("piecewise", "linear")


# ---------------------------------------------------------------------------
# least squares
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x``, with the fit's RMS relative residual."""

    intercept: float
    slope: float
    residual: float

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_linear(xs: Sequence[float], ys: Sequence[float], relative: bool = False) -> LinearFit:
    """Least-squares line through ``(xs, ys)``.

    With ``relative=True`` the residuals are divided by ``y`` (each row of the
    system scaled by ``1 / y``), so points spanning orders of magnitude weigh
    alike: the small ones fix the intercept, the large ones the slope.

    Raises:
        ValueError: fewer than two distinct ``xs``, or lengths that differ.
    """
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"fit_linear: {x.size} xs but {y.size} ys")
    if np.unique(x).size < 2:
        raise ValueError(f"fit_linear needs two distinct x values, got {list(xs)}")
    a = np.stack([np.ones_like(x), x], axis=1)  # (n, 2)
    w = 1.0 / np.where(y > 0, y, 1.0) if relative else np.ones_like(y)
    (intercept, slope), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    pred = intercept + slope * x
    scale = np.where(y != 0, np.abs(y), 1.0)
    residual = float(np.sqrt(np.mean(((pred - y) / scale) ** 2)))
    return LinearFit(float(intercept), float(slope), residual)


def fit_link(sizes_bytes: Sequence[int], times_s: Sequence[float]) -> tuple[float, float, float]:
    """``(bandwidth_bytes_per_s, latency_s, residual)`` of ``t = latency + bytes / bandwidth``.

    Least squares on relative residuals (``fit_linear(relative=True)``). A slope
    that is not positive (all sizes within noise of each other) falls back to the
    largest message's throughput; a negative intercept (noise, or a token-bucket
    burst that speeds up the start of every message) is clamped to 0.
    """
    if len(sizes_bytes) != len(times_s) or not sizes_bytes:
        raise ValueError(f"fit_link: {len(sizes_bytes)} sizes but {len(times_s)} times")
    if len(set(sizes_bytes)) < 2:
        k = int(np.argmax(sizes_bytes))
        return sizes_bytes[k] / times_s[k], 0.0, 0.0
    fit = fit_linear(sizes_bytes, times_s, relative=True)
    if fit.slope > 0:
        bandwidth = 1.0 / fit.slope
    else:
        k = int(np.argmax(sizes_bytes))
        bandwidth = sizes_bytes[k] / times_s[k]
    return bandwidth, max(fit.intercept, 0.0), fit.residual


# ---------------------------------------------------------------------------
# time against micro-batch size
# ---------------------------------------------------------------------------


def predict_layer_time(ms: Sequence[Measurement], b: int, model: TimeModel = "piecewise") -> tuple[float, float]:
    """Forward and backward seconds at micro-batch ``b`` from measurements ``ms`` (sorted by size).

    ``"piecewise"``: ``cost.interpolate_measurements``. ``"linear"``: a least-squares
    line per direction, floored at 0; one measurement: proportional to ``b``.
    """
    if not ms:
        raise ValueError("predict_layer_time needs at least one measurement")
    if model == "piecewise":
        return interpolate_measurements(ms, b)
    if model != "linear":
        raise ValueError(f"time model must be one of {TIME_MODELS}, got {model!r}")
    if len({m.micro_batch for m in ms}) < 2:
        m0 = ms[0]
        return m0.forward_s * b / m0.micro_batch, m0.backward_s * b / m0.micro_batch
    sizes = [m.micro_batch for m in ms]
    fwd = fit_linear(sizes, [m.forward_s for m in ms]).predict(b)
    bwd = fit_linear(sizes, [m.backward_s for m in ms]).predict(b)
    return max(fwd, 0.0), max(bwd, 0.0)


@dataclass(frozen=True)
class FitError:
    """Relative error of a time model on held-out micro-batch sizes, for one device type.

    Attributes:
        type_name: the device type whose measurements were used.
        model: ``"piecewise"`` or ``"linear"``.
        held_out: the micro-batch sizes predicted without being fitted on.
        per_layer: per layer, mean over held-out sizes of |predicted - measured| / measured
            of forward + backward seconds.
        total: the same for the whole model (sums over layers), the figure a
            stage-time estimate depends on; small layers' noise averages out.
    """

    type_name: str
    model: str
    held_out: tuple[int, ...]
    per_layer: tuple[float, ...]
    total: float

    @property
    def mean(self) -> float:
        return float(np.mean(self.per_layer))

    @property
    def max(self) -> float:
        return float(np.max(self.per_layer))

    def summary(self) -> str:
        sizes = ", ".join(str(b) for b in self.held_out)
        return (f"{self.model} fit on {self.type_name}, held-out micro-batch {sizes}: "
                f"whole model {100 * self.total:.1f}%, per layer mean {100 * self.mean:.1f}% "
                f"max {100 * self.max:.1f}%")


def fit_error(profile: ModelProfile, type_name: str, held_out: Sequence[int] | None = None,
              model: TimeModel = "piecewise") -> FitError:
    """Error of the per-layer time model on micro-batch sizes it was not fitted on.

    Args:
        profile: a profile with measured times for ``type_name`` at 3 or more sizes.
        type_name: the device type, e.g. ``"cpu"`` or ``"A100-40GB"``.
        held_out: sizes to predict, fitted on all the other sizes at once. ``None``:
            leave-one-out over the interior sizes (each predicted from all the others),
            which tests interpolation, the planner's common case.
        model: ``"piecewise"`` or ``"linear"``.

    Raises:
        ProfileError: too few measured sizes, or held-out sizes that were not measured.

    Example:
        >>> fit_error(profile, "cpu").summary()        # doctest: +SKIP
        'piecewise fit on cpu, held-out micro-batch 2, 4: whole model 3.1%, ...'
    """
    per_layer_ms = [tuple(m for m in layer.measurements(type_name) if m.source == "measured")
                    for layer in profile.layers]
    sizes = sorted({m.micro_batch for ms in per_layer_ms for m in ms})
    if len(sizes) < 3:
        raise ProfileError(f"fit_error needs measurements at 3 or more micro-batch sizes on {type_name!r}; "
                           f"profile {profile.name!r} has {sizes or 'none'}")
    if held_out is None:
        folds = [[b] for b in sizes[1:-1]]
    else:
        missing = sorted(set(held_out) - set(sizes))
        if missing:
            raise ProfileError(f"held-out micro-batch sizes {missing} were not measured on {type_name!r} "
                               f"(measured: {sizes})")
        if len(set(sizes) - set(held_out)) < 2:
            raise ProfileError(f"holding out {sorted(held_out)} leaves fewer than 2 of {sizes} to fit on")
        folds = [sorted(set(held_out))]
    errors = np.zeros((len(profile.layers), sum(len(f) for f in folds)))
    total_pred = np.zeros(errors.shape[1])
    total_meas = np.zeros(errors.shape[1])
    for i, ms in enumerate(per_layer_ms):
        if not ms:
            raise ProfileError(f"layer {i} ({profile.layers[i].name}) has no measurement on {type_name!r}")
        col = 0
        for fold in folds:
            train = [m for m in ms if m.micro_batch not in fold]
            for b in fold:
                measured = [m for m in ms if m.micro_batch == b]
                if not measured or not train:
                    raise ProfileError(f"layer {i}: no measurement at micro-batch {b} on {type_name!r}")
                fwd, bwd = predict_layer_time(train, b, model)
                actual = measured[0].forward_s + measured[0].backward_s
                errors[i, col] = abs(fwd + bwd - actual) / actual if actual > 0 else 0.0
                total_pred[col] += fwd + bwd
                total_meas[col] += actual
                col += 1
    total = float(np.mean(np.abs(total_pred - total_meas) / np.where(total_meas > 0, total_meas, 1.0)))
    return FitError(type_name, model, tuple(b for f in folds for b in f),
                    tuple(float(e) for e in errors.mean(axis=1)), total)


# ---------------------------------------------------------------------------
# merging and scaling
# ---------------------------------------------------------------------------


def _measured_only(layer: LayerProfile) -> tuple[tuple[str, tuple[Measurement, ...]], ...]:
    kept = ((t, tuple(m for m in ms if m.source == "measured")) for t, ms in layer.measured)
    return tuple((t, ms) for t, ms in kept if ms)


def _check_same_model(profiles: Sequence[ModelProfile]) -> None:
    """Raise unless every profile has the first one's layers (count, parameter bytes), precision and seq_len."""
    if not profiles:
        raise ProfileError("merging profiles needs at least one profile")
    first = profiles[0]
    for k, p in enumerate(profiles[1:], start=1):
        if p.num_layers != first.num_layers:
            raise ProfileError(f"profile {k} ({p.name!r}) has {p.num_layers} layers, "
                               f"profile 0 ({first.name!r}) has {first.num_layers}: not the same model")
        if p.precision != first.precision:
            raise ProfileError(f"profile {k} ({p.name!r}) is {p.precision}, profile 0 is {first.precision}")
        if p.seq_len != first.seq_len:
            raise ProfileError(f"profile {k} ({p.name!r}) was measured at seq_len {p.seq_len}, profile 0 at "
                               f"{first.seq_len}: re-profile at one length")
        for i, (a, b) in enumerate(zip(first.layers, p.layers, strict=True)):
            if abs(a.param_bytes - b.param_bytes) > 1e-9 * max(a.param_bytes, 1.0):
                raise ProfileError(f"layer {i}: profile 0 has {a.param_bytes:.0f} parameter bytes "
                                   f"({a.name}), profile {k} has {b.param_bytes:.0f} ({b.name})")


def _with_measured(profiles: Sequence[ModelProfile], i: int,
                   measured: tuple[tuple[str, tuple[Measurement, ...]], ...]) -> LayerProfile:
    """Layer ``i`` of the first profile with ``measured``; byte and FLOP counts the largest any profile reports
    (saved bytes can differ a little between backends)."""
    return dataclasses.replace(
        profiles[0].layers[i],
        output_bytes_per_sample=max(p.layers[i].output_bytes_per_sample for p in profiles),
        saved_bytes_per_sample=max(p.layers[i].saved_bytes_per_sample for p in profiles),
        forward_flops_per_sample=max(p.layers[i].forward_flops_per_sample for p in profiles),
        measured=measured,
    )


def merge_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile holding the measurements of several (one per device type, typically).

    Layers must match one to one (same count, same parameter bytes) and precisions
    must agree. Measured figures win over scaled ones; for the same device type and
    micro-batch size a later profile's measurement replaces an earlier one's, and so
    for the optimizer step of the same device type and optimizer, and for a type's
    calibrated action overhead. Byte
    and FLOP counts are taken as the largest reported (saved bytes can differ a
    little between backends). Name and input come from the first profile.

    Raises:
        ProfileError: naming the profile and layer that do not match.

    Example:
        >>> both = merge_profiles([load_profile("cpu.json"), load_profile("a100.json")])  # doctest: +SKIP
    """
    _check_same_model(profiles)
    first = profiles[0]
    layers = []
    for i in range(first.num_layers):
        by_type: dict[str, dict[int, Measurement]] = {}
        for p in profiles:
            for type_name, ms in p.layers[i].measured:
                slot = by_type.setdefault(type_name, {})
                for m in ms:
                    old = slot.get(m.micro_batch)
                    if old is None or m.source == "measured" or old.source != "measured":
                        slot[m.micro_batch] = m
        layers.append(_with_measured(profiles, i, tuple((t, tuple(slot[b] for b in sorted(slot)))
                                                        for t, slot in by_type.items())))
    figures: dict[str, DeviceFigures] = {}
    rates: dict[str, dict[str, float]] = {}
    for p in profiles:
        figures.update(dict(p.measured_on))
        for type_name, by_optimizer in p.optimizer_step_s_per_byte:
            rates.setdefault(type_name, {}).update(by_optimizer)
    overheads: dict[str, float] = {}
    per_iteration: dict[str, float] = {}
    common: dict[str, float] = {}
    overhead_spreads: dict[str, float] = {}
    for p in profiles:
        overheads.update(dict(p.action_overhead_s))
        overhead_spreads.update(dict(p.action_overhead_spread_s))
        per_iteration.update(dict(p.iteration_overhead_s))
        common.update(dict(p.common_spread))
    return dataclasses.replace(first, layers=tuple(layers), measured_on=tuple(figures.items()),
                               optimizer_step_s_per_byte=tuple((t, tuple(r.items())) for t, r in rates.items()),
                               action_overhead_s=tuple(overheads.items()),
                               iteration_overhead_s=tuple(per_iteration.items()),
                               common_spread=tuple(common.items()),
                               action_overhead_spread_s=tuple(overhead_spreads.items()))


def estimate_common_spread(total_spread_s: float, part_spreads_s: Sequence[float], total_s: float) -> float:
    """The relative spread of a shift common to every part of a sum, from the spread of the sum and the parts'.

    Parts that vary independently add their variances: ``var(T) = sum_i var(t_i)``; a shift ``c``
    (a fraction) common to all of them adds ``(c T)^2`` on top (it moves every part the same way)::

        c = sqrt(max(s_T^2 - sum_i s_i^2, 0)) / T

    Here the parts are a device's layer times and the sum its whole model's time per repeat (or per
    device of a type); 0 where the sum strays no more than independent parts would make it, and where
    ``total_s`` is 0. Clipped to 1.

    Example:
        >>> round(estimate_common_spread(0.10, [0.01] * 10, 1.0), 4)  # 10 parts of 0.1 s, each 1% apart: common
        0.0995
    """
    if total_s <= 0:
        return 0.0
    excess = total_spread_s ** 2 - sum(s * s for s in part_spreads_s)
    return min(math.sqrt(max(excess, 0.0)) / total_s, 1.0)


def _iqr_spread(values: Sequence[float]) -> float:
    """IQR / 1.349 (``profiler.layers.estimate_spread``) of two or more values."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 1.349


def _common_between(profiles: Sequence[ModelProfile]) -> dict[str, float]:
    """Per device type measured by two or more of ``profiles`` (devices of that type profiled at once): the
    shift common to all of a device's layers that sets the devices apart (``estimate_common_spread`` of their
    whole-model forward + backward times against the layers' own spreads between devices), at the largest
    micro-batch size every layer was measured at on each of them."""
    out: dict[str, float] = {}
    types = {t for p in profiles for layer in p.layers for t, _ in _measured_only(layer)}
    for type_name in sorted(types):
        # per profile: {micro_batch: [f + b of each layer]}, complete sizes only
        per_profile: list[dict[int, list[float]]] = []
        for p in profiles:
            sizes: dict[int, list[float]] = {}
            for layer in p.layers:
                for m in dict(_measured_only(layer)).get(type_name, ()):
                    sizes.setdefault(m.micro_batch, []).append(m.forward_s + m.backward_s)
            complete = {b: ts for b, ts in sizes.items() if len(ts) == p.num_layers}
            if complete:
                per_profile.append(complete)
        common_sizes = set.intersection(*(set(d) for d in per_profile)) if len(per_profile) >= 2 else set()
        if not common_sizes:
            continue
        b = max(common_sizes)
        rows = [d[b] for d in per_profile]  # rows[device][layer]
        totals = [sum(r) for r in rows]
        parts = [_iqr_spread([r[i] for r in rows]) for i in range(len(rows[0]))]
        out[type_name] = estimate_common_spread(_iqr_spread(totals), parts, statistics.median(totals))
    return out


def _spread_of(spreads: Sequence[float | None], medians: Sequence[float]) -> float | None:
    """The spread of a median over devices: the larger of the devices' median spread over their own repeats and
    the spread between their medians (``profiler.layers.estimate_spread``: IQR / 1.349); None where no device
    knew its spread and there is one device."""
    known = [s for s in spreads if s is not None]
    within = statistics.median(known) if known else None
    if len(medians) < 2:
        return within
    q1, _, q3 = statistics.quantiles(medians, n=4, method="inclusive")
    return max(within or 0.0, (q3 - q1) / 1.349)


def _median_measurement(ms: Sequence[Measurement]) -> Measurement:
    """Several devices' measurements of one layer at one size as one: the medians and their spread."""
    forward, backward = [m.forward_s for m in ms], [m.backward_s for m in ms]
    return Measurement(ms[0].micro_batch, statistics.median(forward), statistics.median(backward), "measured",
                       _spread_of([m.forward_spread_s for m in ms], forward),
                       _spread_of([m.backward_spread_s for m in ms], backward))


def average_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from several measurements of the same device type(s): each measured time (per type, layer
    and micro-batch size) and each optimizer-step rate is the median over the profiles that have it; the
    spread of a time is the larger of the devices' spread over their repeats and the spread between devices;
    so is a type's ``common_spread`` (the devices' own, and the shift common to all layers that sets the
    devices apart, ``_common_between``).

    Several devices of one type, profiled at once, each time the same layers with their
    own noise (10-15% per layer on an emulated device); the median of two or more halves
    it or better. Scaled figures are dropped; byte and FLOP counts are the largest reported.

    Raises:
        ProfileError: the profiles are not of the same model (as ``merge_profiles``).

    Example:
        >>> slow = average_profiles([load_profile("slow-0.json"), load_profile("slow-1.json")])  # doctest: +SKIP
    """
    _check_same_model(profiles)
    layers = []
    for i in range(profiles[0].num_layers):
        samples: dict[str, dict[int, list[Measurement]]] = {}
        for p in profiles:
            for type_name, ms in _measured_only(p.layers[i]):
                for m in ms:
                    samples.setdefault(type_name, {}).setdefault(m.micro_batch, []).append(m)
        measured = tuple((t, tuple(_median_measurement(by_b[b]) for b in sorted(by_b))) for t, by_b in samples.items())
        layers.append(_with_measured(profiles, i, measured))
    figures: dict[str, DeviceFigures] = {}
    rates: dict[str, dict[str, list[float]]] = {}
    for p in profiles:
        figures.update(dict(p.measured_on))
        for type_name, by_optimizer in p.optimizer_step_s_per_byte:
            for name, rate in by_optimizer:
                rates.setdefault(type_name, {}).setdefault(name, []).append(rate)
    # a type's common shift: the larger of its devices' own (median) and the one that sets them apart
    own: dict[str, list[float]] = {}
    for p in profiles:
        for type_name, fraction in p.common_spread:
            own.setdefault(type_name, []).append(fraction)
    between = _common_between(profiles)
    common = {t: max(statistics.median(own[t]) if t in own else 0.0, between.get(t, 0.0))
              for t in [*own, *(t for t in between if t not in own)]}
    return dataclasses.replace(profiles[0], layers=tuple(layers), measured_on=tuple(figures.items()),
                               optimizer_step_s_per_byte=tuple(
                                   (t, tuple((n, statistics.median(v)) for n, v in r.items()))
                                   for t, r in rates.items()),
                               common_spread=tuple(common.items()))


def _catalog_device(type_name: str) -> Device:
    try:
        t = lookup_device_type(type_name)
    except KeyError as e:
        raise ProfileError(f"cannot scale to {e.args[0]}") from None
    return Device(name=f"scaled:{t.name}", node="scaled", index=0, type_name=t.name,
                  peak_fp32_flops=t.peak_fp32_flops, peak_fp16_flops=t.peak_fp16_flops,
                  memory_bytes=t.memory_bytes, memory_bandwidth_bytes_per_s=t.memory_bandwidth_bytes_per_s,
                  peak_bf16_flops=t.peak_bf16_flops)


def scale_to(profile: ModelProfile, device_types: Sequence[str]) -> ModelProfile:
    """Add ``source = "scaled"`` measurements for catalog types that were not measured.

    For each layer and each micro-batch size it was measured at, the time on the
    new type is ``cost.estimate_layer_time``: the measured time times the ratio of
    the two types' roofline times (DESIGN.md cost model). Types already measured
    are left as they are; scaled entries from an earlier call are recomputed from
    the measured ones, never from other scaled ones.

    Raises:
        ProfileError: an unknown device type (with near names), or a layer with no
            measurement to scale from.

    Example:
        >>> p = scale_to(profile_on_cpu, ["A100-40GB", "T4"])        # doctest: +SKIP
        >>> p.layers[0].measurements("T4")[0].source                 # doctest: +SKIP
        'scaled'
    """
    base = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, measured=_measured_only(layer)) for layer in profile.layers))
    devices = [_catalog_device(t) for t in device_types]
    layers = []
    for i, layer in enumerate(base.layers):
        if not layer.measured:
            raise ProfileError(f"layer {i} ({layer.name}) has no measured times to scale from")
        measured = dict(layer.measured)
        sizes = sorted({m.micro_batch for _, ms in layer.measured for m in ms})
        for dev in devices:
            if dev.type_name in measured:
                continue
            measured[dev.type_name] = tuple(
                Measurement(b, *estimate_layer_time(base, i, dev, b), source="scaled") for b in sizes)
        layers.append(dataclasses.replace(layer, measured=tuple(measured.items())))
    return dataclasses.replace(base, layers=tuple(layers))

"""Fits of measurements: a layer's time against micro-batch size, a link's time against message size.

Pure Python and numpy, no torch: the planning side and the profiler both use it.

- ``fit_linear``: a least-squares line, optionally on relative residuals.
- ``fit_link``: ``latency + bytes / bandwidth`` (Hockney) from timed messages.
- ``predict_from_measurements``: a layer's forward and backward seconds at a micro-batch size from its
  measurements, by one of two time models: ``"piecewise"`` (linear between measured sizes,
  ``cost.interpolate_measurements``, what the planner uses) and ``"linear"`` (least-squares ``a + c·b``
  per layer; Barrachina et al. fit a small model per kernel in the same spirit).
- ``fit_error``: how well a time model predicts sizes it was not fitted on.
- ``estimate_common_spread``: the spread common to all the parts of a sum (all of a device's layers).

Merged, averaged and scaled profiles are ``hetrain.profile_combine``'s.

Example:
    >>> from hetrain.profile import Measurement
    >>> ms = [Measurement(b, 0.001 * b, 0.002 * b) for b in (1, 2, 4, 8)]
    >>> round(fit_linear([m.micro_batch for m in ms], [m.forward_s for m in ms]).slope, 6)
    0.001
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hetrain.cost import interpolate_measurements
from hetrain.profile import Measurement, ModelProfile, ProfileError

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


def predict_from_measurements(ms: Sequence[Measurement], b: int, model: TimeModel = "piecewise") -> tuple[float, float]:
    """Forward and backward seconds at micro-batch ``b`` from measurements ``ms`` (sorted by size).

    ``"piecewise"``: ``cost.interpolate_measurements``. ``"linear"``: a least-squares
    line per direction, floored at 0; one measurement: proportional to ``b``.
    """
    if not ms:
        raise ValueError("predict_from_measurements needs at least one measurement")
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
                fwd, bwd = predict_from_measurements(train, b, model)
                actual = measured[0].forward_s + measured[0].backward_s
                errors[i, col] = abs(fwd + bwd - actual) / actual if actual > 0 else 0.0
                total_pred[col] += fwd + bwd
                total_meas[col] += actual
                col += 1
    total = float(np.mean(np.abs(total_pred - total_meas) / np.where(total_meas > 0, total_meas, 1.0)))
    return FitError(type_name, model, tuple(b for f in folds for b in f),
                    tuple(float(e) for e in errors.mean(axis=1)), total)


# ---------------------------------------------------------------------------
# the spread common to the parts of a sum
# ---------------------------------------------------------------------------


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

"""A learned per-layer time model for device types without measurements (Barrachina et al.).

Barrachina et al. predict each kernel's time with small models trained on measured kernels. Here one
model predicts, for a layer on a device type at micro-batch ``b``, how far its forward (backward) time
lies from the type's roofline time (``cost._roofline_layer`` at efficiency 1), in log space:

    g(type, layer, b, direction) ~ log(time / roofline time on that type)

from dimensionless or log features (``FEATURES``): the type's figures (peak FLOP/s in the profile's
precision, the fp16 peak, memory bandwidth), the layer's FLOPs against its bytes on that type,
the roofline time itself and the micro-batch size. A time on an unmeasured type ``T`` is then taken from
each measured type ``R`` of that layer, the way the roofline fallback does (``cost.estimate_layer_time``),
with the learned correction on top:

    log t_T = log t_R(b) + log(roof_T / roof_R) + g(T) - g(R)

and the predictions from all references are averaged in log space, each weighted by ``d^-p`` with ``d`` its
distance to T in the space of the type's figures (``type_distance``: log peak, log fp16 peak, log memory
bandwidth) and ``p`` the model's ``reference_power`` (0: a plain mean). Where g is exact this is exact;
where g is wrong by the same amount on two similar types the error cancels, and the nearer a reference,
the more alike the two types' errors.

The fitted model is gradient-boosted regression trees (``hetrain.profiler.learned`` trains it with
scikit-learn; cross-validated over GPU types it beat an MLP and a log-space linear model, and chose the
weighting p = 4, see benchmarks/RESULTS.md). It is saved as JSON (``save``/``load_time_model``): the
trees' arrays, read and evaluated here with numpy, so planning with a time model needs no scikit-learn.

Example:
    >>> model = load_time_model("time_model.json")                          # doctest: +SKIP
    >>> profile, types = apply_time_model(profile, cluster.devices, model)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from hetrain.catalog import DeviceType, lookup_device_type
from hetrain.cluster import Device
from hetrain.cost import _roofline_layer, interpolate_measurements
from hetrain.errors import InputError
from hetrain.profile import LayerProfile, Measurement, ModelProfile

FORMAT = "hetrain-layer-time-model"
FORMAT_VERSION = 1
#: the model's inputs, in order; every one dimensionless or the log of a figure in the unit its name says
FEATURES = (
    "backward",                      # 0 forward, 1 backward
    "log_micro_batch",
    "log_compute_over_memory_s",     # log(flops / peak) - log(bytes / bandwidth): which roof binds
    "log_roofline_s",                # log of the roofline time (small kernels sit far from their roof)
    "log_peak_tflops",               # in the profile's precision
    "log_peak_fp16_tflops",
    "log_bandwidth_gb_per_s",
    "log_fp16_over_peak",            # tensor-core headroom over the precision's peak
    "log_ridge_flops_per_byte",      # peak / bandwidth: the roofline's ridge point
)
#: a measured time below this (seconds) is taken as this in log space (some layers' backward is ~1 us)
MIN_TIME_S = 1e-6
#: the source of the measurements a time model writes (``Measurement.source``)
LEARNED_SOURCE = "learned"


class TimeModelError(InputError):
    """A time model file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class TypeFigures:
    """What the model knows of a device type: its peaks and memory bandwidth.

    Its memory is not a feature: it sets what fits, not how fast, and with a handful of types to train
    on, trees used it to tell the types apart and predicted held-out types worse (docs/profile.md).
    """

    peak_flops: float  # in the profile's precision
    peak_fp16_flops: float
    memory_bandwidth_bytes_per_s: float

    @staticmethod
    def of_device(device: Device, precision: str) -> TypeFigures:
        return TypeFigures(device.peak_flops(precision), device.peak_fp16_flops, device.memory_bandwidth_bytes_per_s)

    @staticmethod
    def of_type(t: DeviceType, precision: str) -> TypeFigures:
        return TypeFigures(t.peak_flops(precision), t.peak_fp16_flops, t.memory_bandwidth_bytes_per_s)

    @staticmethod
    def of_catalog(type_name: str, precision: str) -> TypeFigures | None:
        """The catalog's figures of ``type_name``, or None for a type the catalog does not know."""
        try:
            return TypeFigures.of_type(lookup_device_type(type_name), precision)
        except KeyError:
            return None

    def to_dict(self) -> dict[str, float]:
        return {"peak_flops": self.peak_flops, "peak_fp16_flops": self.peak_fp16_flops,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s}


def type_distance(a: TypeFigures, b: TypeFigures) -> float:
    """How far apart two types are: the Euclidean distance of (log peak, log fp16 peak, log bandwidth).

    Example:
        >>> x = TypeFigures(10e12, 40e12, 500e9)
        >>> round(type_distance(x, TypeFigures(10e12, 40e12, 500e9 * math.e)), 12)
        1.0
    """
    return math.sqrt(math.log(a.peak_flops / b.peak_flops) ** 2 + math.log(a.peak_fp16_flops / b.peak_fp16_flops) ** 2
                     + math.log(a.memory_bandwidth_bytes_per_s / b.memory_bandwidth_bytes_per_s) ** 2)


#: a reference this near (type_distance) counts as this near: a type measured twice under two names
MIN_TYPE_DISTANCE = 1e-3


def reference_weights(figures: TypeFigures, references: Sequence[TypeFigures], power: float) -> np.ndarray:
    """Weights (summing to 1) of the references' predictions for a type: ``d^-power``, d its distance."""
    d = np.array([max(type_distance(figures, r), MIN_TYPE_DISTANCE) for r in references])
    w: np.ndarray = d ** -power
    out: np.ndarray = w / w.sum()
    return out


def layer_features(profile: ModelProfile, i: int, figures: TypeFigures, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(features, roofline seconds) of layer ``i`` at micro-batch ``b`` on a type: rows forward, backward.

    The roofline time is ``cost._roofline_layer`` at efficiency 1; its bytes are the ones that function
    counts (forward: weights, input, output; backward: twice the weights, input, output, saved).
    """
    layer = profile.layers[i]
    in_bytes = profile.input_bytes_per_sample if i == 0 else profile.layers[i - 1].output_bytes_per_sample
    peak, bw = figures.peak_flops, figures.memory_bandwidth_bytes_per_s
    roof = np.maximum(np.array(_roofline_layer(layer, in_bytes, b, peak, bw, 1.0)), 1e-12)  # > 0: it divides
    flops = np.array([1.0, 2.0]) * b * layer.forward_flops_per_sample
    moved = np.array([layer.param_bytes + b * (in_bytes + layer.output_bytes_per_sample),
                      2 * layer.param_bytes + b * (in_bytes + layer.output_bytes_per_sample
                                                   + layer.saved_bytes_per_sample)])
    compute_s = np.maximum(flops / peak, 1e-12)  # an embedding has no FLOPs: far on the memory side
    memory_s = np.maximum(moved / bw, 1e-12)
    device = [math.log(peak / 1e12), math.log(figures.peak_fp16_flops / 1e12), math.log(bw / 1e9),
              math.log(figures.peak_fp16_flops / peak), math.log(peak / bw)]
    rows = np.array([[d, math.log(b), math.log(compute_s[d] / memory_s[d]), math.log(roof[d]), *device]
                     for d in (0, 1)])
    return rows, roof


@dataclass(frozen=True)
class Tree:
    """One regression tree as scikit-learn stores it: node k splits on ``feature[k] <= threshold[k]``
    (left) or goes right; a leaf has ``left[k] == -1`` and predicts ``value[k]``."""

    left: tuple[int, ...]
    right: tuple[int, ...]
    feature: tuple[int, ...]
    threshold: tuple[float, ...]
    value: tuple[float, ...]


@dataclass(frozen=True)
class LayerTimeModel:
    """Gradient-boosted trees for ``g`` = log(time / roofline time): ``init + learning_rate * sum(trees)``.

    Attributes:
        init: the constant the boosting starts from (the mean of the targets).
        learning_rate: the shrinkage of every tree.
        trees: the trees, in order.
        trained_on: the device types whose measurements trained it.
        precision: the precision of compute of the profiles it was trained on.
        reference_power: how much nearer references weigh (``reference_weights``); 0: all alike.
        sklearn_version: the scikit-learn that fitted it (a record; the file needs none to be read).
        path: the file it was read from ("" if built in memory).
        type_figures: per type it was trained on, the figures it learned that type with and where they
            came from (the catalog, a cluster file, ``--device-spec``, a profile); empty in files written
            before it was recorded.
        left_out: per measured type it was not trained on, why (its figures unknown).
    """

    init: float
    learning_rate: float
    trees: tuple[Tree, ...]
    trained_on: tuple[str, ...]
    precision: str
    reference_power: float = 0.0
    sklearn_version: str = ""
    path: str = ""
    type_figures: tuple[tuple[str, TypeFigures, str], ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()

    @cached_property
    def _packed(self) -> tuple[np.ndarray, ...]:
        """The trees as (trees, nodes) arrays, padded with leaves: left, right, feature, threshold, value."""
        shape = (len(self.trees), max((len(t.left) for t in self.trees), default=1))
        left, right, feature = np.full(shape, -1), np.full(shape, -1), np.zeros(shape, dtype=int)
        threshold, value = np.zeros(shape), np.zeros(shape)
        for k, t in enumerate(self.trees):
            n = len(t.left)
            left[k, :n], right[k, :n], feature[k, :n] = t.left, t.right, np.maximum(t.feature, 0)
            threshold[k, :n], value[k, :n] = t.threshold, t.value
        return left, right, feature, threshold, value

    def predict(self, x: np.ndarray) -> np.ndarray:
        """g for the rows of ``x`` (n, len(FEATURES)): every tree walked at once, one level per step."""
        left, right, feature, threshold, value = self._packed
        trees, rows = np.arange(len(self.trees))[:, None], np.arange(len(x))[None, :]
        node = np.zeros((len(self.trees), len(x)), dtype=int)
        while True:
            nxt = left[trees, node]
            inner = nxt >= 0
            if not inner.any():
                break
            go_left = x[rows, feature[trees, node]] <= threshold[trees, node]
            node = np.where(inner, np.where(go_left, nxt, right[trees, node]), node)
        out: np.ndarray = self.init + self.learning_rate * value[trees, node].sum(axis=0)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "gradient_boosted_trees",
                "features": list(FEATURES), "precision": self.precision, "trained_on": list(self.trained_on),
                "reference_power": self.reference_power,
                "type_figures": {t: {**f.to_dict(), "source": why} for t, f, why in self.type_figures},
                "left_out": dict(self.left_out),
                "sklearn_version": self.sklearn_version, "init": self.init, "learning_rate": self.learning_rate,
                "trees": [{"left": list(t.left), "right": list(t.right), "feature": list(t.feature),
                           "threshold": list(t.threshold), "value": list(t.value)} for t in self.trees]}

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (atomically)."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()) + "\n")
        tmp.replace(p)


def _field(data: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise TimeModelError(f"{where}: missing field {key!r}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TimeModelError(f"{where}: field {key!r} has the wrong type ({type(value).__name__}: {str(value)[:40]})")
    return value


def _tree_from(raw: Any, where: str) -> Tree:
    if not isinstance(raw, Mapping):
        raise TimeModelError(f"{where}: expected an object, got {type(raw).__name__}")
    arrays = {k: _field(raw, k, where, list) for k in ("left", "right", "feature", "threshold", "value")}
    n = len(arrays["left"])
    for key, v in arrays.items():
        if len(v) != n or n == 0:
            raise TimeModelError(f"{where}.{key}: {len(v)} entries, the tree has {n} nodes")
    try:
        left = tuple(int(v) for v in arrays["left"])
        right = tuple(int(v) for v in arrays["right"])
        feature = tuple(int(v) for v in arrays["feature"])
        threshold = tuple(float(v) for v in arrays["threshold"])
        value = tuple(float(v) for v in arrays["value"])
    except (TypeError, ValueError) as e:
        raise TimeModelError(f"{where}: a node entry is not a number ({e})") from None
    for k in range(n):
        if left[k] >= 0 and not (0 <= feature[k] < len(FEATURES) and k < left[k] < n and k < right[k] < n):
            raise TimeModelError(f"{where}: node {k} points outside the tree (feature {feature[k]}, "
                                 f"children {left[k]}, {right[k]} of {n} nodes)")
        if not math.isfinite(value[k]):
            raise TimeModelError(f"{where}.value[{k}]: {value[k]} is not finite")
    return Tree(left, right, feature, threshold, value)


def _type_records(data: Mapping[str, Any], path: str) -> tuple[tuple[tuple[str, TypeFigures, str], ...],
                                                                 tuple[tuple[str, str], ...]]:
    """The optional ``type_figures`` and ``left_out`` of a time model file (absent in older files: empty)."""
    used: list[tuple[str, TypeFigures, str]] = []
    recorded = _field(data, "type_figures", path, Mapping) if "type_figures" in data else {}
    for t, raw in recorded.items():
        where = f"{path}: type_figures[{t!r}]"
        if not isinstance(raw, Mapping):
            raise TimeModelError(f"{where}: expected an object, got {type(raw).__name__}")
        values = [float(_field(raw, k, where, (int, float))) for k in ("peak_flops", "peak_fp16_flops",
                                                                        "memory_bandwidth_bytes_per_s")]
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise TimeModelError(f"{where}: the figures {values} must be finite and > 0")
        used.append((str(t), TypeFigures(*values), str(_field(raw, "source", where, str))))
    left = _field(data, "left_out", path, Mapping) if "left_out" in data else {}
    return tuple(used), tuple((str(t), str(why)) for t, why in left.items())


def parse_time_model(data: Any, path: str = "time model") -> LayerTimeModel:
    """A LayerTimeModel from its JSON dict; TimeModelError names ``path`` and the field."""
    if not isinstance(data, Mapping):
        raise TimeModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise TimeModelError(f"{path}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    version = _field(data, "format_version", path, int)
    if version != FORMAT_VERSION:
        raise TimeModelError(f"{path}: field 'format_version' is {version}; this hetrain reads {FORMAT_VERSION}")
    features = _field(data, "features", path, list)
    if tuple(features) != FEATURES:
        raise TimeModelError(f"{path}: field 'features' is {features}; this hetrain computes {list(FEATURES)}")
    trees = tuple(_tree_from(t, f"{path}: trees[{k}]") for k, t in enumerate(_field(data, "trees", path, list)))
    init = float(_field(data, "init", path, (int, float)))
    rate = float(_field(data, "learning_rate", path, (int, float)))
    if not (math.isfinite(init) and math.isfinite(rate) and rate > 0):
        raise TimeModelError(f"{path}: fields 'init' {init} and 'learning_rate' {rate} must be finite, the rate > 0")
    power = float(_field(data, "reference_power", path, (int, float))) if "reference_power" in data else 0.0
    if not (math.isfinite(power) and power >= 0):
        raise TimeModelError(f"{path}: field 'reference_power' is {power}; it must be finite and >= 0")
    used, left = _type_records(data, path)
    return LayerTimeModel(init=init, learning_rate=rate, trees=trees,
                          trained_on=tuple(str(t) for t in _field(data, "trained_on", path, list)),
                          precision=str(_field(data, "precision", path, str)), reference_power=power,
                          sklearn_version=str(data.get("sklearn_version", "")), path=path,
                          type_figures=used, left_out=left)


def load_time_model(path: str | Path) -> LayerTimeModel:
    """Read a time model JSON file; TimeModelError (one line: the file and the field) if it cannot be used."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise TimeModelError(f"{path}: cannot read the time model ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise TimeModelError(f"{path}: not JSON (line {e.lineno}: {e.msg})") from None
    return parse_time_model(data, str(path))


#: ``g`` for rows of features: a LayerTimeModel's ``predict``, or any fitted regressor's
Predictor = Callable[[np.ndarray], np.ndarray]


def _measured_only(layer: LayerProfile) -> list[tuple[str, tuple[Measurement, ...]]]:
    kept = ((t, tuple(m for m in ms if m.source == "measured")) for t, ms in layer.measured)
    return [(t, ms) for t, ms in kept if ms]


def predict_layer_time(predict: Predictor, profile: ModelProfile, i: int, figures: TypeFigures,
                       b: int, reference_power: float = 0.0,
                       known: Mapping[str, TypeFigures] | None = None) -> tuple[float, float]:
    """Forward and backward seconds of layer ``i`` at micro-batch ``b`` on a type with ``figures``.

    From every measured type of the layer whose figures are known (g needs them): in ``known`` (a model's
    ``type_figures``: types it was trained on, custom ones too) or else in the catalog,
    ``t_R(b) * roof_T / roof_R * exp(g_T - g_R)``, averaged in log space with ``reference_weights`` at
    ``reference_power``. No such reference: the learned time straight from the roofline, ``roof_T * exp(g_T)``.
    """
    here, roof_here = layer_features(profile, i, figures, b)
    refs = [(ms, fig) for t, ms in _measured_only(profile.layers[i])
            if (fig := (known or {}).get(t) or TypeFigures.of_catalog(t, profile.precision)) is not None]
    feats = [layer_features(profile, i, fig, b) for _, fig in refs]
    g = predict(np.vstack([here, *(f for f, _ in feats)])).reshape(-1, 2)  # rows: this type, then each reference
    if not refs:
        out = roof_here * np.exp(g[0])
    else:
        logs = [np.log(np.maximum(np.array(interpolate_measurements(ms, b)), MIN_TIME_S))
                + np.log(roof_here / roof_there) + g[0] - g[1 + k]
                for k, ((ms, _), (_, roof_there)) in enumerate(zip(refs, feats, strict=True))]
        w = reference_weights(figures, [fig for _, fig in refs], reference_power)
        out = np.exp(np.sum(w[:, None] * np.array(logs), axis=0))
    return float(out[0]), float(out[1])


def apply_time_model(profile: ModelProfile, devices: Sequence[Device],
                     model: LayerTimeModel) -> tuple[ModelProfile, tuple[str, ...]]:
    """The profile with ``source = "learned"`` measurements for the device types it has no measurements of.

    For each such type among ``devices``, each layer gets the model's time at every micro-batch size
    measured on any type (between them the cost model interpolates, as for measured ones). Types with
    measurements are left as they are. Returns the new profile and the types it learned, sorted.

    Raises:
        TimeModelError: the model was trained in another precision than the profile's.
    """
    if model.precision != profile.precision:
        raise TimeModelError(f"{model.path or 'time model'}: field 'precision' is {model.precision!r}, the "
                             f"profile {profile.name!r} is {profile.precision!r}; fit a model on "
                             f"{profile.precision} profiles")
    measured_types = {t for layer in profile.layers for t, _ in _measured_only(layer)}
    targets: dict[str, TypeFigures] = {}
    for d in devices:
        if d.type_name not in measured_types:
            targets.setdefault(d.type_name, TypeFigures.of_device(d, profile.precision))
    if not targets:
        return profile, ()
    known = {t: f for t, f, _ in model.type_figures}
    layers = []
    for i, layer in enumerate(profile.layers):
        sizes = sorted({m.micro_batch for _, ms in _measured_only(layer) for m in ms}) or [1]
        measured = [(t, ms) for t, ms in layer.measured if t not in targets]
        for type_name, fig in targets.items():
            measured.append((type_name, tuple(
                Measurement(b, *predict_layer_time(model.predict, profile, i, fig, b, model.reference_power, known),
                            source=LEARNED_SOURCE)
                for b in sizes)))
        layers.append(replace(layer, measured=tuple(measured)))
    return replace(profile, layers=tuple(layers)), tuple(sorted(targets))

"""Training the learned layer-time model (``hetrain.time_model``) on measured profiles, with scikit-learn.

Every measured (layer, device type, micro-batch size, direction) of the profiles is one sample: the
features of ``time_model.layer_features`` and the target ``log(measured / roofline time)``. Three
regressors can be fitted (``KINDS``): gradient-boosted trees (what ``fit_time_model`` saves: the most
accurate in leave-one-GPU-type-out, benchmarks/learned_time_model.py), a small MLP and a log-space linear
model (ridge), the two baselines.

    hetrain fit-time-model --profiles a100.json v100.json ... [--cluster c.toml] [--device-spec SPEC] -o time_model.json

A measured type is learned from where its figures are known (``choose_type``: ``--device-spec`` or a cluster
file, the catalog, the profile's ``measured_on``); the others are left out, each with its reason, printed and
saved in the model (``LayerTimeModel.left_out``). Nothing here is chosen by cross-validation: the trees'
settings and ``REFERENCE_POWER`` are constants, chosen in benchmarks/learned_time_model.py with each held-out
type out of the choice (nested leave-one-type-out).

Example:
    >>> model = fit_time_model([load_profile("merged.json")])     # doctest: +SKIP
    >>> model.save("time_model.json")                             # doctest: +SKIP
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetrain.catalog import DeviceType, lookup_device_type
from hetrain.profile import ModelProfile, ProfileError, load_profile
from hetrain.time_model import (
    MIN_TIME_S,
    LayerTimeModel,
    Predictor,
    Tree,
    TypeFigures,
    layer_features,
)

KINDS = ("trees", "mlp", "linear")
#: the boosting's settings: shallow trees, many small steps (fixed, not tuned per held-out type)
TREES = {"n_estimators": 200, "max_depth": 3, "learning_rate": 0.05, "random_state": 0}
#: the reference weightings the type-out cross-validation chooses among (``time_model.reference_weights``)
REFERENCE_POWERS = (0.0, 2.0, 4.0)
#: the weighting a saved model uses: the one leave-one-type-out over all 7 GPU types of the Sailor profiles
#: chose (benchmarks/learned_time_model.py, "chosen on all types")
REFERENCE_POWER = 4.0


@dataclass(frozen=True)
class TypeChoice:
    """One measured device type of the profiles: the figures the model learns it with, or why it is left out.

    Attributes:
        type_name: the type as the profiles name it.
        figures: its figures in the profiles' precision (``time_model.FEATURES`` needs all three); None: left out.
        why: where the figures come from, or why it is left out (``choose_type``).
    """

    type_name: str
    figures: TypeFigures | None
    why: str

    def line(self) -> str:
        """``"L40S: used: figures from the catalog (L40S [L40S])"`` or ``"P40: left out: ..."``."""
        return f"{self.type_name}: {'used' if self.figures is not None else 'left out'}: {self.why}"


def _canonical(type_name: str) -> str:
    try:
        return lookup_device_type(type_name).name
    except KeyError:
        return type_name


def choose_type(type_name: str, profiles: Sequence[ModelProfile],
                declared: Mapping[str, DeviceType] | None = None) -> TypeChoice:
    """The figures of ``type_name``, first found of: ``declared`` (a cluster file, ``--device-spec``, keyed by
    type name), the catalog, a profile's ``measured_on``. A profile records a type's peak in its own precision
    and its memory bandwidth; the fp16 peak the model also needs is that peak in an fp16 or bf16 profile
    (bf16 runs at the fp16 rate but on Volta and Turing, which the catalog knows), unknown in an fp32 one.
    """
    precision = _precision(profiles)
    spec = {_canonical(k): t for k, t in (declared or {}).items()}.get(_canonical(type_name))
    if spec is not None:
        return TypeChoice(type_name, TypeFigures.of_type(spec, precision), f"figures from {spec.source}")
    try:
        t = lookup_device_type(type_name)
        return TypeChoice(type_name, TypeFigures.of_type(t, precision),
                          f"figures from the catalog ({t.name} [{t.source}])")
    except KeyError:
        pass
    recorded = next(((p, f) for p in profiles if (f := p.figures_of(type_name)) is not None), None)
    fix = "add it to the cluster file (--cluster) or --device-spec"
    if recorded is None:
        return TypeChoice(type_name, None, f"its peak {precision} TFLOPS is unknown (not in the catalog, not in its "
                                           f"profile); {fix}")
    p, f = recorded
    if precision == "fp32":
        return TypeChoice(type_name, None, f"its peak fp16 TFLOPS is unknown (not in the catalog; profile {p.name!r} "
                                           "records its fp32 peak and memory bandwidth only); "
                                           f"{fix} with tflops_fp16")
    return TypeChoice(type_name, TypeFigures(f.peak_flops, f.peak_flops, f.memory_bandwidth_bytes_per_s),
                      f"figures from profile {p.name!r} (measured_on: {precision} peak "
                      f"{f.peak_flops / 1e12:.4g} TFLOPS, taken as its fp16 peak; "
                      f"{f.memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s)")


def choose_types(profiles: Sequence[ModelProfile], declared: Mapping[str, DeviceType] | None = None,
                 exclude: Sequence[str] = ()) -> tuple[TypeChoice, ...]:
    """``choose_type`` of every type with measured layer times in the profiles, less ``exclude``, sorted."""
    names = sorted({t for p in profiles for layer in p.layers for t, ms in layer.measured
                    if t not in exclude and any(m.source == "measured" for m in ms)})
    return tuple(choose_type(t, profiles, declared) for t in names)


def _precision(profiles: Sequence[ModelProfile]) -> str:
    precisions = sorted({p.precision for p in profiles})
    if len(precisions) != 1:
        raise ProfileError(f"the profiles are in {', '.join(precisions) or 'no precision'}; fit one time model "
                           "per precision")
    return precisions[0]


def training_set(profiles: Sequence[ModelProfile], exclude: Sequence[str] = (),
                 declared: Mapping[str, DeviceType] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(features, log(time / roofline time)) of every measured layer time on a type with known figures
    (``choose_types``) not in ``exclude``.

    Raises:
        ProfileError: profiles in different precisions, or no measured time to train on.
    """
    return _training_rows(profiles, choose_types(profiles, declared, exclude))


def _training_rows(profiles: Sequence[ModelProfile], choices: Sequence[TypeChoice]) -> tuple[np.ndarray, np.ndarray]:
    """``training_set`` of the types ``choices`` gives figures for."""
    figures = {c.type_name: c.figures for c in choices if c.figures is not None}
    xs: list[np.ndarray] = []
    ys: list[float] = []
    for profile in profiles:
        for i, layer in enumerate(profile.layers):
            for type_name, ms in layer.measured:
                fig = figures.get(type_name)
                if fig is None:
                    continue
                for m in ms:
                    if m.source != "measured":
                        continue
                    rows, roof = layer_features(profile, i, fig, m.micro_batch)
                    for d, seconds in enumerate((m.forward_s, m.backward_s)):
                        xs.append(rows[d])
                        ys.append(math.log(max(seconds, MIN_TIME_S) / max(float(roof[d]), 1e-12)))
    if not xs:
        left = "; ".join(c.line() for c in choices)
        raise ProfileError(f"no measured layer times on a device type with known figures: nothing to fit the time "
                           f"model on ({left or 'no measured type'})")
    return np.array(xs), np.array(ys)


def trained_types(profiles: Sequence[ModelProfile], exclude: Sequence[str] = (),
                  declared: Mapping[str, DeviceType] | None = None) -> tuple[str, ...]:
    """The measured types of the profiles with known figures, less ``exclude``, sorted."""
    return tuple(c.type_name for c in choose_types(profiles, declared, exclude) if c.figures is not None)


def fit_regressor(profiles: Sequence[ModelProfile], kind: str = "trees", exclude: Sequence[str] = ()) -> Predictor:
    """A fitted regressor of ``kind`` (``KINDS``) for g, as a function of feature rows."""
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.linear_model import Ridge
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = training_set(profiles, exclude)
    est: Any
    if kind == "trees":
        est = GradientBoostingRegressor(**TREES)
    elif kind == "mlp":
        est = make_pipeline(StandardScaler(), MLPRegressor(hidden_layer_sizes=(16, 16), alpha=1e-2, max_iter=5000,
                                                           random_state=0))
    elif kind == "linear":
        est = make_pipeline(StandardScaler(), Ridge(alpha=1.0))
    else:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(KINDS)}")
    est.fit(x, y)
    predict: Predictor = est.predict
    return predict


def fit_time_model(profiles: Sequence[ModelProfile], exclude: Sequence[str] = (),
                   reference_power: float = REFERENCE_POWER,
                   declared: Mapping[str, DeviceType] | None = None) -> LayerTimeModel:
    """Gradient-boosted trees for g, fitted on the profiles' measured times, as a LayerTimeModel.

    It learns from every measured type whose figures are known (``choose_types``: ``declared``, the catalog,
    the profile) and records, for each measured type, where its figures came from or why it was left out.

    Raises:
        ProfileError: profiles in different precisions, or nothing to fit on.
    """
    return _fit(profiles, exclude, reference_power, declared)[0]


def _fit(profiles: Sequence[ModelProfile], exclude: Sequence[str], reference_power: float,
         declared: Mapping[str, DeviceType] | None) -> tuple[LayerTimeModel, int]:
    """``fit_time_model``, and how many layer times (forward and backward each) it was fitted on."""
    import sklearn
    from sklearn.ensemble import GradientBoostingRegressor

    precision = _precision(profiles)
    choices = choose_types(profiles, declared, exclude)
    x, y = _training_rows(profiles, choices)
    est = GradientBoostingRegressor(**TREES).fit(x, y)
    trees = []
    for stage in est.estimators_[:, 0]:
        t = stage.tree_
        trees.append(Tree(left=tuple(int(v) for v in t.children_left), right=tuple(int(v) for v in t.children_right),
                          feature=tuple(int(v) for v in t.feature), threshold=tuple(float(v) for v in t.threshold),
                          value=tuple(float(v) for v in t.value[:, 0, 0])))
    init = float(np.ravel(est.init_.predict(x[:1]))[0])
    model = LayerTimeModel(init=init, learning_rate=float(est.learning_rate), trees=tuple(trees),
                           trained_on=tuple(c.type_name for c in choices if c.figures is not None),
                           precision=precision, reference_power=reference_power, sklearn_version=sklearn.__version__,
                           type_figures=tuple((c.type_name, c.figures, c.why) for c in choices
                                              if c.figures is not None),
                           left_out=tuple((c.type_name, c.why) for c in choices if c.figures is None))
    return model, len(x)


def load_declared_types(cluster_paths: Sequence[str] = (), device_specs: Sequence[str] = ()) -> dict[str, DeviceType]:
    """Device types by name from cluster files (the custom types they list, and catalog types whose figures
    they change) and ``--device-spec`` texts (``cluster.parse_device_type``); a later one replaces an earlier
    one of the same name."""
    from hetrain.cluster import load_cluster, parse_device_type

    declared: dict[str, DeviceType] = {}
    for path in cluster_paths:
        for d in load_cluster(path).devices:
            try:
                t = lookup_device_type(d.type_name)
                if (t.peak_fp32_flops, t.peak_fp16_flops, t.peak_bf16_flops, t.memory_bandwidth_bytes_per_s) == (
                        d.peak_fp32_flops, d.peak_fp16_flops, d.peak_bf16_flops, d.memory_bandwidth_bytes_per_s):
                    continue  # the catalog's figures: say so
            except KeyError:
                pass
            declared[d.type_name] = DeviceType(d.type_name, d.peak_fp32_flops, d.peak_fp16_flops, d.memory_bytes,
                                               d.memory_bandwidth_bytes_per_s, f"cluster file {path}",
                                               d.peak_bf16_flops)
    for text in device_specs:
        t = parse_device_type(text)
        declared[t.name] = t
    return declared


def run_fit_command(profile_paths: Sequence[str], output: str, cluster_paths: Sequence[str] = (),
                    device_specs: Sequence[str] = ()) -> int:
    """``hetrain fit-time-model``: fit on the profiles, save, print which types it learned from (and where
    their figures came from) and which it left out and why, one line per type."""
    profiles = [load_profile(p) for p in profile_paths]
    declared = load_declared_types(cluster_paths, device_specs)
    model, samples = _fit(profiles, (), REFERENCE_POWER, declared)
    model.save(output)
    print(f"hetrain fit-time-model: {len(model.trees)} trees on {samples} measured layer times of "
          f"{len(model.trained_on)} device types ({model.precision}) -> {output}", file=sys.stdout)
    for choice in [TypeChoice(t, f, why) for t, f, why in model.type_figures] + \
            [TypeChoice(t, None, why) for t, why in model.left_out]:
        print(f"  {choice.line()}", file=sys.stdout)
    return 0

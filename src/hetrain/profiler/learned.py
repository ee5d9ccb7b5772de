"""Training the learned layer-time model (``hetrain.time_model``) on measured profiles, with scikit-learn.

Every measured (layer, device type, micro-batch size, direction) of the profiles is one sample: the
features of ``time_model.layer_features`` and the target ``log(measured / roofline time)``. Three
regressors can be fitted (``KINDS``): gradient-boosted trees (what ``fit_time_model`` saves: the most
accurate in leave-one-GPU-type-out, benchmarks/learned_time_model.py), a small MLP and a log-space linear
model (ridge), the two baselines.

    hetrain fit-time-model --profiles a100.json v100.json ... -o time_model.json

Example:
    >>> model = fit_time_model([load_profile("merged.json")])     # doctest: +SKIP
    >>> model.save("time_model.json")                             # doctest: +SKIP
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def training_set(profiles: Sequence[ModelProfile], exclude: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(features, log(time / roofline time)) of every measured layer time on a catalog type not in ``exclude``.

    Raises:
        ProfileError: no measured time to train on.
    """
    xs: list[np.ndarray] = []
    ys: list[float] = []
    for profile in profiles:
        for i, layer in enumerate(profile.layers):
            for type_name, ms in layer.measured:
                fig = TypeFigures.of_catalog(type_name, profile.precision)
                if fig is None or type_name in exclude:
                    continue
                for m in ms:
                    if m.source != "measured":
                        continue
                    rows, roof = layer_features(profile, i, fig, m.micro_batch)
                    for d, seconds in enumerate((m.forward_s, m.backward_s)):
                        xs.append(rows[d])
                        ys.append(math.log(max(seconds, MIN_TIME_S) / max(float(roof[d]), 1e-12)))
    if not xs:
        raise ProfileError("no measured layer times on a device type the catalog knows: nothing to fit the time "
                           "model on")
    return np.array(xs), np.array(ys)


def trained_types(profiles: Sequence[ModelProfile], exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The measured catalog types of the profiles, less ``exclude``, sorted."""
    return tuple(sorted({t for p in profiles for layer in p.layers for t, ms in layer.measured
                         if t not in exclude and any(m.source == "measured" for m in ms)
                         and TypeFigures.of_catalog(t, p.precision) is not None}))


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
                   reference_power: float = REFERENCE_POWER) -> LayerTimeModel:
    """Gradient-boosted trees for g, fitted on the profiles' measured times, as a LayerTimeModel.

    Raises:
        ProfileError: profiles in different precisions, or nothing to fit on.
    """
    import sklearn
    from sklearn.ensemble import GradientBoostingRegressor

    precisions = sorted({p.precision for p in profiles})
    if len(precisions) != 1:
        raise ProfileError(f"the profiles are in {', '.join(precisions)}; fit one time model per precision")
    x, y = training_set(profiles, exclude)
    est = GradientBoostingRegressor(**TREES).fit(x, y)
    trees = []
    for stage in est.estimators_[:, 0]:
        t = stage.tree_
        trees.append(Tree(left=tuple(int(v) for v in t.children_left), right=tuple(int(v) for v in t.children_right),
                          feature=tuple(int(v) for v in t.feature), threshold=tuple(float(v) for v in t.threshold),
                          value=tuple(float(v) for v in t.value[:, 0, 0])))
    init = float(np.ravel(est.init_.predict(x[:1]))[0])
    return LayerTimeModel(init=init, learning_rate=float(est.learning_rate), trees=tuple(trees),
                          trained_on=trained_types(profiles, exclude), precision=precisions[0],
                          reference_power=reference_power, sklearn_version=sklearn.__version__)


def run_fit_command(profile_paths: Sequence[str], output: str) -> int:
    """``hetrain fit-time-model``: fit on the profiles, save, print what it was trained on."""
    profiles = [load_profile(p) for p in profile_paths]
    model = fit_time_model(profiles)
    model.save(output)
    x, _ = training_set(profiles)
    print(f"hetrain fit-time-model: {len(model.trees)} trees on {len(x)} measured layer times of "
          f"{', '.join(model.trained_on)} ({model.precision}) -> {output}", file=sys.stdout)
    return 0

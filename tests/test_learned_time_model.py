"""The learned layer-time model: fitted on measured profiles, saved and read back, used by the planner for
a device type without measurements, and better than the roofline ratio on GPU types it never saw.

Data: tests/data/sailor_*.json, three layers (embedding, one block, head) of OPT-350M (7 GPU types) and
GPT-Neo-2.7B (4 types) from the Sailor project's measured profiles (tests/data/README.md).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetrain.catalog import lookup_device_type
from hetrain.cli import main
from hetrain.cluster import Device
from hetrain.cost import estimate_layer_time, estimate_layer_times
from hetrain.plan import load_plan
from hetrain.profile import ModelProfile, load_profile
from hetrain.time_model import (
    TimeModelError,
    TypeFigures,
    apply_time_model,
    layer_features,
    load_time_model,
    predict_layer_time,
)

pytest.importorskip("sklearn")  # training needs the train extra; reading a model does not

from hetrain.profiler.learned import fit_regressor, fit_time_model

DATA = Path(__file__).resolve().parent / "data"
OPT = DATA / "sailor_OPT-350M.json"
NEO = DATA / "sailor_GPT-Neo-2.7B.json"


def _profiles() -> list[ModelProfile]:
    return [load_profile(OPT), load_profile(NEO)]


def _device(type_name: str, name: str = "d") -> Device:
    t = lookup_device_type(type_name)
    return Device(name=name, node="n", index=0, type_name=t.name, peak_fp32_flops=t.peak_fp32_flops,
                  peak_fp16_flops=t.peak_fp16_flops, memory_bytes=t.memory_bytes,
                  memory_bandwidth_bytes_per_s=t.memory_bandwidth_bytes_per_s)


def _without(profile: ModelProfile, type_name: str, first: str | None = None) -> ModelProfile:
    def keep(measured: tuple) -> tuple:
        return tuple(sorted(((t, ms) for t, ms in measured if t != type_name), key=lambda e: e[0] != first))
    return dataclasses.replace(profile, layers=tuple(dataclasses.replace(x, measured=keep(x.measured))
                                                     for x in profile.layers))


def _whole_model_error(profile: ModelProfile, type_name: str, estimate) -> float:  # type: ignore[no-untyped-def]
    """Mean over T's measured micro-batch sizes of |sum of predicted fwd+bwd - measured| / measured."""
    sizes = sorted({m.micro_batch for x in profile.layers for m in x.measurements(type_name)})
    errs = []
    for b in sizes:
        measured = sum(m.forward_s + m.backward_s for x in profile.layers for m in x.measurements(type_name)
                       if m.micro_batch == b)
        predicted = sum(sum(estimate(i, b)) for i in range(profile.num_layers))
        errs.append(abs(predicted - measured) / measured)
    return statistics.fmean(errs)


def _learned_error(profiles: list[ModelProfile], profile: ModelProfile, held: str) -> float:
    """The learned model's whole-model error on ``held``, fitted and predicting without it."""
    predict = fit_regressor(profiles, "trees", exclude=[held])
    rest, fig = _without(profile, held), TypeFigures.of_catalog(held, "fp32")
    assert fig is not None
    return _whole_model_error(profile, held, lambda i, b: predict_layer_time(predict, rest, i, fig, b))


def _roofline_error(profile: ModelProfile, held: str, reference: str) -> float:
    """hetrain's roofline fallback's whole-model error on ``held``, scaled from ``reference``."""
    rest, dev = _without(profile, held, reference), _device(held)
    return _whole_model_error(profile, held, lambda i, b: estimate_layer_time(rest, i, dev, b))


def test_model_round_trips_to_disk(tmp_path: Path) -> None:
    model = fit_time_model(_profiles())
    path = tmp_path / "time_model.json"
    model.save(path)
    back = load_time_model(path)
    assert back.trained_on == model.trained_on and len(back.trees) == len(model.trees) == 200
    assert back.precision == "fp32" and back.path == str(path)
    p = load_profile(OPT)
    rows = np.vstack([layer_features(p, i, TypeFigures.of_catalog("T4", "fp32"), b)[0]  # type: ignore[arg-type]
                      for i in range(p.num_layers) for b in (1, 3, 16)])
    np.testing.assert_array_equal(back.predict(rows), model.predict(rows))
    # the numpy evaluation of the saved trees is scikit-learn's own prediction
    np.testing.assert_allclose(model.predict(rows), fit_regressor(_profiles(), "trees")(rows), rtol=1e-12)


def test_plan_takes_an_unmeasured_types_layer_times_from_the_model(tmp_path: Path, capsys) -> None:
    model_path, plan_path = tmp_path / "time_model.json", tmp_path / "plan.json"
    assert main(["fit-time-model", "--profiles", str(OPT), str(NEO), "-o", str(model_path)]) == 0
    assert "A100-40GB" in capsys.readouterr().out
    cluster = tmp_path / "c.toml"
    cluster.write_text('name = "mix"\n[[node]]\nname = "a"\ndevices = [{ type = "A100-40GB", count = 2 }]\n'
                       'intra_link = "nvlink3"\nnic = "100Gbit/s"\n'
                       '[[node]]\nname = "t"\ndevices = [{ type = "T4", count = 2 }]\nintra_link = "pcie3"\n'
                       'nic = "10Gbit/s"\n')
    assert main(["plan", "--cluster", str(cluster), "--profile", str(OPT), "--global-batch", "8",
                 "--time-model", str(model_path), "-o", str(plan_path)]) == 0
    assert f"layer times for T4 from the learned model ({model_path})" in capsys.readouterr().out
    plan = load_plan(plan_path)
    assert plan.options["time_model"] == {"file": str(model_path), "types": ["T4"]}
    model, original, t4 = load_time_model(model_path), load_profile(OPT), _device("T4")
    for i, layer in enumerate(plan.profile.layers):
        ms = layer.measurements("T4")
        assert ms and all(m.source == "learned" for m in ms)
        assert layer.measurements("A100-40GB") == original.layers[i].measurements("A100-40GB")
        for m in ms:  # what the plan's cost model uses for T4 is the model's prediction ...
            fig = TypeFigures.of_device(t4, "fp32")
            assert (m.forward_s, m.backward_s) == pytest.approx(predict_layer_time(model.predict, original, i, fig,
                                                                                   m.micro_batch), rel=1e-12)
    fwd, bwd = estimate_layer_times(plan.profile, t4, 4)
    roof = [estimate_layer_time(original, i, t4, 4) for i in range(original.num_layers)]
    # ... and not the roofline ratio's
    assert all(abs(f / r[0] - 1) > 0.05 for f, r in zip(fwd, roof, strict=True))
    assert sum(fwd) + sum(bwd) != pytest.approx(sum(sum(r) for r in roof), rel=0.05)


def test_without_a_model_the_profile_and_plan_are_unchanged() -> None:
    p = load_profile(OPT)
    model = fit_time_model(_profiles())
    same, learned = apply_time_model(p, [_device("A100-40GB"), _device("V100-16GB")], model)
    assert learned == () and same is p


def test_leave_one_type_out_beats_the_roofline_ratio() -> None:
    """Each GPU type of the OPT subset held out of training: the learned model's whole-model error is at
    least 2x smaller than the roofline fallback's (hetrain's cost.estimate_layer_time from each other type
    in turn, averaged), on average over the types."""
    profiles = _profiles()
    opt = profiles[0]
    types = [t for t, _ in opt.measured_on]
    assert len(types) == 7
    learned, roofline = [], []
    for held in types:
        learned.append(_learned_error(profiles, opt, held))
        roofline.append(statistics.fmean(_roofline_error(opt, held, r) for r in types if r != held))
    assert statistics.fmean(learned) * 2 <= statistics.fmean(roofline), (learned, roofline)


def test_bad_model_file_is_one_line_naming_file_and_field(tmp_path: Path, capsys) -> None:
    good = fit_time_model(_profiles()).to_dict()
    bad = tmp_path / "bad.json"
    broken = json.loads(json.dumps(good))
    del broken["trees"][3]["threshold"]
    bad.write_text(json.dumps(broken))
    with pytest.raises(TimeModelError, match=r"bad\.json: trees\[3\]: missing field 'threshold'"):
        load_time_model(bad)
    broken = {**good, "precision": 3}
    bad.write_text(json.dumps(broken))
    with pytest.raises(TimeModelError, match=r"bad\.json: field 'precision' has the wrong type"):
        load_time_model(bad)
    bad.write_text("{not json")
    assert main(["plan", "--cluster", str(DATA.parent.parent / "examples/clusters/cloud-mixed.toml"), "--profile",
                 str(OPT), "--global-batch", "8", "--time-model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.json: not JSON" in err and len(err.splitlines()) == 1


def test_planning_with_a_model_imports_neither_sklearn_nor_torch(tmp_path: Path) -> None:
    model_path = tmp_path / "time_model.json"
    fit_time_model(_profiles()).save(model_path)
    cluster = DATA.parent.parent / "examples/clusters/cloud-mixed.toml"
    code = ("import sys; from hetrain.cli import main; "
            f"assert main(['plan', '--cluster', {str(cluster)!r}, '--profile', {str(OPT)!r}, '--global-batch', '16', "
            f"'--time-model', {str(model_path)!r}]) == 0; "
            "assert 'sklearn' not in sys.modules and 'torch' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "layer times for T4 from the learned model" in done.stdout

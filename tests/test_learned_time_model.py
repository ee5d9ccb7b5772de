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
from hetrain.profile import DeviceFigures, ModelProfile, load_profile
from hetrain.time_model import (
    TimeModelError,
    TypeFigures,
    apply_time_model,
    layer_features,
    load_time_model,
    predict_layer_time,
    reference_weights,
    type_distance,
)

pytest.importorskip("sklearn")  # training needs the train extra; reading a model does not

from hetrain.profiler.learned import REFERENCE_POWER, fit_regressor, fit_time_model

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
    assert back.reference_power == model.reference_power == REFERENCE_POWER
    p = load_profile(OPT)
    rows = np.vstack([layer_features(p, i, TypeFigures.of_catalog("T4", "fp32"), b)[0]  # type: ignore[arg-type]
                      for i in range(p.num_layers) for b in (1, 3, 16)])
    np.testing.assert_array_equal(back.predict(rows), model.predict(rows))
    # the numpy evaluation of the saved trees is scikit-learn's own prediction
    np.testing.assert_allclose(model.predict(rows), fit_regressor(_profiles(), "trees")(rows), rtol=1e-12)


def test_references_weigh_by_their_distance_by_hand() -> None:
    """A reference's weight is d^-p, d the distance of the two types' (log peak, log fp16 peak, log bandwidth)."""
    e = float(np.e)
    here = TypeFigures(10e12, 40e12, 500e9)
    near = TypeFigures(10e12, 40e12, 500e9 * e)          # log bandwidth 1 apart: d = 1
    far = TypeFigures(10e12 * e * e, 40e12, 500e9)       # log peak 2 apart: d = 2
    assert type_distance(here, near) == pytest.approx(1.0) and type_distance(here, far) == pytest.approx(2.0)
    assert type_distance(here, TypeFigures(10e12 * e, 40e12 * e, 500e9 * e)) == pytest.approx(3 ** 0.5)
    np.testing.assert_allclose(reference_weights(here, [near, far], 0.0), [0.5, 0.5])
    np.testing.assert_allclose(reference_weights(here, [near, far], 2.0), [0.8, 0.2])      # 1 : 1/4
    np.testing.assert_allclose(reference_weights(here, [near, far], 4.0), [16 / 17, 1 / 17])  # 1 : 1/16


def test_a_layers_time_is_the_weighted_log_mean_of_its_references_predictions() -> None:
    """With two measured types, the prediction is exp(w1 log p1 + w2 log p2), p_k the one from type k alone."""
    profiles = _profiles()
    opt = profiles[0]
    predict = fit_regressor(profiles, "trees", exclude=["V100-16GB"])
    fig = TypeFigures.of_catalog("V100-16GB", "fp32")
    assert fig is not None
    pair = ["TITAN-RTX", "A100-80GB"]
    both = _without(opt, "V100-16GB")
    for t, _ in opt.measured_on:
        if t not in pair:
            both = _without(both, t)
    alone = [_without(both, pair[1]), _without(both, pair[0])]
    w = reference_weights(fig, [TypeFigures.of_catalog(t, "fp32") for t in pair], 4.0)  # type: ignore[misc]
    assert w[0] > 0.9  # the Titan RTX is far nearer the V100 than the A100 is
    for i in range(opt.num_layers):
        one = [np.array(predict_layer_time(predict, p, i, fig, 4)) for p in alone]
        for power, weights in ((0.0, [0.5, 0.5]), (4.0, w)):
            expected = np.exp(weights[0] * np.log(one[0]) + weights[1] * np.log(one[1]))
            np.testing.assert_allclose(predict_layer_time(predict, both, i, fig, 4, power), expected, rtol=1e-12)


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
            assert (m.forward_s, m.backward_s) == pytest.approx(predict_layer_time(
                model.predict, original, i, fig, m.micro_batch, model.reference_power), rel=1e-12)
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


@pytest.mark.slow  # fits the time model once per GPU type held out (seven)
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
    old = {k: v for k, v in good.items() if k != "reference_power"}  # written before the weighting: a plain mean
    bad.write_text(json.dumps(old))
    assert load_time_model(bad).reference_power == 0.0
    bad.write_text(json.dumps({**good, "reference_power": -1}))
    with pytest.raises(TimeModelError, match=r"bad\.json: field 'reference_power' is -1\.0; it must be finite"):
        load_time_model(bad)
    bad.write_text("{not json")
    assert main(["plan", "--cluster", str(DATA.parent.parent / "examples/clusters/cloud-mixed.toml"), "--profile",
                 str(OPT), "--global-batch", "8", "--time-model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.json: not JSON" in err and len(err.splitlines()) == 1


@pytest.mark.slow  # starts a Python process
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


def _renamed(profile: ModelProfile, old: str, new: str, figures: DeviceFigures | None) -> ModelProfile:
    """The profile with ``old``'s measurements filed under ``new`` (in place: the samples keep their order),
    its ``measured_on`` entry ``figures`` (None: none)."""
    layers = tuple(dataclasses.replace(x, measured=tuple((new if t == old else t, ms) for t, ms in x.measured))
                   for x in profile.layers)
    measured_on = tuple((t, f) for t, f in profile.measured_on if t != old)
    return dataclasses.replace(profile, layers=layers,
                               measured_on=measured_on + (((new, figures),) if figures is not None else ()))


def _t4_rows(profile: ModelProfile) -> np.ndarray:
    fig = TypeFigures.of_catalog("T4", profile.precision)
    assert fig is not None
    return np.vstack([layer_features(profile, i, fig, b)[0] for i in range(profile.num_layers) for b in (1, 4)])


TITAN_RTX_SPEC = '{ type = "MyGPU", tflops = 16.3, tflops_fp16 = 130, memory = "24GiB", memory_bandwidth = "672GB/s" }'


def test_fit_learns_from_a_custom_type_the_cluster_file_describes(tmp_path: Path, capsys) -> None:
    """The Titan RTX's measurements under a name the catalog lacks ("MyGPU"), its figures in a cluster file:
    learned from, said so, and the model is the one fitted with the Titan RTX in the catalog. Without the
    cluster file it is left out with its reason, and so is a type with no figures anywhere."""
    opt = load_profile(OPT)
    titan = opt.figures_of("TITAN-RTX")
    custom = _renamed(_renamed(opt, "TITAN-RTX", "MyGPU", titan), "RTX2080Ti", "OldGPU", None)
    profile_path, model_path, cluster = tmp_path / "p.json", tmp_path / "m.json", tmp_path / "c.toml"
    custom.save(profile_path)
    cluster.write_text(f'[[node]]\nname = "a"\ndevices = [{TITAN_RTX_SPEC}, "A100-40GB"]\n')
    assert main(["fit-time-model", "--profiles", str(profile_path), "--cluster", str(cluster),
                 "-o", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert f"  MyGPU: used: figures from cluster file {cluster}\n" in out
    assert "  A100-40GB: used: figures from the catalog (A100-40GB [A100])\n" in out
    assert ("  OldGPU: left out: its peak fp32 TFLOPS is unknown (not in the catalog, not in its profile); add it "
            "to the cluster file (--cluster) or --device-spec\n") in out
    model = load_time_model(model_path)
    assert "MyGPU" in model.trained_on and "OldGPU" not in model.trained_on and len(model.trained_on) == 6
    assert [t for t, _ in model.left_out] == ["OldGPU"]
    assert {t: f for t, f, _ in model.type_figures}["MyGPU"] == TypeFigures.of_catalog("TITAN-RTX", "fp32")
    # the same samples as with the Titan RTX known to the catalog: the same model
    reference = fit_time_model([_renamed(opt, "RTX2080Ti", "OldGPU", None)])
    np.testing.assert_allclose(model.predict(_t4_rows(opt)), reference.predict(_t4_rows(opt)), rtol=1e-9)
    # without the cluster file: MyGPU's fp32 profile records no fp16 peak
    fit = fit_time_model([custom])
    assert "MyGPU" not in fit.trained_on
    assert dict(fit.left_out)["MyGPU"] == (
        "its peak fp16 TFLOPS is unknown (not in the catalog; profile 'OPT-350M' records its fp32 peak and memory "
        "bandwidth only); add it to the cluster file (--cluster) or --device-spec with tflops_fp16")


def test_fit_learns_from_a_custom_type_its_fp16_profile_describes() -> None:
    """In an fp16 profile, measured_on's peak is the fp16 peak: the type's figures are all there."""
    opt = dataclasses.replace(load_profile(OPT), precision="fp16")
    custom = _renamed(opt, "TITAN-RTX", "MyGPU", DeviceFigures(130e12, 672e9))
    model = fit_time_model([custom])
    assert "MyGPU" in model.trained_on and model.left_out == ()
    source = {t: why for t, _, why in model.type_figures}["MyGPU"]
    assert source.startswith("figures from profile 'OPT-350M' (measured_on: fp16 peak 130 TFLOPS")
    np.testing.assert_allclose(model.predict(_t4_rows(opt)), fit_time_model([opt]).predict(_t4_rows(opt)), rtol=1e-9)


def test_device_spec_describes_a_custom_type_and_a_custom_reference_predicts(tmp_path: Path, capsys) -> None:
    """--device-spec gives the figures; a profile measured on the custom type predicts another type through
    the model's recorded figures, as the catalog type it stands for does. A bad spec is one line."""
    opt = load_profile(OPT)
    custom = _renamed(opt, "TITAN-RTX", "MyGPU", None)
    path, model_path = tmp_path / "p.json", tmp_path / "m.json"
    custom.save(path)
    assert main(["fit-time-model", "--profiles", str(path), "--device-spec", TITAN_RTX_SPEC,
                 "-o", str(model_path)]) == 0
    assert "  MyGPU: used: figures from --device-spec\n" in capsys.readouterr().out
    model = load_time_model(model_path)
    only_custom = _without(custom, "V100-16GB")
    only_titan = _without(opt, "V100-16GB")
    for t, _ in opt.measured_on:
        if t not in ("TITAN-RTX", "V100-16GB"):
            only_custom, only_titan = _without(only_custom, t), _without(only_titan, t)
    v100 = TypeFigures.of_catalog("V100-16GB", "fp32")
    assert v100 is not None
    learned, _ = apply_time_model(only_custom, [_device("V100-16GB")], model)
    for i in range(opt.num_layers):
        ms = learned.layers[i].measurements("V100-16GB")
        assert ms and all(m.source == "learned" for m in ms)
        for m in ms:
            expected = predict_layer_time(model.predict, only_titan, i, v100, m.micro_batch, model.reference_power)
            assert (m.forward_s, m.backward_s) == pytest.approx(expected, rel=1e-12)
    assert main(["fit-time-model", "--profiles", str(path), "--device-spec", '{ type = "MyGPU", tflops = 16.3 }',
                 "-o", str(model_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--device-spec" in err and "'MyGPU' (not in the catalog) is missing memory and memory_bandwidth" in err

"""Precision as a planning decision: the plan records it, the profile and the memory model count it, train runs it.

(The multi-rank bf16 and fp16 runs are in ``tests/distributed/test_runtime_precision.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetrain.amp import LossScaler, check_precision, from_wire, to_wire
from hetrain.cli import main
from hetrain.errors import InputError
from hetrain.models.analytic import build_profile
from hetrain.plan import load_plan
from hetrain.profile import load_profile, parse_profile
from hetrain.profiler.layers import profile_layers
from hetrain.runtime.command import main as train_main

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "pipetorch.toml"


def test_fp16_on_a_cpu_is_refused_with_the_reason() -> None:
    with pytest.raises(InputError, match=r"plan.json: precision fp16 is not supported on a CPU.*bf16 or fp32"):
        check_precision("fp16", "cpu", "plan.json")
    check_precision("fp16", "cuda")
    check_precision("bf16", "cpu")


def test_activations_travel_in_the_compute_dtype_and_come_back_in_fp32() -> None:
    x = torch.randn(3, 5)
    wire = to_wire(x, "bf16")
    assert wire.dtype == torch.bfloat16 and wire.element_size() * wire.numel() == x.numel() * 2
    assert from_wire(wire).dtype == torch.float32
    torch.testing.assert_close(from_wire(wire), x, rtol=1e-2, atol=1e-2)
    assert to_wire(x, "fp32") is x
    ids = torch.arange(4)
    assert to_wire(ids, "bf16") is ids and from_wire(ids) is ids  # token ids are not floating: as they are


def test_the_loss_scaler_backs_off_and_grows() -> None:
    s = LossScaler(init_scale=2.0 ** 16, growth_interval=3)
    assert s.update(found_inf=True) is False and s.scale == 2.0 ** 15 and s.skipped == 1
    assert [s.update(found_inf=False) for _ in range(3)] == [True] * 3 and s.scale == 2.0 ** 16
    state = s.state_dict()
    t = LossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)


def test_a_mixed_precision_profile_counts_fp32_parameters_and_16_bit_transfers() -> None:
    """Measured as the runtime trains: fp32 weights under autocast. A Linear's output is bf16 under autocast,
    a LayerNorm's is fp32 and is sent in bf16: half the bytes either way."""
    layers = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    fp32 = profile_layers(layers, torch.randn(1, 16), micro_batches=[2], repeats=1, warmup=0)
    bf16 = profile_layers(layers, torch.randn(1, 16), micro_batches=[2], repeats=1, warmup=0, precision="bf16")
    assert bf16.precision == "bf16"
    assert [x.param_bytes for x in bf16.layers] == [x.param_bytes for x in fp32.layers] == [
        (16 * 32 + 32) * 4, 2 * 32 * 4, (32 * 8 + 8) * 4]
    assert [x.output_bytes_per_sample for x in bf16.layers] == [32 * 2, 32 * 2, 8 * 2]
    assert [x.output_bytes_per_sample for x in fp32.layers] == [32 * 4, 32 * 4, 8 * 4]
    assert all(p.dtype == torch.float32 for p in layers.parameters()), "the profiler left the weights in fp32"


def test_a_format_1_profile_in_16_bits_is_read_with_fp32_parameters() -> None:
    """Format 1 counted a 16-bit profile's parameters in 16 bits (the old profiler cast the layers)."""
    data = build_profile("gpt2-small", precision="fp16").to_dict()
    new_bytes = [layer["param_bytes"] for layer in data["layers"]]
    old = {**data, "format_version": 1,
           "layers": [{**{k: v for k, v in layer.items() if k != "tp"}, "param_bytes": layer["param_bytes"] / 2}
                      for layer in data["layers"]]}  # format 1 had no TP split
    assert [x.param_bytes for x in parse_profile(old).layers] == new_bytes
    fp32 = build_profile("gpt2-small", precision="fp32").to_dict()
    assert parse_profile({**fp32, "format_version": 1}).param_bytes == parse_profile(fp32).param_bytes


def test_plan_precision_is_recorded_and_counted(tmp_path: Path, capsys) -> None:
    """``--precision`` rebuilds a reference model's profile in it: the plan says it, and its memory counts it."""
    plans = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / f"{precision}.json"
        assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "32",
                     "--strategy", "dp", "--precision", precision, "-o", str(out)]) == 0
        assert f"precision {precision}" in capsys.readouterr().out
        plans[precision] = load_plan(out)
    assert plans["bf16"].precision == "bf16" and plans["fp32"].precision == "fp32"
    # the same fp32 weights, gradients and Adam state; 16-bit activations between stages
    assert plans["bf16"].profile.param_bytes == plans["fp32"].profile.param_bytes
    assert (plans["bf16"].profile.layers[1].output_bytes_per_sample
            == plans["fp32"].profile.layers[1].output_bytes_per_sample / 2)


def test_plan_refuses_a_precision_its_profile_was_not_measured_in(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "profile.json"
    build_profile("gpt2-small", precision="fp32").save(profile)
    assert load_profile(profile).precision == "fp32"
    assert main(["plan", "--cluster", str(CLUSTER), "--profile", str(profile), "--global-batch", "8",
                 "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert f"{profile} was measured in fp32" in err and "hetrain profile --precision bf16" in err
    assert "Traceback" not in err


def _plan(tmp_path: Path, precision: str, sync: str = "bsp") -> Path:
    out = tmp_path / f"{precision}-{sync}.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--model", "gpt2-small", "--global-batch", "32",
                 "--strategy", "dp", "--precision", precision, "--sync", sync, "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize(("precision", "sync", "flag", "message"), [
    ("bf16", "bsp", ["--precision", "fp32"], "was planned for bf16 (its memory and time predictions hold for that); "
                                             "re-plan with hetrain plan --precision fp32"),
    ("fp16", "bsp", [], "precision fp16 is not supported on a CPU"),
    ("fp16", "wsp", [], "precision fp16 needs the bsp sync mode"),
])
def test_train_refuses_a_precision_other_than_the_plan_or_one_it_cannot_run(
        tmp_path: Path, capsys, monkeypatch, precision: str, sync: str, flag: list[str], message: str) -> None:
    plan = _plan(tmp_path, precision, sync)
    capsys.readouterr()
    monkeypatch.setenv("HETRAIN_DEVICE", "cpu")
    code = train_main(["--plan", str(plan), "--model", "gpt2-small", "--steps", "1", "--no-progress", *flag])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and str(plan) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_models_lists_each_reference_model_in_its_default_precision(capsys) -> None:
    assert main(["models"]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["gpt2-small"] == "fp16" and rows["gpt-tiny"] == "fp32"

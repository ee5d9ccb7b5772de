"""``hetrain export --checkpoint CKPT/step-N``: one step's directory given for the checkpoint directory is named
as such, with the command line that exports it."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from hetrain.cli import main  # noqa: E402
from hetrain.runtime.state.checkpoint import save_checkpoint  # noqa: E402


def test_a_step_directory_points_to_its_parent_and_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ck"
    for step in (5, 10):
        save_checkpoint(ckpt, step, {"layers.0.weight": torch.full((2, 2), float(step))}, {},
                        {"step": step, "model": "mlp-digits"}, keep=None)
    step_dir, out = ckpt / "step-00000010", tmp_path / "w.safetensors"
    for extra in ([], ["--step", "5"]):
        assert main(["export", "--checkpoint", str(step_dir), "--to-safetensors", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err == (f"hetrain export: error: --checkpoint {step_dir}: this is the directory of step 10 of the "
                       f"checkpoint in {ckpt}; --checkpoint takes the checkpoint directory and --step picks the "
                       f"step: --checkpoint {ckpt} --step 10\n")
        assert not out.exists()
    # the hinted command line exports it
    assert main(["export", "--checkpoint", str(ckpt), "--step", "10", "--to-safetensors", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"hetrain export: step 10 of mlp-digits -> {out}")
    # a directory that only looks like a step's keeps the usual message
    other = tmp_path / "step-10"
    other.mkdir()
    assert main(["export", "--checkpoint", str(other), "--to-safetensors", str(out), "--force"]) == 2
    assert f"no complete checkpoint in {other}" in capsys.readouterr().err

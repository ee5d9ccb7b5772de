"""Which device and backend a rank takes (``HETRAIN_DEVICE``), and the errors that name the setting."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hetrain.distributed.device import DeviceError, choose_device  # noqa: E402


def test_cpu_is_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_DEVICE", "cpu")
    assert choose_device(3) == ("gloo", torch.device("cpu"))
    monkeypatch.setenv("HETRAIN_DEVICE", " CPU ")
    assert choose_device(0) == ("gloo", torch.device("cpu"))


def test_auto_without_cuda_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_DEVICE", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device(1) == ("gloo", torch.device("cpu"))


def test_a_bad_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_DEVICE", "tpu")
    with pytest.raises(DeviceError, match=r"HETRAIN_DEVICE='tpu': expected one of auto, cpu, cuda"):
        choose_device(0)


def test_cuda_asked_for_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="HETRAIN_DEVICE=cuda, but CUDA is not available"):
        choose_device(0)


def test_more_ranks_than_gpus_names_the_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before CUDA is touched (its own error would be 'invalid device ordinal')."""
    monkeypatch.setenv("HETRAIN_DEVICE", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match=r"LOCAL_RANK 1, but this node has 1 CUDA device\(s\).*"
                                          r"--nproc-per-node 1.*HETRAIN_DEVICE=cpu"):
        choose_device(1)

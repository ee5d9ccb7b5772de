"""``hetrain profile`` on a model whose layer fails at a micro-batch size: one line naming the model, the layer,
the size and the input, with the ``--micro-batch`` sizes to try instead; never the bare message or a traceback.
On data with one bad sample, the line names the data set and the sample that fails alone, not the size."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hetrain.cli import main  # noqa: E402
from hetrain.profiler.layers import LayerError, measure_layers  # noqa: E402

# A BatchNorm needs two samples per channel in training mode: micro-batch 1 fails, 2 and up run. The data's
# two-sample check (``check_model_on_batch``) passes, so only the profiler meets the failure.
BATCHNORM = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    def build():
        return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def dataset():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g)
        y = torch.randint(0, 4, (64,), generator=g)
        return TensorDataset(x, y), TensorDataset(x[:16], y[:16])
""")

# A layer whose own code raises a KeyError (no ValueError or RuntimeError) from 3 samples on.
PICKY = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    class Picky(nn.Module):
        def forward(self, x):
            return {1: x, 2: x}[x.shape[0]]

    def build():
        return [nn.Linear(16, 8), Picky(), nn.Linear(8, 4)]

    def dataset():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g)
        y = torch.randint(0, 4, (64,), generator=g)
        return TensorDataset(x, y), TensorDataset(x[:16], y[:16])
""")


def profile(tmp_path: Path, source: str, sizes: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Path]:
    """``hetrain profile`` of ``source`` written to model.py at ``--micro-batch sizes``: (status, stderr, output)."""
    (tmp_path / "model.py").write_text(source)
    out = tmp_path / "p.json"
    capsys.readouterr()
    code = main(["profile", "--model", f"{tmp_path}/model.py:build", "--data", f"{tmp_path}/model.py:dataset",
                 "--micro-batch", sizes, "--repeats", "1", "-o", str(out)])
    return code, capsys.readouterr().err, out


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_batchnorm_at_micro_batch_1_is_named_with_its_layer_and_the_sizes_to_try(tmp_path, capsys) -> None:
    code, stderr, out = profile(tmp_path, BATCHNORM, "1,2,4,8", capsys)
    line = one_error_line(stderr)
    assert code == 2 and not out.exists()  # the model fails at a size asked for: bad input
    assert line.startswith(f"hetrain profile: error: model {tmp_path}/model.py:build: "), line
    for needle in ("layer 1 (batchnorm1d1)", "micro-batch 1", "(1, 64) float32",
                   "ValueError: Expected more than 1 value per channel", "--micro-batch 2,4,8"):
        assert needle in line, f"{needle!r} not in {line}"

    code, stderr, out = profile(tmp_path, BATCHNORM, "2,4,8", capsys)  # the sizes it suggests: they run
    assert code == 0, stderr
    assert [m["micro_batch"] for m in json.loads(out.read_text())["layers"][1]["measured"]["cpu"]] == [2, 4, 8]


def test_an_unexpected_error_type_from_a_layer_is_one_line_naming_the_layer(tmp_path, capsys) -> None:
    code, stderr, out = profile(tmp_path, PICKY, "1,2,4", capsys)
    line = one_error_line(stderr)
    assert code == 2 and not out.exists()  # the model fails at a size asked for: bad input
    for needle in ("layer 1 (picky1)", "micro-batch 4", "(4, 8) float32", "KeyError: 4",
                   "--micro-batch 1,2"):  # the sizes it ran at
        assert needle in line, f"{needle!r} not in {line}"


def test_measure_layers_raises_a_layer_error_chaining_the_layers_own() -> None:
    layers = [nn.Linear(4, 8), nn.BatchNorm1d(8)]
    with pytest.raises(LayerError, match=r"^layer 1 \(bn\) fails at micro-batch 1 on input \(1, 8\) float32: "
                                          r"ValueError: Expected more than 1 value per channel") as info:
        measure_layers(layers, torch.randn(1, 4), (1, 2), names=["lin", "bn"], repeats=1, warmup=0, optimizers=())
    e = info.value
    assert (e.layer, e.name, e.micro_batch, e.micro_batches, e.sizes_to_try()) == (1, "bn", 1, (1, 2), [2])
    assert isinstance(e.__cause__, ValueError)
    assert all(m.training for m in layers)  # left in training mode, as they were found


# A token model of vocabulary 64 whose data holds token id 1000 in sample 5 (of 64): micro-batches 1, 2 and 4
# run (samples 0-3), 8 holds sample 5.
BAD_SAMPLE = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    V, T = 64, 16

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    def build():
        return [nn.Embedding(V, 32), nn.Linear(32, 32), nn.Linear(32, V)]

    def dataset():
        x = torch.arange(64 * T).reshape(64, T) % V
        x[5, 3] = 1000
        return TensorDataset(x, (x + 1) % V), TensorDataset(x[:8] % V, (x[:8] + 1) % V)
""")


def profile_line(tmp_path: Path, source: str, sizes: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``hetrain profile`` of ``source`` (model.py) at ``--micro-batch sizes``: (status, the one stderr line, data)."""
    (tmp_path / "model.py").write_text(source)
    out = tmp_path / "p.json"
    data = f"{tmp_path}/model.py:dataset"
    capsys.readouterr()
    code = main(["profile", "--model", f"{tmp_path}/model.py:build", "--data", data, "--micro-batch", sizes,
                 "--repeats", "1", "-o", str(out)])
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and not out.exists() and len(lines) == 1, stderr  # bad input
    return code, lines[0], data


def test_a_sample_that_fails_alone_is_named_instead_of_other_sizes(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, line, data = profile_line(tmp_path, BAD_SAMPLE, "1,2,4,8", capsys)
    assert line == (f"hetrain profile: error: model {tmp_path}/model.py:build: layer 0 (embedding0) fails at "
                    "micro-batch 8 on input (8, 16) int64: IndexError: index out of range in self; sample 5 of the "
                    f"data set (--data {data}) fails alone and other samples run: fix or drop that sample (any "
                    "micro-batch size that holds it fails)")
    assert "--micro-batch" not in line


def test_a_failure_of_the_size_keeps_the_sizes_to_try(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, line, _ = profile_line(tmp_path, BATCHNORM, "1,2,4", capsys)
    assert "layer 1 (batchnorm1d1) fails at micro-batch 1" in line and line.endswith(
        "; measure it at other sizes, e.g. --micro-batch 2,4"), line
    assert "sample" not in line.split("; ", 1)[1], line


def test_measure_layers_names_the_sample_behind_the_layer_that_failed() -> None:
    """A later layer: its input (the earlier layers' output for the batch) is cut into samples; the failing one is
    found in a batch where it comes first, before one that runs."""

    class Picky(nn.Module):  # fails on a sample whose input sums above a bound: a property of the data
        def forward(self, x: Any) -> Any:
            if bool((x.sum(dim=1) > 1e3).any()):
                raise ValueError("input too large")
            return x

    ids = torch.tensor([[7], [1], [2], [3]])  # sample 0 is the bad one
    embed = nn.Embedding(8, 4)
    with torch.no_grad():
        embed.weight[7] = 1e4
    layers = [embed, nn.Flatten(), Picky()]
    with pytest.raises(LayerError) as info:
        measure_layers(layers, lambda b: ids[:b], (4,), repeats=1, warmup=0, optimizers=())
    e = info.value
    assert (e.layer, e.micro_batch) == (2, 4)
    assert e.sample is not None and e.sample[0] == 0 and str(e.sample[1]) == "input too large"

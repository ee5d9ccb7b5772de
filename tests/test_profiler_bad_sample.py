"""``hetrain profile`` on data with one bad sample: the line names the data set and the sample that fails alone,
not the micro-batch size; a failure that depends on the size (a BatchNorm at 1) keeps the sizes to try."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hetrain.cli import main  # noqa: E402
from hetrain.profiler.layers import LayerError, measure_layers  # noqa: E402

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

# A BatchNorm fails at micro-batch 1 on every sample alike: the size is at fault, not a sample.
BATCHNORM = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    def build():
        return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def dataset():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g)
        return TensorDataset(x, torch.randint(0, 4, (64,), generator=g))
""")


def profile(tmp_path: Path, source: str, sizes: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
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
    assert code == 1 and not out.exists() and len(lines) == 1, stderr
    return code, lines[0], data


def test_a_sample_that_fails_alone_is_named_instead_of_other_sizes(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, line, data = profile(tmp_path, BAD_SAMPLE, "1,2,4,8", capsys)
    assert line == (f"hetrain profile: error: model {tmp_path}/model.py:build: layer 0 (embedding0) fails at "
                    "micro-batch 8 on input (8, 16) int64: IndexError: index out of range in self; sample 5 of the "
                    f"data set (--data {data}) fails alone and other samples run: fix or drop that sample (any "
                    "micro-batch size that holds it fails)")
    assert "--micro-batch" not in line


def test_a_failure_of_the_size_keeps_the_sizes_to_try(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, line, _ = profile(tmp_path, BATCHNORM, "1,2,4", capsys)
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

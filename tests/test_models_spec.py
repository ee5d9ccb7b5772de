"""``path/to/file.py:FUNCTION``: a model or data file imports the modules beside it, as ``python file.py`` would."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hetrain.data.user import load_user_datasets  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402

# pkgdir/main_model.py takes its model and data from pkgdir/<helpers>.py; its build() imports one more
# neighbour only when called, as a function may.
HELPERS = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    def build():
        return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def dataset():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 16, generator=g)
        return TensorDataset(x, x.sum(1).gt(0).long()), TensorDataset(x[:8], x[:8].sum(1).gt(0).long())
""")
MAIN = textwrap.dedent("""
    from {helpers} import build as _build, dataset

    def build():
        return _build()

    def build_later():
        from {later} import extra
        return [*_build(), extra()]
""")
LATER = "from torch import nn\n\ndef extra():\n    return nn.Softmax(dim=-1)\n"


@pytest.fixture
def pkgdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """tmp_path/pkgdir with main_model.py and its neighbours (names unique to this test); the current
    directory is tmp_path, so the neighbours are not on the path but for the loader; sys.path restored."""
    names = {"helpers": f"helpers_{tmp_path.name}", "later": f"later_{tmp_path.name}"}
    d = tmp_path / "pkgdir"
    d.mkdir()
    (d / f"{names['helpers']}.py").write_text(HELPERS)
    (d / f"{names['later']}.py").write_text(LATER)
    (d / "main_model.py").write_text(MAIN.format(**names))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield d
    for name in names.values():
        sys.modules.pop(name, None)


def test_a_model_file_imports_the_module_beside_it(pkgdir: Path) -> None:
    source = resolve_model("pkgdir/main_model.py:build")  # a relative path, from another directory
    assert source.layer_names == ("linear0", "relu1", "linear2")
    train = load_user_datasets("pkgdir/main_model.py:dataset").train  # the data, taken from the neighbour too
    x, _ = train.take(torch.arange(2))
    assert source.build_layers(seed=0)[0](x).shape == (2, 8)


def test_a_function_imports_its_neighbours_when_called_and_they_never_shadow_installed_packages(pkgdir: Path) -> None:
    source = resolve_model("pkgdir/main_model.py:build_later")  # imports a neighbour inside build_later()
    assert source.layer_names[-1] == "softmax3"
    entry = str(pkgdir.resolve())
    assert sys.path[-1] == entry and sys.path.count(entry) == 1  # kept, but after every installed package

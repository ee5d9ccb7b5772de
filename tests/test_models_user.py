"""A user's model and data by ``MODULE:FUNCTION``: loading, cutting into layers, seeds, loss, data, refusals."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hetrain.data.user import build_model_datasets, load_user_datasets  # noqa: E402
from hetrain.errors import InputError  # noqa: E402
from hetrain.models.layers import LayerRange, run_layers  # noqa: E402
from hetrain.models.registry import build_layers  # noqa: E402
from hetrain.models.spec import SpecError, is_user_spec, split_spec  # noqa: E402
from hetrain.models.user import check_model_on_batch, resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_model" / "model.py"

MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    calls = []

    def mlp():
        calls.append(1)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    def as_list():
        return [nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)]

    def as_module_list():
        return nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 2)])

    def one_layer():
        return nn.Linear(3, 2)

    def empty():
        return nn.Sequential()

    def tied():
        a, b = nn.Linear(3, 3), nn.Linear(3, 3)
        b.weight = a.weight
        return [a, b]

    def grows():
        calls.append(1)
        return [nn.Linear(3, 3) for _ in calls]

    def pairs():
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(10, 3, generator=g), torch.arange(10) % 2)

    def split():
        return pairs(), pairs()

    def ints():
        return [(i, i % 2) for i in range(6)]

    def loss_fn(out, target):
        return (out.sum(dim=1) - target).pow(2).mean()
""")


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The module above as ``tmp_path/usermods.py``, importable as ``usermods`` too."""
    path = tmp_path / "usermods.py"
    path.write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermods", raising=False)
    return path


def test_a_spec_is_told_from_a_name() -> None:
    assert not is_user_spec("gpt-tiny") and is_user_spec("pkg.mod:build") and is_user_spec("a/b.py:f")
    assert split_spec("a/b.py:f") == ("a/b.py", "f")
    for bad in ("a.py:", ":f", "a.py:1f"):
        with pytest.raises(SpecError, match="MODULE:FUNCTION"):
            split_spec(bad)


def test_a_sequential_from_a_file_is_cut_into_its_children(user_module: Path) -> None:
    source = resolve_model(f"{user_module}:mlp")
    assert source.num_layers == 3 and source.layer_names == ("linear0", "tanh1", "linear2")
    assert source.preset is None and source.name == f"{user_module}:mlp"
    layers = source.build_layers(seed=3)
    assert [type(m) for m in layers] == [nn.Linear, nn.Tanh, nn.Linear]


def test_a_module_spec_imports_the_same_model(user_module: Path) -> None:
    by_file = resolve_model(f"{user_module}:as_list").build_layers(seed=1)
    by_module = resolve_model("usermods:as_list").build_layers(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(LayerRange(by_file).state_dict().values(),
                                                 LayerRange(by_module).state_dict().values(), strict=True))


def test_weights_are_those_of_the_function_under_the_seed_and_any_range_matches_the_whole(user_module: Path) -> None:
    source = resolve_model(f"{user_module}:mlp")
    from importlib import import_module

    torch.manual_seed(7)
    want = LayerRange(list(import_module("usermods").mlp())).state_dict()  # torch.manual_seed(seed); build()
    whole = LayerRange(source.build_layers(seed=7)).state_dict()
    assert list(whole) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    assert all(torch.equal(whole[k], want[k]) for k in want)
    tail = LayerRange(source.build_layers(2, 3, seed=7), first=2).state_dict()
    assert all(torch.equal(tail[k], whole[k]) for k in tail)
    other = LayerRange(source.build_layers(seed=8)).state_dict()
    assert not torch.equal(other["layers.0.weight"], whole["layers.0.weight"])


def test_building_leaves_the_callers_random_state_alone(user_module: Path) -> None:
    source = resolve_model(f"{user_module}:mlp")
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    source.build_layers(seed=5)
    assert torch.equal(torch.rand(3), before)


def test_module_list_and_a_lone_module_are_models(user_module: Path) -> None:
    assert resolve_model(f"{user_module}:as_module_list").num_layers == 2
    assert resolve_model(f"{user_module}:one_layer").layer_names == ("linear0",)


def test_the_modules_loss_fn_is_the_loss_else_cross_entropy(user_module: Path) -> None:
    out, target = torch.tensor([[1.0, 2.0]]), torch.tensor([1])
    assert resolve_model(f"{user_module}:mlp").loss_fn(out, target).item() == pytest.approx(4.0)
    example = resolve_model(f"{EXAMPLE}:build")
    assert example.loss_fn(out, target).item() == pytest.approx(torch.nn.functional.cross_entropy(out, target).item())


def test_a_reference_model_resolves_to_the_registry(user_module: Path) -> None:
    source = resolve_model("mlp-digits", hidden=[32])
    assert source.preset == "mlp-digits" and source.config == {"hidden": [32]} and source.num_layers == 2
    got = LayerRange(source.build_layers(seed=2)).state_dict()
    want = LayerRange(build_layers("mlp-digits", seed=2, hidden=[32])).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="unknown model 'mlp-nope'"):
        resolve_model("mlp-nope")


@pytest.mark.parametrize("fn, needles", [
    ("empty", ("an empty Sequential",)),
    ("tied", ("layers 0 and 1", "tied weights")),
])
def test_models_that_cannot_be_cut_are_refused(user_module: Path, fn: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(SpecError) as e:
        resolve_model(f"{user_module}:{fn}")
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_a_function_that_changes_its_model_is_refused_at_build(user_module: Path) -> None:
    source = resolve_model(f"{user_module}:grows")
    with pytest.raises(SpecError, match="returned 1 layers, then 2"):
        source.build_layers(seed=0)


SKIP_MODEL = """
import torch
from torch import nn


class Skip(nn.Sequential):
    \"\"\"A Sequential whose forward is its own: the first child's output skips the second and joins the third's.\"\"\"

    def forward(self, x):
        h = self[0](x)                  # (B, 8)
        return self[2](self[1](h) + h) * 0.5


def build():
    return Skip(nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 3))


def example_input():
    return torch.randn(2, 4)

"""


def test_a_sequential_with_a_skip_is_traced_and_trains_exactly_as_its_own_forward(tmp_path: Path) -> None:
    """Cut into its children, the skip would be dropped (up to 0.83 away from its forward): traced, the first
    child's output travels through the second layer to the third."""
    file = tmp_path / "skip.py"
    file.write_text(SKIP_MODEL)
    source = resolve_model(f"{file}:build")
    assert source.num_layers == 3
    layers = source.build_layers(seed=4)
    module = _load(file)
    torch.manual_seed(4)
    own = module.build()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    torch.testing.assert_close(run_layers(layers, x), own(x), rtol=0, atol=0)
    # the same SGD steps on both: every weight stays equal to the model's own
    params = [p for layer in layers for p in layer.parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(own.parameters(), lr=0.1)
    for _ in range(3):
        for o, out in ((opt, run_layers(layers, x)), (ref_opt, own(x))):
            o.zero_grad()
            source.loss_fn(out, y).backward()
            o.step()
    got = {name: p for layer in layers for name, p in layer.named_parameters()}
    assert sorted(got) == sorted(name for name, _ in own.named_parameters())  # the model's own names
    for name, p in own.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=0, atol=0)


def test_a_module_to_trace_needs_an_example_input(tmp_path: Path) -> None:
    file = tmp_path / "skip.py"
    file.write_text(SKIP_MODEL.replace("def example_input", "def other_input"))
    with pytest.raises(SpecError) as e:
        resolve_model(f"{file}:build")
    assert str(e.value) == (f"{file}:build: its model is a module whose own forward hetrain traces to cut it; "
                            f"define example_input() in {file}, returning one micro-batch of its input (a tensor, as "
                            "torch.distributed.pipelining asks for mb_args)")


def test_a_forward_that_branches_on_its_data_is_refused_naming_the_construct(tmp_path: Path) -> None:
    file = tmp_path / "branch.py"
    file.write_text(SKIP_MODEL.replace("return self[2](self[1](h) + h) * 0.5",
                                       "return self[2](h) if h.sum() > 0 else self[2](self[1](h))"))
    with pytest.raises(SpecError) as e:
        resolve_model(f"{file}:build")
    text = str(e.value)
    assert "\n" not in text and "its forward cannot be traced (data-dependent control flow" in text, text
    assert "pass its layers as a list" in text, text


def _load(file: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("skip_model", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_user_data_sets_are_batched_by_index(user_module: Path) -> None:
    train, val = load_user_datasets(f"{user_module}:pairs")
    assert val is None and len(train) == 10
    x, y = train.take(torch.tensor([3, 1]))
    assert x.shape == (2, 3) and y.tolist() == [1, 1]
    train, val = load_user_datasets(f"{user_module}:split")
    assert len(train) == len(val) == 10
    x, y = load_user_datasets(f"{user_module}:ints").train.take(torch.tensor([4, 5]))
    assert x.tolist() == [4, 5] and y.tolist() == [0, 1]  # numbers made tensors by default_collate


def test_data_for_a_model(user_module: Path) -> None:
    name, (train, _) = build_model_datasets(resolve_model("mlp-digits"), None)
    assert name == "digits" and len(train) > 1000
    name, (train, _) = build_model_datasets(resolve_model("mlp-digits"), f"{user_module}:pairs")
    assert name == f"{user_module}:pairs" and len(train) == 10
    with pytest.raises(InputError, match="no --data given"):
        build_model_datasets(resolve_model(f"{user_module}:mlp"), None)


def test_the_example_learns_its_data_in_one_process() -> None:
    source = resolve_model(f"{EXAMPLE}:build")
    assert source.num_layers == 5
    _, (train, val) = build_model_datasets(source, f"{EXAMPLE}:dataset")
    assert val is not None and len(val) == 256
    net = LayerRange(source.build_layers(seed=0))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    from hetrain.data.datasets import iter_batches

    losses = []
    for x, y in iter_batches(train, 32, seed=0, steps=40):
        opt.zero_grad()
        loss = source.loss_fn(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_a_model_is_tried_on_its_data_and_a_loss_must_be_one_number(user_module: Path) -> None:
    x, y = torch.zeros(2, 3), torch.zeros(2)
    check_model_on_batch(resolve_model(f"{user_module}:mlp"), x, y, "d")
    with pytest.raises(SpecError, match=r"layer 0 \(linear0\) fails on input \(2, 4\) float32"):
        check_model_on_batch(resolve_model(f"{user_module}:mlp"), torch.zeros(2, 4), y, "d")
    per_sample = dataclasses.replace(resolve_model(f"{user_module}:mlp"),
                                     loss_fn=lambda out, target: (out.sum(1) - target) ** 2)
    with pytest.raises(SpecError, match=r"returned \(2,\) float32, not one number"):
        check_model_on_batch(per_sample, x, y, "d")

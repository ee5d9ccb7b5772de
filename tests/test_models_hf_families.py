"""Every transformers family hetrain is checked on is cut exactly: built from its config.json, traced, and its
chained layers give the model's own logits, its own loss (with the router's auxiliary loss for MoE models) and
its own gradients.

The cut is refused where it is not exact (``check_cut``, run by ``resolve_model``); these tests check the
equality again from outside, against a transformers model built under the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_families import ENCODERS, FAMILIES, VOCAB

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hetrain.models.layers import run_layers  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402

pytestmark = pytest.mark.slow


def family_dir(tmp_path: Path, family: str) -> Path:
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(FAMILIES.get(family) or ENCODERS[family]))
    return d


def _no_export(*args: object, **kwargs: object) -> None:
    raise AssertionError("traced again: the kept cut was not used")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_runs_its_own_forward_loss_and_gradients(family: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked on the cut read back from the cache (``save_cut`` / ``load_cut``): what every later run uses."""
    d = family_dir(tmp_path, family)
    resolve_model(f"hf:{d}")  # traced, checked against the model's forward, and kept
    with monkeypatch.context() as m:  # the second time, the kept cut: no trace
        m.setattr(torch.export, "export", _no_export)
        source = resolve_model(f"hf:{d}")
    assert source.num_layers == 4 and source.layer_names == ("embed", "block1", "block2", "head")
    config = transformers.AutoConfig.from_pretrained(d)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layers = [m.eval() for m in source.build_layers(seed=5)]
    window = torch.randint(1, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))  # (B, T + 1)
    x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()  # targets: the inputs shifted by one
    out = run_layers(layers, x)
    # transformers' loss on the same window: its labels shifted as the data shifted them
    want = model(input_ids=x, labels=x, shift_labels=y)
    logits = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    loss = source.loss_fn(out, y)
    torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.loss.backward()
    tied = {name for tie in source.tied for _, name in tie}  # a tied copy holds one part of the model's gradient
    compared = 0
    for layer in layers:
        for name, p in layer.named_parameters():
            if name in tied:
                continue
            ref = model.get_parameter(name).grad
            assert ref is not None and p.grad is not None, name
            torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            compared += 1
    assert compared >= len(list(model.parameters())) - 2 * len(source.tied)


def test_the_moe_loss_is_transformers_loss_with_router_logits(tmp_path: Path) -> None:
    """Mixtral asks for its router's load-balancing loss (output_router_logits): the loss hetrain trains on is
    transformers' cross-entropy plus router_aux_loss_coef times that loss, not the cross-entropy alone."""
    d = family_dir(tmp_path, "mixtral")
    source = resolve_model(f"hf:{d}")
    layers = [m.eval() for m in source.build_layers(seed=1)]
    x = torch.randint(0, VOCAB, (2, 9))
    logits, aux = run_layers(layers, x)
    config = transformers.AutoConfig.from_pretrained(d)
    assert float(aux) > 0 and config.router_aux_loss_coef == 0.02
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))
    torch.testing.assert_close(source.loss_fn((logits, aux), x), ce + 0.02 * aux)


def test_split_points_cut_where_the_user_says_and_the_profile_records_them(tmp_path: Path) -> None:
    from hetrain.cli import main
    from hetrain.models.spec import SpecError
    from hetrain.profile import load_profile

    d = family_dir(tmp_path, "granite")
    points = ("model.layers.1", "model.norm")
    source = resolve_model(f"hf:{d}", split_points=points)
    assert source.num_layers == 3 and source.layer_names == ("embed", *points) and source.split_points == points
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).eval()
    layers = [m.eval() for m in source.build_layers(seed=0)]
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n, _ in layers[1].named_parameters())
    x = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(run_layers(layers, x), model(x).logits, rtol=1e-5, atol=1e-5)
    out = tmp_path / "p.json"
    assert main(["profile", "--model", f"hf:{d}", "--split-points", ",".join(points), "--seq-len", "8",
                 "--micro-batch", "1", "--repeats", "1", "-o", str(out)]) == 0
    profile = load_profile(out)
    assert profile.split_points == points and len(profile.layers) == 3
    with pytest.raises(SpecError, match=r"split point 'model.layer.1' is not a module of GraniteForCausalLM"):
        resolve_model(f"hf:{d}", split_points=("model.layer.1",))
    with pytest.raises(SpecError, match=r"runs model.layers.1 after model.layers.0, which the split points list"):
        resolve_model(f"hf:{d}", split_points=("model.layers.1", "model.layers.0"))


@pytest.mark.parametrize("family", list(ENCODERS))
def test_an_encoder_trains_as_a_masked_lm_with_transformers_loss(family: str, tmp_path: Path) -> None:
    """BERT-style encoders are cut like decoders and train on their own objective: the cross-entropy at the masked
    positions, labels as transformers' DataCollatorForLanguageModeling makes them (not shifted)."""
    from hetrain.data.user import build_model_datasets
    from hetrain.errors import InputError

    d = family_dir(tmp_path, family)
    source = resolve_model(f"hf:{d}")
    assert source.masked_lm and source.num_layers == 4
    config = transformers.AutoConfig.from_pretrained(d)
    torch.manual_seed(5)
    model = transformers.AutoModelForMaskedLM.from_config(config, dtype=torch.float32).eval()
    layers = [m.eval() for m in source.build_layers(seed=5)]
    ids = torch.randint(5, VOCAB, (4, 12), generator=torch.Generator().manual_seed(3))  # (B, T)
    masked = torch.rand(4, 12, generator=torch.Generator().manual_seed(4)) < 0.3
    inputs, labels = ids.masked_fill(masked, 4), ids.masked_fill(~masked, -100)
    (tmp_path / "mlm.py").write_text(
        "import torch\n"
        f"INPUTS, LABELS = torch.tensor({inputs.tolist()}), torch.tensor({labels.tolist()})\n"
        "def rows():\n"
        "    return [{'input_ids': i, 'labels': l} for i, l in zip(INPUTS, LABELS)]\n")
    _, split = build_model_datasets(source, f"{tmp_path / 'mlm.py'}:rows", seq_len=12)
    x, y = split.train.take(torch.arange(4))
    assert torch.equal(x, inputs) and torch.equal(y, labels)  # not shifted
    out = run_layers(layers, x)
    want = model(input_ids=inputs, labels=labels)
    torch.testing.assert_close(out, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(source.loss_fn(out, y), want.loss, rtol=1e-5, atol=1e-6)
    (tmp_path / "t.txt").write_text("some text " * 50)
    with pytest.raises(InputError, match=r"is a masked LM: it trains on samples of masked input_ids and their labels"):
        build_model_datasets(source, f"text:{tmp_path / 't.txt'}", seq_len=12)


def test_a_damaged_kept_cut_is_traced_again_and_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_CACHE_DIR", str(tmp_path / "cuts"))
    d = family_dir(tmp_path, "llama")
    resolve_model(f"hf:{d}")
    (kept,) = (tmp_path / "cuts").glob("*.pt")
    kept.write_bytes(kept.read_bytes()[:100])  # cut short
    traced = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: traced.append(1) or real(*a, **k))
    source = resolve_model(f"hf:{d}")
    assert traced == [1] and kept.stat().st_size > 100  # traced again, written over
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).eval()
    x = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(run_layers([m.eval() for m in source.build_layers(seed=0)], x), model(x).logits)
    monkeypatch.setenv("HETRAIN_CACHE_DIR", "off")
    traced.clear()
    resolve_model(f"hf:{d}")
    assert traced == [1]  # no cache: traced every time

"""``--model hf:DIR``: a local transformers causal LM cut into layers, its weights, its tied copies."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hetrain.errors import InputError  # noqa: E402
from hetrain.models.hf import lm_loss  # noqa: E402
from hetrain.models.layers import LayerRange, run_layers  # noqa: E402
from hetrain.models.spec import SpecError  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402
from hetrain.runtime.step.hooks import chain_hooks  # noqa: E402
from hetrain.runtime.step.tied import TiedGrads, check_tied, is_local, tie_ranks  # noqa: E402
from hetrain.sync_layout import Segment  # noqa: E402
from hetrain.sync_mode import sync_mode  # noqa: E402
from tiers import slow_where  # noqa: E402

VOCAB = 100


def gpt2_config(**extra: Any) -> Any:
    sizes = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": 64} | extra
    return transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                   **sizes)


def llama_config(**extra: Any) -> Any:
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    bos_token_id=0, eos_token_id=0, **extra)


CONFIGS = {
    "gpt2": gpt2_config,
    "llama": llama_config,
    "llama-eager": lambda: llama_config(attn_implementation="eager"),  # an explicit (B, 1, T, T) causal mask
    "llama-tied": lambda: llama_config(tie_word_embeddings=True),
}


def write_dir(tmp_path: Path, config: Any, weights_seed: int | None = None) -> tuple[str, Any]:
    """A model directory with config.json (and model.safetensors from a model built under ``weights_seed``)."""
    config.save_pretrained(tmp_path)
    model = None
    if weights_seed is not None:
        torch.manual_seed(weights_seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").is_file()
    return f"hf:{tmp_path}", model


# each case traces a transformers model: gpt2 in the fast tier
@pytest.mark.parametrize("kind", slow_where(CONFIGS, lambda _k, kind: kind != "gpt2"))
def test_cut_layers_give_the_models_logits(kind: str, tmp_path: Path) -> None:
    config = CONFIGS[kind]()
    spec, _ = write_dir(tmp_path, config)
    source = resolve_model(spec)
    assert source.num_layers == 4 and source.layer_names == ("embed", "block1", "block2", "head")
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, VOCAB, (3, 11))  # (B, T)
    got = run_layers(source.build_layers(seed=7), ids)
    want = model(ids).logits  # (B, T, V)
    assert got.shape == (3, 11, VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a stage's layers are those of the whole model: the same chain, built in two parts
    parts = source.build_layers(0, 2, seed=7) + source.build_layers(2, 4, seed=7)
    torch.testing.assert_close(run_layers(parts, ids), want, rtol=1e-5, atol=1e-5)
    # the loss: next-token cross-entropy over every position
    targets = torch.randint(0, VOCAB, (3, 11))
    torch.testing.assert_close(lm_loss(got, targets),
                               torch.nn.functional.cross_entropy(want.reshape(-1, VOCAB), targets.reshape(-1)))


@pytest.mark.slow  # traces a transformers model
def test_tied_weights_become_equal_copies_named_as_ties(tmp_path: Path) -> None:
    gpt2 = resolve_model(write_dir(tmp_path / "g", gpt2_config())[0])
    assert gpt2.tied == (((0, "transformer.wte.weight"), (3, "lm_head.weight")),)
    layers = gpt2.build_layers(seed=1)
    first, last = layers[0].get_parameter("transformer.wte.weight"), layers[3].get_parameter("lm_head.weight")
    assert first is not last and torch.equal(first, last)
    assert resolve_model(write_dir(tmp_path / "l", llama_config())[0]).tied == ()  # Llama's default: untied
    assert resolve_model(write_dir(tmp_path / "t", llama_config(tie_word_embeddings=True))[0]).tied == (
        ((0, "model.embed_tokens.weight"), (3, "lm_head.weight")),)


@pytest.mark.slow  # traces a transformers model
def test_weights_are_loaded_into_a_ranks_layers(tmp_path: Path) -> None:
    spec, saved = write_dir(tmp_path, gpt2_config(), weights_seed=11)
    source = resolve_model(spec)
    block, head = source.build_layers(2, 4, seed=0)  # another seed: the file's weights win
    hf_state = saved.state_dict()
    names = [name for name, _ in block.named_parameters()]
    assert names and all(name.startswith("transformer.h.1.") for name in names)  # layer 2 is HF's block 1
    for name, tensor in block.named_parameters():  # the model's own names
        torch.testing.assert_close(tensor, hf_state[name], rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head.weight, hf_state["transformer.wte.weight"], rtol=0, atol=0)
    torch.testing.assert_close(head.transformer.ln_f.weight, hf_state["transformer.ln_f.weight"], rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(run_layers(source.build_layers(seed=5), ids), saved(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # traces a transformers model
def test_weights_saved_from_the_base_model_are_found_without_its_prefix(tmp_path: Path) -> None:
    """The hub's gpt2 names its tensors "h.0.attn...", "wte.weight": saved from GPT2Model, not the LM."""
    from safetensors.torch import save_file

    spec, saved = write_dir(tmp_path, gpt2_config(), weights_seed=6)
    base = {k.removeprefix("transformer."): t.contiguous() for k, t in saved.state_dict().items()
            if k.startswith("transformer.") and ".attn.bias" not in k}
    save_file(base, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(run_layers(resolve_model(spec).build_layers(seed=0), ids), saved(ids).logits,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # traces a transformers model
def test_a_rank_reads_only_its_layers_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = write_dir(tmp_path, llama_config(), weights_seed=2)
    source = resolve_model(spec)
    import safetensors

    read: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._f = real(*args, **kwargs)

        def __enter__(self) -> Spy:
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.__exit__(*exc)

        def get_tensor(self, key: str) -> Any:
            read.append(key)
            return self._f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    source.build_layers(3, 4, seed=0)
    assert sorted(read) == ["lm_head.weight", "model.norm.weight"]


@pytest.mark.parametrize("problem", slow_where(  # the two whose directory is read trace the model
    ["no-dir", "no-config", "wrong-shape", "missing-tensor", "not-safetensors"],
    lambda _k, problem: problem in ("wrong-shape", "missing-tensor")))
def test_a_directory_that_cannot_be_used_is_named(problem: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = tmp_path / "m"
    if problem != "no-dir":
        d.mkdir()
    if problem in ("wrong-shape", "missing-tensor", "not-safetensors"):
        gpt2_config().save_pretrained(d)
    if problem == "wrong-shape":
        write_dir(tmp_path / "small", gpt2_config(n_embd=16), weights_seed=0)
        (tmp_path / "small" / "model.safetensors").rename(d / "model.safetensors")
    if problem == "missing-tensor":
        save_file({"transformer.wte.weight": torch.zeros(VOCAB, 32)}, str(d / "model.safetensors"))
    if problem == "not-safetensors":
        (d / "model.safetensors").write_text("not weights")
    needles = {"no-dir": (str(d), "does not exist"), "no-config": (str(d / "config.json"), "missing"),
               "wrong-shape": (str(d / "model.safetensors"), "transformer.", "(100, 16)", "do not match"),
               "missing-tensor": (str(d / "model.safetensors"), "has no tensor transformer.wpe.weight"),
               "not-safetensors": (str(d / "model.safetensors"), "cannot be read as safetensors")}[problem]
    with pytest.raises(SpecError) as caught:
        resolve_model(f"hf:{d}")
    text = str(caught.value)
    assert "\n" not in text and all(n in text for n in needles), text


def test_settings_are_refused_for_an_hf_model(tmp_path: Path) -> None:
    spec, _ = write_dir(tmp_path, gpt2_config())
    with pytest.raises(SpecError, match=r"config\.json"):
        resolve_model(spec, n_blocks=2)


@pytest.mark.slow  # traces a transformers model
def test_tied_grads_on_one_rank_sum_the_copies_as_the_tied_models_gradient(tmp_path: Path) -> None:
    """One stage holding both ends: the copies' gradients are summed on the rank, without a group."""
    config = gpt2_config()
    source = resolve_model(write_dir(tmp_path, config)[0])
    net = LayerRange(source.build_layers(seed=3))
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids, targets = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    lm_loss(net(ids), targets).backward()
    lm_loss(model(ids).logits, targets).backward()

    plan = SimpleNamespace(sync="wsp", segments=lambda: (Segment(0, 4, ("n0:0", "n1:0")),))  # both hold all 4
    hook = chain_hooks(None, TiedGrads(source.tied, plan, "n1:0", net, [], lambda work, what: None))  # type: ignore[arg-type]
    assert hook is not None
    hook(0)
    want = model.transformer.wte.weight.grad
    torch.testing.assert_close(net[0].transformer.wte.weight.grad, want)
    torch.testing.assert_close(net[3].lm_head.weight.grad, want)


def test_a_tie_across_devices_needs_bsp() -> None:
    tie = ((0, "model.embed_tokens.weight"), (3, "lm_head.weight"))
    across = (Segment(0, 2, ("n0:0",)), Segment(2, 4, ("n0:1",)))
    plan = SimpleNamespace(sync="wsp", sync_mode=sync_mode("wsp"), segments=lambda: across)
    assert not is_local(plan, tie)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"layer 0 \(model\.embed_tokens\.weight\) and layer 3 "
                                         r"\(lm_head\.weight\).*'wsp'"):
        check_tied(plan, [tie])  # type: ignore[arg-type]
    bsp = SimpleNamespace(sync="bsp", sync_mode=sync_mode("bsp"), segments=lambda: across)
    check_tied(bsp, [tie])  # type: ignore[arg-type]
    assert tie_ranks(bsp,  # type: ignore[arg-type]
                     {"n0:0": 0, "n0:1": 1}, [tie]) == [[0, 1]]

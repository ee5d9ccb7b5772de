"""``hetrain export``: a checkpoint's weights as a Hugging Face directory or one safetensors file; its refusals.

Checkpoints here are written in this process by ``save_checkpoint`` (the function the stages call);
``tests/distributed/test_hf_export.py`` exports ones that two pipeline stages wrote under torchrun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from hetrain.cli import main  # noqa: E402
from hetrain.models.layers import LayerRange  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402
from hetrain.runtime.state.checkpoint import save_checkpoint  # noqa: E402
from hetrain.runtime.state.export import ExportError, export_hf  # noqa: E402
from tiers import slow_where  # noqa: E402

VOCAB = 100


def gpt2_config(**extra: Any) -> Any:
    sizes = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": 64} | extra
    return transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **sizes)  # dropout on: eval() must turn it off


def llama_config(**extra: Any) -> Any:
    sizes = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64} | extra
    return transformers.LlamaConfig(bos_token_id=0, eos_token_id=0, **sizes)


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config, "llama-tied": lambda: llama_config(tie_word_embeddings=True)}


def model_dir(path: Path, config: Any) -> str:
    config.save_pretrained(path)
    return f"hf:{path}"


def write_checkpoint(ckpt: Path, model: str, step: int, *, meta_model: str | None = "same", seed: int = 0,
                     shift: float = 0.05) -> LayerRange:
    """A checkpoint of ``model``'s layers (built under ``seed``) moved by ``shift``·noise, tied copies kept equal;
    returns the layers with those weights."""
    source = resolve_model(model)
    stage = LayerRange(source.build_layers(seed=seed))
    state = {n: t + shift * torch.randn_like(t) for n, t in stage.state_dict().items()}
    for tie in source.tied:  # as runtime.step.tied keeps them: equal
        (k0, n0), *rest = tie
        for k, n in rest:
            state[f"layers.{k}.{n}"] = state[f"layers.{k0}.{n0}"].clone()
    meta = {"step": step} | ({} if meta_model is None else {"model": model if meta_model == "same" else meta_model})
    save_checkpoint(ckpt, step, state, {}, meta, keep=None)
    stage.load_state_dict(state)
    return stage.eval()


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], args: list[str], status: int = 2) -> str:
    code, _, err = run(args, capsys)
    assert code == status, err
    assert err.startswith("hetrain export: error: ") and err.count("\n") == 1, err
    return err


def logits(model: Any, ids: Any) -> Any:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


# each case traces a transformers model: gpt2 in the fast tier
@pytest.mark.parametrize("kind", slow_where(CONFIGS, lambda _k, kind: kind != "gpt2"))
def test_export_loads_in_transformers_with_the_checkpoints_logits(kind: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec = model_dir(tmp_path / "src", CONFIGS[kind]())
    trained = write_checkpoint(tmp_path / "ckpt", spec, 7)
    code, out, err = run(["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert out.startswith(f"hetrain export: step 7 of {spec} -> {tmp_path / 'out'}"), out

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    ids = torch.randint(0, VOCAB, (3, 11))  # (B, T)
    got = logits(model.eval(), ids)
    torch.testing.assert_close(got, logits(trained, ids), rtol=1e-5, atol=1e-5)
    untrained = LayerRange(resolve_model(spec).build_layers(seed=0)).eval()
    assert (got - logits(untrained, ids)).abs().max() > 1e-2  # the check above can fail

    with safetensors.safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    head = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    assert head in keys and ("lm_head.weight" in keys) == (kind == "llama")  # a tied matrix once, as HF writes it
    assert (tmp_path / "out" / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out", "src"]  # no temporary left beside OUT


@pytest.mark.slow  # traces a transformers model
def test_tokenizer_and_generation_config_are_copied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    spec = model_dir(tmp_path / "src", llama_config())
    words = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path / "src")
    transformers.GenerationConfig(max_new_tokens=5, bos_token_id=0).save_pretrained(tmp_path / "src")
    write_checkpoint(tmp_path / "ckpt", spec, 3)
    assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")], capsys)[0] == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes(), name
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("hello world")["input_ids"] == [1, 2]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").max_new_tokens == 5


@pytest.mark.slow  # traces a transformers model
def test_the_tokenizer_trained_with_is_exported_and_files_are_readable_as_the_umask_allows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``train --tokenizer FILE`` keeps FILE beside the checkpoints (``save_tokenizer``); export writes it with the
    model. safetensors writes 0600: another user, or a serving container, could not read model.safetensors."""
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers

    from hetrain.runtime.state.export import save_tokenizer

    spec = model_dir(tmp_path / "src", llama_config())  # a directory without a tokenizer
    words = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "own.json"))
    write_checkpoint(tmp_path / "ckpt", spec, 3)
    save_tokenizer(tmp_path / "ckpt", tmp_path / "own.json")
    old = os.umask(0o022)
    try:
        assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")], capsys)[0] == 0
        assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-safetensors", str(tmp_path / "w.safetensors")],
                   capsys)[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "own.json").read_bytes()
    for path in (tmp_path / "out" / "model.safetensors", tmp_path / "out" / "config.json",
                 tmp_path / "out" / "tokenizer.json", tmp_path / "w.safetensors"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o644), path
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(0o755)


@pytest.mark.slow  # traces a transformers model
def test_newest_checkpoint_by_default_and_step_picks_another(tmp_path: Path) -> None:
    spec = model_dir(tmp_path / "src", llama_config())
    early = write_checkpoint(tmp_path / "ckpt", spec, 5, seed=1)
    late = write_checkpoint(tmp_path / "ckpt", spec, 9, seed=2)
    ids = torch.randint(0, VOCAB, (2, 6))
    for step, want, out in ((None, late, "a"), (5, early, "b")):
        done = export_hf(tmp_path / "ckpt", tmp_path / out, step=step)
        assert done.step == (9 if step is None else 5) and done.tensors == 21
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        torch.testing.assert_close(logits(model, ids), logits(want, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # traces a transformers model
def test_model_named_when_the_checkpoint_does_not_record_it(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    spec = model_dir(tmp_path / "src", llama_config())
    write_checkpoint(tmp_path / "ckpt", spec, 4, meta_model=None)
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")])
    assert f"checkpoint step 4 in {tmp_path / 'ckpt'} does not record its model" in err
    assert "--model hf:DIR" in err and "--plan PLAN" in err
    assert not (tmp_path / "out").exists()
    assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"), "--model", spec],
               capsys)[0] == 0


@pytest.mark.slow  # traces a transformers model
def test_a_moved_model_directory_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = model_dir(tmp_path / "src", llama_config())
    write_checkpoint(tmp_path / "ckpt", spec, 4)
    (tmp_path / "src").rename(tmp_path / "moved")
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")]
    err = one_line_error(capsys, args)
    assert f"was trained from {spec} (its meta)" in err and "give --model hf:DIR" in err, err
    err = one_line_error(capsys, [*args, "--model", spec])
    assert f"--model {spec}: directory {tmp_path / 'src'} does not exist" in err, err
    assert run([*args, "--model", f"hf:{tmp_path / 'moved'}"], capsys)[0] == 0


@pytest.mark.slow  # traces a transformers model
def test_no_checkpoint_and_a_missing_step_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "empty"), "--to-hf", str(tmp_path / "out")])
    assert f"--checkpoint {tmp_path / 'empty'}: no complete checkpoint in {tmp_path / 'empty'}" in err, err
    spec = model_dir(tmp_path / "src", llama_config())
    write_checkpoint(tmp_path / "ckpt", spec, 5)
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"),
                                  "--step", "6"])
    assert "no complete checkpoint of step 6" in err and "complete checkpoints: steps 5" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # traces a transformers model
def test_a_non_empty_out_is_replaced_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = model_dir(tmp_path / "src", llama_config())
    write_checkpoint(tmp_path / "ckpt", spec, 5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(out)]
    err = one_line_error(capsys, args)
    assert f"--to-hf {out}: the directory is not empty (it holds notes.txt); give --force" in err, err
    assert (out / "notes.txt").read_text() == "mine"
    assert run([*args, "--force"], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out", "src"]
    (tmp_path / "empty").mkdir()  # an empty directory is written into without --force
    assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "empty")], capsys)[0] == 0
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path), "--force"])
    assert "it holds the checkpoint directory" in err, err


def test_a_reference_model_exports_only_as_one_safetensors_file(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    trained = write_checkpoint(tmp_path / "ckpt", "mlp-digits", 12)
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")])
    assert f"checkpoint step 12 in {tmp_path / 'ckpt'} is of model mlp-digits (its meta): only hf:DIR models " \
           "export to Hugging Face" in err and "--to-safetensors FILE" in err, err
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"),
                                  "--model", "mlp-digits"])
    assert "--model mlp-digits: only hf:DIR models export to Hugging Face" in err, err

    file = tmp_path / "w.safetensors"
    code, out, _ = run(["--checkpoint", str(tmp_path / "ckpt"), "--to-safetensors", str(file)], capsys)
    assert code == 0 and out.startswith(f"hetrain export: step 12 of mlp-digits -> {file}"), out
    saved = load_file(str(file))
    assert saved.keys() == trained.state_dict().keys()
    for name, t in trained.state_dict().items():
        torch.testing.assert_close(saved[name], t, rtol=0, atol=0)
    with safetensors.safe_open(str(file), framework="pt") as f:
        assert f.metadata()["step"] == "12" and f.metadata()["model"] == "mlp-digits"
    err = one_line_error(capsys, ["--checkpoint", str(tmp_path / "ckpt"), "--to-safetensors", str(file)])
    assert f"--to-safetensors {file}: the file exists; give --force" in err, err
    assert run(["--checkpoint", str(tmp_path / "ckpt"), "--to-safetensors", str(file), "--force"], capsys)[0] == 0


@pytest.mark.slow  # traces a transformers model
def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = model_dir(tmp_path / "small", llama_config())
    write_checkpoint(tmp_path / "ckpt", small, 2)
    wider = model_dir(tmp_path / "wider", llama_config(hidden_size=64))
    deeper = model_dir(tmp_path / "deeper", llama_config(num_hidden_layers=3))
    gpt2 = model_dir(tmp_path / "gpt2", gpt2_config())
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"), "--model"]
    err = one_line_error(capsys, [*args, wider])
    assert "has layers.0.model.embed_tokens.weight of shape (100, 32), but" in err and "(100, 64)" in err, err
    err = one_line_error(capsys, [*args, deeper])
    assert "has no tensor layers.3.model.layers.2." in err and "it is not a checkpoint of this model" in err, err
    err = one_line_error(capsys, [*args, gpt2])
    assert "has no tensor layers.0.transformer.wte.weight (transformer.wte.weight" in err, err
    err = one_line_error(capsys, [*args, model_dir(tmp_path / "one", llama_config(num_hidden_layers=1))])
    assert "has no tensor layers.2.lm_head.weight (lm_head.weight of" in err, err  # its head is a block there
    state = LayerRange(resolve_model(small).build_layers()).state_dict()
    save_checkpoint(tmp_path / "more", 3, {**state, "layers.4.extra.weight": torch.ones(2)}, {}, {"model": small})
    with pytest.raises(ExportError, match=r"step 3 in .*more holds layers.4.extra.weight \(1 such\), which hf:"):
        export_hf(tmp_path / "more", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # traces a transformers model
def test_tied_copies_that_differ_are_named_and_the_first_is_written(tmp_path: Path) -> None:
    spec = model_dir(tmp_path / "src", gpt2_config())
    stage = LayerRange(resolve_model(spec).build_layers(seed=0))
    state = stage.state_dict()
    state["layers.3.lm_head.weight"] = state["layers.3.lm_head.weight"] + 0.5
    save_checkpoint(tmp_path / "ckpt", 1, state, {}, {"model": spec})
    with pytest.warns(RuntimeWarning, match=r"the tied copies layers.0.transformer.wte.weight and "
                                            r"layers.3.lm_head.weight differ \(largest difference 0.5\)"):
        export_hf(tmp_path / "ckpt", tmp_path / "out")
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))["transformer.wte.weight"]
    torch.testing.assert_close(written, state["layers.0.transformer.wte.weight"], rtol=0, atol=0)

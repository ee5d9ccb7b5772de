"""From a Hugging Face config to a trained, exported model: profile, plan, train on two stages, export.

    hetrain profile --model hf:DIR --data tokens.py:dataset -o p.json
    hetrain plan --cluster two-cpus.toml --profile p.json --global-batch 8 --strategy pp -o plan.json
    hetrain train --plan plan.json --model hf:DIR ... --checkpoint-dir ckpt   (two ranks, as torchrun starts them)
    hetrain export --checkpoint ckpt --to-hf out

For a tiny GPT-2 (its ``wte``/``lm_head`` matrix tied, one copy on each rank) and a tiny Llama
(untied): the checkpoint is written by both ranks, and ``AutoModelForCausalLM.from_pretrained(out)``
must load it with no missing or unexpected keys and give the logits of hetrain's layers loaded from
the checkpoint, which differ from the untrained model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_jobs import TWO_CPUS, counting_tokens, train_ranks

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hetrain.cli import main  # noqa: E402
from hetrain.models.layers import LayerRange  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402
from hetrain.runtime.state.checkpoint import load_checkpoint, load_manifest  # noqa: E402

TOKENS = counting_tokens(128)  # the next token is learnable
STEPS, SEED = 6, 3
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                            eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                              max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_model_trained_on_two_stages_exports_to_what_transformers_loads(kind: str, tmp_path: Path, clean_env,
                                                                          capsys) -> None:
    CONFIGS[kind]().save_pretrained(tmp_path / kind)
    model, data = f"hf:{tmp_path / kind}", f"{tmp_path / 'tokens.py'}:dataset"
    (tmp_path / "tokens.py").write_text(TOKENS)
    (tmp_path / "two-cpus.toml").write_text(TWO_CPUS)
    # the commands in this process and the training on forked ranks (``cli_jobs``); at TP 1, so that the
    # pipeline has two stages whatever the measured (and, on a loaded host, noisy) profile makes of a TP-2 stage
    assert main(["profile", "--model", model, "--data", data, "-o", str(tmp_path / "p.json"), "--micro-batch", "4",
                 "--repeats", "1"]) == 0
    assert main(["plan", "--cluster", str(tmp_path / "two-cpus.toml"), "--profile", str(tmp_path / "p.json"),
                 "--global-batch", "8", "--strategy", "pp", "--max-tp", "1", "-o", str(tmp_path / "plan.json")]) == 0
    ckpt = tmp_path / "ckpt"
    train_ranks({**clean_env, "HETRAIN_NODE": "n0"}, [
        "--plan", str(tmp_path / "plan.json"), "--model", model, "--data", data, "--steps", str(STEPS), "--seed",
        str(SEED), "--lr", "0.01", "--checkpoint-dir", str(ckpt), "--timeout-s", "60", "--no-progress"],
        timeout_s=240)
    manifest = load_manifest(ckpt)
    assert manifest["step"] == STEPS
    assert {f["rank"] for f in manifest["files"].values()} == {0, 1}  # each stage wrote its layers

    # the GPT-2 by the model its checkpoint records, the Llama by its plan's
    how = [] if kind == "gpt2" else ["--plan", str(tmp_path / "plan.json")]
    assert main(["export", "--checkpoint", str(ckpt), "--to-hf", str(tmp_path / "out"), *how]) == 0
    assert f"hetrain export: step {STEPS} of {model} -> {tmp_path / 'out'}" in capsys.readouterr().out

    exported, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    source = resolve_model(model)
    untrained = LayerRange(source.build_layers(seed=SEED)).eval()
    trained = LayerRange(source.build_layers(seed=SEED)).eval()
    weights, _, _ = load_checkpoint(ckpt, list(trained.state_dict()))
    trained.load_state_dict(weights)
    ids = torch.randint(0, 100, (3, 16))  # (B, T)
    with torch.no_grad():
        got = exported.eval()(ids).logits  # (B, T, V)
        torch.testing.assert_close(got, trained(ids), rtol=1e-5, atol=1e-5)
        assert (got - untrained(ids)).abs().max() > 1e-2  # trained: the check above can fail
    tied = exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    assert tied == (kind == "gpt2")

"""``--model hf:DIR`` with sliding-window attention: each block masks as the transformers model masks it, so the
chained layers give the model's own logits at sequences longer than the window (Mistral, Qwen2), and a config
whose window is null or longer than the sequence (as the Hub publishes Mistral's) keeps working."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.slow  # every case traces a transformers model

from hetrain.cli import main  # noqa: E402
from hetrain.models.layers import run_layers  # noqa: E402
from hetrain.models.user import resolve_model  # noqa: E402

VOCAB, WINDOW, T = 320, 8, 32  # T: four windows long
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **TINY, "sliding_window": WINDOW}
# blocks 2 and 3 slide, block 1 does not (max_window_layers 1: Qwen2's layer_types)
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **TINY, "tie_word_embeddings": True,
         "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}

CONFIGS: dict[str, dict[str, Any]] = {
    "mistral": MISTRAL,
    "mistral-eager": MISTRAL | {"attn_implementation": "eager"},  # an explicit (B, 1, T, T) mask in every block
    "qwen2": QWEN2,
    "qwen2-all-sliding": QWEN2 | {"max_window_layers": 0},
    "qwen2-eager": QWEN2 | {"attn_implementation": "eager"},
    # as the Hub publishes them: no window (Mistral-7B-v0.2 on), a window longer than T (v0.1's 4096),
    # Qwen2's window switched off; and a Llama config.json with a key its class has no field for
    "mistral-null": MISTRAL | {"sliding_window": None},
    "mistral-4096": MISTRAL | {"sliding_window": 4096},
    "qwen2-off": QWEN2 | {"use_sliding_window": False},
    "llama-stray-key": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY, "sliding_window": 4},
}


def model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_cut_layers_give_the_models_logits_beyond_the_window(kind: str, tmp_path: Path) -> None:
    d = model_dir(tmp_path, CONFIGS[kind])
    source = resolve_model(f"hf:{d}")
    layers = [m.eval() for m in source.build_layers(seed=3)]
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).eval()
    for length in (WINDOW, T):  # at the window both masks are causal; beyond it only the sliding one is right
        ids = torch.randint(0, VOCAB, (2, length))  # (B, T)
        with torch.no_grad():
            got, want = run_layers(layers, ids), model(ids).logits  # (B, T, V) each
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (kind, length, (got - want).abs().max().item())


@pytest.mark.parametrize(("kind", "block", "window"), [("mistral-eager", 1, WINDOW), ("qwen2-eager", 1, None),
                                                       ("qwen2-eager", 2, WINDOW)])
def test_a_block_sees_exactly_the_window_it_is_given(kind: str, block: int, window: int | None,
                                                     tmp_path: Path) -> None:
    """Position i's output moves with position j's input iff 0 <= i - j < window (every j <= i without one):
    transformers' ``sliding_window_causal_mask_function``, checked by perturbing one position at a time of the
    hidden state that reaches the block (the mask and rotary tables travel beside it, as the trace cut them)."""
    source = resolve_model(f"hf:{model_dir(tmp_path, CONFIGS[kind])}")
    layers = [m.eval() for m in source.build_layers(0, block + 1, seed=0)]
    with torch.no_grad():
        inputs = list(run_layers(layers[:block], torch.randint(0, VOCAB, (1, T))))
        hidden = [k for k, t in enumerate(inputs) if t.is_floating_point() and tuple(t.shape) == (1, T, 32)]
        assert len(hidden) == 1, [tuple(t.shape) for t in inputs]  # the one (B, T, C) activation
        base = _hidden_out(layers[block](tuple(inputs)))
        for j in (0, 5, 20):
            moved = list(inputs)
            moved[hidden[0]] = inputs[hidden[0]].clone()
            moved[hidden[0]][0, j] += 1.0
            changed = (_hidden_out(layers[block](tuple(moved))) - base).abs().amax(dim=-1)[0] > 1e-6  # (T,)
            seen = [j <= i and (window is None or i - j < window) for i in range(T)]
            assert changed.tolist() == seen, (kind, block, j)


def _hidden_out(out: Any) -> Any:
    return next(t for t in out if t.is_floating_point() and tuple(t.shape) == (1, T, 32))


def test_hetrain_profile_runs_a_sliding_window_model_beyond_its_window(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = model_dir(tmp_path, MISTRAL)
    out = tmp_path / "p.json"
    code = main(["profile", "--model", f"hf:{d}", "--seq-len", str(T), "--micro-batch", "1,2", "--repeats", "1",
                 "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["seq_len"] == T

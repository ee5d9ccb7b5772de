"""``param_bytes`` counts the parameters as the model holds them (docs/profile.md): 4 bytes each in fp32, whatever
the precision of compute (the fp32 master weights of mixed precision); 2 for a model of your own built in bf16. An
``hf:DIR`` is built in fp32 whatever its config.json names (a Hub config's ``"torch_dtype": "bfloat16"``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hetrain.cli import main  # noqa: E402
from hetrain.profiler.layers import measure_layers  # noqa: E402


def layers(dtype: Any) -> list[nn.Module]:
    return [nn.Linear(16, 32).to(dtype), nn.Linear(32, 4).to(dtype)]  # 544 and 132 parameters


@pytest.mark.parametrize(("dtype", "precision", "per_param"), [
    (torch.float32, "fp32", 4),
    (torch.float32, "bf16", 4),  # autocast computes in bf16; the weights stay fp32
    (torch.bfloat16, "fp32", 2),  # a bf16 model: bf16 weights, no fp32 master copy
    (torch.bfloat16, "bf16", 2),
])
def test_param_bytes_are_the_parameters_as_the_model_holds_them(dtype: Any, precision: str,
                                                                per_param: int) -> None:
    model = layers(dtype)
    m = measure_layers(model, torch.randn(1, 16, dtype=dtype), (1, 2), repeats=1, warmup=0,
                       precision=precision, optimizers=())  # type: ignore[arg-type]
    assert [r.param_bytes for r in m.layers] == [544 * per_param, 132 * per_param]
    assert all(p.dtype == dtype for layer in model for p in layer.parameters())  # profiling cast nothing


@pytest.mark.parametrize(("extra", "per_param"), [({}, 4), ({"torch_dtype": "float32"}, 4),
                                                  ({"torch_dtype": "bfloat16"}, 4), ({"dtype": "bfloat16"}, 4)])
@pytest.mark.slow  # traces a transformers model
def test_an_hf_model_is_built_with_fp32_master_weights_whatever_its_config_json_names(
        tmp_path: Path, extra: dict[str, str], per_param: int, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    d = tmp_path / "model"
    d.mkdir()
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64} | extra
    (d / "config.json").write_text(json.dumps(config))
    out = tmp_path / "p.json"
    code = main(["profile", "--model", f"hf:{d}", "--seq-len", "8", "--micro-batch", "1,2", "--repeats", "1",
                 "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    embed = json.loads(out.read_text())["layers"][0]
    assert embed["param_bytes"] == 64 * 32 * per_param  # the (V, C) token embedding

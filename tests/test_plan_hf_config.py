"""``hetrain plan --model hf:DIR`` plans a model from its config.json alone: Llama-2-70B on a laptop, in seconds,
with no torch, no transformers and no weights; ``simulate`` and ``models`` take the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.models.analytic import PARAM_BYTES
from hetrain.plan import load_plan

# Touvron et al. 2023, "Llama 2", table 1, and the published config.json of Llama-2-70b-hf
LLAMA2_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

# 4 nodes of 8 A100-80GB: 2.7 TB for the 1.2 TB that 69e9 fp32 weights, gradients and Adam state take
NODE = ('[[node]]\nname = "a{k}"\ndevices = [{{ type = "A100-80GB", count = 8 }}]\n'
        'intra_link = "nvlink3"\nnic = "ib-hdr"\n')


@pytest.fixture
def llama70b(tmp_path: Path) -> tuple[Path, Path]:
    """(the model directory, holding config.json only; the cluster file)."""
    model = tmp_path / "llama-2-70b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_70B))
    cluster = tmp_path / "a100x32.toml"
    cluster.write_text('name = "a100x32"\n' + "".join(NODE.format(k=k) for k in range(4)))
    return model, cluster


def test_llama2_70b_plans_from_its_config_without_torch_or_weights(llama70b: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    model, cluster = llama70b
    out = tmp_path / "plan.json"
    code = ("import json, resource, sys\nfrom hetrain.cli import main\n"
            f"code = main(['plan', '--cluster', {str(cluster)!r}, '--model', 'hf:{model}', '--global-batch', '64', "
            f"'--time-budget', '5s', '-o', {str(out)!r}])\n"
            "print(json.dumps([code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', "
            "'safetensors'}), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    status, imported, max_rss_kb = json.loads(done.stdout.strip().splitlines()[-1])
    assert (status, imported) == (0, []), done.stdout + done.stderr
    assert max_rss_kb * 1024 < 2e9  # kilobytes on Linux: a planner's memory, nothing like 276 GB of weights
    plan = load_plan(out)
    assert plan.profile.param_bytes / PARAM_BYTES == pytest.approx(68.98e9, rel=1e-3)
    assert plan.profile.num_layers == 82 and plan.profile.seq_len == 4096 and plan.precision == "bf16"
    assert plan.model == "llama-2-70b"


def test_simulate_and_models_take_the_planned_config(llama70b: tuple[Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model, cluster = llama70b
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(cluster), "--model", f"hf:{model}", "--global-batch", "16",
                 "--seq-len", "2048", "--time-budget", "2s", "-o", str(out)]) == 0
    assert load_plan(out).profile.seq_len == 2048
    capsys.readouterr()
    assert main(["simulate", str(out)]) == 0
    assert "simulated iteration" in capsys.readouterr().out
    assert main(["models", f"hf:{model}", "llama2-13b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [f"hf:{model}", "82", "275.9", "GB", "bf16"]
    assert lines[2].split() == ["llama2-13b", "42", "52.1", "GB", "bf16"]


def test_a_bad_config_is_one_line_of_plan_output(llama70b: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    model, cluster = llama70b
    (model / "config.json").write_text(json.dumps({**LLAMA2_70B, "num_key_value_heads": 7}))
    assert main(["plan", "--cluster", str(cluster), "--model", f"hf:{model}", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{model / 'config.json'}: num_key_value_heads is 7; it must divide num_attention_heads (64)" in err


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b", "gpt-2.7b"])
def test_the_big_presets_plan_by_name(name: str, llama70b: tuple[Path, Path], tmp_path: Path) -> None:
    _, cluster = llama70b
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(cluster), "--model", name, "--global-batch", "16", "--time-budget", "2s",
                 "-o", str(out)]) == 0
    assert load_plan(out).model == name

"""Each transformers family from its config.json through the CLI: profile, plan on 2 pipeline stages, and one
step of ``hetrain train`` on two Gloo ranks (``cli_jobs.train_ranks``). The first step's loss, on data of one
repeated token, equals the loss transformers computes on the same window (relative 1e-4).

The families whose forward does more than their named parts run by default (``CLI_FAMILIES``); every family
with ``HETRAIN_ALL_FAMILIES=1`` (each takes about half a minute here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_jobs import TWO_CPUS, hetrain, step_rows, train_ranks

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_families  # noqa: E402

TOKEN, T, SEED = 7, 12, 3

FAMILIES = list(hf_families.FAMILIES) if os.environ.get("HETRAIN_ALL_FAMILIES") else list(hf_families.CLI_FAMILIES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_trains_on_two_stages_from_the_cli_with_transformers_first_loss(family: str, tmp_path: Path,
                                                                                 clean_env) -> None:
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_families.FAMILIES[family]))
    np.full(16 * T + 1, TOKEN, dtype="<u2").tofile(tmp_path / "repeated.bin")  # a file of one repeated token
    (tmp_path / "two-cpus.toml").write_text(TWO_CPUS)
    model, data = f"hf:{d}", f"tokens:{tmp_path / 'repeated.bin'}"
    hetrain(["profile", "--model", model, "--data", data, "--seq-len", str(T), "-o", "p.json", "--micro-batch", "2",
             "--repeats", "1"], tmp_path)
    hetrain(["plan", "--cluster", "two-cpus.toml", "--profile", "p.json", "--global-batch", "4", "--strategy", "pp",
             "--max-tp", "1", "-o", "plan.json"], tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    train_ranks({**clean_env, "HETRAIN_NODE": "n0"}, [
        "--plan", str(tmp_path / "plan.json"), "--model", model, "--data", data, "--steps", "1", "--seed", str(SEED),
        "--log-every", "1", "--metrics-out", str(metrics), "--timeout-s", "60", "--no-progress"], timeout_s=240)
    first = step_rows(metrics)[0]["loss"]

    torch.manual_seed(SEED)  # every rank builds the model under --seed, as here
    config = transformers.AutoConfig.from_pretrained(d)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    x = torch.full((4, T), TOKEN)
    want = reference(input_ids=x, labels=x, shift_labels=x).loss.item()  # training mode, as the first step runs
    assert first == pytest.approx(want, rel=1e-4), (family, first, want)

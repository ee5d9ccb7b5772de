"""Sailor's measured layer profiles (profiles.json) as hetrain ModelProfiles, one per model.

Source of the data: the public artifact of the Sailor project (github.com/eth-easl/sailor, SOSP 2025,
MIT licence), re-encoded as ``profiles.json``: ``models[model].timing[gpu_type][mbs][tp] = {fwd_s[],
bwd_s[], update_s[]}`` per layer id, ``layer_sizes_per_tp[tp]`` element counts per layer at micro-batch 1,
``dims`` the model's shape. Layer 0 is the embedding, 1..L the transformer blocks, L+1 the final LayerNorm,
the LM head and the loss.

Conversion rule (one, for every model and GPU type):

- only tensor-parallel degree 1 (one GPU runs the whole layer; hetrain has no tensor parallelism);
- a GPU type becomes its catalog type (``hetrain.imports.sailor.catalog_type``: ``A100-40`` -> ``A100-40GB``,
  ``GH-96`` -> ``GH200``, ``RTX-2080`` -> ``RTX2080Ti``: the data gives those GPUs 11 GiB, a 2080 Ti's memory),
  with its peak fp32 rate and memory bandwidth recorded in ``measured_on``;
- bytes are elements x 4 (the runs were fp32): ``param_bytes`` from ``params_floats``,
  ``output_bytes_per_sample`` from ``act_output_floats``, ``saved_bytes_per_sample`` from ``act_mem_floats``;
- forward FLOPs per sample from the dims (``models.analytic.gpt_block_flops`` for a block; the LM head
  ``2 s h V``; the embedding a gather, no FLOPs);
- each (micro-batch, layer) with tp=1 timings is one Measurement of that type.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetrain.catalog import lookup_device_type
from hetrain.imports.sailor import catalog_type
from hetrain.models.analytic import gpt_block_flops
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile

BYTES_PER_FLOAT = 4  # the runs were fp32
TOKEN_BYTES = 8  # int64 token ids
#: readable names of the two models of the data set
MODEL_NAMES = {"OPT-350": "OPT-350M", "GPT-Neo-2.7": "GPT-Neo-2.7B"}


def layer_flops(dims: dict[str, Any], layer_id: int) -> float:
    """Forward FLOPs per sample of layer ``layer_id``: 0 for the embedding, ``24 s h^2 + 4 s^2 h`` for a
    block, ``2 s h V`` for the LM head (a (s, h) x (h, V) matmul)."""
    h, s, v = int(dims["hidden_size"]), int(dims["sequence_length"]), int(dims["vocab_size_in_config"])
    last = int(dims["num_layers_total"]) - 1
    if layer_id == 0:
        return 0.0
    if layer_id == last:
        return float(2 * s * h * v)
    return float(gpt_block_flops(h, s))


def convert_model(model: str, raw: dict[str, Any], layer_ids: list[int] | None = None) -> ModelProfile:
    """One model of profiles.json as a ModelProfile (tp=1), keeping ``layer_ids`` (default all) in order."""
    dims = raw["dims"]
    sizes = raw["layer_sizes_per_tp"]["1"]
    ids = list(range(int(dims["num_layers_total"]))) if layer_ids is None else layer_ids
    figures: dict[str, DeviceFigures] = {}
    per_layer: dict[int, dict[str, list[Measurement]]] = {i: {} for i in ids}
    for gpu, by_mbs in raw["timing"].items():
        t = lookup_device_type(catalog_type(gpu))
        for mbs, by_tp in sorted(by_mbs.items(), key=lambda kv: int(kv[0])):
            if "1" not in by_tp:
                continue
            entry = by_tp["1"]
            figures[t.name] = DeviceFigures(t.peak_fp32_flops, t.memory_bandwidth_bytes_per_s)
            for i in ids:
                per_layer[i].setdefault(t.name, []).append(
                    Measurement(int(mbs), float(entry["fwd_s"][i]), float(entry["bwd_s"][i])))
    layers = tuple(
        LayerProfile(
            name="embedding" if i == 0 else ("head" if i == int(dims["num_layers_total"]) - 1 else f"block{i}"),
            param_bytes=sizes["params_floats"][i] * BYTES_PER_FLOAT,
            output_bytes_per_sample=sizes["act_output_floats"][i] * BYTES_PER_FLOAT,
            saved_bytes_per_sample=sizes["act_mem_floats"][i] * BYTES_PER_FLOAT,
            forward_flops_per_sample=layer_flops(dims, i),
            measured=tuple((t, tuple(ms)) for t, ms in per_layer[i].items()),
        )
        for i in ids)
    return ModelProfile(name=MODEL_NAMES.get(model, model), layers=layers,
                        input_bytes_per_sample=float(int(dims["sequence_length"]) * TOKEN_BYTES),
                        precision="fp32", measured_on=tuple(figures.items()))


def load_sailor_profiles(data_dir: str | Path) -> dict[str, ModelProfile]:
    """Every model of ``data_dir/profiles.json``, converted, by its readable name."""
    data = json.loads((Path(data_dir) / "profiles.json").read_text())
    return {MODEL_NAMES.get(name, name): convert_model(name, raw) for name, raw in data["models"].items()}

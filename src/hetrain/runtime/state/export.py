"""Trained weights out of a checkpoint: a Hugging Face model directory, or one safetensors file.

    hetrain export --checkpoint ckpt --to-hf trained/                 # a model trained from --model hf:DIR
    hetrain export --checkpoint ckpt --to-safetensors weights.safetensors    # any model, hetrain's names

A checkpoint (``runtime.state.checkpoint``) names every tensor by global layer index,
``layers.{k}.<name in the layer>``, as the stages of any plan wrote it. For a
model trained from ``--model hf:DIR`` (``models.hf``), the names go back to the
transformers model's own through the same cut that made the layers: the model is
built from ``DIR/config.json`` on the ``meta`` device (no memory for weights),
cut into layers, and each layer's tensor is matched to the model's by identity::

    layers.0.tokens.weight        -> transformer.wte.weight         (GPT-2)
    layers.1.block.attn.c_attn.weight -> transformer.h.0.attn.c_attn.weight
    layers.3.lm_head.weight       -> (the same tensor as wte: written once, as save_pretrained does)
    layers.3.lm_head.weight       -> lm_head.weight                 (Llama, untied)

``OUT`` gets ``model.safetensors`` under those names, ``DIR``'s ``config.json``,
and its ``generation_config.json`` and tokenizer files where ``DIR`` has them, so
``AutoModelForCausalLM.from_pretrained(OUT)`` loads it with no missing or
unexpected keys. The tied copies (each layer holds its own, equal after every
step: ``runtime.step.tied``) are written once, the first layer's.

Which directory ``DIR`` is: ``--model hf:DIR`` if given, else the model of
``--plan PLAN``, else the ``model`` the checkpoint's meta records (the plan's
model, ``stage_state.checkpoint_meta``). ``OUT`` is written whole into a hidden
directory beside it and renamed into place, so it never holds half an export.

Example:
    >>> done = export_hf("ckpt", "trained")                                      # doctest: +SKIP
    >>> done.step, done.model, done.tensors                                      # doctest: +SKIP
    (200, 'hf:my-gpt2', 28)
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetrain.errors import InputError
from hetrain.fields import check_output_path
from hetrain.runtime.state.checkpoint import CheckpointError, fsync_path, load_checkpoint, load_manifest, step_dir_name

#: files of a transformers model directory, besides config.json and the weights, copied when present
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
              "chat_template.json")
WEIGHTS = "model.safetensors"
TRAINED_TOKENIZER = "tokenizer.json"  # beside the checkpoints: the --tokenizer the model was trained with
_PS_PREFIX = "ps."  # a parameter server's copy of the global weights (sync.modes): the layers' own are saved too


class ExportError(InputError):
    """A checkpoint, an output or a model that cannot be exported; the message names which and why."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote.

    Attributes:
        path: the directory (``--to-hf``) or file (``--to-safetensors``).
        step: the checkpoint's step.
        model: the model it holds (``hf:DIR``, a reference model's name, a spec), or "" if not recorded.
        tensors: tensors written.
        weight_bytes: bytes of tensor data written.
    """

    path: Path
    step: int
    model: str
    tensors: int
    weight_bytes: int


# --- which checkpoint, which model -----------------------------------------------------------------------


def find_checkpoint(directory: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The manifest of checkpoint ``step`` in ``directory`` (default: the newest complete one).

    Raises:
        ExportError: no complete checkpoint there, or none of that step (naming the steps there are).
    """
    try:
        return load_manifest(directory, step)
    except CheckpointError as e:
        raise ExportError(f"--checkpoint {directory}: {_step_dir_hint(Path(directory)) or e}") from None


def _step_dir_hint(path: Path) -> str | None:
    """Where ``path`` is one step's directory of a checkpoint (``ckpt/step-00000010``) rather than the
    checkpoint directory: that, and the command line that exports it; else None."""
    head, _, digits = path.name.partition("-")
    if head != "step" or not digits.isdigit() or path.name != step_dir_name(int(digits)):
        return None
    return (f"this is the directory of step {int(digits)} of the checkpoint in {path.parent}; --checkpoint takes "
            f"the checkpoint directory and --step picks the step: --checkpoint {path.parent} --step {int(digits)}")


def _where(manifest: dict[str, Any], directory: str | os.PathLike[str]) -> str:
    return f"checkpoint step {manifest['step']} in {directory}"


def checkpoint_model(manifest: dict[str, Any], directory: str | os.PathLike[str], model: str | None = None,
                     plan: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """The model a checkpoint holds and where that was read: ``(spec, "--model" | "--plan PLAN" | "its meta")``.

    Raises:
        ExportError: none of the three names a model.
        PlanError: ``plan`` cannot be read.
    """
    if model:
        return model, "--model"
    if plan is not None:
        from hetrain.plan import load_plan

        return load_plan(Path(plan)).model, f"--plan {plan}"
    recorded = manifest["meta"].get("model")
    if isinstance(recorded, str) and recorded:
        return recorded, "its meta"
    raise ExportError(f"{_where(manifest, directory)} does not record its model (its meta has no 'model'); "
                      "give --model hf:DIR (the model's directory) or --plan PLAN (the plan it was trained with)")


def _model_names(manifest: dict[str, Any]) -> list[str]:
    """The checkpoint's model tensors (``layers.{k}.…``), without parameter servers' copies."""
    return [n for n in manifest["tensors"] if not n.startswith(_PS_PREFIX)]


# --- Hugging Face names ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfLayout:
    """How a checkpoint of ``hf:DIR`` maps onto the transformers model's names.

    Attributes:
        source: the model directory.
        hf_name: checkpoint name (``layers.0.tokens.weight``) -> the model's name it is written under.
        shapes: checkpoint name -> its shape in the model built from config.json.
    """

    source: Path
    hf_name: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def build_hf_layout(spec: str, split_points: Sequence[str] = ()) -> HfLayout:
    """The names of ``hf:DIR``'s layers in a checkpoint and in the transformers model, matched by tensor.

    The model is built and traced as training cut it (``models.hf.cut_causal_lm``); each layer holds the
    model's own tensors, so the names match by tensor.

    Raises:
        SpecError: the directory, its config or its layout cannot be used (``models.hf``).
        ExportError: a tensor of the model that no layer holds.
    """
    from hetrain.models.hf import build_model, cut_causal_lm, load_hf_dir
    from hetrain.models.layers import LayerRange

    hf = load_hf_dir(spec)
    model = build_model(hf, 0)
    names_of: dict[int, list[str]] = {}  # tensor id -> its names in the model's state_dict, in order
    for name, t in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(t), []).append(name)
    # tied: one tensor in two layers, as in the model
    stage = LayerRange(cut_causal_lm(model, hf.config, spec, split_points or None).layers)
    hf_name: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in stage.state_dict(keep_vars=True).items():
        if id(t) not in names_of:
            raise ExportError(f"--model {spec}: layer tensor {name} is not one of the model's own tensors; hetrain "
                              "cannot name it in a Hugging Face file")
        hf_name[name] = names_of[id(t)][0]  # tied names share a tensor: the first, as save_pretrained keeps
        shapes[name] = tuple(t.shape)
    covered = set(hf_name.values())
    lost = [names[0] for names in names_of.values() if names[0] not in covered]
    if lost:
        raise ExportError(f"--model {spec}: the model's tensor {lost[0]} is in none of hetrain's layers "
                          f"({len(lost)} such); hetrain cannot export it")
    return HfLayout(hf.path, hf_name, shapes)


def _check_matches(manifest: dict[str, Any], directory: str | os.PathLike[str], spec: str,
                   layout: HfLayout) -> None:
    """The checkpoint holds exactly the model's layers, each of its shape."""
    where = _where(manifest, directory)
    held = manifest["tensors"]
    missing = [n for n in layout.hf_name if n not in held]
    if missing:
        raise ExportError(f"{where} has no tensor {missing[0]} ({layout.hf_name[missing[0]]} of {spec}; "
                          f"{len(missing)} missing of {len(layout.hf_name)}): it is not a checkpoint of this model")
    stray = [n for n in _model_names(manifest) if n not in layout.hf_name]
    if stray:
        raise ExportError(f"{where} holds {stray[0]} ({len(stray)} such), which {spec} does not have: "
                          "it is not a checkpoint of this model")
    for name, shape in layout.shapes.items():
        saved = tuple(held[name]["shape"])
        if saved != shape:
            raise ExportError(f"{where} has {name} of shape {saved}, but {layout.source / 'config.json'} makes "
                              f"{layout.hf_name[name]} {shape}: it is not a checkpoint of this model")


def _hf_tensors(tensors: Mapping[str, torch.Tensor], layout: HfLayout, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names; a tie's copies once (the first layer's)."""
    out: dict[str, torch.Tensor] = {}
    first: dict[str, str] = {}
    for name in sorted(layout.hf_name, key=_layer_order):
        target = layout.hf_name[name]
        if target in out:  # another layer's copy of a tied tensor: equal after every step (runtime.step.tied)
            if not torch.equal(out[target], tensors[name]):
                diff = (out[target].float() - tensors[name].float()).abs().max().item()
                warnings.warn(f"{where}: the tied copies {first[target]} and {name} differ (largest difference "
                              f"{diff:.3g}); {target} is written from {first[target]}", RuntimeWarning, stacklevel=3)
            continue
        out[target] = tensors[name].contiguous()
        first[target] = name
    return out


def _layer_order(name: str) -> tuple[int, str]:
    """``layers.10.x`` after ``layers.9.x``."""
    _, k, rest = name.split(".", 2)
    return int(k), rest


# --- writing -------------------------------------------------------------------------------------------------


def _check_out_dir(out: Path, force: bool) -> None:
    if out.is_file() or out.is_symlink():
        raise ExportError(f"--to-hf {out}: is a file; give a directory (new, or empty, or --force to replace it)")
    if out.is_dir() and any(out.iterdir()) and not force:
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise ExportError(f"--to-hf {out}: the directory is not empty (it holds {shown}); give --force to "
                          "replace it")
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        raise ExportError(f"--to-hf {out}: {parent} is not a directory")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_umask_allows(path: Path) -> None:
    """Give ``path`` the mode a new file (or directory) gets under the umask: safetensors writes its files 0600,
    which another user, or a serving container, cannot read."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def save_tokenizer(checkpoint_dir: str | os.PathLike[str], tokenizer: str | os.PathLike[str]) -> Path:
    """Keep the ``--tokenizer`` a model was trained with beside its checkpoints, as ``tokenizer.json``, so that
    ``export --to-hf`` writes it with the model. Atomic: written aside, then renamed over."""
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / TRAINED_TOKENIZER
    tmp = directory / f".{TRAINED_TOKENIZER}.{uuid.uuid4().hex[:12]}.tmp"
    shutil.copyfile(tokenizer, tmp)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(directory)
    return final


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> int:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    as_umask_allows(path)
    fsync_path(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _place_dir(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` onto ``out``; a replaced ``out`` is moved out of sight first, then removed."""
    aside = None
    if out.is_dir():
        if any(out.iterdir()):
            aside = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.replaced")
            os.replace(out, aside)
        else:
            out.rmdir()
    os.replace(tmp, out)
    fsync_path(out.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def export_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
              model: str | None = None, plan: str | os.PathLike[str] | None = None, force: bool = False) -> Exported:
    """Write checkpoint ``step`` of an ``hf:DIR`` model as a Hugging Face model directory ``out``.

    Args:
        checkpoint: the directory ``hetrain train --checkpoint-dir`` wrote.
        out: the directory to write: new, empty, or (``force``) replaced whole.
        step: which checkpoint; default the newest complete one.
        model: ``hf:DIR``, the model's directory; default the plan's, else the checkpoint's own record.
        plan: the plan the model was trained with, to read its model from.
        force: replace a non-empty ``out``.

    Returns:
        What was written.

    Raises:
        ExportError: no such checkpoint, a model that is not ``hf:DIR`` or whose directory is gone, a
            checkpoint of another model, an ``out`` that is not empty.
        SpecError: the model's directory cannot be used (``models.hf``).
        CheckpointError: a checkpoint file that is missing or damaged.
    """
    from hetrain.models.hf import is_hf_spec

    out = Path(out)
    _check_out_dir(out, force)
    if Path(checkpoint).resolve().is_relative_to(out.resolve()):
        raise ExportError(f"--to-hf {out}: it holds the checkpoint directory {checkpoint}; give another directory")
    manifest = find_checkpoint(checkpoint, step)
    spec, source = checkpoint_model(manifest, checkpoint, model, plan)
    where = _where(manifest, checkpoint)
    if not is_hf_spec(spec):
        named = f"--model {spec}" if source == "--model" else f"{where} is of model {spec} ({source})"
        raise ExportError(f"{named}: only hf:DIR models export to Hugging Face (--to-hf); --to-safetensors FILE "
                          "writes any checkpoint's weights as one file")
    if source != "--model" and not Path(spec.removeprefix("hf:")).is_dir():
        raise ExportError(f"{where} was trained from {spec} ({source}), and {spec.removeprefix('hf:')} is not a "
                          "directory here; give --model hf:DIR naming the model's directory")
    layout = build_hf_layout(spec, manifest.get("meta", {}).get("split_points", ()))
    _check_matches(manifest, checkpoint, spec, layout)
    step_done = int(manifest["step"])
    tensors, _, _ = load_checkpoint(checkpoint, list(layout.hf_name), step_done)
    weights = _hf_tensors(tensors, layout, where)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        weight_bytes = _save_safetensors(weights, tmp / WEIGHTS, {"format": "pt"})  # "pt": what transformers reads
        trained = Path(checkpoint) / TRAINED_TOKENIZER  # the --tokenizer it was trained with, where one was given
        for name in ("config.json", *SIDE_FILES):
            origin = trained if name == TRAINED_TOKENIZER and trained.is_file() else layout.source / name
            if origin.is_file():
                shutil.copyfile(origin, tmp / name)
                as_umask_allows(tmp / name)
                fsync_path(tmp / name)
        as_umask_allows(tmp)
        fsync_path(tmp)
        _place_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, step_done, spec, len(weights), weight_bytes)


def export_safetensors(checkpoint: str | os.PathLike[str], file: str | os.PathLike[str], *, step: int | None = None,
                       force: bool = False) -> Exported:
    """Write checkpoint ``step``'s model tensors as one safetensors file, under hetrain's names (``layers.{k}.…``).

    Any model: a reference model, your own, or ``hf:DIR`` (then both copies of a tied tensor). The
    file's metadata holds ``step`` and ``model`` (as the checkpoint records it).

    Raises:
        ExportError: no such checkpoint, or ``file`` exists (without ``force``) or cannot be written.
        CheckpointError: a checkpoint file that is missing or damaged.
    """
    path = check_output_path(Path(file), "--to-safetensors", ExportError)
    if path.exists() and not force:
        raise ExportError(f"--to-safetensors {path}: the file exists; give --force to replace it")
    manifest = find_checkpoint(checkpoint, step)
    step_done = int(manifest["step"])
    names = _model_names(manifest)
    tensors, _, meta = load_checkpoint(checkpoint, names, step_done)
    model = meta.get("model")
    model = model if isinstance(model, str) else ""
    part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
    try:
        weight_bytes = _save_safetensors({n: t.contiguous() for n, t in tensors.items()}, part,
                                         {"format": "pt", "step": str(step_done), "model": model,
                                          "checkpoint": step_dir_name(step_done)})
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return Exported(path, step_done, model, len(tensors), weight_bytes)


__all__ = ["SIDE_FILES", "WEIGHTS", "ExportError", "Exported", "HfLayout", "build_hf_layout", "checkpoint_model",
           "export_hf", "export_safetensors", "find_checkpoint"]

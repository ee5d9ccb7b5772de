"""A local Hugging Face causal LM (``--model hf:DIR``), cut into hetrain's layers by tracing its own forward.

``DIR`` is a transformers model directory: ``config.json``, and optionally the weights
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``). Nothing is
downloaded. The model is built from its config with ``AutoModelForCausalLM.from_config`` on
every rank under the same seed; its forward (``hf_forward``: logits, and the router's auxiliary
loss where the config asks for it) is traced and cut at its decoder blocks (``hetrain.models.trace``),
so every layer runs exactly what the model's forward runs between two blocks::

    layer 0       embed     everything before the first block: embeddings, their scale, rotary tables, masks
    layer 1..n    block k   decoder block k-1
    layer n+1     head      everything after the last block: final norm, lm_head, a logit scale or soft-cap

The chained layers are checked against the model's own forward where the model is built
(``resolve_hf``). A rank with weights loads only its own layers' tensors (``safe_open``, reading
just those keys). Layers name their tensors as the model does (``model.layers.0.mlp.up_proj.weight``).

Tied weights (GPT-2's ``lm_head`` is ``wte``): every layer gets its own copy, equal at the
start; ``ModelSource.tied`` lists each tie as ``((layer, name), ...)`` and the runtime sums
the copies' gradients before each optimizer step (``hetrain.runtime.step.tied``), so they stay equal.

Example:
    >>> source = resolve_hf("hf:my-gpt2")                   # doctest: +SKIP
    >>> source.num_layers, source.layer_names[:2], source.tied    # doctest: +SKIP
    (4, ('embed', 'block1'), (((0, 'transformer.wte.weight'), (3, 'lm_head.weight')),))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetrain.models.hf_analytic import HF_PREFIX, is_hf_spec
from hetrain.models.hf_blocks import WHOLE, BlockForm, ModuleForm, find_forms
from hetrain.models.kept_cuts import cut_key, load_cut, save_cut
from hetrain.models.spec import SpecError
from hetrain.models.trace import TracedCut, bind, check_cut, repeated_blocks, trace_cut, untie

Tie = tuple[tuple[int, str], ...]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every position of every sequence."""
    # (B, T, V) and (B, T) -> (B·T, V) and (B·T,): one prediction per position
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- the layers --------------------------------------------------------------------------


def hf_forward(model: nn.Module, ids: torch.Tensor) -> Any:
    """The model's own forward as training runs it: logits ``(B, T, V)``, and for an MoE model whose config
    asks for it (``output_router_logits``) also the router's load-balancing loss, ``(logits, aux_loss)``."""
    if is_masked_lm(model.config):  # an encoder: no cache to turn off
        return model(input_ids=ids).logits
    if _router_aux(model.config) is not None:
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        return out.logits, out.aux_loss
    return model(input_ids=ids, use_cache=False).logits


def is_masked_lm(config: Any) -> bool:
    """Whether the config is an encoder's, trained as a masked LM (BERT, RoBERTa, DistilBERT): its class has a
    masked-LM model and either no causal-LM one or ``is_decoder`` off (BERT's causal ``BertLMHeadModel`` needs it
    on). Its loss is the cross-entropy at the masked positions, its targets the labels as they are, not shifted."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    kind = type(config)
    if kind not in MODEL_FOR_MASKED_LM_MAPPING:
        return False
    return kind not in MODEL_FOR_CAUSAL_LM_MAPPING or not getattr(config, "is_decoder", False)


def _router_aux(config: Any) -> float | None:
    """The coefficient of the router's auxiliary loss where the config asks for it, else None."""
    if not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(config, "router_aux_loss_coef", None)
    return float(coef) if isinstance(coef, int | float) else None


def moe_loss(coef: float) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``lm_loss`` plus ``coef`` times the router's load-balancing loss, as transformers adds it."""

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        total: torch.Tensor = lm_loss(logits, targets) + coef * aux
        return total

    return loss


def example_ids(config: Any, batch: int = 2, length: int = 8) -> torch.Tensor:
    """Token ids ``(batch, length)`` to trace and check with: seeded, below the vocabulary."""
    vocab = int(config.vocab_size)
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def cut_causal_lm(model: nn.Module, config: Any, name: str, split_points: Sequence[str] | None = None
                  ) -> TracedCut:
    """The model's forward traced and cut at its decoder blocks (or ``split_points``): embed, blocks, head.

    Raises:
        SpecError: a forward that cannot be traced, or split points that are not its modules.
    """
    import transformers

    points = list(split_points) if split_points else repeated_blocks(model)
    if not points:
        raise SpecError(f"{name}: {type(model).__name__} has no repeated blocks to cut at; give --split-points")
    length = min(8, _positions_bound(config))
    # the graph is decided by transformers' code for this class and config: traced once, kept (trace.save_cut);
    # not by where the config was read from (_name_or_path), or the same model in another directory is traced again
    described = json.loads(config.to_json_string(use_diff=False))
    described.pop("_name_or_path", None)
    key = cut_key("hf", type(model).__qualname__, json.dumps(described, sort_keys=True),
                  transformers.__version__, ",".join(points), str(not split_points), str(length))
    cut = load_cut(key, model)
    if cut is None:
        cut = trace_cut(model, (example_ids(config, 2, length),), points, what=name, call=hf_forward,
                        tail=not split_points)
        save_cut(key, cut, model)
    return cut


def _positions_bound(config: Any) -> int:
    """The most tokens a sample may hold, or 8 where the config does not say (the trace's length is at most 8)."""
    found = position_field(config)
    return 8 if found is None else found[1]


# --- the directory -------------------------------------------------------------------------


@dataclass(frozen=True)
class HfDir:
    """A checked model directory: its config and where each weight tensor is stored (empty: no weights)."""

    spec: str
    path: Path
    config: Any
    files: dict[str, Path]  # tensor name -> the safetensors file holding it


def load_hf_dir(spec: str) -> HfDir:
    """Read ``hf:DIR``'s config.json and the weights' index (no tensor data).

    Raises:
        SpecError: no such directory, no config.json, a config transformers cannot read, or a
            weights index that cannot be read (each names the file).
    """
    path = Path(spec[len(HF_PREFIX):])
    if not path.is_dir():
        raise SpecError(f"--model {spec}: directory {path} does not exist (hf:DIR takes a local transformers model "
                        "directory with config.json; nothing is downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecError(f"--model {spec}: {config_file} is missing (a transformers model directory holds "
                        "config.json, and optionally model.safetensors)")
    _require(spec, "transformers")
    _require(spec, "safetensors")
    from transformers import AutoConfig

    raw = _read_object(config_file)  # None: not a JSON object, which AutoConfig names below
    if raw is not None:
        check_counts(spec, config_file, raw)  # before AutoConfig, whose own checks do not show the value
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' own errors: named in one line with the file
        raise SpecError(f"--model {spec}: {config_file} cannot be read as a transformers config: "
                        f"{type(e).__name__}: {_first_line(e)}") from e
    if raw is not None:
        check_keys(spec, config_file, raw, config)
    return HfDir(spec, path, config, _weight_files(spec, path))


def _read_object(file: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


#: config fields (by their transformers-wide names) that must be whole numbers >= 1 where a file gives them
POSITIVE_FIELDS = {
    "num_hidden_layers": "the number of blocks",
    "num_attention_heads": "the number of attention heads",
    "hidden_size": "the width of the hidden states",
    "vocab_size": "the vocabulary size",
}

#: other model families' names for a field: one family's key in another's config.json is a slip that
#: transformers ignores (a Llama config's ``n_layer`` leaves its default of 32 blocks)
SYNONYMS = {
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "hidden_size": ("n_embd", "n_embed", "d_model"),
}


def _attribute_map(raw: dict[str, Any]) -> dict[str, str]:
    """The config class's names for transformers-wide fields (GPT-2: ``num_hidden_layers -> n_layer``)."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return {}
    return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})


def check_counts(spec: str, config_file: Path, raw: dict[str, Any]) -> None:
    """Every field of ``POSITIVE_FIELDS`` that ``raw`` (config.json) gives, under any name its config class
    gives it (GPT-2's ``n_layer`` for ``num_hidden_layers``), is an integer >= 1: transformers builds a
    model with no blocks from ``"n_layer": -2``.

    Raises:
        SpecError: naming the file, the key and its value.
    """
    wide = {own: w for w, own in _attribute_map(raw).items()}  # the class's name -> the transformers-wide name
    for key, value in raw.items():
        what = POSITIVE_FIELDS.get(wide.get(key, key))
        if what is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise SpecError(f"--model {spec}: {config_file}: {key} is {json.dumps(value)}; it must be a whole "
                            f"number >= 1 ({what})")


def check_keys(spec: str, config_file: Path, raw: dict[str, Any], config: Any) -> None:
    """Refuse a key of ``raw`` (config.json) that is a slip for a field of ``config``'s class.

    transformers keeps a key its config class does not know as an extra attribute that changes
    nothing: a misspelt ``n_layers`` builds GPT-2's default of 12 blocks. Such a key is refused
    when it is a close spelling of a field of the class, or another family's name for one
    (``SYNONYMS``), and the file does not set that field. Any other unknown key is accepted, as
    transformers accepts it: a config.json from the Hub carries bookkeeping (``architectures``,
    ``_name_or_path``, ``transformers_version``, ``torch_dtype``) and keys of older transformers
    versions (GPT-2's ``n_ctx``, ``task_specific_params``).

    Raises:
        SpecError: naming the file, the key, its value and the field it meant.
    """
    try:
        default = type(config)()  # the class's fields at their defaults
    except Exception:  # a class that needs arguments to build: no defaults to tell a slip by
        return
    aliases: dict[str, str] = dict(getattr(config, "attribute_map", None) or {})  # wide name -> the class's name
    wide = {own: w for w, own in aliases.items()}
    fields = {k for k in vars(default) if not k.startswith("_")}
    given = set(raw) | {wide.get(k, k) for k in raw} | {aliases.get(k, k) for k in raw}
    for key in raw:
        kept_inert = key in vars(config) and key not in vars(default) and not hasattr(type(config), key)
        if not kept_inert:  # a field, an alias, a property, or a key transformers consumed (rope_theta)
            continue
        meant = _meant_field(key, fields | set(aliases), aliases)
        if meant is not None and meant not in given and aliases.get(meant, meant) not in given:
            raise SpecError(f"--model {spec}: {config_file}: unknown key {key!r} ({json.dumps(raw[key])}); did you "
                            f"mean {meant!r}? {type(config).__name__} has no {key!r}: transformers would ignore it "
                            f"and build {meant} = {json.dumps(getattr(default, meant, None))}")


def _meant_field(key: str, known: set[str], aliases: dict[str, str]) -> str | None:
    """The field of the config class that ``key`` is a slip for: another family's name for it, or a close spelling."""
    import difflib

    for wide, others in SYNONYMS.items():
        own = aliases.get(wide, wide)  # as the class spells it: n_layer (GPT-2), num_hidden_layers (Llama)
        if key in (wide, *others) and key != own and own in known:
            return own
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    return close[0] if close else None


def _require(spec: str, package: str) -> None:
    """Refuse ``hf:DIR`` in one line where ``package`` (of the ``hf`` extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise SpecError(f"--model {spec}: Hugging Face models need {package}, which is not installed "
                        "(pip install 'hetrain[hf]')")


def _weight_files(spec: str, path: Path) -> dict[str, Path]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if single.is_file():
        shards = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({path / str(f) for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecError(f"--model {spec}: {index} is not a safetensors index (a JSON object with "
                            f"weight_map): {type(e).__name__}: {_first_line(e)}") from e
    else:
        return {}
    files: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:  # reads the header only
                files.update((key, shard) for key in f.keys())  # noqa: SIM118 (a safe_open, not a dict)
        except Exception as e:  # safetensors' own errors (missing, truncated, not safetensors): one line
            raise SpecError(f"--model {spec}: {shard} cannot be read as safetensors: {type(e).__name__}: "
                            f"{_first_line(e)}") from e
    return files


def build_model(hf: HfDir, seed: int) -> nn.Module:
    """The whole transformers model under ``seed``, its weights in fp32: a causal LM, or an encoder's masked LM."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    masked = is_masked_lm(hf.config)
    auto = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            # fp32 weights whatever dtype the config names (a Hub config's "bfloat16" is the dtype it was
            # published in): training keeps fp32 master weights and computes in the plan's precision, as
            # Megatron-LM, DeepSpeed and torchtitan do (docs/own-model.md, "Parameter dtype")
            model: nn.Module = auto.from_config(hf.config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        except Exception as e:  # transformers' own errors: named in one line with the file
            what = "a masked LM" if masked else "a causal LM"
            raise SpecError(f"--model {hf.spec}: transformers cannot build {what} from {hf.path / 'config.json'}"
                            f": {type(e).__name__}: {_first_line(e)}") from e
    return model


def _names_of(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> its names in the model (and, under the base model's prefix, as a base model's file names
    them: the hub's gpt2 saves ``h.0...`` for ``transformer.h.0...``)."""
    hf_names: dict[int, list[str]] = {}
    base = f"{getattr(model, 'base_model_prefix', '')}."  # "transformer." (GPT-2), "model." (Llama)
    for name, p in model.named_parameters(remove_duplicate=False):
        hf_names.setdefault(id(p), []).append(name)
    for names in hf_names.values():
        names.extend(n.removeprefix(base) for n in list(names) if base != "." and n.startswith(base))
    return hf_names


def _bound(templates: list[nn.Module], model: nn.Module) -> tuple[list[nn.Module], dict[int, list[str]],
                                                                   tuple[Tie, ...]]:
    """The traced layers over ``model``'s own parameters, untied; ``hf_names``: parameter id -> its names."""
    hf_names = _names_of(model)
    layers: list[nn.Module] = [bind(t, model) for t in templates]
    ties = untie(layers, hf_names)
    return layers, hf_names, ties


def _stored_name(hf: HfDir, names: list[str]) -> str | None:
    return next((n for n in names if n in hf.files), None)


def check_weights(hf: HfDir, layers: list[nn.Module], hf_names: dict[int, list[str]]) -> None:
    """Every parameter of the model has a tensor of its shape in the weights (headers only).

    Raises:
        SpecError: a missing tensor or a shape that differs, naming the file, the tensor and both shapes.
    """
    from safetensors import safe_open

    for k, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            names = hf_names[id(p)]
            key = _stored_name(hf, names)
            if key is None:
                some = next(iter(hf.files.values()))
                raise SpecError(f"--model {hf.spec}: {some} has no tensor {names[0]} (layer {k}, {name}); the "
                                f"weights do not match {hf.path / 'config.json'}")
            with safe_open(str(hf.files[key]), framework="pt") as f:
                shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(p.shape):
                raise SpecError(f"--model {hf.spec}: {hf.files[key]} has {key} of shape {shape}, but "
                                f"{hf.path / 'config.json'} makes it {tuple(p.shape)}; the weights do not match "
                                "the config")


def load_weights(hf: HfDir, layers: dict[int, nn.Module], hf_names: dict[int, list[str]]) -> None:
    """Copy into ``layers`` (by global index) their tensors only, each file opened once."""
    from safetensors import safe_open

    wanted: dict[Path, list[tuple[str, nn.Parameter]]] = {}
    for layer in layers.values():
        for _, p in layer.named_parameters():
            key = _stored_name(hf, hf_names[id(p)])
            assert key is not None  # check_weights ran at resolve time
            wanted.setdefault(hf.files[key], []).append((key, p))
    with torch.no_grad():
        for file, params in wanted.items():
            with safe_open(str(file), framework="pt") as f:
                for key, p in params:
                    p.copy_(f.get_tensor(key))


@dataclass(frozen=True)
class HfModel:
    """What ``hetrain.models.user.ModelSource`` takes of an ``hf:DIR`` model.

    Attributes:
        num_layers: embed, the blocks, head.
        layer_names: ``("embed", "block1", ..., "head")``.
        tied: the ties, ``((layer, name in the layer), ...)`` each (``untie``).
        build: ``build(first, end, seed)``: layers ``[first, end)``, the file's weights in them if any.
        vocab: the config's ``vocab_size``.
        max_positions: ``(field, value)``: the config field that bounds the tokens per sample and its value.
        loss_fn: next-token cross-entropy, plus the router's auxiliary loss where the config asks for it; for a
            masked LM, the cross-entropy at the labelled positions.
        masked_lm: an encoder trained as a masked LM (``is_masked_lm``): its targets are not shifted.
    """

    num_layers: int
    layer_names: tuple[str, ...]
    tied: tuple[Tie, ...]
    build: Callable[[int, int, int], list[nn.Module]]
    vocab: int
    max_positions: tuple[str, int]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss
    masked_lm: bool = False


#: config.json fields that bound the positions of a sample, the first present wins (GPT-2's, then the others')
POSITION_FIELDS = ("n_positions", "max_position_embeddings")


def position_field(config: Any) -> tuple[str, int] | None:
    """``(field, value)`` of the first of ``POSITION_FIELDS`` the config sets to a whole number >= 1, or None."""
    fields = config.to_dict()
    for name in POSITION_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def max_positions(hf: HfDir) -> tuple[str, int]:
    """``(field, value)`` of the config field that bounds the tokens per sample (``POSITION_FIELDS``).

    Raises:
        SpecError: the config gives none of them.
    """
    found = position_field(hf.config)
    if found is not None:
        return found
    raise SpecError(f"--model {hf.spec}: {hf.path / 'config.json'} gives none of {', '.join(POSITION_FIELDS)}; "
                    "hetrain needs the longest sample the model takes")


def resolve_hf(spec: str, split_points: Sequence[str] | None = None) -> HfModel:
    """``hf:DIR``, built, traced, cut and checked against its own forward and its weights once here.

    The cut is checked where it is made: the chained layers run one sample next to the model's own
    forward, in fp32 (``check_cut``), and a difference is refused naming the first layer that differs.

    Raises:
        SpecError: a missing or unreadable file, a forward hetrain cannot trace or cut exactly, or weights
            that do not match the config (each in one line, naming the file).
    """
    hf = load_hf_dir(spec)
    model = build_model(hf, 0)
    cut = cut_causal_lm(model, hf.config, spec, split_points)
    length = min(7, _positions_bound(hf.config))  # another shape than the trace's: a specialised size shows
    check_cut(cut, model, (example_ids(hf.config, 3, length),), hf_forward, f"--model {spec}")
    templates = cut.layers
    # what a TP stage runs in place of each traced block (hf_blocks), found and checked on the model's own forward
    forms = find_forms(model, cut, (example_ids(hf.config, 3, length),), spec, hf_forward) if not split_points else {}
    layers, hf_names, ties = _bound(templates, model)
    if hf.files:
        check_weights(hf, layers, hf_names)
    n = len(layers)
    names = ("embed", *(f"block{k}" for k in range(1, n - 1)), "head") if not split_points else cut.names
    del model, layers, cut

    def build(first: int, end: int, seed: int) -> list[nn.Module]:
        model = build_model(hf, seed)
        built, ids, _ = _bound(templates, model)
        kept = dict(enumerate(built[first:end], start=first))
        if hf.files:
            load_weights(hf, kept, ids)
        for k, layer in kept.items():
            setattr(layer, "tp_form", _tp_form(model, forms, k, n, spec, bool(split_points)))  # noqa: B010
        return list(kept.values())

    coef = _router_aux(hf.config)
    loss = lm_loss if coef is None else moe_loss(coef)
    return HfModel(n, names, ties, build, int(hf.config.vocab_size), max_positions(hf), loss,
                   is_masked_lm(hf.config))


def _tp_form(model: nn.Module, forms: dict[int, BlockForm | str], k: int, n: int, spec: str,
             split: bool) -> ModuleForm | str:
    """Layer ``k``'s form under TP: ``WHOLE`` (the embedding, the head), its block's ``ModuleForm``, or why it has none
    (``runtime.tp`` refuses such a layer in a TP stage with that reason)."""
    if split:
        return "it is cut at --split-points, which have no module form; cut at the decoder blocks (the default)"
    if k in (0, n - 1):
        return WHOLE
    form = forms.get(k, "it has no module form")
    if isinstance(form, str):
        return form
    return ModuleForm(model.get_submodule(form.path), form, f"{spec} block {k}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


__all__ = ["HF_PREFIX", "POSITION_FIELDS", "HfModel", "is_hf_spec", "lm_loss", "load_hf_dir", "max_positions",
           "resolve_hf"]

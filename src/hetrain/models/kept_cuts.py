"""A traced cut kept between runs, so that every rank of every run does not trace the model again.

Tracing (``hetrain.models.trace``) takes seconds on every rank; for an ``hf:DIR`` model the graph depends only
on transformers' code for its class and config, so it is traced once and kept, by ``hetrain profile`` for
``hetrain train``. A cut is kept as each layer's generated Python code (what ``fx.GraphModule`` pickles,
as torch does: code has compatibility that a pickled ``fx.Graph`` has not) and its attributes, the model's own
tensors replaced by ``meta`` ones: on load the code is traced back into a graph with every tensor a proxy, and
the model's tensors are bound again (``trace.bind``). A kept cut is checked against the model's forward before
use, like a fresh one (``trace.check_cut``).

Where: ``HETRAIN_CACHE_DIR`` (``off`` or empty: nowhere), else ``$XDG_CACHE_HOME/hetrain/cuts``.

Example:
    >>> key = cut_key("hf", "LlamaForCausalLM", config_json, transformers_version)   # doctest: +SKIP
    >>> cut = load_cut(key, model) or trace_cut(...)                                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import _format_import_block
from torch.package.importer import sys_importer

from hetrain.models.trace import ModeOp, TracedCut, bind, fetch

#: bump when what ``save_cut`` writes changes meaning
CUT_FORMAT = 1


def cache_directory() -> Path | None:
    """Where traced cuts are kept: ``HETRAIN_CACHE_DIR`` (``off`` or empty: nowhere), else
    ``$XDG_CACHE_HOME/hetrain/cuts`` (``~/.cache/hetrain/cuts``)."""
    setting = os.environ.get("HETRAIN_CACHE_DIR")
    if setting is not None:
        return None if setting in ("", "off") else Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetrain" / "cuts"


def cut_key(*parts: str) -> str:
    """A cut's name in the cache: a digest of what decides the graph (the model's class and config, the library
    versions, the split points) and of this module's format."""
    text = "\0".join((str(CUT_FORMAT), torch.__version__, *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save_cut(key: str, cut: TracedCut, model: nn.Module) -> None:
    """Keep ``cut``'s graphs for ``load_cut``: each layer as its generated Python code and its attributes, the
    model's own tensors left out (``meta`` in their place: bound again on load). Written aside and renamed, so a
    reader never sees half a file; a cache that cannot be written is skipped (it only saves time)."""
    directory = cache_directory()
    if directory is None:
        return
    layers = []
    for layer in cut.layers:
        assert isinstance(layer, fx.GraphModule)
        code = layer.recompile()
        source = _format_import_block(code.globals, sys_importer) + "\n" + code.src
        attrs: dict[str, Any] = {}
        for node in layer.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                value = fetch(layer, str(node.target))
                if isinstance(value, torch.Tensor) and _has(model, str(node.target)):
                    value = torch.empty_like(value, device="meta")  # the model's own: bound again on load
                attrs[str(node.target)] = value
        layers.append({"source": source, "attrs": attrs})
    record = {"format": CUT_FORMAT, "layers": layers, "names": cut.names, "crossing": cut.crossing}
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(record, tmp)
        os.replace(tmp, directory / f"{key}.pt")
    except (OSError, RuntimeError, TypeError, AttributeError, pickle.PicklingError):
        with contextlib.suppress(OSError):
            tmp.unlink()


def load_cut(key: str, model: nn.Module) -> TracedCut | None:
    """The cut ``save_cut`` kept under ``key``, over ``model``'s own tensors; None where there is none, or one that
    cannot be read (it is traced again and written over). Whichever it is, ``check_cut`` checks it before use."""
    directory = cache_directory()
    if directory is None or not (directory / f"{key}.pt").is_file():
        return None
    try:
        record = torch.load(directory / f"{key}.pt", weights_only=False)  # the user's own cache: graphs as code
        if not isinstance(record, dict) or record.get("format") != CUT_FORMAT:
            return None
        layers: list[nn.Module] = [bind(_rebuild(r["source"], r["attrs"]), model) for r in record["layers"]]
        return TracedCut(layers, tuple(record["names"]), tuple(record["crossing"]), None)
    except Exception:  # a damaged or foreign file: traced again
        return None


class _EveryTensor(fx.Tracer):
    """Traces a layer's generated code back into its graph: every tensor attribute a proxy (so nothing is computed
    while tracing), a ``ModeOp`` a call of its own."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, ModeOp) or super().is_leaf_module(m, module_qualified_name)


def _rebuild(source: str, attrs: dict[str, Any]) -> fx.GraphModule:
    """A layer from its code and attributes, as ``save_cut`` kept it."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "<hetrain cut>", "exec"), namespace)  # code fx generated, from the user's own cache
    cls = type("TracedLayer", (nn.Module,), {"forward": namespace["forward"]})
    root = cls()
    for target, value in attrs.items():
        path, _, leaf = target.rpartition(".")
        owner = root
        for part in path.split(".") if path else []:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Parameter | nn.Module):
            setattr(owner, leaf, value)
        else:
            owner.register_buffer(leaf, value)
    return fx.GraphModule(root, _EveryTensor().trace(root), class_name="TracedLayer")


def _has(model: nn.Module, name: str) -> bool:
    try:
        fetch(model, name)
    except AttributeError:
        return False
    return True


__all__ = ["CUT_FORMAT", "cache_directory", "cut_key", "load_cut", "save_cut"]

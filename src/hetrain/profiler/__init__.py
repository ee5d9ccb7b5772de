"""Measure what the planner needs: per-layer costs (torch) and the cluster's links (torch.distributed).

- ``profile_layers``: per-layer forward/backward seconds and bytes -> ModelProfile;
- ``merge_node_profiles``: one profile from a profiling job's per-device files (pure);
- ``discover``: under torchrun, measure devices and links -> cluster TOML.

Names load lazily: ``import hetrain.profiler.merge`` imports no torch. The pure fits and the combining of
profiles (``merge_profiles``, ``scale_to``, ``fit_error``, ``fit_link``) are the planning side's:
``hetrain.fit`` and ``hetrain.profile_combine``.

Example:
    >>> from hetrain.profiler import profile_layers                       # doctest: +SKIP
    >>> from hetrain.profile_combine import scale_to                      # doctest: +SKIP
    >>> p = scale_to(profile_layers(layers, x), ["A100-40GB"])           # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "profile_layers": "layers", "measure_layers": "layers", "LayerReport": "layers",
    "LayersMeasurement": "layers", "LayerError": "layers", "match_device_type": "layers",
    "measure_device_figures": "layers", "run_profile_command": "layers",
    "merge_node_profiles": "merge", "node_profile_path": "merge",
    "discover": "network", "DiscoveryError": "network", "DiscoveryResult": "network",
    "build_plan": "network", "round_robin": "network", "run_discover_command": "network",
    "parse_message_sizes": "network",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hetrain.profiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hetrain.profiler.{module}"), name)
    globals()[name] = value
    return value

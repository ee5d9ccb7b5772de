"""hetrain: plan, predict and run hybrid pipeline + data parallel training on heterogeneous clusters.

The planning side (cluster, catalog, profile, cost, plan, planner, schedule,
simulator, timeline) imports no torch. Example::

    import hetrain
    cluster = hetrain.load_cluster("examples/clusters/hetpipe.toml")
    profile = hetrain.build_profile("gpt2-medium")
    plan = hetrain.plan(cluster, profile, global_batch=512)
    print(plan.summary())
"""

from __future__ import annotations

from typing import Any

from hetrain.cluster import Cluster, ClusterError, Device, Link, Node, load_cluster, parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan, PlanError, load_plan
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planning import plan_with_simulator as plan
from hetrain.planning import simulated_iteration_s
from hetrain.profile import LayerProfile, ModelProfile, ProfileError, load_profile
from hetrain.profile_combine import merge_profiles
from hetrain.simulator import simulate
from hetrain.version import __version__

# `hetrain.plan(...)` (imported above) is the planner with the simulator as its scoring function
# (``planning.plan_with_simulator``, which records the options in ``options["planner"]`` so that a restart on
# other devices re-makes the plan alike); the module of the Plan type stays importable as `hetrain.plan` through
# `from hetrain.plan import Plan` (sys.modules).

# Torch-side names load on first use, so `import hetrain` never imports torch.
_LAZY = {
    "Trainer": "hetrain.runtime.trainer",
    "profile_layers": "hetrain.profiler.layers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetrain' has no attribute {name!r}")


__all__ = [
    "Cluster", "ClusterError", "Device", "LayerProfile", "Link", "ModelProfile", "Node", "Plan",
    "PlanError", "PlannerError", "PlannerOptions", "ProfileError", "Trainer", "__version__", "build_profile",
    "load_cluster", "load_plan", "load_profile", "merge_profiles", "parse_cluster", "plan", "profile_layers",
    "simulate", "simulated_iteration_s",
]

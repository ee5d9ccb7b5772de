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

from dataclasses import replace
from typing import Any

from hetrain.cluster import Cluster, ClusterError, Device, Link, Node, load_cluster, parse_cluster
from hetrain.elastic import record_planner_options
from hetrain.models.analytic import build_profile
from hetrain.plan import Plan, PlanError, load_plan
from hetrain.planner import PlannerError, PlannerOptions
from hetrain.planner import plan as _plan
from hetrain.profile import LayerProfile, ModelProfile, ProfileError, load_profile
from hetrain.profile_combine import merge_profiles
from hetrain.simulator import simulate
from hetrain.version import __version__


def simulated_iteration_s(plan: Plan) -> float:
    """The simulator's iteration seconds for ``plan``: the planner's scoring function."""
    return simulate(plan).iteration_s


# `hetrain.plan(...)` is the planner with the simulator as its scoring function; the module of
# the Plan type stays importable as `hetrain.plan` through `from hetrain.plan import Plan` (sys.modules).
def plan(cluster: Cluster, profile: ModelProfile, global_batch: int, options: PlannerOptions | None = None,
         **kwargs: Any) -> Plan:
    """``planner.plan`` whose best ``simulate_top_k`` candidates are re-ranked by the simulator.

    The planner imports no simulator (DESIGN.md): it is handed ``simulated_iteration_s`` here. The plan
    records the options in ``options["planner"]``, so that a restart on other devices re-makes it alike
    (``hetrain.elastic``, docs/elastic.md).
    """
    opts = options if options is not None else PlannerOptions(**kwargs)
    if options is not None and kwargs:
        opts = replace(options, **kwargs)
    return record_planner_options(_plan(cluster, profile, global_batch, opts, score=simulated_iteration_s), opts)


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

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

from hetrain.cluster import Cluster, ClusterError, Device, Link, Node, load_cluster, parse_cluster
from hetrain.plan import Plan, PlanError, load_plan
from hetrain.profile import LayerProfile, ModelProfile, ProfileError, load_profile

__version__ = "0.1.0"

__all__ = [
    "Cluster", "ClusterError", "Device", "LayerProfile", "Link", "ModelProfile", "Node", "Plan",
    "PlanError", "ProfileError", "__version__", "load_cluster", "load_plan", "load_profile",
    "parse_cluster",
]

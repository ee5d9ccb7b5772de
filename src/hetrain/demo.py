"""``hetrain demo``: the main job on an embedded default cluster.

Plans a reference model on a mixed cloud cluster (A100, V100 and T4 nodes on
networks of different speeds) and prints the plan against pure data
parallelism and pure pipeline, with the simulator's view of the chosen plan.
"""

from __future__ import annotations

import argparse
import sys
import time

from hetrain.cluster import parse_cluster

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

DEFAULT_CLUSTER = """
name = "demo-mixed-cloud"

[[node]]
name = "a100"
devices = [{ type = "A100-40GB", count = 8 }]
intra_link = "nvlink3"
nic = "100Gbit/s"

[[node]]
name = "v100"
devices = [{ type = "V100-16GB", count = 4 }]
intra_link = "nvlink2"
nic = "25Gbit/s"

[[node]]
name = "t4a"
devices = [{ type = "T4", count = 4 }]
intra_link = "pcie3"
nic = "10Gbit/s"

[[node]]
name = "t4b"
devices = [{ type = "T4", count = 4 }]
intra_link = "pcie3"
nic = "10Gbit/s"
"""


def run_demo(args: argparse.Namespace) -> int:
    """Plan ``args.model`` on the default cluster and compare with DP and PP."""
    from hetrain.cli import compare_strategies, format_comparison
    from hetrain.models.analytic import build_profile
    from hetrain.planner import plan
    from hetrain.simulator import simulate

    cluster = parse_cluster(tomllib.loads(DEFAULT_CLUSTER))
    profile = build_profile(args.model)
    print(cluster.summary())
    print(f"\nmodel {profile.name}: {profile.num_layers} layers, global batch {args.global_batch}\n")
    start = time.perf_counter()
    best = plan(cluster, profile, args.global_batch)
    planned_s = time.perf_counter() - start
    print(best.summary())
    print(f"  (planned in {planned_s:.1f} s)\n")
    rows = compare_strategies(cluster, profile, args.global_batch, best, {})
    print("predicted against the pure families on the same cluster:")
    print(format_comparison(rows))
    sim = simulate(best)
    print(f"\nsimulated iteration {sim.iteration_s * 1e3:.1f} ms, {sim.samples_per_s:.1f} samples/s "
          f"(closed form {best.prediction.iteration_s * 1e3:.1f} ms)")
    return 0

"""One profile for the planner from one profile per device: each filed under its device type, merged.

A profiling job measures the model on every device at once, each rank writing its own file::

    out_dir/profile-node-<node>-<k>.json     device k of node <node> (local rank k of that node's job)

``merge_node_profiles`` reads them back, files each under its device's type with that type's peak
figures (``profile.relabel_profile``: a CPU process profiles as ``cpu`` whatever it emulates), takes
the median over the devices of a type (``profile_combine.average_profiles``) and merges the types
(``profile_combine.merge_profiles``).

Pure Python and numpy, no torch.

Example:
    >>> profile = merge_node_profiles(tomllib.loads(cluster_text), Path("out/demo"))  # doctest: +SKIP
    >>> [t for t, _ in profile.measured_on]                                           # doctest: +SKIP
    ['cpu-fast', 'cpu-slow']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetrain.cluster import parse_cluster
from hetrain.errors import RunError
from hetrain.profile import ModelProfile, load_profile, relabel_profile
from hetrain.profile_combine import average_profiles, merge_profiles


def node_profile_path(out_dir: str | Path, node: str, local_rank: int) -> Path:
    """Where the profiling job's rank ``local_rank`` of node ``node`` writes its profile."""
    return Path(out_dir) / f"profile-node-{node}-{local_rank}.json"


def merge_node_profiles(cluster_dict: dict[str, Any], out_dir: Path) -> ModelProfile:
    """One measurement set per device type: each device's profile (device ``<node>:<k>`` is local rank k
    of its node's job) filed under its type, the median over the devices of a type, the types merged.

    Raises:
        RunError: a device of the cluster has no profile file (the message names the device and the path).
    """
    cluster = parse_cluster(cluster_dict)
    by_type: dict[str, list[ModelProfile]] = {}
    for node in cluster.nodes:
        for k, dev in enumerate(node.devices):
            path = node_profile_path(out_dir, node.name, k)
            if not path.exists():
                raise RunError(f"the profiling job wrote no profile for device {dev.name!r} ({path})")
            figures = (dev.peak_fp32_flops, dev.memory_bandwidth_bytes_per_s)
            by_type.setdefault(dev.type_name, []).append(relabel_profile(load_profile(path), dev.type_name, figures))
    return merge_profiles([average_profiles(ps) for ps in by_type.values()])

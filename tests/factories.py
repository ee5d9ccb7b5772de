"""Builders for the clusters, profiles and plans that tests write by hand.

A test says what it is about (the nodes, the layers and their times, the devices of each
pipeline, where the layers are cut, the batch split, the sync mode) and these fill in the
rest the same way everywhere: a plan made by hand predicts nothing (a zero ``Prediction``),
its formation is ``"manual"``, its model is its profile's, and its global batch is the sum
of its mini-batches. Example::

    cluster = make_cluster({"n0": 2})           # one node of two CPU devices, loopback inside
    profile = make_profile(4)                   # four A100-measured layers of 1 MB
    plan = make_plan(cluster, profile, [(["n0:0", "n0:1"], [0, 1, 4], 8, 4)], sync="bsp")

``make_plan`` takes each virtual worker (VW) as ``(devices, layer bounds, mini-batch,
micro-batches)``: stage ``j`` holds layers ``[bounds[j], bounds[j + 1])`` on ``devices[j]``;
or as a ``VirtualWorker`` where a test needs more (a stage's predicted memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hetrain.cluster import Cluster, parse_cluster
from hetrain.models.analytic import build_mlp_profile
from hetrain.plan import DeviceMemory, Plan, Prediction, Stage, VirtualWorker
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.sync_layout import SyncOptions

A100 = "A100-40GB"
V100 = "V100-16GB"

#: one VW: (devices, layer bounds, mini-batch, micro-batches); stage j is layers [bounds[j], bounds[j + 1])
VWSpec = tuple[Sequence[str], Sequence[int], int, int]
#: a link as the cluster file gives it: a name or rate ("loopback", "1Gbit/s") or a table of SI figures
LinkSpec = str | Mapping[str, float]


def link(bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> dict[str, float]:
    """A link in plain SI figures, as a cluster file's ``intra_link`` or ``nic`` table."""
    return {"bandwidth_bytes_per_s": bandwidth_bytes_per_s, "latency_s": latency_s}


def make_cluster(nodes: Mapping[str, int | tuple[str, int]] | None = None, *, device_type: str = "cpu",
                 intra_link: LinkSpec = "loopback", nic: LinkSpec | None = "1Gbit/s",
                 name: str = "cpus") -> Cluster:
    """A cluster of ``nodes``: each node's name and its device count, or its (device type, count).

    Args:
        nodes: the nodes in order; ``{"n0": 4}`` (the default) is one node of four devices.
        device_type: the type of a node given by its count alone.
        intra_link: every node's link among its own devices.
        nic: every node's NIC; ``None`` leaves it out (the cluster file's default).
        name: the cluster's name.
    """
    def node(node_name: str, devices: int | tuple[str, int]) -> dict[str, Any]:
        kind, count = (device_type, devices) if isinstance(devices, int) else devices
        spec: dict[str, Any] = {"name": node_name, "devices": [{"type": kind, "count": count}],
                                "intra_link": intra_link}
        if nic is not None:
            spec["nic"] = nic
        return spec

    return parse_cluster({"name": name, "node": [node(n, d) for n, d in (nodes or {"n0": 4}).items()]})


def make_profile(num_layers: int, *, name: str = "toy", times: Mapping[str, tuple[float, float]] | None = None,
                 micro_batch: int = 1, param_bytes: float = 1e6, output_bytes: float = 1e3,
                 saved_bytes: float = 1e4, flops: float = 1e9, input_bytes: float = 1e3) -> ModelProfile:
    """A profile of ``num_layers`` alike layers, each measured as ``times`` says.

    Args:
        num_layers: layers ``l0``, ``l1``, ...
        name: the model's name.
        times: (forward_s, backward_s) of a layer per device type at ``micro_batch`` samples; the default is
            (0.01, 0.02) on an A100; ``{}`` measures nothing (the cost model then works from the FLOPs).
        micro_batch: the micro-batch the times are measured at.
        param_bytes: a layer's parameter bytes.
        output_bytes: a layer's output (activation) bytes per sample.
        saved_bytes: the bytes a layer keeps for its backward, per sample.
        flops: a layer's forward FLOPs per sample.
        input_bytes: the model's input bytes per sample.
    """
    measured = tuple((t, (Measurement(micro_batch, f, b),))
                     for t, (f, b) in (times if times is not None else {A100: (0.01, 0.02)}).items())
    layers = tuple(LayerProfile(f"l{k}", param_bytes, output_bytes, saved_bytes, flops, measured)
                   for k in range(num_layers))
    return ModelProfile(name, layers, input_bytes)


def mlp_digits_profile() -> ModelProfile:
    """The analytic profile of ``mlp-digits`` (64 -> 256 -> 256 -> 10, three layers), as the runtime names it."""
    return build_mlp_profile([64, 256, 256, 10], name="mlp-digits")


def pipelines(specs: Iterable[VWSpec], recompute: Mapping[str, tuple[int, ...]] | None = None) \
        -> tuple[VirtualWorker, ...]:
    """The VWs ``specs`` describe; ``recompute`` gives a device's stage its recompute set."""
    rc = recompute or {}
    return tuple(VirtualWorker(tuple(Stage(d, bounds[j], bounds[j + 1], rc.get(d, ())) for j, d in enumerate(devs)),
                               mini_batch, micro_batches)
                 for devs, bounds, mini_batch, micro_batches in specs)


def replicas(devices: Iterable[str], num_layers: int, mini_batch: int, micro_batches: int = 1) \
        -> tuple[VirtualWorker, ...]:
    """Pure data parallelism: one VW of one stage (the whole model) per device, alike."""
    return tuple(VirtualWorker((Stage(d, 0, num_layers),), mini_batch, micro_batches) for d in devices)


def make_plan(cluster: Cluster, profile: ModelProfile, vws: Iterable[VirtualWorker | VWSpec], *,
              sync: str = "bsp", schedule: str = "1f1b", optimizer: str = "sgd", strategy: str | None = None,
              formation: str = "manual", recompute: Mapping[str, tuple[int, ...]] | None = None,
              memory: Sequence[DeviceMemory] = (), planner_options: Mapping[str, Any] | None = None,
              model: str | None = None, global_batch: int | None = None, sync_options: SyncOptions | None = None,
              **options: Any) -> Plan:
    """A plan made by hand, checked and laid out as every plan is (``Plan.__post_init__``).

    Args:
        cluster: the cluster the plan is for.
        profile: the model's profile; the plan's model is its name unless ``model`` says otherwise.
        vws: each VW, as a ``VirtualWorker`` or ``(devices, layer bounds, mini-batch, micro-batches)``.
        sync: the sync mode.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"1f1b-eager"``.
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``.
        strategy: the plan's family; by default ``"pp"`` for one VW, ``"dp"`` for VWs of one stage each,
            else ``"hybrid"``.
        formation: how the VWs were formed.
        recompute: a device's recompute set, for VWs given as tuples.
        memory: the prediction's peak memory per device (the prediction is otherwise all zeros).
        planner_options: the plan's ``options``, what a planner records.
        model: the plan's model name, where it is not the profile's.
        global_batch: the global batch, where it is not the sum of the mini-batches (a plan it refuses).
        sync_options: the sync mode's options; or give them as keywords (``staleness=0``), not both.
        **options: ``SyncOptions`` fields.
    """
    if sync_options is not None and options:
        raise TypeError(f"make_plan: give sync_options or {', '.join(options)} as keywords, not both")
    built = tuple(vw if isinstance(vw, VirtualWorker) else pipelines([vw], recompute)[0] for vw in vws)
    if strategy is None:
        strategy = "pp" if len(built) == 1 else "dp" if all(len(vw.stages) == 1 for vw in built) else "hybrid"
    return Plan(model or profile.name, sum(vw.mini_batch for vw in built) if global_batch is None else global_batch,
                schedule, sync, optimizer, built,  # type: ignore[arg-type]
                Prediction(0, 0, 0, 0, 0, memory=tuple(memory)), strategy, formation, cluster, profile,
                dict(planner_options or {}), sync_options or SyncOptions(**options))

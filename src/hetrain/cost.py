"""Pure cost functions: compute, point-to-point, all-reduce, pipeline, memory.

One cost model (DESIGN.md decision 4): the planner's closed forms and the
simulator's action durations both come from here. Every function is pure; the
per-(profile, device type, micro-batch) layer time arrays are cached on the
profile so the planner scores a candidate in microseconds.

Notation: ``m`` micro-batches, ``p`` stages (or ring members), ``j`` stage index,
``b`` micro-batch size in samples.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetrain.catalog import RuntimeFootprint, default_footprint, lookup_device_type
from hetrain.cluster import Cluster, Device, Link
from hetrain.profile import LayerProfile, Measurement, ModelProfile

# ---------------------------------------------------------------------------
# compute
# ---------------------------------------------------------------------------


def estimate_roofline_time(flops: float, memory_bytes: float, peak_flops: float,
                           memory_bandwidth_bytes_per_s: float, efficiency: float) -> float:
    """Roofline time of a kernel: ``max(flops / peak, bytes / memory bandwidth) / efficiency``.

    Williams, Waterman & Patterson, "Roofline", CACM 2009; Barrachina et al. use
    the same bound per kernel. ``efficiency`` is the fraction of the roof reached.
    """
    return max(flops / peak_flops, memory_bytes / memory_bandwidth_bytes_per_s) / efficiency


def _roofline_layer(layer: LayerProfile, input_bytes_per_sample: float, b: int, peak_flops: float,
                    memory_bandwidth_bytes_per_s: float, efficiency: float) -> tuple[float, float]:
    """Forward and backward seconds of ``layer`` at micro-batch ``b`` by roofline.

    Forward reads the weights once and the input, writes the output. Backward does
    2x the forward FLOPs (grad wrt input and wrt weights; Kaplan et al. 2020,
    "Scaling laws", sec. 2.1) and moves about twice the bytes (reads weights and
    saved activations, writes weight gradients and input gradients).
    """
    flops = b * layer.forward_flops_per_sample
    moved = layer.param_bytes + b * (input_bytes_per_sample + layer.output_bytes_per_sample)
    fwd = estimate_roofline_time(flops, moved, peak_flops, memory_bandwidth_bytes_per_s, efficiency)
    moved_bwd = 2 * layer.param_bytes + b * (input_bytes_per_sample + layer.output_bytes_per_sample
                                              + layer.saved_bytes_per_sample)
    bwd = estimate_roofline_time(2 * flops, moved_bwd, peak_flops, memory_bandwidth_bytes_per_s, efficiency)
    return fwd, bwd


def interpolate_measurements(ms: Sequence[Measurement], b: int) -> tuple[float, float]:
    """Forward and backward seconds at micro-batch ``b`` from measurements.

    Piecewise linear between measured sizes; outside them, the nearest segment's
    line, floored at half the value proportional to the nearest measurement (so a
    steep segment cannot extrapolate to zero or below). One measurement:
    proportional to ``b``.
    """
    if len(ms) == 1:
        m0 = ms[0]
        return m0.forward_s * b / m0.micro_batch, m0.backward_s * b / m0.micro_batch
    sizes = [m.micro_batch for m in ms]
    if b in sizes:
        m0 = ms[sizes.index(b)]
        return m0.forward_s, m0.backward_s
    k = 1
    while k < len(ms) - 1 and sizes[k] < b:
        k += 1
    lo, hi = ms[k - 1], ms[k]
    w = (b - lo.micro_batch) / (hi.micro_batch - lo.micro_batch)
    fwd = lo.forward_s + w * (hi.forward_s - lo.forward_s)
    bwd = lo.backward_s + w * (hi.backward_s - lo.backward_s)
    near = lo if abs(b - lo.micro_batch) <= abs(b - hi.micro_batch) else hi
    floor = 0.5 * b / near.micro_batch
    return max(fwd, floor * near.forward_s), max(bwd, floor * near.backward_s)


def _device_figures(profile: ModelProfile, type_name: str) -> tuple[float, float] | None:
    """(peak FLOP/s in the profile's precision, memory bandwidth) of a measured type."""
    fig = profile.figures_of(type_name)
    if fig is not None:
        return fig.peak_flops, fig.memory_bandwidth_bytes_per_s
    try:
        t = lookup_device_type(type_name)
    except KeyError:
        return None
    return t.peak_flops(profile.precision), t.memory_bandwidth_bytes_per_s


def estimate_layer_time(profile: ModelProfile, i: int, device: Device, b: int) -> tuple[float, float]:
    """Forward and backward seconds of layer ``i`` on ``device`` at micro-batch ``b``.

    1. measured on this device type: interpolate (``interpolate_measurements``);
    2. measured on another type: scale that by the roofline ratio between types
       (DESIGN.md cost model; Barrachina et al. scale per kernel the same way);
    3. never measured: roofline of the layer's FLOPs and bytes on this device.

    On a TP group (``profile`` one rank's, from ``tp_rank_profile``; ``device`` the group's, from
    ``cluster.tp_cluster``), the layer's TP all-reduces are added, on the critical path, unless the time was
    measured on a rank of such a group (``LayerProfile.measured_tp``: they are in it).
    """
    compute, collectives_in = _layer_compute_time(profile, i, device, b)
    layer = profile.layers[i]
    if profile.tp_degree == 1 or layer.tp is None or collectives_in:
        return compute
    if device.tp != profile.tp_degree or device.tp_link is None:
        raise ValueError(f"a TP {profile.tp_degree} profile costed on {device.name} (TP {device.tp})")
    comm = estimate_tp_collective_time(layer.tp.allreduce_bytes_per_sample * b, layer.tp.allreduces,
                                       device.tp, device.tp_link)
    return compute[0] + comm, compute[1] + comm


def _layer_compute_time(profile: ModelProfile, i: int, device: Device, b: int) -> tuple[tuple[float, float], bool]:
    """(forward, backward) seconds of layer ``i`` by the rules of ``estimate_layer_time``, and whether they were
    measured with the TP collectives in."""
    layer = profile.layers[i]
    in_bytes = profile.input_bytes_per_sample if i == 0 else profile.layers[i - 1].output_bytes_per_sample
    peak = device.peak_flops(profile.precision)
    eff = profile.compute_efficiency
    own = layer.measurements(device.type_name)
    if own:
        return interpolate_measurements(own, b), own[0].source == MEASURED_TP
    here = _roofline_layer(layer, in_bytes, b, peak, device.memory_bandwidth_bytes_per_s, eff)
    for type_name, ms in layer.measured:
        fig = _device_figures(profile, type_name)
        if fig is None or not ms or ms[0].source == MEASURED_TP:
            continue
        there = _roofline_layer(layer, in_bytes, b, fig[0], fig[1], eff)
        fwd, bwd = interpolate_measurements(ms, b)
        return (fwd * here[0] / there[0] if there[0] > 0 else fwd,
                bwd * here[1] / there[1] if there[1] > 0 else bwd), False
    return here, False


#: ``Measurement.source`` of a rank's time measured in a TP group (``LayerProfile.measured_tp``), collectives in
MEASURED_TP = "measured-tp"
#: ``Measurement.source`` of a rank's time estimated from the layer's time on one device (``tp_rank_profile``)
SCALED_TP = "tp-scaled"


def estimate_tp_collective_time(num_bytes: float, calls: int, k: int, link: Link) -> float:
    """Seconds of a layer's TP all-reduces in one forward (or one backward): ``calls`` ring all-reduces among
    the ``k`` ranks of a TP group over the node's ``link``, ``num_bytes`` in all (Megatron-LM: two per
    transformer block each way, of the block's output; Narayanan et al. 2021, sec. 3.3). They sit on the
    critical path: the next matrix multiply needs their result."""
    if k <= 1 or calls <= 0 or num_bytes <= 0:
        return 0.0
    per_call = estimate_ring_allreduce_time(num_bytes / calls, k, link.bandwidth_bytes_per_s, link.step_latency_s)
    return calls * per_call


def _split(whole: float, part: float, k: int, efficiency: float = 1.0) -> float:
    """A figure of which ``part`` is divided over ``k`` ranks at ``efficiency`` and the rest stays whole."""
    return whole - part + part / (k * efficiency)


def tp_rank_profile(profile: ModelProfile, k: int) -> ModelProfile:
    """What one rank of a TP group of ``k`` devices holds and computes, as a profile (cached on ``profile``).

    Per layer with a TP rule (``LayerProfile.tp``): its split parameters, saved activations and FLOPs divided by
    ``k``, the rest whole; its input and output whole (every rank holds them: Megatron's f and g operators
    all-reduce to a replicated tensor), but for an output split among the ranks (a vocab-parallel head's
    logits). Its times: measured on a rank of a group of ``k`` where the profile has them (``measured_tp``,
    collectives in), else its measured time on one device with the split share of its FLOPs divided by
    ``k * profile.tp_efficiency``. A layer without a rule is the same on every rank.
    The planner and the simulator cost a TP stage as a stage of this profile on the group's device
    (``cluster.tp_cluster``); ``estimate_layer_time`` adds the collectives.
    """
    if k == 1:
        return profile
    key = ("tp_rank_profile", k)
    cached = profile._cache.get(key)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    eff = profile.tp_efficiency
    layers = []
    for layer in profile.layers:
        t = layer.tp
        if t is None:
            layers.append(layer)
            continue
        share = t.split_flops_per_sample / layer.forward_flops_per_sample if layer.forward_flops_per_sample else 0.0
        factor = _split(1.0, share, k, eff)
        measured = []
        for type_name, ms in layer.measured:
            at_k = layer.tp_measurements(type_name, k)
            measured.append((type_name, tuple(replace(m, source=MEASURED_TP) for m in at_k) if at_k else tuple(
                replace(m, forward_s=m.forward_s * factor, backward_s=m.backward_s * factor, source=SCALED_TP,
                        forward_spread_s=None, backward_spread_s=None) for m in ms)))
        known = {type_name for type_name, _ in layer.measured}
        measured += [(type_name, tuple(replace(m, source=MEASURED_TP) for m in ms))
                     for type_name, degree, ms in layer.measured_tp if degree == k and type_name not in known]
        layers.append(replace(
            layer, param_bytes=_split(layer.param_bytes, t.split_param_bytes, k),
            output_bytes_per_sample=_split(layer.output_bytes_per_sample, t.split_output_bytes_per_sample, k),
            saved_bytes_per_sample=_split(layer.saved_bytes_per_sample, t.split_saved_bytes_per_sample, k),
            forward_flops_per_sample=_split(layer.forward_flops_per_sample, t.split_flops_per_sample, k, eff),
            measured=tuple(measured), measured_tp=(),
            tp=replace(t, split_param_bytes=t.split_param_bytes / k,  # one rank's part; the all-reduces whole
                       split_flops_per_sample=t.split_flops_per_sample / (k * eff),
                       split_saved_bytes_per_sample=t.split_saved_bytes_per_sample / k,
                       split_output_bytes_per_sample=t.split_output_bytes_per_sample / k)))
    cached = replace(profile, layers=tuple(layers), tp_degree=k)
    profile._cache[key] = cached
    return cached


def estimate_layer_times(profile: ModelProfile, device: Device, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrays (forward_s, backward_s) over all layers for ``device`` at micro-batch ``b``.

    Cached on the profile per (device figures, b): the planner calls this in loops.
    """
    key = ("layer_times", device.type_name, device.peak_fp32_flops, device.peak_fp16_flops,
           device.memory_bandwidth_bytes_per_s, b, device.tp, device.tp_link)
    cached = profile._cache.get(key)
    if cached is None:
        pairs = [estimate_layer_time(profile, i, device, b) for i in range(profile.num_layers)]
        cached = (np.array([f for f, _ in pairs]), np.array([g for _, g in pairs]))
        profile._cache[key] = cached
    return cached


def estimate_action_overhead(profile: ModelProfile, device: Device) -> float:
    """Seconds one forward or one backward action of a micro-batch costs on ``device`` beyond its layers' times.

    The profile's calibrated ``action_overhead_s`` of the device's type (``hetrain calibrate``), else 0.
    A stage's forward of micro-batch i costs ``sum of its layers' forward times + overhead``, and so its
    backward: the overhead is paid per action, so a plan of many small micro-batches pays it more often.
    """
    return profile.action_overhead_of(device.type_name)


def estimate_iteration_overhead(profile: ModelProfile, device: Device) -> float:
    """Seconds one iteration costs on ``device`` beyond its actions: the profile's ``iteration_overhead_s`` of
    the device's type, else 0. The simulator and the planner add it to the device's optimizer step."""
    return profile.iteration_overhead_of(device.type_name)


# ---------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------


def estimate_p2p_time(num_bytes: float, link: Link) -> float:
    """One message over one link: ``latency + bytes / bandwidth`` (Hockney's model)."""
    if num_bytes <= 0:
        return 0.0
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s


#: a link resource the parameter-server exchange loads: ``("out", node)`` / ``("in", node)``, a node's NIC each way
#: (full duplex); ``("pair", a, b)``, the link from device index a to b on one node (``simulator.links`` names them)
LinkKey = tuple[str, ...] | tuple[str, int, int]


def ps_node_leader(members: Sequence[int], hosts: Sequence[int], k: int) -> int:
    """The owner that carries shard ``k``'s traffic across its node's NIC, of a segment whose shards live on
    ``hosts`` (device indices, in shard order), on a node whose owners are ``members``: the shard's host on
    the host's node; elsewhere the node's owners in device order take the shards it does not host in turn,
    starting after the owner that hosts the node's own shard, so that one device does not both keep a shard
    and relay every other (its CPU threads and its link into the node carry both). The runtime
    (``runtime.sync.modes``) and ``estimate_ps_loads`` both use it.

    Example:
        >>> ps_node_leader([2, 3], hosts=[0, 2], k=0), ps_node_leader([2, 3], hosts=[0, 2], k=1)
        (3, 2)
        >>> ps_node_leader([0, 1], hosts=[0, 2], k=1)
        1
    """
    if hosts[k] in members:
        return hosts[k]
    ordered = sorted(members)
    own = [ordered.index(h) for h in hosts if h in members]
    away = [j for j, h in enumerate(hosts) if h not in members]
    start = own[0] + 1 if own else 0
    return ordered[(start + away.index(k)) % len(ordered)]


def estimate_ps_loads(cluster: Cluster, owners: Sequence[int], shards: Sequence[tuple[int, float]],
                      num_bytes: float) -> tuple[dict[LinkKey, float], dict[LinkKey, float]]:
    """Seconds each link resource carries in one wave's pushes, and in its pulls, of a segment of ``num_bytes``
    whose parameter server is cut into ``shards`` (host device index, fraction) among ``owners`` (device indices).

    A node's updates cross its NIC once per shard: its owners first sum the shard's range of their updates at
    the node's leader for that shard (``ps_node_leader``; over their pair of devices in the node), which sends
    the sum to the shard's host (``fraction * bytes``, ``estimate_p2p_time`` over their link) and gets the
    range's global weights back, then hands them on inside the node. Across nodes that is the textbook
    parameter server (Li et al., OSDI 2014), one pusher per node as HetPipe has one VW per node (Park et al.,
    ATC 2020) and as Kim et al.'s hybrid server reduces inside the node first. Pushing each owner separately
    would carry a node's ``owners x`` the bytes through its NIC. A transfer between nodes loads the sender's
    NIC out and the receiver's NIC in; one inside a node, its pair of devices. Where the NICs share their
    transfers fairly, the pushes take the busiest resource's push seconds, the pulls its pull seconds. The
    in-node sums run before the NIC's transfer of the same range; they are counted in the same phase because
    an in-node link moves the range many times faster than the NIC.

    Example:
        >>> from hetrain.cluster import parse_cluster
        >>> c = parse_cluster({"name": "x", "node": [{"name": n, "devices": [{"type": "cpu", "count": 2}],
        ...                    "nic": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}} for n in "ab"]})
        >>> push, pull = estimate_ps_loads(c, [0, 1, 2, 3], [(0, 0.5), (2, 0.5)], 2e9)
        >>> push[("out", "a")], pull[("out", "a")]
        (1.0, 1.0)
    """
    push: dict[LinkKey, float] = {}
    pull: dict[LinkKey, float] = {}
    by_node: dict[str, list[int]] = {}
    for d in owners:
        by_node.setdefault(cluster.devices[d].node, []).append(d)
    names = list(by_node)
    sizes = np.array([fraction * num_bytes for _, fraction in shards], dtype=float)
    hosts = np.array([host for host, _ in shards], dtype=int)
    homes = np.array([names.index(cluster.devices[host].node) for host, _ in shards], dtype=int)
    lat, bw = cluster.latency_s, cluster.bandwidth_bytes_per_s
    # (node, NIC out or in) -> seconds, per direction of the exchange
    nics = {"push": np.zeros((len(names), 2)), "pull": np.zeros((len(names), 2))}

    def add(load: dict[LinkKey, float], key: LinkKey, seconds: float) -> None:
        if seconds > 0:
            load[key] = load.get(key, 0.0) + float(seconds)

    for q, node in enumerate(names):
        members = np.array(sorted(by_node[node]), dtype=int)
        away = (homes != q) & (sizes > 0)  # shards hosted on another node: this node's leader crosses the NICs
        # ps_node_leader's choice for every shard at once: the away shards in turn, after the node's host
        own = np.flatnonzero(np.isin(members, hosts))
        start = int(own[0]) + 1 if len(own) else 0
        position = (start + np.cumsum(homes != q) - 1) % len(members)
        leaders = members[position]
        there = np.where(away, lat[leaders, hosts] + sizes / bw[leaders, hosts], 0.0)
        back = np.where(away, lat[hosts, leaders] + sizes / bw[hosts, leaders], 0.0)
        nics["push"][q, 0] += there.sum()
        np.add.at(nics["push"][:, 1], homes, there)
        np.add.at(nics["pull"][:, 0], homes, back)
        nics["pull"][q, 1] += back.sum()
        if len(members) < 2:
            continue
        # the node's sums at each leader, and the weights handed back: (count, bytes) per leader position
        count = np.bincount(position[away], minlength=len(members))
        volume = np.bincount(position[away], weights=sizes[away], minlength=len(members))
        for j, leader in enumerate(members):
            for d in members:
                if d != leader and count[j]:
                    add(push, ("pair", int(d), int(leader)), count[j] * lat[d, leader] + volume[j] / bw[d, leader])
                    add(pull, ("pair", int(leader), int(d)), count[j] * lat[leader, d] + volume[j] / bw[leader, d])
        for k in np.flatnonzero((homes == q) & (sizes > 0)):  # shards this node hosts: the sum at their host
            host = int(hosts[k])
            for d in members:
                if d != host:
                    add(push, ("pair", int(d), host), lat[d, host] + sizes[k] / bw[d, host])
                    add(pull, ("pair", host, int(d)), lat[host, d] + sizes[k] / bw[host, d])
    for load, seconds in ((push, nics["push"]), (pull, nics["pull"])):
        for q, node in enumerate(names):
            for side, way in enumerate(("out", "in")):
                add(load, (way, node), seconds[q, side])
    return push, pull


def estimate_ring_allreduce_time(num_bytes: float, p: int, bandwidth_bytes_per_s: float,
                                 latency_s: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``p`` members.

    ``2(p-1) * latency + 2(p-1)/p * bytes / B`` with B the slowest link in the
    ring: p-1 reduce-scatter steps and p-1 all-gather steps, each moving bytes/p
    (Patarasuk & Yuan, JPDC 2009; Thakur et al., IJHPCA 2005).
    """
    if p <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (p - 1) * latency_s + 2 * (p - 1) / p * num_bytes / bandwidth_bytes_per_s


@dataclass(frozen=True)
class AllReduceShape:
    """What an all-reduce over a device set costs, independent of the byte count.

    ``ring_*``: flat ring in the best order. ``intra_*``/``inter_*``: the
    hierarchical variant (intra-node reduce-scatter, inter-node all-reduce,
    intra-node all-gather). ``order``: the ring's device order.
    """

    p: int
    ring_bandwidth_bytes_per_s: float
    ring_latency_s: float
    nodes: int
    intra_p: int
    intra_bandwidth_bytes_per_s: float
    intra_latency_s: float
    inter_bandwidth_bytes_per_s: float
    inter_latency_s: float
    order: tuple[int, ...]


def _best_node_cycle(cluster: Cluster, nodes: list[int]) -> tuple[list[int], float]:
    """Order of ``nodes`` in a ring maximising the slowest inter-node link.

    With no [[link]] overrides every node-to-node link is min(NIC_a, NIC_b), so
    every order has the same bottleneck (the slowest NIC): keep file order. With
    overrides: exhaustive over orders up to 8 nodes (7! cycles), else greedy
    nearest-fastest-neighbour.
    """
    if len(nodes) <= 1:
        return nodes, math.inf

    def bottleneck(order: Sequence[int]) -> float:
        return float(cluster.ring_node_links(order)[0].min())

    if not cluster.node_links:
        return nodes, bottleneck(nodes)
    if len(nodes) <= 8:
        best, best_bw = nodes, bottleneck(nodes)
        for rest in itertools.permutations(nodes[1:]):
            order = [nodes[0], *rest]
            bw = bottleneck(order)
            if bw > best_bw:
                best, best_bw = order, bw
        return best, best_bw
    order = [nodes[0]]
    left = set(nodes[1:])
    while left:
        here = order[-1]
        nxt = max(sorted(left), key=lambda n: cluster.node_link(here, n).bandwidth_bytes_per_s)
        order.append(nxt)
        left.remove(nxt)
    return order, bottleneck(order)


def allreduce_shape(cluster: Cluster, devices: Sequence[int]) -> AllReduceShape:
    """The ring order and bottlenecks for an all-reduce among ``devices`` (cached).

    Latencies are a collective step's (``Link.step_latency_s``): the measured
    ``collective_latency_s`` where the cluster file has it, else the link's latency.
    """
    key = tuple(sorted(devices))
    cache: dict[tuple[int, ...], AllReduceShape] = cluster.__dict__.setdefault("_allreduce_cache", {})
    if key in cache:
        return cache[key]
    by_node: dict[int, list[int]] = {}
    for d in key:
        by_node.setdefault(int(cluster.node_index[d]), []).append(d)
    node_ids = list(by_node)
    cycle, inter_bw = _best_node_cycle(cluster, node_ids)
    inter_lat = 0.0
    if len(cycle) > 1:
        inter_lat = float(cluster.ring_node_links(cycle)[1].max())
    multi = [n for n in node_ids if len(by_node[n]) > 1]
    intra_bw = min((cluster.node_link(n, n).bandwidth_bytes_per_s for n in multi), default=math.inf)
    intra_lat = max((cluster.node_link(n, n).step_latency_s for n in multi), default=0.0)
    order = tuple(d for n in cycle for d in by_node[n])
    shape = AllReduceShape(
        p=len(key),
        ring_bandwidth_bytes_per_s=min(intra_bw, inter_bw),
        ring_latency_s=max(intra_lat, inter_lat),
        nodes=len(node_ids),
        intra_p=max(len(v) for v in by_node.values()),
        intra_bandwidth_bytes_per_s=intra_bw,
        intra_latency_s=intra_lat,
        inter_bandwidth_bytes_per_s=inter_bw,
        inter_latency_s=inter_lat,
        order=order,
    )
    cache[key] = shape
    return shape


def estimate_hierarchical_allreduce_time(num_bytes: float, shape: AllReduceShape) -> float:
    """Intra-node reduce-scatter + inter-node all-reduce + intra-node all-gather.

    With k devices per node (the largest node's k), each intra phase is
    ``(k-1) * latency + (k-1)/k * bytes / B_intra``; the inter-node phase runs k
    rings of bytes/k at once through each node's one NIC, so it moves the same
    ``2(n-1)/n * bytes`` per NIC as one ring of the whole buffer over n nodes
    (the 2D/hierarchical scheme of Jia et al. 2018, and NCCL's tree/ring split).
    """
    if num_bytes <= 0 or shape.p <= 1:
        return 0.0
    k, n = shape.intra_p, shape.nodes
    intra = 0.0
    if k > 1:
        intra = (k - 1) * shape.intra_latency_s + (k - 1) / k * num_bytes / shape.intra_bandwidth_bytes_per_s
    inter = estimate_ring_allreduce_time(num_bytes, n, shape.inter_bandwidth_bytes_per_s, shape.inter_latency_s)
    return 2 * intra + inter


ALLREDUCE_ALGORITHMS = ("auto", "ring", "hierarchical")


def estimate_allreduce(num_bytes: float, shape: AllReduceShape, algorithm: str = "auto") -> tuple[float, str]:
    """An all-reduce's (seconds, ``"ring"``/``"hierarchical"``).

    ``algorithm="auto"``: the cheaper of a flat ring and the hierarchical scheme (what the sync layout
    decides, ``sync_layout.build_sync_layout``); ``"ring"``: the flat ring only, as DistributedDataParallel
    and NCCL's ring run it (sync option ``allreduce``); ``"hierarchical"``: the hierarchical scheme where
    the owners span several nodes with two or more on one, else the ring (a decision already taken).
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"all-reduce algorithm must be one of {', '.join(ALLREDUCE_ALGORITHMS)}, got {algorithm!r}")
    ring = estimate_ring_allreduce_time(num_bytes, shape.p, shape.ring_bandwidth_bytes_per_s,
                                        shape.ring_latency_s)
    if algorithm != "ring" and shape.nodes > 1 and shape.intra_p > 1:
        hier = estimate_hierarchical_allreduce_time(num_bytes, shape)
        if hier < ring or algorithm == "hierarchical":
            return hier, "hierarchical"
    return ring, "ring"


def estimate_allreduce_time(cluster: Cluster, devices: Sequence[int], num_bytes: float) -> float:
    """Seconds to all-reduce ``num_bytes`` among ``devices`` (indices), best algorithm."""
    return estimate_allreduce(num_bytes, allreduce_shape(cluster, devices))[0]


def estimate_shard_gather_time(cluster: Cluster, devices: Sequence[int], num_bytes: float) -> float:
    """Seconds in which the owners ``devices`` of a sharded segment of ``num_bytes`` hand each other their updated
    shards after the optimizer step: an all-gather, half a ring all-reduce's bytes on the same links (the
    gradients' reduce-scatter is the other half, priced with the buckets: ``SyncOptions.reduce_wire``)."""
    return 0.5 * estimate_allreduce_time(cluster, devices, num_bytes)


# ---------------------------------------------------------------------------
# pipeline
# ---------------------------------------------------------------------------


def estimate_pipeline_time(stage_times: Sequence[float], m: int) -> float:
    """Iteration time of a GPipe pipeline of ``m`` micro-batches (flushed), or of any without transfers.

    ``stage_times[j]`` is stage j's forward + backward time per micro-batch; a
    transfer between stages enters as its own stage (activation + gradient).
    ``sum_j t_j + (m - 1) * max_j t_j``: the first micro-batch crosses every
    stage, the other m-1 follow at the bottleneck's pace (GPipe, Huang et al.
    2019; the same bubble for 1F1B without transfers, Narayanan et al. 2021, sec. 2.2). 1F1B's transfers
    sit in its steady state's cycle instead: ``estimate_1f1b_pipeline_time``.
    """
    if m < 1:
        raise ValueError(f"micro-batch count must be >= 1, got {m}")
    return float(sum(stage_times)) + (m - 1) * float(max(stage_times))


def estimate_blocking_pipeline_time(stage_times: Sequence[float], link_times: Sequence[float], m: int) -> float:
    """Iteration time of a pipeline of ``m`` micro-batches whose transfers block (sync option ``transfers``).

    ``stage_times[j]``: stage j's forward + backward per micro-batch; ``link_times[j]``: the activation +
    gradient transfer between stage j and j + 1 (``len(stage_times) - 1`` of them). A blocking transfer
    (DeepSpeed's PipelineEngine: a send and its receive are on the critical path of both stages) holds
    its sender and its receiver for its duration, so a stage's time per micro-batch is its compute plus
    the transfers on both its sides: ``t'_j = t_j + c_{j-1} + c_j``. The first micro-batch crosses every
    stage and every link once, the others follow at the slowest ``t'_j``::

        sum_j t_j + sum_j c_j + (m - 1) * max_j (t_j + c_{j-1} + c_j)

    (with ``c_{-1} = c_{p-1} = 0``). The replay of a pipeline of uniform stages and links gives exactly
    this (tests/test_simulator.py); where the transfers overlap compute, ``estimate_pipeline_time`` with
    each link as its own stage.
    """
    if m < 1:
        raise ValueError(f"micro-batch count must be >= 1, got {m}")
    p = len(stage_times)
    if len(link_times) != p - 1:
        raise ValueError(f"{p} stages have {p - 1} links between them, got {len(link_times)} link times")
    c = [0.0, *map(float, link_times), 0.0]
    held = [float(stage_times[j]) + c[j] + c[j + 1] for j in range(p)]
    return float(sum(stage_times)) + float(sum(link_times)) + (m - 1) * max(held)


def estimate_1f1b_period(stage_times: Sequence[float], link_times: Sequence[float], m: int,
                         schedule: str = "1f1b") -> float:
    """Seconds per micro-batch of a 1F1B pipeline's steady state whose transfers overlap compute.

    ``stage_times[j]``: stage j's forward + backward per micro-batch; ``link_times[j]``: the activation +
    gradient transfer between stage j and j + 1. In the steady state stage j runs the forward of micro-batch
    ``i + w_j`` then the backward of ``i`` (``w_j`` warm-up forwards: ``p - j - 1`` under 1F1B; under
    ``1f1b-eager`` one more on every stage but the last, which has none). That order closes a cycle through
    every range of stages ``j..k``: the forward of i on j, its activation on to k (``c``), k's backward of it,
    its gradient back to j, j's backward of it, then j's forward of ``i + w_j - w_k + 1``::

        stage j   F(i) ──a──► ... ──► F(i) on k ─► B(i - w_k) on k ──g──► ... ──► B on j ─► F(i + n) on j
                  n = w_j - w_k + 1 micro-batches (k - j + 1 under 1F1B) per turn of the cycle

    so the stages of the range must do their work and carry their transfers for ``n`` micro-batches in one
    turn: the period is the largest ``(sum_{l=j..k} t_l + sum_{l=j..k-1} c_l) / n`` (j = k: the stage alone,
    ``t_j``). Only a stage with a steady state (``w_j <= m - 2``) starts such a cycle; with fewer
    micro-batches it runs its forwards, then its backwards, as GPipe. Each transfer sits once in the cycle
    of its two stages, where GPipe pays it as a stage of its own (``estimate_pipeline_time``): a balanced
    pipeline of p stages of t, links of c, has the period ``t + (p - 1) c / p`` (max-plus cycle mean,
    Baccelli et al. 1992, ch. 3; the simulator's replay, tests/test_simulator.py).
    """
    p = len(stage_times)
    if len(link_times) != p - 1:
        raise ValueError(f"{p} stages have {p - 1} links between them, got {len(link_times)} link times")
    t, c = [float(x) for x in stage_times], [float(x) for x in link_times]
    warmup = [p - j - (1 if schedule != "1f1b-eager" or j == p - 1 else 0) for j in range(p)]
    period = max(t)
    for j in range(p - 1):
        if warmup[j] > m - 2:  # no steady state on stage j: it closes no cycle
            continue
        work, w_j = t[j], warmup[j] + 1
        for k in range(j + 1, p):  # O(p^2) per partition priced: the comparison inline, not a call of max
            work += c[k - 1] + t[k]
            turn = work / (w_j - warmup[k])
            if turn > period:
                period = turn
    return period


def estimate_1f1b_pipeline_time(stage_times: Sequence[float], link_times: Sequence[float], m: int,
                                schedule: str = "1f1b") -> float:
    """Iteration time of a 1F1B pipeline of ``m`` micro-batches (flushed) whose transfers overlap compute.

    The first micro-batch crosses every stage and every link (warm-up), the other m - 1 follow one per
    steady-state period (``estimate_1f1b_period``), and the cool-down is the first micro-batch's way back,
    already in that first crossing::

        sum_j t_j + sum_j c_j + (m - 1) * period

    Uniform stages with no transfers give GPipe's ``(m + p - 1) t``; with transfers of c, 4 stages of 1 s,
    16 micro-batches: 5.8 + 15 * 1.45 = 27.55 s (the replay: 27.4 s; GPipe's form: 20.8 s).
    """
    if m < 1:
        raise ValueError(f"micro-batch count must be >= 1, got {m}")
    period = estimate_1f1b_period(stage_times, link_times, m, schedule)
    return float(sum(stage_times)) + float(sum(link_times)) + (m - 1) * period


def in_flight(schedule: str, m: int, p: int, j: int) -> int:
    """Micro-batches whose activations stage ``j`` of ``p`` holds at once.

    GPipe: all m (all forwards before any backward). 1F1B: ``min(m, p - j)``
    (PipeDream-Flush, Narayanan et al. 2021). ``1f1b-eager``: one more on every stage but the last
    (``hetrain.schedule.generate.one_f_one_b_eager``).
    """
    if schedule == "gpipe":
        return m
    return min(m, p - j + (schedule == "1f1b-eager" and j < p - 1))


def most_in_flight(schedule: str, p: int) -> int | None:
    """The most micro-batches any stage of ``p`` holds under ``schedule``, whatever m (None: GPipe, m):
    a stage's memory is the same for every m at or above it (``in_flight``, whose first stage holds the most)."""
    return None if schedule == "gpipe" else in_flight(schedule, p + 1, p, 0)


OPTIMIZER_STATE_PER_PARAM = {"sgd": 0, "momentum": 1, "adam": 2}


def estimate_weight_memory(param_bytes: float, bytes_per_element: int, optimizer: str, state_share: float = 1.0,
                           grad_share: float = 1.0, grad_bytes_per_element: int = 4) -> float:
    """Parameters + gradients + optimizer state (+ the 16-bit copy of the weights under mixed precision).

    ``param_bytes`` are fp32 (``LayerProfile.param_bytes``): training keeps the parameters, their
    gradients and the optimizer state in fp32 whatever the precision of compute (``hetrain.amp``):
    4 + 4 bytes per parameter, 0 (SGD), 4 (momentum) or 8 (Adam: m and v) of state. Under bf16 or
    fp16 (``bytes_per_element`` 2) autocast keeps one 16-bit copy of each weight for the iteration:
    2 bytes more. Adam under mixed precision: 18 bytes per parameter, against ZeRO's 16 for 16-bit
    weights and gradients with fp32 master, m and v (Rajbhandari et al., ZeRO, 2020, sec. 3.1).

    Sharded among a segment's owners (``SyncOptions.shard``), a device keeps ``state_share`` of the optimizer
    state (ZeRO-1) and, under ``optimizer+gradients``, ``grad_share`` of the gradients between backwards
    (ZeRO-2; the backward's own gradients are transient: ``estimate_stage_memory``).

    ``grad_bytes_per_element``: the bytes of a gradient as the runtime keeps it
    (``ModelProfile.grad_bytes_per_element``): 4 (hetrain's runtime), or 2 for a runtime with 16-bit gradients
    and fp32 master weights (DeepSpeed's fp16, ``mixed_precision = "master-weights"``): its fp32 master weights,
    16-bit weights, 16-bit gradients and Adam's m and v are 4 + 2 + 2 + 8 = 16 bytes per parameter, ZeRO's count.
    """
    n_params = param_bytes / 4
    state = 4 * OPTIMIZER_STATE_PER_PARAM[optimizer] * n_params * state_share
    cast_copy = bytes_per_element * n_params if bytes_per_element < 4 else 0.0
    return param_bytes * (1.0 + grad_share * grad_bytes_per_element / 4) + state + cast_copy


#: ZeRO-2's gradients in flight during a backward: two of DistributedDataParallel's 25 MiB buckets (one being
#: reduced to its owners while the next fills; DeepSpeed's ``reduce_bucket_size`` plays the same part)
ZERO2_IN_FLIGHT_BYTES = 2 * 25 * 2**20


def zero2_transient_bytes(param_bytes: float, largest_layer_bytes: float, grad_share: float,
                          bucket_bytes: float | None = None) -> float:
    """The gradients a ZeRO-2 stage holds beyond its own share during its last backward: the buckets not yet
    reduced (two buckets: ``ZERO2_IN_FLIGHT_BYTES``, or ``2 * bucket_bytes`` where the plan's bucket size is
    given; or the largest layer, a bucket ending on a layer boundary), at most the share of the stage's gradients
    it does not keep. Earlier backwards of an iteration (several micro-batches) hold the gradients whole
    (``runtime.sync.shard``)."""
    in_flight = ZERO2_IN_FLIGHT_BYTES if bucket_bytes is None else 2 * bucket_bytes
    return min((1.0 - grad_share) * param_bytes, max(in_flight, largest_layer_bytes))


#: The share of a device's memory a plan leaves free: a plan never predicts a device more than
#: 95% full. The memory model's error on measured GPUs (docs/profile.md) is within it, and a
#: training run's peak moves by a few percent with the allocator's fragmentation.
MEMORY_MARGIN_FRACTION = 0.05


def runtime_footprint(profile: ModelProfile, device: Device) -> RuntimeFootprint:
    """The memory a training process holds on ``device`` beyond its tensors: measured on its type
    (``ModelProfile.memory_footprint``), else the catalog's (``catalog.default_footprint``)."""
    return profile.footprint_of(device.type_name) or default_footprint(device.type_name)


def estimate_device_memory(profile: ModelProfile, device: Device, tensor_bytes: float) -> float:
    """Device memory in use at a tensor peak of ``tensor_bytes``: the footprint's fixed bytes, the
    tensors, and what the caching allocator reserves beyond them."""
    return runtime_footprint(profile, device).device_bytes(tensor_bytes)


def tensor_budget(profile: ModelProfile, device: Device, margin: float = MEMORY_MARGIN_FRACTION) -> float:
    """The largest tensor peak that leaves ``margin`` of ``device``'s memory free, its footprint counted:
    ``fixed + (1 + allocator_fraction) * tensors <= (1 - margin) * memory``."""
    fp = runtime_footprint(profile, device)
    return ((1.0 - margin) * device.memory_bytes - fp.fixed_bytes) / (1.0 + fp.allocator_fraction)


# The loss on the last stage, in multiples of the last layer's output bytes: a
# cross-entropy keeps its log-softmax for backward (one output's worth per
# micro-batch in flight), and its backward holds two more at once (the gradient
# of the log-softmax and of the logits). Measured on an H100 with gpt2-small at
# micro-batch 32, where the logits are 6.6 GB: the peak was 42.0 GB against 22.2 GB
# predicted without these terms, 41.9 GB with them (benchmarks/gpu_prediction.py).
LOSS_KEPT_OUTPUTS = 1.0
LOSS_BACKWARD_OUTPUTS = 2.0


def loss_memory_per_sample(profile: ModelProfile) -> tuple[float, float]:
    """(bytes kept per sample in flight, transient bytes per sample in backward) of the loss on the last stage."""
    out = profile.layers[-1].output_bytes_per_sample
    return LOSS_KEPT_OUTPUTS * out, LOSS_BACKWARD_OUTPUTS * out


# Bytes the optimizer step allocates for its duration, per fp32 word of parameters:
# torch's Adam/AdamW (foreach, the default on CUDA) builds sqrt(v) for every
# parameter at once; SGD and momentum update in place. Measured on an H100 with
# torch 2.11 (three 4096x4096 linear layers, 201 MB): Adam and AdamW 1.00x the
# parameter bytes, SGD and momentum 0. Per-tensor Adam (the CPU default) needs only
# its largest tensor's worth, so this is an upper bound there.
OPTIMIZER_STEP_TRANSIENT_PER_PARAM = {"sgd": 0, "momentum": 0, "adam": 1}


def estimate_optimizer_step_memory(param_bytes: float, bytes_per_element: int, optimizer: str,
                                   reduce_copy: float = 0.0, state_share: float = 1.0) -> float:
    """The transient bytes on top of the weights at the end of an iteration (fp32 words, like the state and
    ``param_bytes``; ``bytes_per_element``, the precision of compute, does not change them): the optimizer
    step's, or the 16-bit copies of the gradients being all-reduced just before it (``reduce_copy`` bytes per
    gradient byte, ``SyncOptions.reduce_copy``), whichever is larger: the copies are freed before the step.
    Sharded, the step runs over ``state_share`` of the parameters."""
    return max(OPTIMIZER_STEP_TRANSIENT_PER_PARAM[optimizer] * state_share, reduce_copy) * param_bytes


def estimate_stage_memory(profile: ModelProfile, first: int, end: int, recompute: Sequence[int],
                          b: int, in_flight_count: int, optimizer: str, with_step: bool = True,
                          reduce_copy: float = 0.0, state_share: float = 1.0, grad_share: float = 1.0,
                          micro_batches: int = 1) -> float:
    """Peak bytes of a stage holding layers ``[first, end)``.

    weights (``estimate_weight_memory``) + ``in_flight_count * b *`` activation
    bytes kept per sample, where a recomputed layer keeps only its input instead
    of its saved activations, + the largest recomputed layer's activations for one
    micro-batch (they reappear while it is recomputed during backward; Chen et al.,
    "Training deep nets with sublinear memory cost", 2016). The last stage also
    holds the loss (``loss_memory_per_sample``): kept per micro-batch in flight,
    and a transient for one micro-batch in its backward, counted on top of the
    recompute transient (an upper bound where the two coincide). The optimizer
    step runs once the activations are freed: the peak is the larger of the
    activation peak and weights + ``estimate_optimizer_step_memory``
    (``with_step=False``: the activation peak alone, for the simulator's track); ``reduce_copy``: the 16-bit
    copies of its gradients, in the same transient (``estimate_optimizer_step_memory``).

    ``state_share``, ``grad_share``: the shares of the optimizer state and of the gradients the device keeps
    (``estimate_weight_memory``). Under ZeRO-2 (``grad_share < 1``) a stage that runs one micro-batch per
    iteration (``micro_batches``) holds its backward's gradients until their bucket is reduced to its owners:
    ``zero2_transient_bytes`` in the activation peak's transient; one that runs several accumulates them whole
    until its last backward (its owners' micro-batch counts differ, so they cannot reduce every micro-batch,
    DeepSpeed's way): the whole gradients' unkept share.
    """
    layers = profile.layers
    rc = set(recompute)
    kept = 0.0
    transient = 0.0
    params = 0.0
    for i in range(first, end):
        layer = layers[i]
        params += layer.param_bytes
        if i in rc:
            in_bytes = profile.input_bytes_per_sample if i == 0 else layers[i - 1].output_bytes_per_sample
            kept += in_bytes
            transient = max(transient, layer.saved_bytes_per_sample * b)
        else:
            kept += layer.saved_bytes_per_sample
    if end == profile.num_layers and end > first:
        loss_kept, loss_transient = loss_memory_per_sample(profile)
        kept += loss_kept
        transient += loss_transient * b
    weights = estimate_weight_memory(params, profile.bytes_per_element, optimizer, state_share, grad_share,
                                     profile.grad_bytes_per_element)
    if grad_share < 1.0 and b > 0:
        transient += (zero2_transient_bytes(params, max(x.param_bytes for x in layers[first:end]), grad_share)
                      if micro_batches <= 1 else (1.0 - grad_share) * params)
    peak = weights + in_flight_count * b * kept + transient
    if with_step:
        peak = max(peak, weights + estimate_optimizer_step_memory(params, profile.bytes_per_element, optimizer,
                                                                  reduce_copy, state_share))
    return peak


def estimate_optimizer_time(param_bytes: float, bytes_per_element: int, device: Device, optimizer: str,
                            profile: ModelProfile | None = None) -> float:
    """Seconds of one optimizer step over ``param_bytes`` of parameters on ``device``.

    The first of these that applies (as ``estimate_layer_time`` for layers):

    1. ``profile`` has the step measured on this device type
       (``ModelProfile.optimizer_s_per_byte``; PipeDream's profiler times the weight
       update the same way): measured seconds per byte * ``param_bytes``;
    2. measured on another type with known figures (``measured_on``, else the
       catalog): that rate scaled by the ratio of memory bandwidths, the roofline
       ratio of a memory-bound kernel;
    3. never measured: memory-bound, reading and writing weights, gradients and
       state once: bytes moved = 2 * weight memory, at the device's memory bandwidth.
       Optimistic where the step is not one pass at full bandwidth: torch's
       per-tensor CPU loops, a CPU-quota-throttled device (2-3x on emulated devices).
    """
    if profile is not None:
        rate = profile.optimizer_s_per_byte(device.type_name, optimizer)
        if rate is not None:
            return rate * param_bytes
        for type_name, _ in profile.optimizer_step_s_per_byte:
            rate = profile.optimizer_s_per_byte(type_name, optimizer)
            fig = _device_figures(profile, type_name)
            if rate is not None and fig is not None:
                return rate * param_bytes * fig[1] / device.memory_bandwidth_bytes_per_s
    grad_bpe = 4 if profile is None else profile.grad_bytes_per_element
    return 2 * estimate_weight_memory(param_bytes, bytes_per_element, optimizer,
                                      grad_bytes_per_element=grad_bpe) / device.memory_bandwidth_bytes_per_s


# ---------------------------------------------------------------------------
# statistical efficiency
# ---------------------------------------------------------------------------


def estimate_samples_to_accuracy_factor(global_batch: int, critical_batch: float) -> float:
    """How many more samples a global batch needs to reach a target, relative to tiny batches.

    ``E(B) = E_min * (1 + B / B_crit)``: McCandlish et al., "An empirical model of
    large-batch training", 2018, eq. 2.11. Below the critical batch the cost is
    near 1; beyond it, samples (and epochs) grow linearly with B, which is why
    Pal et al. (IEEE Micro 2019) argue for hybrid parallelism over ever-larger DP batches.
    """
    return 1.0 + global_batch / critical_batch

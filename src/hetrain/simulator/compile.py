"""Compiling every device's Actions to timed operations (``ops``), once, before the replay.

Durations and memory figures come from the one cost model (``hetrain.cost``);
link resources are numbered as transfers first use them (``links``); every
collective gets a number and its phases. The synchronisation decisions (segments,
gradient buckets, each all-reduce's algorithm, parameter-server hosts) are the
plan's (``Plan.layout``, ``sync_layout``): the replay reads them and decides none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hetrain.cluster import Cluster, Device, share_link
from hetrain.cost import (
    estimate_action_overhead,
    estimate_iteration_overhead,
    estimate_layer_times,
    estimate_optimizer_step_memory,
    estimate_optimizer_time,
    estimate_p2p_time,
    estimate_shard_gather_time,
    estimate_stage_memory,
    tp_rank_profile,
)
from hetrain.plan import Plan, Stage, VirtualWorker
from hetrain.profile import ModelProfile
from hetrain.schedule import (
    COLLECTIVE_KINDS,
    Action,
    ActionKind,
    BucketSync,
    Compute,
    Schedule,
    ScheduleError,
    ScheduleTemplates,
    SegmentSync,
    Step,
    Transfer,
)
from hetrain.schedule.templates import TO_NEXT
from hetrain.simulator.links import LinkResources, Phase, allreduce_phases, edge_links, ps_phases
from hetrain.simulator.ops import (
    AverageMerge,
    AverageStart,
    Backward,
    BucketStart,
    BucketWait,
    Collective,
    CollectiveSpec,
    Forward,
    Op,
    OptimizerStep,
    Pull,
    Push,
    Recv,
    Send,
)
from hetrain.sync_layout import Bucket, backward_after

K = ActionKind
_new = tuple.__new__  # a NamedTuple record without its Python-level __new__: millions per large plan


@dataclass(frozen=True)
class CompiledStageCosts:
    """One device's figures: per micro-batch i (``forward_s[i]``...), and for the whole iteration."""

    weights_bytes: float  # weights, gradients and optimizer state: held from t = 0
    step_transient_bytes: float  # the optimizer step's transient
    optimizer_s: float  # the step, and the per-iteration fixed cost (``estimate_iteration_overhead``)
    overhead_s: float  # per forward or backward action
    forward_s: list[float]
    backward_s: list[float]  # the recomputed forwards included
    activation_bytes: list[float]  # kept from a forward's end to its backward's end
    transient_bytes: list[float]  # the largest recomputed layer's activations, during a backward
    layer_times: dict[int, tuple[np.ndarray, np.ndarray]]  # micro-batch size -> (forward_s, backward_s) per layer


def estimate_stage_costs(plan: Plan, vw: VirtualWorker, stage: Stage, device: Device) -> CompiledStageCosts:
    """The figures of ``stage`` of ``vw`` run on ``device``, from ``hetrain.cost``: one rank's, on a TP group
    (``cost.tp_rank_profile``; ``device`` then stands for the group: ``Cluster.group_device``)."""
    profile = tp_rank_profile(plan.profile, stage.tp)
    first, end, rc = stage.first_layer, stage.end_layer, list(stage.recompute)
    state_share, grad_share = plan.shard_shares(stage.device)
    m = len(vw.micro_batch_sizes)

    def held(b: int, n: int) -> float:  # tensors held with n micro-batches of b in flight (b = 0: the weights)
        return estimate_stage_memory(profile, first, end, rc, b, n, plan.optimizer, with_step=False,
                                     state_share=state_share, grad_share=grad_share, micro_batches=m)

    weights = held(0, 0)
    param_bytes = float(sum(profile.layers[i].param_bytes for i in stage.layers))
    per_size: dict[int, tuple[float, float, float, float]] = {}
    layer_times = {}
    overhead = estimate_action_overhead(profile, device)
    for b in set(vw.micro_batch_sizes):
        f, g = estimate_layer_times(profile, device, b)
        layer_times[b] = (f, g)
        held0, held1 = held(b, 0), held(b, 1)
        per_size[b] = (float(f[first:end].sum()) + overhead,
                       float(g[first:end].sum() + f[rc].sum()) + overhead,
                       held1 - held0, held0 - weights)
    sizes = vw.micro_batch_sizes
    return CompiledStageCosts(
        weights_bytes=weights,
        step_transient_bytes=max(estimate_optimizer_step_memory(param_bytes, profile.bytes_per_element,
                                                                plan.optimizer, state_share=state_share),
                                 plan.sync_options.reduce_copy * _shared_param_bytes(plan, stage, profile)),
        optimizer_s=estimate_optimizer_time(state_share * param_bytes, profile.bytes_per_element, device,
                                            plan.optimizer, profile)
        + estimate_iteration_overhead(profile, device) + _shard_gather_s(plan, stage),
        overhead_s=overhead,
        forward_s=[per_size[b][0] for b in sizes], backward_s=[per_size[b][1] for b in sizes],
        activation_bytes=[per_size[b][2] for b in sizes], transient_bytes=[per_size[b][3] for b in sizes],
        layer_times=layer_times,
    )


def _shard_gather_s(plan: Plan, stage: Stage) -> float:
    """Seconds after ``stage``'s optimizer step in which the owners of its sharded segments all-gather their
    updated shards (``planner.search.shard_gather_s``: half a ring all-reduce of the segment's weights)."""
    if plan.sync_options.shard == "none":
        return 0.0
    index = {d.name: d.index for d in plan.cluster.devices}
    return sum(estimate_shard_gather_time(plan.cluster, [index[o] for o in seg.owners], seg.param_bytes)
               for seg in plan.segments() if seg.sharded and stage.device in seg.owners)


def _shared_param_bytes(plan: Plan, stage: Stage, profile: ModelProfile) -> float:
    """Bytes of ``stage``'s gradients that it all-reduces with other owners (its layers in shared segments)."""
    shared = [(seg.first_layer, seg.end_layer) for seg in plan.segments() if seg.shared and stage.device in seg.owners]
    return float(sum(profile.layers[i].param_bytes for i in stage.layers if any(a <= i < b for a, b in shared)))


@dataclass(frozen=True)
class Program:
    """Every device's operations, ready to replay.

    Attributes:
        plan: the plan replayed.
        first: the first iteration's Actions, as templates (``schedule`` fills them in, to explain a
            stalled replay).
        iterations: how many iterations ``ops`` hold.
        names: the devices that have Actions; device number ``d`` is ``names[d]``.
        where: per device number, its (VW, stage).
        weights_bytes: per device number, the memory it holds from t = 0.
        ops: per device number, its operations over all iterations.
        collectives: the collectives the operations name, by number.
        links: the link resources the operations name, by number.
    """

    plan: Plan
    first: ScheduleTemplates
    iterations: int
    names: list[str]
    where: list[tuple[int, int]]
    weights_bytes: list[float]
    ops: list[list[Op]]
    collectives: list[CollectiveSpec]
    links: LinkResources

    @property
    def schedule(self) -> Schedule:
        """The first iteration's Actions, every device's peers filled in."""
        return self.first.schedule()


def compile_program(plan: Plan, schedules: Sequence[Schedule | ScheduleTemplates]) -> Program:
    """Compile ``schedules`` (one per iteration, the same devices in each) to a ``Program``.

    Each is a ``Schedule`` or, as ``simulate`` builds them, its templates (``build_schedule_templates``):
    the operations are the same either way, a template's transfers naming the device's neighbours.

    Raises:
        ScheduleError: a device that holds no stage, an ``ALLREDUCE_START`` after no backward,
            or an action kind the simulator cannot time.
    """
    return _Compiler(plan, schedules).program()


_SENDS = frozenset((K.SEND_F, K.SEND_B))


@dataclass(frozen=True)
class _SendRoute:
    """What a device's sends of one kind from one stage to one peer share, whatever the micro-batch."""

    to: str
    peer: int  # its device number
    forward: bool
    bytes_per_sample: float
    label_head: str  # the label is label_head, the micro-batch, label_tail
    label_tail: str
    kind: str  # the link event's kind
    key_base: int  # the transfer of micro-batch i is numbered key_base + i (``_Compiler.transfer_key``)


@dataclass
class _Device:
    """What compiling one device's actions needs, and its operations compiled so far."""

    d: int
    name: str
    stage: Stage
    costs: CompiledStageCosts
    sizes: Sequence[int]
    out_bytes: float  # per sample, sent forward
    in_bytes: float  # per sample, sent backward
    forward: list[Forward]  # per micro-batch i
    backward: list[Backward]  # per micro-batch i, starting no bucket
    ops: list[Op] = field(default_factory=list)
    last_backward: int = -1  # index in ops of the latest Backward
    rides: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # (``_ride_on_last_backward``)
    wave: int = 0  # parameter-server waves: one per iteration that pulls
    sends: dict[tuple[ActionKind, int, str | None], _SendRoute] = field(default_factory=dict)  # (``_send``)
    # (kind, peer name) -> (the label's text after the action's own, the key of micro-batch 0) (``_recv_route``)
    recvs: dict[tuple[ActionKind, str | None], tuple[str, int]] = field(default_factory=dict)
    pulled: bool = False  # this iteration has a PULL


@dataclass
class _OpTemplate:
    """The operations of one schedule template on devices of equal stage costs, before the device's own.

    ``ops`` holds the computes in place and None where each device's own operation goes: the ``special``
    actions, compiled one at a time in their order, each with the position of the backward before it that
    no earlier special one had (-1: none), then the other ``sends`` (per (kind, stage, peer named): position
    and micro-batch) and the ``recvs`` (per (kind, peer named): position, micro-batch, the action's text).
    """

    ops: list[Op | None]
    special: list[tuple[int, int]]
    sends: dict[tuple[ActionKind, int, str | None], list[tuple[int, int]]]
    recvs: dict[tuple[ActionKind, str | None], list[tuple[int, int, str]]]
    last_backward: int  # the position of the template's last backward (-1: none)


def network_of_tp_groups(plan: Plan) -> Cluster:
    """``plan.cluster`` with the network as one rank of each TP group sees it: the node of a stage's TP group of
    k devices has a k-th of its NIC's bandwidth, and a node link a k-th of its own (the larger k of its two nodes).
    Only a group's first device has actions; its k ranks move their parts at once over the node's one NIC, as
    ``cluster.tp_cluster`` has it for the planner. A plan without TP groups: its cluster as it is."""
    cluster = plan.cluster
    if plan.max_tp == 1:
        return cluster
    node_of = {d.name: d.node for d in cluster.devices}
    k_of: dict[str, int] = {}
    for vw in plan.virtual_workers:
        for s in vw.stages:
            k_of[node_of[s.device]] = max(k_of.get(node_of[s.device], 1), s.tp)
    nodes = tuple(replace(n, nic=share_link(n.nic, k_of.get(n.name, 1))) for n in cluster.nodes)
    links = tuple(replace(nl, link=share_link(nl.link, max(k_of.get(a, 1) for a in nl.nodes)))
                  for nl in cluster.node_links)
    return Cluster(cluster.name, nodes, links)


class _Compiler:
    """Numbers devices, link resources and collectives while it compiles each action."""

    def __init__(self, plan: Plan, schedules: Sequence[Schedule | ScheduleTemplates]) -> None:
        self.plan = plan
        self.schedules = [s if isinstance(s, ScheduleTemplates) else ScheduleTemplates.of(s) for s in schedules]
        self.cluster = network_of_tp_groups(plan)
        self.names = list(self.schedules[0].roles)
        self.index = {name: k for k, name in enumerate(self.names)}
        # transfers are numbered (``transfer_key``): micro-batch indices lie below ``span``
        self.span = 1 + max((a.micro_batch for s in self.schedules for t in s.templates for a in t
                             if isinstance(a, Transfer)), default=0)
        # (iteration, template, id of the stage costs) -> its operations (``_op_template``)
        self.op_templates: dict[tuple[int, int, int], _OpTemplate] = {}
        self.cluster_index = {d.name: d.index for d in self.cluster.devices}
        self.node_of = {dev.name: dev.node for dev in self.cluster.devices}
        self.staleness = plan.sync_options.staleness
        self.blocking = plan.sync_options.transfers == "blocking"
        self.segments = plan.segments()
        self.res = LinkResources()
        # (kind, segment, members or bucket, iteration started) -> collective number
        self.cids: dict[tuple[ActionKind, int, tuple[object, ...], int], int] = {}
        self.collectives: list[CollectiveSpec] = []
        self.last_start: dict[tuple[int, int], int] = {}  # (device, segment) -> iteration of its AVERAGE_START
        self.exchange_phases: dict[int, list[Phase]] = {}  # segment -> its parameter-server exchange's phases
        self.p2p_cache: dict[tuple[int, int, float], tuple[float, tuple[int, ...]]] = {}
        self.labels: dict[tuple[str, int, int], list[str]] = {}  # "jFi" strings, shared by devices of equal (j, m)
        # devices alike (the same stage of equal VWs on the same kind of device) share their costs and compute ops
        self.costs: dict[tuple[object, ...], CompiledStageCosts] = {}
        self.computes: dict[tuple[int, int], tuple[list[Forward], list[Backward]]] = {}
        # (kind, segment, bucket, iteration) -> the one operation of every owner (``_bucket``)
        self.bucket_ops: dict[tuple[ActionKind, int, int, int], BucketStart | BucketWait] = {}
        # (id of the stage costs, micro-batch size, bucket's first bound in layers) -> ``_bucket_final_s``
        self.final_s: dict[tuple[int, int, float], float] = {}

    def program(self) -> Program:
        where = {s.device: (v, j) for v, vw in enumerate(self.plan.virtual_workers) for j, s in enumerate(vw.stages)}
        devices = {dev.name: dev for dev in self.cluster.devices}
        ops: list[list[Op]] = []
        weights: list[float] = []
        for d, name in enumerate(self.names):
            if name not in where:
                raise ScheduleError(f"{name} has actions but holds no stage in the plan")
            v, j = where[name]
            vw = self.plan.virtual_workers[v]
            stage = vw.stages[j]
            device = self.cluster.group_device(stage.tp_group) if stage.tp_group else devices[name]
            dev = self._device(d, name, vw, j, self._stage_costs(vw, stage, device))
            ops.append(self._device_ops(dev))
            weights.append(dev.costs.weights_bytes)
        return Program(self.plan, self.schedules[0], len(self.schedules), self.names,
                       [where[name] for name in self.names], weights, ops, self.collectives, self.res)

    def _stage_costs(self, vw: VirtualWorker, stage: Stage, device: Device) -> CompiledStageCosts:
        """``estimate_stage_costs``, once per kind of device (its figures, not its name) and stage."""
        key = (tuple(vw.micro_batch_sizes), stage.first_layer, stage.end_layer, stage.recompute, stage.tp,
               replace(device, name="", node="", index=0, tp_group=(str(device.tp),)))
        costs = self.costs.get(key)
        if costs is None:
            costs = self.costs[key] = estimate_stage_costs(self.plan, vw, stage, device)
        return costs

    def _device(self, d: int, name: str, vw: VirtualWorker, j: int, costs: CompiledStageCosts) -> _Device:
        stage = vw.stages[j]
        profile = tp_rank_profile(self.plan.profile, stage.tp)
        m = len(vw.micro_batch_sizes)
        for letter in "FB":
            if (letter, j, m) not in self.labels:
                self.labels[(letter, j, m)] = [f"{j}{letter}{i}" for i in range(m)]
        f_labels, b_labels = self.labels[("F", j, m)], self.labels[("B", j, m)]
        first, end = stage.first_layer, stage.end_layer
        computes = self.computes.get((id(costs), j))
        if computes is None:
            computes = self.computes[(id(costs), j)] = (
                [Forward(i, f_labels[i], costs.forward_s[i], costs.activation_bytes[i]) for i in range(m)],
                [Backward(i, b_labels[i], costs.backward_s[i], costs.activation_bytes[i], costs.transient_bytes[i])
                 for i in range(m)])
        return _Device(
            d, name, stage, costs, vw.micro_batch_sizes,
            out_bytes=profile.sent_bytes_per_sample(end - 1),
            in_bytes=profile.sent_bytes_per_sample(first - 1) if first > 0 else 0.0,
            forward=computes[0], backward=computes[1],
        )

    def transfer_key(self, backward: bool, sender: int, receiver: int, micro_batch: int) -> int:
        """The number naming one point-to-point transfer: the sender's ``Send`` and the receiver's ``Recv``
        hold it (``ops.Send.key``), one per (direction, sender, receiver, micro-batch), as an int (a key the
        replay looks up twice per transfer)."""
        return ((sender * len(self.names) + receiver) * 2 + backward) * self.span + micro_batch

    def _device_ops(self, dev: _Device) -> list[Op]:
        """``dev``'s operations over all iterations: per iteration, its template's operations (``_op_template``)
        copied, then what is the device's own filled in.

        First, in the order of its actions, the sync actions and the first send of each route and micro-batch
        size (``_OpTemplate.special``): they number link resources and collectives on first use, in the same
        order as compiling every action in turn would; then the other sends and the receives, whose records
        name the device and its peers but number nothing, built with ``tuple.__new__`` (a NamedTuple's own
        ``__new__`` is a Python call)."""
        ops, d, sizes, p2p, blocking = dev.ops, dev.d, dev.sizes, self.p2p_cache, self.blocking
        for it, shared in enumerate(self.schedules):
            role = shared.roles[dev.name]
            prev_device, next_device = role.prev_device, role.next_device
            actions = shared.templates[role.template]
            tmpl = self._op_template(it, role.template, actions, dev)
            base = len(ops)
            ops.extend(tmpl.ops)  # type: ignore[arg-type]  # its Nones are all filled in below
            for pos, last_b in tmpl.special:
                if last_b >= 0:
                    dev.last_backward = base + last_b  # an ALLREDUCE_START rides on the backward before it
                a = actions[pos]
                if isinstance(a, Transfer):  # the first send of its route and size: _send numbers its links
                    peer = a.peer if a.peer is not None else (next_device if a.kind in TO_NEXT else prev_device)
                    full = a if peer is a.peer else Transfer(a.kind, a.stage, a.micro_batch, peer)
                    ops[base + pos] = self._send(full, dev)
                else:
                    ops[base + pos] = self._compile(a, it, dev)
            for (kind, stage, named), todo in tmpl.sends.items():
                peer = named if named is not None else (next_device if kind in TO_NEXT else prev_device)
                route = dev.sends[(kind, stage, peer)]  # made by the route's first send, a special one
                head, tail, key, bps, link_kind, to = (route.label_head, route.label_tail, route.key_base,
                                                       route.bytes_per_sample, route.kind, route.peer)
                for pos, i in todo:
                    cached = p2p[(d, to, sizes[i] * bps)]
                    ops[base + pos] = _new(Send, (i, f"{head}{i}{tail}", key + i, cached[0], cached[1], link_kind,
                                                  blocking))
            for (kind, named), waits in tmpl.recvs.items():
                peer = named if named is not None else (next_device if kind in TO_NEXT else prev_device)
                got = dev.recvs.get((kind, peer))
                if got is None:
                    got = self._recv_route(actions[waits[0][0]], peer, dev)  # type: ignore[arg-type]
                tail, key = got
                for pos, i, head in waits:
                    ops[base + pos] = _new(Recv, (i, f"{head}{tail}", key + i))
            if tmpl.last_backward >= 0:
                dev.last_backward = base + tmpl.last_backward
            if dev.pulled:
                dev.wave += 1
                dev.pulled = False
        for k, rides in dev.rides.items():  # each backward takes the bucket starts that ride on it, in order
            b_op = ops[k]
            assert isinstance(b_op, Backward)
            ops[k] = b_op._replace(bucket_starts=(*b_op.bucket_starts, *rides))
        return ops

    def _op_template(self, it: int, template: int, actions: Sequence[Action], dev: _Device) -> _OpTemplate:
        """The operations of template ``template`` of iteration ``it`` on devices of ``dev``'s stage costs, worked
        out once for all of them: the computes in place, and where each device's own operations go."""
        key = (it, template, id(dev.costs))
        tmpl = self.op_templates.get(key)
        if tmpl is not None:
            return tmpl
        forward, backward, sizes = dev.forward, dev.backward, dev.sizes
        tmpl = self.op_templates[key] = _OpTemplate([None] * len(actions), [], {}, {}, -1)
        first_sends: set[tuple[ActionKind, int, str | None, int]] = set()
        last_b = -1  # the latest backward not yet handed to a special action
        for pos, a in enumerate(actions):
            if isinstance(a, Compute):
                if a.kind is K.F:
                    tmpl.ops[pos] = forward[a.micro_batch]
                else:
                    tmpl.ops[pos] = backward[a.micro_batch]
                    last_b = tmpl.last_backward = pos
            elif isinstance(a, Transfer):
                i = a.micro_batch
                if a.kind in _SENDS:
                    route = (a.kind, a.stage, a.peer, sizes[i])
                    if route in first_sends:
                        tmpl.sends.setdefault(route[:3], []).append((pos, i))
                        continue
                    first_sends.add(route)
                    tmpl.special.append((pos, last_b))
                    last_b = -1
                else:
                    tmpl.recvs.setdefault((a.kind, a.peer), []).append((pos, i, str(a)))
            else:
                tmpl.special.append((pos, last_b))
                last_b = -1
        return tmpl

    def _recv_route(self, a: Transfer, peer: str | None, dev: _Device) -> tuple[str, int]:
        """What ``dev``'s receives of ``a``'s kind from ``peer`` share: the rest of their label after the
        template action's text (the peer, where the action names none) and the key of micro-batch 0.

        Raises:
            ScheduleError: the action names no peer and the device has no neighbour on that side.
        """
        if peer is None:
            a.named_peer()  # raises, naming the action
        assert peer is not None
        tail = f" from {peer}" if a.peer is None else ""
        got = dev.recvs[(a.kind, peer)] = (tail, self.transfer_key(a.kind is K.RECV_B, self.index[peer], dev.d, 0))
        return got

    def _compile(self, a: Action, it: int, dev: _Device) -> Op:
        """The operation of sync or step action ``a`` of ``dev`` in iteration ``it``: one method per class of
        action (computes and transfers are compiled by ``_device_ops`` itself)."""
        match a:
            case BucketSync():
                return self._bucket(a, it, dev)
            case SegmentSync():
                if a.kind is K.PUSH or a.kind is K.PULL:
                    return self._push_or_pull(a, dev)
                return self._segment_collective(a, it, dev)
            case Step():
                return OptimizerStep(str(a), dev.costs.optimizer_s, dev.costs.step_transient_bytes)
        raise ScheduleError(f"{a} on {dev.name}: the simulator compiles no {type(a).__name__} here")

    def _send(self, a: Transfer, dev: _Device) -> Op:
        """``SEND_F`` / ``SEND_B``: ``b_i x`` the output bytes per sample of the layer before the boundary.

        What does not depend on the micro-batch (the peer, the label's text, bytes per sample) is worked
        out once per (kind, stage, peer) of the device (``dev.sends``)."""
        i, name = a.micro_batch, dev.name
        route = dev.sends.get((a.kind, a.stage, a.peer))
        if route is None:
            to = a.named_peer()
            forward = a.kind is K.SEND_F
            src, dst = a.stages_joined
            peer = self.index[to]
            route = dev.sends[(a.kind, a.stage, a.peer)] = _SendRoute(
                to, peer, forward, dev.out_bytes if forward else dev.in_bytes,
                f"{a.kind.value} {src}->{dst} mb", f" {name}->{to}", "send_f" if forward else "send_b",
                self.transfer_key(not forward, dev.d, peer, 0))
        peer, forward = route.peer, route.forward
        num_bytes = dev.sizes[i] * route.bytes_per_sample
        ckey = (dev.d, peer, num_bytes)
        if ckey not in self.p2p_cache:
            a_idx, b_idx = self.cluster_index[name], self.cluster_index[route.to]
            self.p2p_cache[ckey] = (estimate_p2p_time(num_bytes, self.cluster.link(a_idx, b_idx)),
                                    edge_links(self.cluster, a_idx, b_idx, self.res))
        duration_s, links = self.p2p_cache[ckey]
        return Send(i, f"{route.label_head}{i}{route.label_tail}", route.key_base + i,
                    duration_s, links, route.kind, self.blocking)

    def _collective_id(self, key: tuple[ActionKind, int, tuple[object, ...], int], members: Sequence[str],
                       num_bytes: float, algorithm: str, label: str) -> int:
        """The number of the collective ``key``; its phases are costed when it is first named."""
        if key not in self.cids:
            self.cids[key] = len(self.collectives)
            phases = allreduce_phases(self.cluster, [self.cluster_index[o] for o in members], num_bytes,
                                      self.res, algorithm)
            self.collectives.append(CollectiveSpec(phases, [self.index[o] for o in members], label))
        return self.cids[key]

    def _bucket(self, a: BucketSync, it: int, dev: _Device) -> Op:
        """``ALLREDUCE_START`` / ``ALLREDUCE_WAIT`` of one gradient bucket among the segment's owners.

        Every owner's operation is the same record (it names no device), made when the first owner
        reaches it (``bucket_ops``): a segment of many owners and many buckets names it thousands of times."""
        key = (a.kind, a.segment, a.bucket, it)
        op = self.bucket_ops.get(key)
        if op is None:
            seg = self.segments[a.segment]
            bucket = seg.buckets[a.bucket]
            cid = self._collective_id((K.ALLREDUCE_START, a.segment, (a.bucket,), it),
                                      seg.owners, self.plan.layout.wire_bytes(bucket.param_bytes, seg),
                                      bucket.algorithm,
                                      f"ALLREDUCE seg{a.segment} bucket{a.bucket}")
            op = self.bucket_ops[key] = (BucketStart(cid, str(a), bucket) if a.kind is K.ALLREDUCE_START
                                         else BucketWait(cid, str(a)))
        if isinstance(op, BucketStart):
            self._ride_on_last_backward(dev, op)
        return op

    def _ride_on_last_backward(self, dev: _Device, start: BucketStart) -> None:
        """An ``ALLREDUCE_START`` rides on the backward before it: its bucket's gradients are final this long
        after that backward starts (the stage's layers run backwards, last layer first). Noted in
        ``dev.rides``, put on the backward once the device is compiled (``_device_ops``); the seconds are
        worked out once per bucket, stage costs and micro-batch size (``final_s``)."""
        if dev.last_backward < 0:
            raise ScheduleError(f"{start.label} on {dev.name} follows no backward")
        b_op = dev.ops[dev.last_backward]
        assert isinstance(b_op, Backward)
        i = b_op.micro_batch
        key = (id(dev.costs), dev.sizes[i], start.bucket.bounds[0])
        offset_s = self.final_s.get(key)
        if offset_s is None:
            offset_s = self.final_s[key] = _bucket_final_s(start.bucket, i, dev)
        dev.rides.setdefault(dev.last_backward, []).append((offset_s, start.collective))

    def _segment_collective(self, a: SegmentSync, it: int, dev: _Device) -> Op:
        """A collective over a whole segment: blocking, or a posted average (``AVERAGE_START`` / ``_MERGE``)."""
        k, s = a.kind, a.segment
        seg = self.segments[s]
        members = list(seg.owners)
        if k is K.LOCAL_ALLREDUCE:
            members = [o for o in members if self.node_of[o] == self.node_of[dev.name]]
        kind = K.AVERAGE if k in (K.AVERAGE_START, K.AVERAGE_MERGE) else k
        started = it
        if k is K.AVERAGE_START:
            self.last_start[(dev.d, s)] = it
        elif k is K.AVERAGE_MERGE:  # the average this device started last
            started = self.last_start[(dev.d, s)]
        algorithm = seg.algorithm if len(members) == len(seg.owners) else "ring"  # within one node: the ring
        cid = self._collective_id((kind, s, tuple(members), started), members,
                                  self.plan.layout.wire_bytes(seg.param_bytes, seg), algorithm,
                                  f"{k.value if k in COLLECTIVE_KINDS else 'AVERAGE'} seg{s}")
        if k is K.AVERAGE_START:
            return AverageStart(cid, str(a))
        if k is K.AVERAGE_MERGE:
            return AverageMerge(cid, str(a))
        return Collective(cid, str(a))

    def _push_or_pull(self, a: SegmentSync, dev: _Device) -> Op:
        """``PUSH`` joins the segment's exchange with its parameter-server shards of this wave, ``PULL`` waits
        for the exchange of wave ``wave - D`` (``links.ps_phases``: the pushes, then the weights back). The
        exchange starts when the last owner pushes, as the runtime's reduce to each shard ends only then."""
        s, name = a.segment, dev.name
        seg = self.segments[s]
        if not seg.ps_shards:
            raise ScheduleError(f"{a} on {name}: segment {s} has no parameter-server shards under sync "
                                f"{self.plan.sync}")
        hosts = ",".join(x.host for x in seg.ps_shards)
        if a.kind is K.PUSH:
            return Push(self._ps_exchange(s, dev.wave), f"PUSH seg{s} {name}->{hosts}")
        dev.pulled = True
        wave = dev.wave - self.staleness
        return Pull(self._ps_exchange(s, wave) if wave >= 0 else -1, f"PULL seg{s} {hosts}->{name}")

    def _ps_exchange(self, s: int, wave: int) -> int:
        """The number of segment ``s``'s exchange with its shards in ``wave``; costed when first named."""
        key = (K.PUSH, s, (), wave)
        if key not in self.cids:
            seg = self.segments[s]
            phases = self.exchange_phases.get(s)
            if phases is None:  # the same every wave
                owners = [self.cluster_index[o] for o in seg.owners]
                shards = [(self.cluster_index[x.host], x.fraction) for x in seg.ps_shards]
                phases = self.exchange_phases[s] = ps_phases(self.cluster, owners, shards, seg.param_bytes, self.res)
            self.cids[key] = len(self.collectives)
            members = [self.index[o] for o in seg.owners]
            self.collectives.append(CollectiveSpec(phases, members, f"PS seg{s} wave{wave}"))
        return self.cids[key]


def _bucket_final_s(bucket: Bucket, i: int, dev: _Device) -> float:
    """Seconds into micro-batch ``i``'s backward until ``bucket``'s gradients are final: the backward of the
    stage's layers from its last down to the bucket's first, with the recomputed forwards among them. A bucket
    that starts inside a layer (``Bucket.span``, ``bucket_cut = "exact"``) waits for the share of that layer's
    backward its bytes stand for (``sync_layout.backward_after``)."""
    stage = dev.stage
    start = bucket.bounds[0]
    if start <= stage.first_layer:
        return dev.costs.backward_s[i]
    f, g = dev.costs.layer_times[dev.sizes[i]]
    later = [x for x in stage.recompute if x >= bucket.first_layer]
    if bucket.span is None:
        return dev.costs.overhead_s + float(g[bucket.first_layer:stage.end_layer].sum() + f[later].sum())
    return dev.costs.overhead_s + backward_after(g, start, stage.end_layer) + float(f[later].sum())

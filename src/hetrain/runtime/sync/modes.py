"""Sync modes other than BSP: the runtime side of PUSH, PULL, AVERAGE(_START/_MERGE) and LOCAL_ALLREDUCE.

docs/sync.md describes each mode; ``hetrain.schedule.build_sync_actions`` decides
which of these actions a device runs at the end of each iteration, and this
module only carries them out. Weights of a segment are the parameters of the
layers of that segment held by this rank (a flat vector per segment)::

    LOCAL_ALLREDUCE s   gradients of s summed among its owners on this node, weighted by mini-batch
    AVERAGE s           parameters of s averaged among all owners, weighted by mini-batch (blocking)
    AVERAGE_START s     the same average posted, not waited for (DASO)
    AVERAGE_MERGE s     wait for it; x <- (2S x_local + P x_avg) / (2S + P), S iterations since the start, P owners
                        (DASO's adaptive period, and the loss sent with its averages: ``runtime.sync.daso``)
    PUSH s              this wave's update (parameters now - at the last pull) to the shard of s
    PULL s              the global weights of wave c - D or newer, plus this worker's own newer updates

Parameter servers (``wsp``, ``hybrid-ps``): segment s's server is cut into the
plan's shards (``Segment.ps_shards``: one per node that holds an owner, each a
contiguous range of the segment's flat weights sized by its node's NIC
bandwidth). Shard k lives in a thread of its host. A node's updates cross its
NIC once per shard: per shard, each node has a leader (the host on the host's
node, else ``cost.ps_node_leader``), and a leader with owners beside it on its
node runs a relay thread. Per wave c the host's thread sums its node's weighted
updates of its range (a reduce inside the node), then the other nodes' sums (a
reduce among the leaders), adds them to the range's global weights and
broadcasts them to the leaders, which hand them on inside their nodes; a relay
does the same steps for its node without keeping weights. Workers hand their
range to a thread of their own rank through a queue, or post the reduce and the
broadcast's receive to their leader (or, alone on a node, to the host) without
waiting, so a worker waits only at a PULL that needs wave c - D (the staleness
bound D, HetPipe's Wave Synchronous Parallel, Park et al. ATC 2020, Sec. 4).
Each range crosses the NIC of its host's node, and each node's NIC once, as
HetPipe's one VW per node and Kim et al.'s in-node reduce do::

    node 0 (hosts shard 0)  owner A: worker ──queue──► shard 0: reduce in node ─► reduce among leaders ─► w0 += Σ
                                                        ─► broadcast to leaders ─► broadcast in node
                            owner B: worker: post reduce(c)[r0] to A, post broadcast(c)[r0] from A
    node 1 (hosts shard 1)  owner C: worker ──queue──► relay of shard 0 for node 1: the same steps, no weights
                            owner D: worker ──queue──► shard 1 ...

Per shard one process group of its leaders and one per node of the node's
owners: a rank's threads and its worker each post to their own groups, so the
collectives of one group come in one order on every rank. hetrain's own code,
because the shards are uneven (by NIC bandwidth) and the staleness is bounded
per wave: torch has neither a parameter server nor an uneven sharding of one.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hetrain.cost import ps_node_leader
from hetrain.distributed.health import Health, PeerError
from hetrain.distributed.work import wait_work
from hetrain.errors import RunError
from hetrain.plan import Plan
from hetrain.runtime.sync.allreduce import GradientSync
from hetrain.schedule import ActionKind, SegmentSync

K = ActionKind
#: checkpoint names of a parameter server's global weights: ``ps.layers.3.weight`` (one file per parameter, whatever
#: the shards: a plan with other shards reads them back)
PS_PREFIX = "ps."
#: seconds a parameter-server shard's reduce and broadcast of one wave may stay in flight. A VW may run up to
#: D waves ahead of the slowest owner, and D waves may take any time, so a wave's collectives may wait that
#: long without anything being wrong; what bounds a stall is the worker's own wait at its PULL (``timeout_s``
#: from when it blocks, naming the peers), and a peer that dies closes its connections at once.
PS_IN_FLIGHT_S = 24 * 3600.0


def ps_routes(plan: Plan, s: int, k: int) -> tuple[str, dict[str, list[str]], dict[str, str]]:
    """Shard ``k`` of segment ``s``'s parameter server: its host, each node's owners (in node order, as the
    owners first name the nodes) and each node's leader for the shard (``cost.ps_node_leader``, which the
    cost model prices)."""
    seg = plan.segments()[s]
    index = {d.name: q for q, d in enumerate(plan.cluster.devices)}
    node_of = {d.name: d.node for d in plan.cluster.devices}
    host = seg.ps_shards[k].host
    members: dict[str, list[str]] = {}
    for o in sorted(seg.owners, key=index.__getitem__):
        members.setdefault(node_of[o], []).append(o)
    hosts = [index[x.host] for x in seg.ps_shards]
    leaders = {}
    for node, mates in members.items():
        leader = ps_node_leader([index[o] for o in mates], hosts, k)
        leaders[node] = plan.cluster.devices[leader].name
    return host, members, leaders


def build_mode_groups(plan: Plan, rank_of: Mapping[str, int], timeout_s: float) -> dict[tuple[Any, ...], Any]:
    """The process groups of ``plan.sync`` that this rank is in, keyed by (purpose, segment[, shard]), as the
    plan's sync layout has them.

    ``("local", s)``: the owners of s on this rank's node (``Segment.local_groups``: ``hybrid-ps``, ``daso``);
    for shard k of s's parameter server (``Segment.ps_shards``: ``wsp``, ``hybrid-ps``), ``("ps", s, k)``
    and ``("psb", s, k)``: its leaders, one per node (``ps_routes``), for the reduces and for the broadcasts,
    where there are two or more, and ``("psl", s, k)`` and ``("pslb", s, k)``: the owners of s on this
    rank's node, where there are two or more. Collective over the job: every rank creates
    every group, in segment and shard order.
    """
    me = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    in_flight = timedelta(seconds=max(timeout_s, PS_IN_FLIGHT_S))
    out: dict[tuple[Any, ...], Any] = {}
    for s, seg in enumerate(plan.segments()):
        for members in seg.local_groups:  # in the layout's node order, the same on every rank
            ranks = sorted(rank_of[o] for o in members)
            group = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                out[("local", s)] = group
        for k in range(len(seg.ps_shards)):
            _, by_node, leaders = ps_routes(plan, s, k)
            sets = [((purpose, s, k), sorted(rank_of[o] for o in leaders.values())) for purpose in ("ps", "psb")]
            sets += [((purpose, s, k), sorted(rank_of[o] for o in mates))
                     for mates in by_node.values() for purpose in ("psl", "pslb")]
            for key, ranks in sets:
                if len(ranks) < 2:
                    continue
                group = dist.new_group(ranks, timeout=in_flight)
                if me in ranks:
                    out[key] = group
    return out


def _flat(params: Sequence[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


def _assign(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class _Groups(NamedTuple):
    """The process groups one shard's exchange runs on at this rank: its reduces and its broadcasts each on
    groups of their own, so that a wave's reduce need not wait behind the last wave's broadcast."""

    local_reduce: Any  # the owners on this rank's node (None: alone on it)
    local_bcast: Any
    cross_reduce: Any  # the shard's leaders, one per node (None: all owners on one node)
    cross_bcast: Any


class _Shard:
    """Shard k of segment s's parameter server as this rank carries it: elements ``[lo, hi)`` of the segment's
    flat weights. Per wave: the sum of this node's updates (to this rank), then of every node's sums (to the
    host); the weights after them from the host to the leaders, then inside the node. The host (``hosting``)
    keeps the range's global weights and adds each wave's sum; a relay (another node's leader) passes the
    sums on and the weights back.

    Two threads: one sums, one hands the weights back, each on its own process groups, so wave c + 1's sums
    go out while wave c's weights come back. A NIC is full duplex: one thread for both would leave it idle
    one way while the other works, and make a wave's round trip, not its busiest direction, the pace of the
    exchange. Between nodes the sums and the weights go point to point, each leader's to the host and back
    (a star, as ``cost.estimate_ps_loads`` prices it): Gloo's ``reduce`` is a ring reduce-scatter and a
    gather to the root, which also sends half the range from the root back to the others, into the NIC
    direction that carries the other shards' weights. Inside a node, Gloo's reduce and broadcast (the
    loopback or the in-node link)."""

    def __init__(self, s: int, k: int, lo: int, hi: int, initial: torch.Tensor, groups: _Groups,
                 host_rank: int, leader_ranks: Sequence[int], hosting: bool, timeout_s: float) -> None:
        self.s, self.k, self.lo, self.hi = s, k, lo, hi
        self.others = [r for r in leader_ranks if r != host_rank]  # the leaders the host exchanges with
        self.hosting = hosting
        self.weights = initial[lo:hi].clone()
        self.groups = groups
        self.host_rank = host_rank
        self.me = dist.get_rank()
        self.timeout_s = timeout_s
        self.updates: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.summed: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.results: queue.Queue[tuple[int, torch.Tensor] | BaseException] = queue.Queue()
        self.waves = 0  # waves whose weights came back
        self.role = "parameter-server shard" if hosting else "relay to the parameter-server shard"
        self.threads = [threading.Thread(target=self._sum, name=f"hetrain-ps-seg{s}-shard{k}-sum", daemon=True),
                        threading.Thread(target=self._hand_back, name=f"hetrain-ps-seg{s}-shard{k}-back",
                                         daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout)

    def is_alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def _wait(self, work: Any, what: str, group: Any, wave: int) -> None:
        wait_work(work, f"the {what} of wave {wave} of segment {self.s} shard {self.k}",
                  dist.get_process_group_ranks(group), self.timeout_s)

    def _sum(self) -> None:
        g = self.groups
        wave = 0
        try:
            while True:
                update = self.updates.get()
                if update is None:
                    return
                if g.local_reduce is not None:
                    self._wait(dist.reduce(update, dst=self.me, group=g.local_reduce, async_op=True),
                               "reduce inside the node", g.local_reduce, wave)
                if g.cross_reduce is not None and self.hosting:
                    got = [torch.empty_like(update) for _ in self.others]
                    works = [dist.irecv(buf, src=r, group=g.cross_reduce)
                             for buf, r in zip(got, self.others, strict=True)]
                    for work in works:
                        self._wait(work, "sums from the other nodes", g.cross_reduce, wave)
                    for buf in got:
                        update += buf
                elif g.cross_reduce is not None:
                    self._wait(dist.isend(update, dst=self.host_rank, group=g.cross_reduce),
                               "sum sent to the host", g.cross_reduce, wave)
                if self.hosting:
                    self.weights += update
                    self.summed.put(self.weights.clone())
                else:
                    self.summed.put(torch.empty_like(update))
                wave += 1
        except BaseException as e:  # handed to the worker, which names the peers
            self.results.put(e)
        finally:
            self.summed.put(None)

    def _hand_back(self) -> None:
        g = self.groups
        try:
            while True:
                out = self.summed.get()
                if out is None:
                    return
                if g.cross_bcast is not None and self.hosting:
                    works = [dist.isend(out, dst=r, group=g.cross_bcast) for r in self.others]
                    for work in works:
                        self._wait(work, "weights sent to the other nodes", g.cross_bcast, self.waves)
                elif g.cross_bcast is not None:
                    self._wait(dist.irecv(out, src=self.host_rank, group=g.cross_bcast),
                               "weights from the host", g.cross_bcast, self.waves)
                if g.local_bcast is not None:
                    self._wait(dist.broadcast(out, src=self.me, group=g.local_bcast, async_op=True),
                               "broadcast inside the node", g.local_bcast, self.waves)
                self.results.put((self.waves, out))
                self.waves += 1
        except BaseException as e:
            self.results.put(e)


class ModeSync:
    """Carries out one rank's non-BSP sync actions.

    Args:
        plan: the plan (its ``sync`` and ``options``).
        device: this rank's device.
        sync: the stage's gradient buffers (they list the segment's parameters).
        seg_groups: from ``build_segment_groups`` (all owners of a segment).
        mode_groups: from ``build_mode_groups``.
        rank_of: device -> rank.
        health: names peers in errors.
        timeout_s: the longest one wait may take.
    """

    def __init__(self, plan: Plan, device: str, sync: GradientSync, seg_groups: Mapping[tuple[str, ...], Any],
                 mode_groups: Mapping[tuple[Any, ...], Any], rank_of: Mapping[str, int], health: Health,
                 timeout_s: float) -> None:
        self.plan = plan
        self.device = device
        self.health = health
        self.rank_of = dict(rank_of)
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.opts = plan.sync_options
        self.mode = plan.sync_mode
        self.segments = plan.segments()
        self.seg_groups = dict(seg_groups)
        self.mode_groups = dict(mode_groups)
        self.params: dict[int, list[nn.Parameter]] = {
            s: [p for _, placed in entries for p, _ in placed] for s, entries in sync.buffers.items()}
        self.grads = sync.buffers
        mini = {dev: plan.virtual_workers[plan.stage_of(dev)[0]].mini_batch for dev in plan.devices_used}
        node_of = {d.name: d.node for d in plan.cluster.devices}
        n = plan.global_batch
        self.share = mini[device] / n  # this VW's share of the global batch
        # weights of this device's contribution, per segment
        self.local_weight: dict[int, float] = {}
        self.push_weight: dict[int, float] = {}
        for s, seg in enumerate(self.segments):
            if device not in seg.owners:
                continue
            mates = [o for o in seg.owners if node_of[o] == node_of[device]]
            node_samples = sum(mini[o] for o in mates)
            self.local_weight[s] = mini[device] / node_samples
            # a local mean (hybrid-ps): every node mate holds the same node update; together they push it once,
            # weighted by the node
            self.push_weight[s] = (node_samples / n / len(mates)) if self.mode.local_mean else self.share
        self.node_shared = set(plan.layout.local_segments(device))
        # parameter servers: per segment s, its shards k (``Segment.ps_shards``), each elements bounds[s][k]
        self.wave = 0
        self.bounds: dict[int, list[tuple[int, int]]] = {}  # s -> [lo, hi) of each shard
        self.shards: dict[tuple[int, int], _Shard] = {}  # (s, k) -> the shard this rank hosts or relays
        # (s, k) -> (reduce group, broadcast group, rank, point to point) this worker posts to
        self.routes: dict[tuple[int, int], tuple[Any, Any, int, bool]] = {}
        # (s, k) -> (wave, reduce, bcast, buf) posted to a shard another rank hosts
        self.pending: dict[tuple[int, int], deque[tuple[int, Any, Any, torch.Tensor]]] = {}
        self.own: dict[int, dict[int, torch.Tensor]] = {}  # s -> wave -> own update not yet in every shard's weights
        self.global_wave: dict[tuple[int, int], int] = {}  # (s, k) -> newest wave of its global weights on hand
        self.global_weights: dict[tuple[int, int], torch.Tensor] = {}  # (s, k) -> those weights
        self.base: dict[int, torch.Tensor] = {}  # s -> parameters at the last push or pull
        self.max_lead_waves = 0
        self.lead_checks = 0
        if self.mode.parameter_servers:
            for s, ps in self.params.items():
                if not self.segments[s].ps_shards:
                    continue
                self.base[s] = _flat(ps)
                self.own[s] = {}
                self.bounds[s] = self.segments[s].ps_bounds(self.base[s].numel())
                for k, (lo, hi) in enumerate(self.bounds[s]):
                    self.global_wave[(s, k)] = -1
                    self.global_weights[(s, k)] = self.base[s][lo:hi].clone()
                    host, _, leaders = ps_routes(plan, s, k)
                    node = node_of[device]
                    groups = _Groups(*(self.mode_groups.get((p, s, k)) for p in ("psl", "pslb", "ps", "psb")))
                    if leaders[node] == device and (host == device or groups.local_reduce is not None):
                        shard = _Shard(s, k, lo, hi, self.base[s], groups, rank_of[host],
                                       [rank_of[o] for o in leaders.values()], host == device,
                                       max(timeout_s, PS_IN_FLIGHT_S))
                        shard.start()
                        self.shards[(s, k)] = shard
                    elif leaders[node] == device:  # alone on its node: straight to the host, point to point
                        self.routes[(s, k)] = (groups.cross_reduce, groups.cross_bcast, rank_of[host], True)
                        self.pending[(s, k)] = deque()
                    else:  # to the node's leader
                        self.routes[(s, k)] = (groups.local_reduce, groups.local_bcast, rank_of[leaders[node]],
                                               False)
                        self.pending[(s, k)] = deque()
        # daso
        self.started: dict[int, tuple[int, Any, torch.Tensor]] = {}  # s -> (iteration, work, buffer)

    def _host(self, s: int, k: int) -> str:
        """The device that keeps shard ``k`` of segment ``s``'s parameter server (the plan's ``Segment.ps_shards``)."""
        shards = self.segments[s].ps_shards
        if k >= len(shards):
            raise RunError(f"segment {s} has no parameter-server shard {k} under sync {self.plan.sync}")
        return shards[k].host

    # --- dispatch ------------------------------------------------------------------

    def run(self, a: SegmentSync, step: int, where: object) -> None:
        s = a.segment
        if a.kind is K.LOCAL_ALLREDUCE:
            self._local_allreduce(s, where)
        elif a.kind is K.AVERAGE:
            self._average(s, where)
        elif a.kind is K.AVERAGE_START:
            self._average_start(s, step)
        elif a.kind is K.AVERAGE_MERGE:
            self._average_merge(s, step, where)
        elif a.kind is K.PUSH:
            self._push(s)
        elif a.kind is K.PULL:
            self._pull(s, where)
        else:
            raise ValueError(f"{a} is not a sync-mode action")

    # --- averaging --------------------------------------------------------------------

    def _peers(self, s: int) -> list[int]:
        return sorted(self.rank_of[o] for o in self.segments[s].owners)

    def _wait(self, work: Any, s: int, what: object, peers: Sequence[int]) -> None:
        self.health.wait(work, f"{what} of segment {s}", peers, self.timeout_s)

    def _local_allreduce(self, s: int, where: object) -> None:
        """Gradients of segment s: the mini-batch-weighted mean among the owners on this node."""
        if s not in self.node_shared or s not in self.grads:
            return
        group = self.mode_groups[("local", s)]
        w = self.local_weight[s]
        node_of = {d.name: d.node for d in self.plan.cluster.devices}
        peers = sorted(self.rank_of[o] for o in self.segments[s].owners if node_of[o] == node_of[self.device])
        for flat, placed in self.grads[s]:
            GradientSync._repoint(placed)
            flat.mul_(w)
            self._wait(dist.all_reduce(flat, group=group, async_op=True), s, where, peers)

    def _weighted(self, s: int) -> torch.Tensor:
        return _flat(self.params[s]) * self.share

    def _average(self, s: int, where: object) -> None:
        if s not in self.params:
            return
        buf = self._weighted(s)
        self._wait(dist.all_reduce(buf, group=self.seg_groups[self.segments[s].owners], async_op=True), s, where,
                   self._peers(s))
        _assign(self.params[s], buf)

    def _average_start(self, s: int, step: int) -> None:
        if s not in self.params:
            return
        buf = self._weighted(s)
        work = dist.all_reduce(buf, group=self.seg_groups[self.segments[s].owners], async_op=True)
        self.started[s] = (step, work, buf)

    def _average_merge(self, s: int, step: int, where: object) -> None:
        """DASO's merge of a global average that arrives S iterations late (Coquelin et al., J. Big Data 2022,
        Sec. "Global synchronization"): the P participants' parameters count once each, the local parameters,
        which went on training for S iterations, count 2S times: ``x = (2S x_local + P x_avg) / (2S + P)``.
        The staler the average, the more the local parameters weigh; S = 0 (merged at once) counts them once."""
        if s not in self.started:
            return
        started, work, buf = self.started.pop(s)
        self._wait(work, s, where, self._peers(s))
        local_weight = 2.0 * (step - started) if step > started else 1.0
        p = len(self.segments[s].owners)
        _assign(self.params[s], (local_weight * _flat(self.params[s]) + p * buf) / (local_weight + p))

    # --- parameter servers -------------------------------------------------------------

    def _push(self, s: int) -> None:
        """Post this wave's update of segment s (weighted by its share) to its shards, each its range."""
        if s not in self.base:
            return
        now = _flat(self.params[s])
        update = now - self.base[s]
        self.base[s] = now
        self.own[s][self.wave] = update
        weighted = update * self.push_weight[s]
        for k, (lo, hi) in enumerate(self.bounds[s]):
            part = weighted[lo:hi]  # a contiguous view: each range goes to one collective only
            if (s, k) in self.shards:
                self.shards[(s, k)].updates.put(part)
                continue
            reduce_group, bcast_group, root, p2p = self.routes[(s, k)]
            got = torch.empty_like(part)
            if p2p:
                reduce = dist.isend(part, dst=root, group=reduce_group)
                bcast = dist.irecv(got, src=root, group=bcast_group)
            else:
                reduce = dist.reduce(part, dst=root, group=reduce_group, async_op=True)
                bcast = dist.broadcast(got, src=root, group=bcast_group, async_op=True)
            self.pending[(s, k)].append((self.wave, reduce, bcast, got))

    def _newest(self, s: int, k: int, need: int, where: object) -> tuple[int, torch.Tensor] | None:
        """Shard k of segment s's newest global weights on hand that this rank has not taken yet, waiting for
        wave ``need`` at least; None where nothing newer has come and nothing is needed."""
        newest: tuple[int, torch.Tensor] | None = None
        host = self._host(s, k)
        shard = self.shards.get((s, k))
        if shard is not None:
            while True:
                block = (newest[0] if newest is not None else self.global_wave[(s, k)]) < need
                try:
                    got = shard.results.get(timeout=self.timeout_s) if block else shard.results.get_nowait()
                except queue.Empty:
                    if block:
                        raise self.health.peer_error(
                            f"{where}: the {shard.role} {k} of segment {s} on {self.device} got no "
                            f"update of wave {need} from every owner within {self.timeout_s:g} s",
                            self._peers(s)) from None
                    break
                if isinstance(got, BaseException):
                    raise self.health.peer_error(
                        f"{where}: the {shard.role} {k} of segment {s} on {self.device} lost a worker "
                        f"(reduce or broadcast of wave {shard.waves} failed or timed out, {self.timeout_s:g} s)",
                        self._peers(s), got) from None
                newest = got
            return newest
        pending = self.pending[(s, k)]
        while pending and (pending[0][0] <= need or pending[0][2].is_completed()):
            wave, reduce, bcast, got_buf = pending.popleft()
            for work in (reduce, bcast):
                self.health.wait(work, f"{where}: pushing to / pulling from the parameter-server shard {k} of "
                                       f"segment {s} on {host} (wave {wave})", self._peers(s), self.timeout_s)
            newest = (wave, got_buf)
        return newest

    def _pull(self, s: int, where: object) -> None:
        """Take the newest global weights of s on hand from each of its shards, waiting for wave ``wave - D``
        at least; add this worker's own updates that a shard's weights do not hold yet."""
        if s not in self.base:
            return
        need = self.wave - self.opts.staleness
        fresh = False
        for k in range(len(self.bounds[s])):
            newest = self._newest(s, k, need, where)
            if newest is not None:
                self.global_wave[(s, k)], self.global_weights[(s, k)] = newest
                fresh = True
        if not fresh:
            return
        own = self.own[s]
        waves = [self.global_wave[(s, k)] for k in range(len(self.bounds[s]))]
        for c in [c for c in own if c <= min(waves)]:
            del own[c]
        local = torch.empty_like(self.base[s])
        for k, (lo, hi) in enumerate(self.bounds[s]):
            part = local[lo:hi]
            part.copy_(self.global_weights[(s, k)])
            for c, update in own.items():  # own updates this shard's global weights do not hold yet
                if c > waves[k]:
                    part += update[lo:hi]
        _assign(self.params[s], local)
        self.base[s] = local

    def end_wave(self) -> None:
        """After the last PULL of a wave: how far ahead of the slowest owner of its segments this rank may be.

        A shard's global weights of wave c hold every owner's update of wave c, so every owner has computed
        at least ``c + 1`` waves, c the oldest wave among the shards on hand. The lead counted from it is
        an upper bound on the true lead, and the PULL's wait keeps it at most D. Nothing crosses the network
        for it: the clocks this replaced (a store write at each push, a read of every owner's clock at each
        wave) put a store round trip on the critical path of every wave, and over a slow link shared with
        the exchange those waited behind the wave's bytes (0.2 s of a 0.58 s wave at 100 Mbit/s; RESULTS,
        "WSP without the store on its critical path"). ``tests/distributed/test_relaxed_stall.py`` checks the
        bound by the clock: no step starts further ahead of a stalled worker than D allows.
        """
        if not self.base:
            return
        self.wave += 1
        oldest = min(self.global_wave.values())
        self.max_lead_waves = max(self.max_lead_waves, self.wave - (oldest + 1))
        self.lead_checks += 1

    def _drain(self, where: object) -> None:
        """Merge a DASO average in flight; wait until every wave this rank pushed is in the global weights
        it holds, keeping its local steps since the last push."""
        for s in list(self.started):
            self._average_merge(s, self.started[s][0] + 1, where)
        saved = self.opts
        try:
            from dataclasses import replace

            self.opts = replace(self.opts, staleness=0)
            self.wave -= 1  # the last wave pushed
            for s in self.base:
                if self.wave >= 0 and min(self.global_wave[(s, k)] for k in range(len(self.bounds[s]))) < self.wave:
                    drift = _flat(self.params[s]) - self.base[s]  # local steps since the last push: kept
                    self._pull(s, where)
                    _assign(self.params[s], self.base[s] + drift)
        finally:
            self.wave += 1
            self.opts = saved

    def finish(self, where: object) -> None:
        """Wait for every wave in flight and take the final global weights; stop the shard threads."""
        try:
            self._drain(where)
        finally:
            for shard in self.shards.values():
                shard.updates.put(None)
            for shard in self.shards.values():
                shard.join(timeout=self.timeout_s)

    # --- checkpoints -------------------------------------------------------------------

    def checkpoint_state(self, module: nn.Module, where: object) -> dict[str, torch.Tensor]:
        """Bring the mode to a state a checkpoint can hold, and return the parameter servers' weights this rank
        writes.

        Every owner does this at the same step: where pushes come every few iterations (``hybrid-ps``) it
        first pushes its local steps since the last push (one extra wave), then every owner waits until every
        shard's global weights hold all pushed waves (as at the end of training) and a DASO average in flight is
        merged. Every owner of a segment then holds its whole global weights (each shard's range, as its host
        broadcast them); the host of the segment's first shard returns them under ``ps.<parameter name>``
        (``PS_PREFIX``), one file per parameter, whatever the shards, so that a plan sharded otherwise reads
        them back (``restore_state``).
        """
        if self.mode.parameter_servers and not self.mode.same_every_iteration and self.base:
            for s in sorted(self.base, reverse=True):
                self._push(s)
            self.wave += 1
        self._drain(where)
        name_of = {id(p): n for n, p in module.named_parameters()}
        out: dict[str, torch.Tensor] = {}
        for s, weights in self.base.items():
            if self._host(s, 0) != self.device:
                continue
            offset = 0
            for p in self.params[s]:
                out[PS_PREFIX + name_of[id(p)]] = weights[offset:offset + p.numel()].view_as(p).detach().cpu()
                offset += p.numel()
        return out

    def restore_state(self, module: nn.Module, directory: str | Path, step: int) -> list[int]:
        """After the module's weights are loaded from checkpoint ``step``: the parameter servers' global weights
        from it.

        Every owner of a segment reads them (its base for the next push, and each shard's weights on hand);
        each shard's host also puts its range in its shard. A checkpoint without them (written under another
        mode) leaves the global weights equal to the loaded ones. Returns the segments whose server state was
        found.
        """
        if not self.base:
            return []
        from hetrain.runtime.state.checkpoint import load_checkpoint, load_manifest

        held = load_manifest(directory, step)["tensors"]
        name_of = {id(p): n for n, p in module.named_parameters()}
        found = []
        for s in self.base:
            names = [PS_PREFIX + name_of[id(p)] for p in self.params[s]]
            weights = _flat(self.params[s])
            if names and all(n in held for n in names):
                tensors, _, _ = load_checkpoint(directory, names, step)
                weights = torch.cat([tensors[n].reshape(-1) for n in names]).to(weights)
                found.append(s)
            self.base[s] = weights.clone()
            for k, (lo, hi) in enumerate(self.bounds[s]):
                self.global_weights[(s, k)] = weights[lo:hi].clone()
                if (s, k) in self.shards and self.shards[(s, k)].hosting:
                    self.shards[(s, k)].weights.copy_(weights[lo:hi])
        return found

    def close(self) -> None:
        for shard in self.shards.values():
            if shard.is_alive():
                shard.updates.put(None)


__all__ = ["PS_PREFIX", "ModeSync", "PeerError", "build_mode_groups", "ps_routes"]

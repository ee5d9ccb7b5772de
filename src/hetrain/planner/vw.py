"""Evaluate one virtual worker: best device order, partition and micro-batching.

A VW is scored as a function of its mini-batch ``B``: for each candidate
micro-batch size ``b``, ``m = ceil(B / b)`` micro-batches, and the best
partition over the best device order. VWs with the same device types, node
pattern and links share one evaluator (``vw_signature``), so a 1024-device
cluster of identical nodes costs a handful of searches, not hundreds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.cost import most_in_flight
from hetrain.planner.partition import PartitionResult, partition
from hetrain.planner.stage_cost import StageTableCache
from hetrain.profile import ModelProfile

INF = float("inf")


def vw_signature(cluster: Cluster, group: Sequence[int]) -> tuple[object, ...]:
    """What determines a VW's costs: device figures, node pattern and links, in canonical order."""
    devs = sorted(group, key=lambda d: (int(cluster.node_index[d]), cluster.devices[d].type_name, d))
    relabel: dict[int, int] = {}
    kinds = []
    for d in devs:
        dev = cluster.devices[d]
        node = relabel.setdefault(int(cluster.node_index[d]), len(relabel))
        kinds.append((node, dev.type_name, dev.peak_fp32_flops, dev.peak_fp16_flops, dev.memory_bytes,
                      dev.memory_bandwidth_bytes_per_s))
    # the links between every ordered pair, as bytes (the diagonal, a device to itself, left out as 0)
    idx = np.ix_(devs, devs)
    bandwidth, latency = cluster.bandwidth_bytes_per_s[idx], cluster.latency_s[idx]
    np.fill_diagonal(bandwidth, 0.0)
    np.fill_diagonal(latency, 0.0)
    return (tuple(kinds), bandwidth.tobytes(), latency.tobytes())


def vw_shape(cluster: Cluster, group: tuple[int, ...]) -> tuple[tuple[object, ...], tuple[Device, ...]]:
    """(``vw_signature``, ``canonical_devices``) of ``group``, kept on the cluster: every search screens and
    searches the same formations again, and ``hetrain plan`` searches three times (with and without sharded
    state, and pure data parallelism), 4096 VWs a formation at 4096 devices. Equal signatures are kept once."""
    shapes: dict[tuple[int, ...], tuple[tuple[object, ...], tuple[Device, ...]]] = \
        cluster.__dict__.setdefault("_vw_shape_cache", {})
    found = shapes.get(group)
    if found is None:
        signatures: dict[tuple[object, ...], tuple[object, ...]] = cluster.__dict__.setdefault("_vw_signatures", {})
        sig = vw_signature(cluster, group)
        found = shapes[group] = (signatures.setdefault(sig, sig), tuple(canonical_devices(cluster, group)))
    return found


def canonical_devices(cluster: Cluster, group: Sequence[int]) -> list[Device]:
    """The VW's devices in the canonical order of ``vw_signature``."""
    devs = sorted(group, key=lambda d: (int(cluster.node_index[d]), cluster.devices[d].type_name, d))
    return [cluster.devices[d] for d in devs]


def _multiset_permutations(items: list[int]) -> Iterator[tuple[int, ...]]:
    """Distinct permutations of a list with repeated values (lexicographic, no duplicates)."""
    a = sorted(items)
    while True:
        yield tuple(a)
        i = len(a) - 2
        while i >= 0 and a[i] >= a[i + 1]:
            i -= 1
        if i < 0:
            return
        j = len(a) - 1
        while a[j] <= a[i]:
            j -= 1
        a[i], a[j] = a[j], a[i]
        a[i + 1:] = reversed(a[i + 1:])


def _distinct_orders(n_by_class: list[int]) -> int:
    total = math.factorial(sum(n_by_class))
    for c in n_by_class:
        total //= math.factorial(c)
    return total


def _positions_orders(positions: list[int], labels: list[int], limit: int) -> list[tuple[int, ...]] | None:
    """Every distinct order of ``positions`` (devices with equal labels are interchangeable).

    None if there are more than ``limit`` of them.
    """
    sub = [labels[q] for q in positions]
    counts = [sub.count(c) for c in dict.fromkeys(sub)]
    if _distinct_orders(counts) > limit:
        return None
    members: dict[int, list[int]] = {}
    for q in positions:
        members.setdefault(labels[q], []).append(q)
    orders = []
    for perm in _multiset_permutations(sub):
        used: dict[int, int] = {}
        order = []
        for c in perm:
            order.append(members[c][used.get(c, 0)])
            used[c] = used.get(c, 0) + 1
        orders.append(tuple(order))
    return orders


def candidate_orders(cluster: Cluster, devices: Sequence[Device], num_layers: int,
                     budget: float, exhaustive_limit: int = 120) -> list[tuple[int, ...]]:
    """Device orders (as positions into ``devices``) to try for the pipeline.

    Devices of the same type on the same node are interchangeable. When the
    distinct orders are few (at most ``exhaustive_limit``, and orders x p x L^2
    DP cells within ``budget``) all are tried, which makes the search exact over orders.
    Otherwise the devices of a node stay together (interleaving nodes only adds
    slow inter-node boundaries): every order of up to 4 nodes, or chains along
    the fastest next link from 4 starting nodes; inside a node, every order of
    up to 6 distinct devices, else larger memory first (1F1B's early stages hold
    more micro-batches) or faster first.
    """
    p = len(devices)
    cls: dict[tuple[object, ...], int] = {}
    labels = [cls.setdefault((d.node, d.type_name, d.memory_bytes, d.peak_fp32_flops, d.peak_fp16_flops,
                              d.memory_bandwidth_bytes_per_s), len(cls)) for d in devices]
    counts = [labels.count(c) for c in range(len(cls))]
    total = _distinct_orders(counts)
    if total <= exhaustive_limit and total * p * num_layers**2 <= budget:
        every = _positions_orders(list(range(p)), labels, exhaustive_limit)
        assert every is not None
        return every
    nodes: dict[str, list[int]] = {}
    for pos, d in enumerate(devices):
        nodes.setdefault(d.node, []).append(pos)
    names = list(nodes)

    def bw(a: str, b: str) -> float:
        return float(cluster.bandwidth_bytes_per_s[devices[nodes[a][0]].index, devices[nodes[b][0]].index])

    chains: list[list[str]]
    if len(names) <= 4:
        chains = [list(c) for c in itertools.permutations(names)]
    else:
        chains = []
        for start in names[:4]:
            chain = [start]
            left = [n for n in names if n != start]
            while left:
                nxt = max(left, key=lambda n: bw(chain[-1], n))
                chain.append(nxt)
                left.remove(nxt)
            chains += [chain, chain[::-1]]
    inside: dict[str, list[tuple[int, ...]]] = {}
    for n, members in nodes.items():
        every_inside = _positions_orders(members, labels, 6)
        if every_inside is None:
            by_mem = tuple(sorted(members, key=lambda q: (-devices[q].memory_bytes, -devices[q].peak_fp32_flops)))
            by_speed = tuple(sorted(members, key=lambda q: (-devices[q].peak_fp32_flops, -devices[q].memory_bytes)))
            every_inside = list(dict.fromkeys([by_mem, by_speed]))
        inside[n] = every_inside
    combos = 1
    for v in inside.values():
        combos *= len(v)
    if combos * len(chains) > 64:
        inside = {n: v[:1] for n, v in inside.items()}
    orders: dict[tuple[int, ...], None] = {}
    for chain in chains:
        for parts in itertools.product(*(inside[n] for n in chain)):
            orders[tuple(q for part in parts for q in part)] = None
    return list(orders)


def micro_batch_candidates(limit: int, fixed: Sequence[int] | None) -> list[int]:
    """Micro-batch sizes to try: the user's, or powers of two up to ``limit``."""
    if fixed:
        return sorted({b for b in fixed if b >= 1})
    out = [1]
    while out[-1] * 2 <= max(1, limit):
        out.append(out[-1] * 2)
    return out


@dataclass
class VWEvaluator:
    """Scores one VW shape for any mini-batch; caches partitions by (b, m)."""

    cluster: Cluster
    profile: ModelProfile
    devices: list[Device]
    schedule: str
    optimizer: str
    allow_recompute: bool
    order_budget: float
    max_caps: int
    micro_batch_sizes: Sequence[int] | None
    cache: StageTableCache = field(default_factory=StageTableCache)
    exhaustive_orders: int = 120
    blocking: bool = False  # the runtime's transfers hold sender and receiver (sync option ``transfers``)
    reduce_copy: float = 0.0  # bf16 gradient copies per gradient byte at the step (partition; 0: none shared)
    shares: tuple[float, ...] = (1.0, 1.0)  # (optimizer state, gradients) a stage keeps where sharded
    _orders: list[tuple[int, ...]] | None = None
    _cache: dict[tuple[int, int, bool], PartitionResult | None] = field(default_factory=dict)
    _coarse: dict[tuple[int, int], PartitionResult | None] = field(default_factory=dict)
    _parts: dict[tuple[tuple[int, ...], int, int, bool], PartitionResult | None] = field(default_factory=dict)
    _refined: dict[tuple[int, bool, int], PartitionResult | None] = field(default_factory=dict)

    def orders(self) -> list[tuple[int, ...]]:
        if self._orders is None:
            self._orders = candidate_orders(self.cluster, self.devices, self.profile.num_layers, self.order_budget,
                                            self.exhaustive_orders)
        return self._orders

    def _partition(self, order: tuple[int, ...], b: int, m: int, fast: bool) -> PartitionResult | None:
        # A screening partition depends on m only through the stage tables, and under
        # 1F1B those are the same for every m >= p (stage j holds min(m, p - j)): share it.
        most = most_in_flight(self.schedule, len(self.devices))
        shared_m = min(m, most) if fast and most is not None else m
        key = (order, b, shared_m, fast)
        if key not in self._parts:
            self._parts[key] = self._partition_uncached(order, b, m, fast)
        r = self._parts[key]
        return r if r is None or r.m == m else replace(r, m=m)

    def _partition_uncached(self, order: tuple[int, ...], b: int, m: int, fast: bool) -> PartitionResult | None:
        return partition(self.cluster, self.profile, [self.devices[q] for q in order], b, m, self.schedule,
                         self.optimizer, self.allow_recompute, 1 if fast else self.max_caps, self.cache,
                         full_recompute=fast, blocking=self.blocking, reduce_copy=self.reduce_copy,
                         shares=self.shares)

    def best(self, b: int, m: int, fast: bool = False) -> PartitionResult | None:
        """Best partition over candidate orders at micro-batch ``b`` and ``m`` micro-batches.

        Exact over every candidate order, bottleneck cap and greedy recompute set.
        ``fast`` screens instead: two device orders, the min-max bottleneck cap only,
        and full recomputation where a stage needs any (an upper bound).
        """
        key = (b, m, fast)
        if key not in self._cache:
            best: PartitionResult | None = None
            for order in self.orders()[:2] if fast else self.orders():
                r = self._partition(order, b, m, fast)
                if r is not None and (best is None or r.pipeline_s < best.pipeline_s):
                    best = r
            self._cache[key] = best
        return self._cache[key]

    def coarse(self, b: int, m_ref: int) -> PartitionResult | None:
        """Partition used to estimate time against mini-batch before the batch split.

        For 1F1B it is computed at ``m >= p`` (the most activation memory a stage
        ever holds: ``cost.most_in_flight``), so it stays memory-feasible for any m.
        """
        most = most_in_flight(self.schedule, len(self.devices))
        m = max(m_ref, most) if most is not None else m_ref
        # keyed by m too: the best of the screened orders depends on m, and the VWs that share this evaluator
        # ask with their own m_ref, so a key of b alone kept whichever asked first (the search's call order)
        key = (b, m)
        if key not in self._coarse:
            self._coarse[key] = self.best(b, m, fast=True)
        return self._coarse[key]

    def estimate_time(self, mini_batch: int, m_ref: int) -> float:
        """Closed-form pipeline seconds for ``mini_batch`` from the coarse partitions.

        The mini-batch is cut as the runtime cuts it (``_b_m``: m = ceil(B / b) micro-batches sized
        evenly, ``B mod m`` of them one sample larger), and each micro-batch is priced at its own size:
        warm-up and cool-down at the larger size, then every micro-batch through the bottleneck. So the
        time grows with every sample, not only where m does, and the batch split (``search._split_batch``,
        which gives each sample to the VW that finishes soonest with it) sees 16 + 16 as faster than
        17 + 15 where both cut into micro-batches of at most 3, and a size beyond the mini-batch as the
        mini-batch itself.
        """
        best = INF
        for b in micro_batch_candidates(mini_batch, self.micro_batch_sizes):
            size, m = self._b_m(mini_batch, b)
            large = mini_batch - m * (size - 1)  # micro-batches of ``size``; the other m - large hold size - 1
            r = self._priced(size, m_ref)
            small = self._priced(size - 1, m_ref) if large < m else r
            if r is None or small is None:
                continue
            sum_s, max_s, held = r
            if self.schedule == "gpipe" and m > held:
                continue  # GPipe holds all m micro-batches: not checked beyond the coarse partition's m
            best = min(best, sum_s - max_s + large * max_s + (m - large) * small[1])
        return best

    def _priced(self, size: int, m_ref: int) -> tuple[float, float, int] | None:
        """(sum_s, max_s, m) of a coarse partition at micro-batch ``size``: its own at a power of two or a size
        the user fixed, else interpolated linearly between the powers of two around it, or extrapolated along
        the line through the two below it where the one above does not fit (one coarse partition per power of
        two, not one per size the batch split walks through; ``refine`` partitions the sizes it keeps exactly,
        memory included); None where none fits."""
        lo = 1 << (size.bit_length() - 1)
        if size == lo or size in (self.micro_batch_sizes or ()):
            r = self.coarse(size, m_ref)
            return None if r is None else (r.sum_s, r.max_s, r.m)
        below = self.coarse(lo, m_ref)
        if below is None:
            return None
        base = self.coarse(2 * lo, m_ref)
        if base is not None:
            w = (size - lo) / lo  # between lo and 2 lo
        else:
            base = self.coarse(lo // 2, m_ref) if lo >= 2 else None
            if base is None:
                return None
            w = -(size - lo) / (lo // 2)  # beyond lo, along the line from lo / 2
        return ((1 - w) * below.sum_s + w * base.sum_s, (1 - w) * below.max_s + w * base.max_s,
                min(below.m, base.m))

    def refine(self, mini_batch: int, fast: bool = False, shortlist: int = 3) -> PartitionResult | None:
        """Best (b, m, partition) for ``mini_batch``: m = ceil(B / b), sized evenly.

        ``fast``: screening partitions (see ``best``). Otherwise every (b, order)
        is screened and the ``shortlist`` best are searched exactly. Memoised: the
        VWs of a formation that share this evaluator mostly get the same mini-batch.
        """
        key = (mini_batch, fast, shortlist)
        if key not in self._refined:
            self._refined[key] = self._refine(mini_batch, fast, shortlist)
        return self._refined[key]

    def _refine(self, mini_batch: int, fast: bool, shortlist: int) -> PartitionResult | None:
        if fast:
            found = [self.best(*self._b_m(mini_batch, b), fast=True)
                     for b in micro_batch_candidates(mini_batch, self.micro_batch_sizes)]
            return min((r for r in found if r is not None), key=lambda r: r.pipeline_s, default=None)
        # the two most promising micro-batch sizes by screening, then every order at those
        sizes = sorted(micro_batch_candidates(mini_batch, self.micro_batch_sizes),
                       key=lambda b: r.pipeline_s if (r := self.best(*self._b_m(mini_batch, b), fast=True)) else INF)
        screened: list[tuple[float, tuple[int, ...], int, int]] = []
        for b in sizes[:2]:
            b_eff, m = self._b_m(mini_batch, b)
            for order in self.orders():
                r = self._partition(order, b_eff, m, fast=True)
                if r is not None:
                    screened.append((r.pipeline_s, order, b_eff, m))
        screened.sort(key=lambda x: x[0])
        best: PartitionResult | None = None
        for _, order, b_eff, m in screened[:shortlist]:
            r = self._partition(order, b_eff, m, fast=False)
            if r is not None and (best is None or r.pipeline_s < best.pipeline_s):
                best = r
        return best

    @staticmethod
    def _b_m(mini_batch: int, b: int) -> tuple[int, int]:
        """(micro-batch size, count) for a mini-batch cut into micro-batches of at most b."""
        m = -(-mini_batch // b)
        return -(-mini_batch // m), m

"""Partition a model over the ordered devices of one virtual worker.

Given devices ``d_0 .. d_{p-1}`` in pipeline order, micro-batch size ``b`` and
``m`` micro-batches, choose cuts ``0 = k_0 < k_1 < ... < k_p = L`` minimising the
pipeline's iteration time (cost.estimate_pipeline_time)::

    f = sum_j t_j + sum_j c_j + (m - 1) * max(t_j, c_j)

where ``t_j`` is stage j's forward + backward time (with recomputation where
memory requires it) and ``c_j`` the activation + gradient transfer over the
actual link between positions j-1 and j (Pipe-Torch's point: cut where the
link is fast or the activation small).

``f`` mixes a sum and a max, so a single min-sum or min-max DP is not exact.
We enumerate the bottleneck: for a cap ``T`` on every stage and transfer, a
min-sum DP over (position, layer) gives ``S(T)``; the answer is
``min_T S(T) + (m - 1) * T`` over candidate caps ``T``, the distinct stage and
transfer times. Caps are tried in increasing order from the min-max bottleneck
``T*`` and the search stops once ``S(inf) + (m - 1) * T`` cannot beat the best
(the same early stop as Alpa's stage DP, Zheng et al. OSDI 2022, sec. 5.2).
This is exact when all caps are tried; beyond ``max_caps`` caps, the remaining
caps are sampled geometrically (reported in ``PartitionResult.exact``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.planner.stage_cost import (
    INF,
    StageCosts,
    StageTableCache,
    build_model_arrays,
    build_stage_costs,
    link_time_table,
)
from hetrain.profile import ModelProfile


@dataclass(frozen=True)
class PartitionResult:
    """The best cuts for one device order.

    Attributes:
        cuts: ``(k_0=0, k_1, ..., k_p=L)``.
        recompute: per stage, its recompute set.
        stage_s: per stage, forward + backward seconds per micro-batch.
        forward_s / backward_s: per stage, split of ``stage_s``.
        link_s: per boundary j (between stage j-1 and j, j >= 1), transfer seconds.
        sum_s / max_s: the sum and the max of all stage and transfer times.
        pipeline_s: ``sum_s + (m - 1) * max_s``.
        exact: whether every candidate cap was tried.
    """

    devices: tuple[Device, ...]
    cuts: tuple[int, ...]
    recompute: tuple[tuple[int, ...], ...]
    stage_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    link_s: tuple[float, ...]
    sum_s: float
    max_s: float
    m: int
    b: int
    exact: bool

    @property
    def pipeline_s(self) -> float:
        return self.sum_s + (self.m - 1) * self.max_s


def _band(j: int, p: int, L: int) -> tuple[slice, slice]:
    """Stage j of p starts in [j, L-p+j] (stage 0 at layer 0) and ends in [j+1, L-p+j+1]: a layer per stage."""
    return slice(j, L - p + j + 1) if j else slice(0, 1), slice(j + 1, L - p + j + 2)


def _banded(tables: list[np.ndarray], links: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """Per stage j, within its band: cost = t_j(k, l) + c_j(k) and peak = max(t_j(k, l), c_j(k)).

    Returns (cost blocks, peak blocks, first row layer k of each block).
    """
    p, L = len(tables), tables[0].shape[0] - 1
    cost, peak, starts = [], [], []
    for j, t in enumerate(tables):
        ks, ls = _band(j, p, L)
        block = t[ks, ls]
        c = links[j][ks][:, None]
        cost.append(block + c)
        peak.append(np.maximum(block, c))
        starts.append(ks.start)
    return cost, peak, starts


def _min_sum(cost: list[np.ndarray], peak: list[np.ndarray], starts: list[int],
             cap: float) -> tuple[float, list[int]] | None:
    """Min over cuts of the sum of costs with every term <= cap; (sum, cuts) or None.

    Banded blocks (``_banded``): ``cost[j][k - start_j, l - (j + 1)]`` is stage j
    on layers [k, l) plus the transfer into it, ``peak`` the larger of the two,
    which must not exceed ``cap``. DP over stages, vectorised over layers;
    ``dp[r]``: best sum with the stages so far ending at the r-th layer of the band.
    """
    p = len(cost)
    dp = np.zeros(1)  # stage 0 starts at layer 0
    back = []
    for c, top in zip(cost, peak, strict=True):
        total = dp[:, None] + (np.where(top <= cap, c, INF) if np.isfinite(cap) else c)  # (k, l) in the band
        arg = np.argmin(total, axis=0)
        dp = total[arg, np.arange(total.shape[1])]
        back.append(arg)
    if not np.isfinite(dp[-1]):
        return None
    L = p + cost[-1].shape[1] - 1  # the last stage's band ends at layer L
    cuts = [L]
    for j in range(p - 1, -1, -1):
        cuts.append(int(back[j][cuts[-1] - (j + 1)]) + starts[j])
    return float(dp[-1]), cuts[::-1]


def _min_max(peak: list[np.ndarray]) -> float:
    """The smallest achievable max term (the min-max bottleneck ``T*``), over banded blocks."""
    dp = np.zeros(1)
    for c in peak:
        dp = np.min(np.maximum(dp[:, None], c), axis=0)
    return float(dp[-1])


def _worst(peak: list[np.ndarray], starts: list[int], cuts: Sequence[int]) -> float:
    """The largest term of the cuts: max over stages of peak_j(cuts[j], cuts[j+1])."""
    return max(float(peak[j][cuts[j] - starts[j], cuts[j + 1] - (j + 1)]) for j in range(len(peak)))


def partition(cluster: Cluster, profile: ModelProfile, devices: Sequence[Device], b: int, m: int,
              schedule: str, optimizer: str, allow_recompute: bool = True,
              max_caps: int = 64, cache: StageTableCache | None = None,
              full_recompute: bool = False) -> PartitionResult | None:
    """Best cuts of the model over ``devices`` in this order; None if no cut fits memory.

    Every device gets at least one layer, so ``len(devices) <= L`` is required.
    ``full_recompute`` (for screening): a stage that needs recomputation recomputes
    every useful layer instead of the greedy's cheapest set, an upper bound that
    needs no per-range greedy.

    Example:
        >>> r = partition(cluster, profile, cluster.devices[:2], b=4, m=8,
        ...               schedule="1f1b", optimizer="adam")         # doctest: +SKIP
        >>> r.cuts, r.pipeline_s                                      # doctest: +SKIP
    """
    L = profile.num_layers
    p = len(devices)
    if p == 0 or p > L:
        return None
    stages = build_stage_costs(profile, devices, b, m, schedule, optimizer, allow_recompute, cache)
    links = link_time_table(cluster, devices, build_model_arrays(profile, optimizer), b)
    # An upper bound first, with every useful layer recomputed where memory needs it:
    # any optimum has max stage time M* <= (f0 - S_lb) / (m - 1), S_lb a lower bound
    # of the sum, so ranges slower than that need no exact recompute set.
    cost_full, peak_full, starts = _banded([s.full_s for s in stages], links)
    t_full = _min_max(peak_full)
    if not np.isfinite(t_full):
        return None
    found_full = _min_sum(cost_full, peak_full, starts, t_full)
    assert found_full is not None
    sum_full, cuts_full = found_full
    f0 = sum_full + (m - 1) * _worst(peak_full, starts, cuts_full)
    if full_recompute:
        return _result(devices, stages, links, cuts_full, m, b, full_recompute=True, exact=False)
    s_lb = float(np.min(np.stack([s.fwd_s + s.bwd_s for s in stages]), axis=0).sum())
    limit = f0 if m == 1 else min(f0, (f0 - s_lb) / (m - 1))
    limit *= 1 + 1e-9
    for s in stages:
        s.ensure_recompute(limit)
    cost, peak, starts = _banded([s.time_s for s in stages], links)
    peak = [np.where(pk <= limit, pk, INF) for pk in peak]  # ranges above the limit cannot be in the answer
    t_star = _min_max(peak)
    if not np.isfinite(t_star):
        return None
    unconstrained = _min_sum(cost, peak, starts, limit)
    assert unconstrained is not None  # t_star finite implies a feasible cut
    s_min = unconstrained[0]
    values = np.unique(np.concatenate([c[np.isfinite(c) & (c >= t_star)] for c in peak]))
    exact = len(values) <= max_caps
    if not exact:
        # the first caps above the bottleneck, then a geometric sample of the rest
        n_head = max(1, max_caps // 2)
        rest = values[n_head:]
        picks = np.unique(np.geomspace(1, len(rest), max_caps - n_head).astype(int) - 1) if max_caps > n_head \
            else np.zeros(0, dtype=int)
        values = np.concatenate([values[:n_head], rest[picks]])
    best: list[int] | None = None
    best_f = INF
    for cap in values:
        if s_min + (m - 1) * cap >= best_f:
            break
        found = _min_sum(cost, peak, starts, float(cap))
        if found is None:
            continue
        total, cuts = found
        f = total + (m - 1) * _worst(peak, starts, cuts)
        if f < best_f:
            best_f, best = f, cuts
    assert best is not None
    return _result(devices, stages, links, best, m, b, full_recompute=False, exact=exact)


def _result(devices: Sequence[Device], stages: list[StageCosts], links: np.ndarray, cuts: Sequence[int], m: int,
            b: int, full_recompute: bool, exact: bool) -> PartitionResult:
    """The PartitionResult of ``cuts`` over the given stage tables."""
    p = len(devices)
    fwd, bwd, stage_s, rcs = [], [], [], []
    for j, s in enumerate(stages):
        k, l = cuts[j], cuts[j + 1]
        rc = s.recompute(k, l, full_recompute)
        f_s, b_s = s.forward_backward(k, l, full_recompute)
        fwd.append(f_s)
        bwd.append(b_s)
        stage_s.append(float((s.full_s if full_recompute else s.time_s)[k, l]))
        rcs.append(rc)
    link_s = [float(links[j][cuts[j]]) for j in range(1, p)]
    return PartitionResult(
        devices=tuple(devices), cuts=tuple(cuts), recompute=tuple(rcs), stage_s=tuple(stage_s),
        forward_s=tuple(fwd), backward_s=tuple(bwd), link_s=tuple(link_s),
        sum_s=float(sum(stage_s) + sum(link_s)), max_s=float(max(stage_s + link_s)), m=m, b=b,
        exact=exact,
    )

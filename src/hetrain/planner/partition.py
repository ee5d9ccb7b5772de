"""Partition a model over the ordered devices of one virtual worker.

Given devices ``d_0 .. d_{p-1}`` in pipeline order, micro-batch size ``b`` and
``m`` micro-batches, choose cuts ``0 = k_0 < k_1 < ... < k_p = L`` minimising the
pipeline's iteration time (cost.estimate_pipeline_time)::

    f = sum_j t_j + sum_j c_j + (m - 1) * max(t_j, c_j)

where ``t_j`` is stage j's forward + backward time (with recomputation where
memory requires it, and the device's overhead per action twice) and ``c_j``
the activation + gradient transfer over the actual link between positions j-1
and j (Pipe-Torch's point: cut where the link is fast or the activation small).
Where the runtime's transfers block (sync option ``transfers=blocking``) a stage
is held by the transfers on both its sides, and the bottleneck term becomes
``max_j (t_j + c_j + c_{j+1})`` (cost.estimate_blocking_pipeline_time). The cuts found are priced
by their schedule's own form (``PartitionResult.max_s``): under 1F1B the bottleneck is the steady
state's period, in which each transfer sits in the cycle of the stages on its two sides
(cost.estimate_1f1b_period, at least ``max_j t_j``); the search keeps GPipe's per-stage terms, whose
caps a min-sum DP can enforce stage by stage, where a cycle's mean spans several stages.

``f`` mixes a sum and a max, so a single min-sum or min-max DP is not exact.
We enumerate the bottleneck: for a cap ``T`` on every stage and transfer, a
min-sum DP over (position, layer) gives ``S(T)``; the answer is
``min_T S(T) + (m - 1) * T`` over candidate caps ``T``, the distinct stage and
transfer times. Caps are tried in increasing order from the min-max bottleneck
``T*`` and the search stops once ``S(inf) + (m - 1) * T`` cannot beat the best
(the same early stop as Alpa's stage DP, Zheng et al. OSDI 2022, sec. 5.2).
This is exact when all caps are tried; beyond ``max_caps`` caps, the remaining
caps are sampled geometrically (reported in ``PartitionResult.exact``).

The DPs run over every stage's ranges at once, as (stage, end layer, length)
arrays holding only ranges short enough to be at most a bound on the bottleneck
(``_span``), a guess checked afterwards; docs/planner.md, "Cost of planning".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetrain.cluster import Cluster, Device
from hetrain.cost import estimate_1f1b_period, in_flight
from hetrain.planner.stage_cost import (
    INF,
    KindTables,
    StageCosts,
    StageTableCache,
    build_kind_tables,
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
        sum_s: the sum of all stage and transfer times.
        max_s: the bottleneck, seconds per micro-batch after the first: the slowest stage or transfer under
            GPipe, 1F1B's steady-state period (``cost.estimate_1f1b_period``), or under blocking transfers
            the slowest stage with the transfers on both its sides.
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


def _span(bases: Sequence[np.ndarray], limit: float) -> int:
    """Most layers any stage can hold with a time <= ``limit``: beyond it every range is slower.

    Read off the tables without recomputation, which are lower bounds of the
    others and grow with the range.
    """
    if not np.isfinite(limit):
        return int(bases[0].shape[0]) - 1
    return max(1, max(int((base <= limit).sum(axis=1).max()) for base in bases))


@dataclass(frozen=True)
class _Cells:
    """The ranges each stage may hold, in the banded layout of ``_banded``.

    Stage j of p ends in [j + 1, j + W] (every stage holds a layer), W = L - p + 1,
    and holds at most ``span`` layers. Entry ``[j, c, e]`` is the range ending at
    l = j + 1 + c and starting at k = l - span + e, so along e the start layer
    grows (ties in the DP go to the earliest start, as in a plain (k, l) table).
    """

    rows: np.ndarray  # (W, span): k - j, negative where no such range
    start: np.ndarray  # (p, W, span): k (clipped to a valid layer)
    end: np.ndarray  # (p, W, 1): l
    flat: np.ndarray  # (p, W, span): k * (L + 1) + l, into a flattened (L+1, L+1) table
    invalid: np.ndarray  # (p, W, span): ranges that do not exist, and stage 0 not starting at layer 0


def _cells(p: int, L: int, span: int) -> _Cells:
    """The layout for p stages over L layers, ranges of at most ``span`` layers (small ones are kept)."""
    span = min(span, L - p + 1)
    return _cells_cached(p, L, span) if p * (L - p + 1) * span <= 1 << 17 else _build_cells(p, L, span)


@functools.lru_cache(maxsize=64)
def _cells_cached(p: int, L: int, span: int) -> _Cells:
    return _build_cells(p, L, span)


def _build_cells(p: int, L: int, span: int) -> _Cells:
    W = L - p + 1
    c_idx = np.arange(W)
    rows = c_idx[:, None] - (span - 1 - np.arange(span))[None, :]
    j = np.arange(p)[:, None, None]
    invalid = np.broadcast_to(rows < 0, (p, W, span)).copy()
    invalid[0] |= rows != 0
    prev = np.maximum(rows, 0)
    start = j + prev[None]
    end = j + 1 + c_idx[None, :, None]
    return _Cells(rows, start, end, start * (L + 1) + end, invalid)


def _banded(block: np.ndarray, links: np.ndarray, cells: _Cells,
            blocking: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per stage j and range: cost = t_j(k, l) + c_j(k) and peak = max(t_j(k, l), c_j(k)), (p, W, span) each.

    ``block`` holds t_j at ``cells``; ``links[j, k]`` is the transfer into stage j cut before layer k.
    ``blocking``: peak = t_j(k, l) + c_j(k) + c_{j+1}(l), the stage held by the transfers on both sides.
    """
    block[cells.invalid] = INF
    p, W, span = block.shape
    # c[j, c, e] = links[j, k] with k = j + c + e + 1 - span: a strided view of the rows padded by span in
    # front (the padding only meets ranges that do not exist, which are inf already).
    padded = np.zeros((p, links.shape[1] + span))
    padded[:, span:] = links
    step = padded.itemsize
    c = np.lib.stride_tricks.as_strided(padded.ravel()[1:], shape=(p, W, span),
                                        strides=(step * (padded.shape[1] + 1), step, step), writeable=False)
    if blocking:
        after = np.zeros((p, W, 1))
        after[:-1] = links[np.arange(1, p)[:, None, None], cells.end[:-1]]  # c_{j+1}(l): out of stage j
        return block + c, block + c + after
    return block + c, np.maximum(block, c)


def _min_sum(cost: np.ndarray, peak: np.ndarray, rows: np.ndarray, cap: float) -> tuple[float, list[int]] | None:
    """Min over cuts of the sum of costs with every term <= cap; (sum, cuts) or None.

    Banded blocks (``_banded``): ``cost[j, c, e]`` is stage j on its range plus
    the transfer into it, ``peak`` the larger of the two, which must not exceed
    ``cap``. DP over stages, vectorised over layers; ``dp[c]``: best sum with
    the stages so far ending at layer j + 1 + c.
    """
    p, W = cost.shape[0], cost.shape[1]
    allowed = np.where(peak <= cap, cost, INF) if np.isfinite(cap) else cost
    prev = np.maximum(rows, 0)  # the previous stage ends at layer k = j + rows: its own c is rows
    span = cost.shape[2]
    at = np.arange(W) * span
    dp = np.zeros(W)  # before stage 0: its range starts at layer 0 (other rows are inf)
    back = np.empty((p, W), dtype=np.intp)
    for j in range(p):
        total = (dp.take(prev) if j else 0.0) + allowed[j]  # (W, span)
        arg = np.argmin(total, axis=1)
        dp = total.take(at + arg)
        back[j] = arg
    if not np.isfinite(dp[-1]):
        return None
    L = p + W - 1
    cuts = [L]
    for j in range(p - 1, -1, -1):
        cuts.append(int(rows[cuts[-1] - (j + 1), back[j, cuts[-1] - (j + 1)]]) + j)
    return float(dp[-1]), cuts[::-1]


def _min_max(peak: np.ndarray, rows: np.ndarray) -> float:
    """The smallest achievable max term (the min-max bottleneck ``T*``), over banded blocks."""
    prev = np.maximum(rows, 0)
    dp = peak[0].min(axis=1)
    for j in range(1, peak.shape[0]):
        dp = np.maximum(dp.take(prev), peak[j]).min(axis=1)
    return float(dp[-1])


def _worst(peak: np.ndarray, cuts: Sequence[int]) -> float:
    """The largest term of the cuts: max over stages of peak_j(cuts[j], cuts[j+1])."""
    span = peak.shape[2]
    j = np.arange(peak.shape[0])
    c = np.asarray(cuts)
    return float(peak[j, c[1:] - (j + 1), span - (c[1:] - c[:-1])].max())


def _guess_bottleneck(kinds: KindTables, kind_of: Sequence[int]) -> float:
    """A guess of the bottleneck: 2 x a lower bound of it, the model's work spread over the devices in
    proportion to their speed (a_d: device d's least time per unit of work), plus two actions' overhead."""
    work = kinds.layer_s.min(axis=0)  # (L,) each layer on its fastest kind
    slowness = (kinds.layer_s / np.where(work > 0, work, 1.0)).min(axis=1)  # (u,) a_d per kind
    guess = max(float(work.max()), 2.0 * float(work.sum()) / float((1.0 / slowness[kind_of]).sum()))
    return guess + 2 * max(t.overhead_s for t in kinds.kinds)  # every stage's time holds its two actions' overhead


def _full_recompute_optimum(kinds: KindTables, kind_of: Sequence[int], bases: Sequence[np.ndarray],
                            links: np.ndarray, n: np.ndarray, m: int,
                            blocking: bool) -> tuple[float, list[int]] | None:
    """The best cuts with every useful layer recomputed where memory needs it, and their objective ``f0``
    (an upper bound of the optimum); None if no cut fits memory.

    Ranges slower than a guess U of the bottleneck (``_guess_bottleneck``) are left out of the tables;
    if the bottleneck found is at most U the answer is the same as with every range, else widen to the
    bottleneck found (an upper bound of the true one) or to every range.
    """
    p, L = len(kind_of), kinds.layer_s.shape[1]
    guess = _guess_bottleneck(kinds, kind_of)
    kind = np.array(kind_of)[:, None, None] * (L + 1) ** 2
    for _ in range(3):
        cells = _cells(p, L, _span(bases, guess))
        block = kinds.full_at(kind + cells.flat, n)
        cost_full, peak_full = _banded(block, links, cells, blocking)
        t_full = _min_max(peak_full, cells.rows)
        if t_full <= guess or not np.isfinite(guess):
            break
        guess = t_full if np.isfinite(t_full) else INF
    if not np.isfinite(t_full):
        return None
    found_full = _min_sum(cost_full, peak_full, cells.rows, t_full)
    assert found_full is not None
    sum_full, cuts_full = found_full
    return sum_full + (m - 1) * _worst(peak_full, cuts_full), cuts_full


def _caps(peak: np.ndarray, t_star: float, max_caps: int) -> tuple[np.ndarray, bool]:
    """The caps to try, ascending from the bottleneck ``t_star``, and whether they are all of them: every
    distinct term up to ``max_caps``, else the first caps above the bottleneck, then a geometric sample of
    the rest."""
    values = np.unique(peak[np.isfinite(peak) & (peak >= t_star)])
    exact = len(values) <= max_caps
    if not exact:
        n_head = max(1, max_caps // 2)
        rest = values[n_head:]
        picks = np.unique(np.geomspace(1, len(rest), max_caps - n_head).astype(int) - 1) if max_caps > n_head \
            else np.zeros(0, dtype=int)
        values = np.concatenate([values[:n_head], rest[picks]])
    return values, exact


def _best_cuts(cost: np.ndarray, peak: np.ndarray, rows: np.ndarray, caps: np.ndarray, s_min: float,
               m: int) -> list[int]:
    """The cuts minimising ``S(T) + (m - 1) * T`` over the caps ``T``, tried in increasing order until
    ``s_min + (m - 1) * T`` (``s_min``: the sum without a cap) cannot beat the best."""
    best: list[int] | None = None
    best_f = INF
    for cap in caps:
        if s_min + (m - 1) * cap >= best_f:
            break
        found = _min_sum(cost, peak, rows, float(cap))
        if found is None:
            continue
        total, cuts = found
        f = total + (m - 1) * _worst(peak, cuts)
        if f < best_f:
            best_f, best = f, cuts
    assert best is not None
    return best


def partition(cluster: Cluster, profile: ModelProfile, devices: Sequence[Device], b: int, m: int,
              schedule: str, optimizer: str, allow_recompute: bool = True,
              max_caps: int = 64, cache: StageTableCache | None = None,
              full_recompute: bool = False, blocking: bool = False,
              reduce_copy: float = 0.0, shares: tuple[float, ...] = (1.0, 1.0)) -> PartitionResult | None:
    """Best cuts of the model over ``devices`` in this order; None if no cut fits memory.

    Every device gets at least one layer, so ``len(devices) <= L`` is required.
    ``full_recompute`` (for screening): a stage that needs recomputation recomputes
    every useful layer instead of the greedy's cheapest set, an upper bound that
    needs no per-range greedy. ``blocking``: the runtime's transfers hold sender and receiver
    (sync option ``transfers``), so each stage's time holds the transfers on both its sides.
    ``reduce_copy``: the bf16 copies of the gradients each stage all-reduces, per gradient byte, counted
    with the optimizer step's memory (``stage_cost.build_model_arrays``; 0 where no replica shares them).
    ``shares``: the (optimizer state, gradients) shares each stage keeps where they are sharded.

    Example:
        >>> r = partition(cluster, profile, cluster.devices[:2], b=4, m=8,
        ...               schedule="1f1b", optimizer="adam")         # doctest: +SKIP
        >>> r.cuts, r.pipeline_s                                      # doctest: +SKIP
    """
    L = profile.num_layers
    p = len(devices)
    if p == 0 or p > L:
        return None
    if shares[1] < 1.0 and m > 1:  # ZeRO-2 over several micro-batches: whole gradients until the last backward
        shares = (shares[0], shares[1], True)
    kinds, kind_of = build_kind_tables(profile, devices, b, optimizer, allow_recompute, cache, reduce_copy, shares)
    links = link_time_table(cluster, devices, build_model_arrays(profile, optimizer, reduce_copy, shares), b)
    n = np.array([in_flight(schedule, m, p, j) for j in range(p)], dtype=float)[:, None, None]
    bases = [t.base_s for t in kinds.kinds]
    # An upper bound first, with every useful layer recomputed where memory needs it:
    # any optimum has max stage time M* <= (f0 - S_lb) / (m - 1), S_lb a lower bound
    # of the sum, so ranges slower than that need no exact recompute set.
    full = _full_recompute_optimum(kinds, kind_of, bases, links, n, m, blocking)
    if full is None:
        return None
    f0, cuts_full = full
    if full_recompute:
        return _result_full(devices, kinds, kind_of, n[:, 0, 0], links, cuts_full, m, b, schedule, blocking)
    stages = build_stage_costs(profile, devices, b, m, schedule, optimizer, allow_recompute, cache, reduce_copy,
                               shares)
    s_lb = float(np.min(np.stack([s.fwd_s + s.bwd_s for s in stages]), axis=0).sum())
    limit = f0 if m == 1 else min(f0, (f0 - s_lb) / (m - 1))
    limit *= 1 + 1e-9
    for s in stages:
        s.ensure_recompute(limit)
    cells = _cells(p, L, _span(bases, limit))
    block = np.stack([s.time_s[cells.start[j], cells.end[j]] for j, s in enumerate(stages)])
    cost, peak = _banded(block, links, cells, blocking)
    rows = cells.rows
    peak = np.where(peak <= limit, peak, INF)  # ranges above the limit cannot be in the answer
    t_star = _min_max(peak, rows)
    if not np.isfinite(t_star):
        return None
    unconstrained = _min_sum(cost, peak, rows, limit)
    assert unconstrained is not None  # t_star finite implies a feasible cut
    caps, exact = _caps(peak, t_star, max_caps)
    best = _best_cuts(cost, peak, rows, caps, unconstrained[0], m)
    return _result(devices, stages, links, best, m, b, schedule, full_recompute=False, exact=exact,
                   blocking=blocking)


def _result_full(devices: Sequence[Device], kinds: KindTables, kind_of: Sequence[int], n: np.ndarray,
                 links: np.ndarray, cuts: Sequence[int], m: int, b: int, schedule: str,
                 blocking: bool = False) -> PartitionResult:
    """The PartitionResult of ``cuts`` with full recomputation where a stage needs any (screening)."""
    p = len(devices)
    L = kinds.layer_s.shape[1]
    k, l = np.asarray(cuts[:-1]), np.asarray(cuts[1:])
    flat = np.asarray(kind_of) * (L + 1) ** 2 + k * (L + 1) + l
    stage_s = kinds.full_at(flat, n).tolist()
    pending = (n > kinds.fits_up_to.take(flat)) & (n <= kinds.full_fits_up_to.take(flat))
    fwd, bwd, rcs = [], [], []
    for j in range(p):
        t = kinds.kinds[kind_of[j]]
        rc: tuple[int, ...] = ()
        extra = 0.0
        if pending[j]:
            rc = tuple(int(i) for i in np.sort(t.order[(t.order >= k[j]) & (t.order < l[j])]))
            extra = float(t.fwd_s[list(rc)].sum())
        fwd.append(float(t.fwd_s[k[j]:l[j]].sum()) + t.overhead_s)
        bwd.append(float(t.bwd_s[k[j]:l[j]].sum()) + extra + t.overhead_s)
        rcs.append(rc)
    link_s = [float(links[j][cuts[j]]) for j in range(1, p)]
    return PartitionResult(
        devices=tuple(devices), cuts=tuple(cuts), recompute=tuple(rcs), stage_s=tuple(stage_s),
        forward_s=tuple(fwd), backward_s=tuple(bwd), link_s=tuple(link_s),
        sum_s=float(sum(stage_s) + sum(link_s)), max_s=_max_term(stage_s, link_s, blocking, schedule, m), m=m, b=b,
        exact=False,
    )


def _max_term(stage_s: list[float], link_s: list[float], blocking: bool, schedule: str, m: int) -> float:
    """The bottleneck: the slowest stage or link (GPipe); under 1F1B, the steady state's period, where each
    link sits in the cycle of the stages on its sides (``cost.estimate_1f1b_period``); under blocking
    transfers, the slowest stage with the links on both its sides (``cost.estimate_blocking_pipeline_time``)."""
    if not blocking:
        if schedule == "gpipe":
            return float(max(stage_s + link_s))
        return estimate_1f1b_period(stage_s, link_s, m, schedule)
    c = [0.0, *link_s, 0.0]
    return float(max(t + c[j] + c[j + 1] for j, t in enumerate(stage_s)))


def priced_as(r: PartitionResult, schedule: str, blocking: bool = False) -> PartitionResult:
    """``r``'s cuts priced by ``schedule``'s form (``_max_term``): the same stages and transfers, the bottleneck of
    that schedule."""
    max_s = _max_term(list(r.stage_s), list(r.link_s), blocking, schedule, r.m)
    return r if max_s == r.max_s else replace(r, max_s=max_s)


def _result(devices: Sequence[Device], stages: list[StageCosts], links: np.ndarray, cuts: Sequence[int], m: int,
            b: int, schedule: str, full_recompute: bool, exact: bool, blocking: bool = False) -> PartitionResult:
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
        sum_s=float(sum(stage_s) + sum(link_s)), max_s=_max_term(stage_s, link_s, blocking, schedule, m), m=m, b=b,
        exact=exact,
    )

"""Plans that stay good under profile noise: the best few plans scored over sampled profiles.

A profile's layer times are medians over repeats; each may carry its spread
(``Measurement.forward_spread_s`` / ``backward_spread_s``, a standard deviation).
Two profiles of the same model on the same devices differ by about that much, and
a planner that trusts the medians exactly can choose a different plan from each.

``draw_profiles`` makes ``K`` profiles from one: in draw k, every measured time
``t`` with spread ``s`` becomes ``t * (1 + s / t) ** z`` (log-normal: about
``t + z * s`` for a small spread, never below 0, however noisy the repeats were),
with one standard normal ``z`` per (layer, device type, forward or backward) shared
by every micro-batch size, drawn from a generator seeded with ``seed``. A device type with a
``common_spread`` ``c`` (``ModelProfile.common_spread``: how far all its times move together from one
profiling to the next) has all its times, and its optimizer step, multiplied by ``(1 + c) ** z_type`` as
well, one standard normal ``z_type`` per type and draw from a second generator of the same seed (so a
profile without it draws exactly what it drew before). Independent draws of many layers average out
over a stage (a stage of ``n`` layers moves by about ``s / sqrt(n)``); a common shift does not, and it
moves every stage of that type the same way: what tells apart a plan that leans on the slow type from
one that does not. The calibrated overhead per action ``o`` with its spread ``s_o``
(``ModelProfile.action_overhead_spread_s``, ``hetrain calibrate``) becomes ``max(0, o + z_o * s_o)``, one
``z_o`` per draw for every type alike (it is the host's work, not a device's): what tells apart a plan
of many small micro-batches, which pays it more often, from one of few large ones. One number per
draw, so its K values are not left to chance: they are the standard normal's quantiles at
``(k + 1/2) / K``, in an order shuffled by a third generator of the seed (K = 8 reaches
``z = +-1.53``, where 8 random draws may all fall below +0.3). Every candidate plan is scored
on the same K profiles (common random numbers), so the comparison between two plans
is not blurred by independent noise, and the same inputs give the same plan.

The rule (``choose_robust``), over the candidates' simulated times ``t_c`` at the
medians and ``w_c``, the slowest of their K draws (their worst case)::

    N = argmin_c t_c                          the plan fastest at the medians
    E = { c : t_c <= w_N }                    the plans within N's spread
    chosen = argmin_{c in E} w_c              (ties: the faster at the medians)

so a plan whose mean is a little worse but whose worst case is clearly better
wins; a plan slower at the medians than N is in its worst draw never does. With
no spread in the profile there is nothing to draw and the ranking is the
medians' (``has_spread``).

``confidence`` records, for ``hetrain plan`` to print and ``--json`` to carry: every
candidate's layout, time at the medians, worst draw and the number of draws it is the
fastest in.

Pure Python and numpy; the scoring function is handed in (the simulator, by ``hetrain.plan``).

Example:
    >>> ranked, figures = rank_robust(plans, lambda p, t: t / p.global_batch, score, draws=8)  # doctest: +SKIP
    >>> print(format_confidence(ranked[0]))                                                 # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetrain.plan import Plan
from hetrain.profile import LayerProfile, Measurement, ModelProfile

#: profiles drawn per planning by default (``PlannerOptions.robust_draws``): K simulations of each of the best few
DRAWS = 8
#: the seed of the draws by default (``PlannerOptions.robust_seed``)
SEED = 0


def has_spread(profile: ModelProfile) -> bool:
    """Whether any measured time of ``profile`` has a spread above 0, or a device type a common spread or a spread
    of its overhead per action."""
    return any(fraction > 0 for _, fraction in (*profile.common_spread, *profile.action_overhead_spread_s)) or any(
        m.forward_spread_s or m.backward_spread_s for layer in profile.layers for _, ms in layer.measured for m in ms)


def _drawn(t: float, spread: float | None, z: float) -> float:
    """``t`` moved by ``z`` spreads, multiplicatively: ``t * (1 + s / t) ** z``, which stays above 0 and keeps the
    median ``t``; about ``t + z * s`` where ``s`` is small against ``t``."""
    if not spread or t <= 0:
        return t
    return t * math.exp(z * math.log1p(spread / t))


def _shifted(m: Measurement, z_forward: float, z_backward: float, common: float = 1.0) -> Measurement:
    """``m`` with its times drawn within their spreads, then scaled by the type's common factor."""
    return dataclasses.replace(m, forward_s=common * _drawn(m.forward_s, m.forward_spread_s, z_forward),
                               backward_s=common * _drawn(m.backward_s, m.backward_spread_s, z_backward))


def _common_factors(profile: ModelProfile, rng: np.random.Generator) -> dict[str, float]:
    """One draw's factor per device type with a common spread: ``(1 + c) ** z``, ``z`` standard normal, the
    types in name order (deterministic whatever order the profile lists them in)."""
    return {t: math.exp(float(rng.standard_normal()) * math.log1p(c))
            for t, c in sorted(profile.common_spread) if c > 0}


def _overheads(profile: ModelProfile, z: float) -> tuple[tuple[str, float], ...]:
    """The profile's overheads per action moved by ``z`` of their spreads, ``max(0, o + z * s)``, per type."""
    types = dict.fromkeys(t for t, _ in (*profile.action_overhead_s, *profile.action_overhead_spread_s))
    return tuple((t, max(0.0, profile.action_overhead_of(t) + z * profile.action_overhead_spread_of(t)))
                 for t in types)


def draw_profiles(profile: ModelProfile, draws: int, seed: int = SEED) -> list[ModelProfile]:
    """``draws`` profiles whose measured times are drawn within their spread (module docstring).

    Deterministic: the same profile, ``draws`` and ``seed`` give the same profiles. Times without a
    spread are kept as they are.
    """
    rng = np.random.default_rng(seed)
    rng_common = np.random.default_rng([seed, 1])  # its own stream: the per-layer draws stay as they were
    # the overhead's quantiles, shuffled by their own stream: the common factors stay as they were too
    z_overheads = [statistics.NormalDist().inv_cdf((k + 0.5) / draws)
                   for k in np.random.default_rng([seed, 2]).permutation(draws)]
    out = []
    for z_overhead in z_overheads:
        factors = _common_factors(profile, rng_common)
        layers: list[LayerProfile] = []
        for layer in profile.layers:
            measured = []
            for type_name, ms in layer.measured:
                z_forward, z_backward = (float(z) for z in rng.standard_normal(2))
                factor = factors.get(type_name, 1.0)
                measured.append((type_name, tuple(_shifted(m, z_forward, z_backward, factor) for m in ms)))
            layers.append(dataclasses.replace(layer, measured=tuple(measured)))
        rates = tuple((t, tuple((n, r * factors.get(t, 1.0)) for n, r in by_name))
                      for t, by_name in profile.optimizer_step_s_per_byte)
        drawn = dataclasses.replace(profile, layers=tuple(layers), optimizer_step_s_per_byte=rates)
        if profile.action_overhead_spread_s:
            drawn = dataclasses.replace(drawn, action_overhead_s=_overheads(profile, z_overhead))
        out.append(drawn)
    return out


def describe_layout(plan: Plan) -> str:
    """The plan's VWs: ``"n0:0 L0-6 > n1:0 L7-9 (16 as 4x4); ..."``: stages in pipeline order (device, layers),
    then the mini-batch as micro-batches x their size."""
    return "; ".join(" > ".join(f"{s.device} L{s.first_layer}-{s.end_layer - 1}" for s in vw.stages)
                      + f" ({vw.mini_batch} as {vw.micro_batches}x{vw.micro_batch_size})"
                      for vw in plan.virtual_workers)


def choose_robust(medians: Sequence[float], worst: Sequence[float]) -> int:
    """The index chosen by the rule (module docstring) from each candidate's time at the medians and worst draw."""
    nominal = min(range(len(medians)), key=lambda c: medians[c])
    within = [c for c in range(len(medians)) if medians[c] <= worst[nominal]]
    return min(within, key=lambda c: (worst[c], medians[c]))


def _alike(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b, strict=True))


def rank_robust(plans: Sequence[Plan], key: Callable[[Plan, float], float], score: Callable[[Plan], float],
                draws: int = DRAWS, seed: int = SEED) -> tuple[list[Plan], dict[str, Any]]:
    """``plans`` (each with ``prediction.simulated_iteration_s`` set, sorted by ``key``) with the robust choice
    first, and the figures of ``confidence``. Plans alike in every figure (at the medians and in every draw, as
    two VWs with their devices paired the other way) count as one: the first; the others go last.

    Args:
        plans: the candidates, best first at the medians; all of one profile.
        key: (plan, iteration seconds) -> the objective, lower is better (seconds per sample, or to accuracy).
        score: a plan's iteration seconds (the simulator's); called ``draws`` times per plan.
        draws: profiles drawn; 0, or a profile without spread, draws none (the order is kept).
        seed: the draws' seed.
    """
    medians = []
    for p in plans:
        assert p.prediction.simulated_iteration_s is not None
        medians.append(key(p, p.prediction.simulated_iteration_s))
    drawn = draw_profiles(plans[0].profile, draws, seed) if draws > 0 and has_spread(plans[0].profile) else []
    # times[c][k]: candidate c on drawn profile k, the same profiles for every candidate
    times = [[key(p, score(dataclasses.replace(p, profile=d))) for d in drawn] for p in plans]
    # plans alike in every figure (the same VWs with their devices paired otherwise) count once
    order: list[int] = []
    for c in range(len(plans)):
        if not any(_alike([medians[c], *times[c]], [medians[e], *times[e]]) for e in order):
            order.append(c)
    alike = [c for c in range(len(plans)) if c not in order]
    if drawn:
        worst = {c: max(times[c]) for c in order}
        first = order[choose_robust([medians[c] for c in order], [worst[c] for c in order])]
        order = [first] + [c for c in order if c != first]
    fastest = {c: sum(1 for k in range(len(drawn)) if min(order, key=lambda e: times[e][k]) == c) for c in order}
    figures: dict[str, Any] = {
        "draws": len(drawn), "seed": seed,
        "rule": "fastest at the profile's medians" if not drawn else
                "best worst case among the plans within the fastest's spread",
        "candidates": [{
            "layout": describe_layout(plans[c]),
            "objective": medians[c],
            "simulated_iteration_s": plans[c].prediction.simulated_iteration_s,
            **({"worst_objective": max(times[c]), "fastest_in_draws": fastest[c]} if drawn else {}),
        } for c in order],
    }
    ranked = [plans[c] for c in order + alike]
    ranked[0] = ranked[0].with_options({**ranked[0].options, "confidence": figures})
    return ranked, figures


def format_confidence(plan: Plan) -> str:
    """How sure the planner is of ``plan``, in words a user can act on (from ``options["confidence"]``); ``""``
    for a plan without the figures (one candidate, or no scoring function)."""
    figures = plan.options.get("confidence")
    if not isinstance(figures, dict) or len(figures.get("candidates", ())) < 2:
        return ""
    me, *others = figures["candidates"]
    nxt = min(others, key=lambda c: c["objective"])
    gap = nxt["objective"] / me["objective"] - 1
    draws = int(figures.get("draws", 0))
    where = "at the profile's medians" if draws else "simulated"
    if gap >= 0:
        lines = [f"next best plan ({nxt['layout']}) is {100 * gap:.1f}% slower {where}"]
    else:
        lines = [f"the plan fastest {where} ({nxt['layout']}) is {-100 * gap:.1f}% faster there, but in its "
                 f"slowest of {draws} draws {100 * (nxt['worst_objective'] / me['worst_objective'] - 1):.1f}% "
                 f"slower than this one: this plan was chosen for its worst case"]
    if not draws:
        lines.append("the profile has no spread, so no draws: profile with --repeats >= 2 to see how sure this is")
        return "\n".join(lines)
    lines.append(f"under the profile's spread this plan is the fastest in {me['fastest_in_draws']} of {draws} draws; "
                 f"its slowest draw is {100 * (me['worst_objective'] / me['objective'] - 1):.1f}% slower than at the "
                 f"medians")
    if 3 * me["fastest_in_draws"] < 2 * draws and abs(gap) < 0.05:
        lines.append("the best plans are within the profile's noise: they should run about as fast; "
                     "re-profile with more repeats to tell them apart")
    return "\n".join(lines)

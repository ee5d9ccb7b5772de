"""The planner: partition search against brute force, batch split, formations, errors."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import numpy as np
import pytest

from hetrain.cluster import parse_cluster
from hetrain.cost import estimate_blocking_pipeline_time, estimate_stage_memory, in_flight, tensor_budget
from hetrain.models.analytic import build_profile
from hetrain.planner import PlannerError, PlannerOptions, plan
from hetrain.planner.formation import _set_partitions, build_formations
from hetrain.planner.partition import partition
from hetrain.planner.search import _split_batch
from hetrain.planner.stage_cost import build_model_arrays, build_stage_costs, choose_recompute, link_time_table
from hetrain.planner.vw import VWEvaluator, candidate_orders
from hetrain.profile import LayerProfile, ModelProfile
from tiers import slow_where


def random_instance(rng: random.Random, n: int, layers: int, tight_memory: bool):
    """A random cluster of n devices on 1-3 nodes and a random model of `layers` layers."""
    nodes = []
    k = 0
    n_nodes = rng.randint(1, min(3, n))
    sizes = [1] * n_nodes
    for _ in range(n - n_nodes):
        sizes[rng.randrange(n_nodes)] += 1
    model_param = 0.0
    prof_layers = []
    for i in range(layers):
        param = rng.uniform(1e6, 5e7)
        model_param += param
        prof_layers.append(LayerProfile(f"l{i}", param, rng.uniform(1e4, 4e6), rng.uniform(1e5, 2e7),
                                        rng.uniform(1e9, 5e10)))
    profile = ModelProfile("rand", tuple(prof_layers), 1e4, "fp32", 0.5)
    # weights + grads + Adam state = 4x param bytes; tight memory forces recompute or spreading
    full_model = 4 * model_param
    for a, size in enumerate(sizes):
        devs = []
        for _ in range(size):
            mem = rng.uniform(0.35, 0.9) * full_model if tight_memory else 10 * full_model
            devs.append({"type": f"t{k}", "tflops": rng.uniform(2, 40), "memory": f"{mem:.0f}B",
                         "memory_bandwidth": f"{rng.uniform(100, 900):.0f}GB/s"})
            k += 1
        nodes.append({"name": f"n{a}", "devices": devs, "intra_link": f"{rng.uniform(5, 100):.1f}GB/s",
                      "nic": f"{rng.uniform(1, 50):.1f}Gbit/s"})
    cluster = parse_cluster({"node": nodes})
    return cluster, profile


def overlapped_pipeline_time(t, c, m):
    """Transfers overlapping compute: the stages and links in turn once, then the slowest of them m - 1 times."""
    return sum(t) + sum(c) + (m - 1) * max(t + c)


def brute_force(cluster, profile, b, m, schedule, optimizer="adam", pipeline_time=overlapped_pipeline_time):
    """Best pipeline time over every device order and every contiguous split, same stage costs;
    ``pipeline_time(stage_s, link_s, m)`` scores one split (``cost.estimate_blocking_pipeline_time`` when
    transfers block)."""
    L = profile.num_layers
    devices = list(cluster.devices)
    p = len(devices)
    arrays = build_model_arrays(profile, optimizer)
    best = math.inf
    for order in itertools.permutations(devices):
        stages = build_stage_costs(profile, order, b, m, schedule, optimizer)
        for s in stages:
            s.ensure_recompute(math.inf)  # every range's exact greedy recompute set
        links = link_time_table(cluster, order, arrays, b)
        for inner in itertools.combinations(range(1, L), p - 1):
            cuts = (0, *inner, L)
            t = [stages[j].time_s[cuts[j], cuts[j + 1]] for j in range(p)]
            c = [links[j][cuts[j]] for j in range(1, p)]
            if not all(np.isfinite(t)):
                continue
            best = min(best, pipeline_time(t, c, m))
    return best


# seeds 12 and 13 search six devices by brute force (seconds each): the full run only
@pytest.mark.parametrize("seed", slow_where(range(14), lambda _k, seed: seed >= 12))
def test_partition_search_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 5) if seed < 12 else 6
    layers = rng.randint(n, 10) if n < 6 else 8
    cluster, profile = random_instance(rng, n, layers, tight_memory=seed % 2 == 0)
    b, m = rng.choice([1, 2, 4]), rng.randint(1, 8)
    schedule = rng.choice(["gpipe", "1f1b"])
    expected = brute_force(cluster, profile, b, m, schedule)
    ev = VWEvaluator(cluster, profile, list(cluster.devices), schedule, "adam", True, order_budget=1e9,
                     max_caps=10_000, micro_batch_sizes=None, exhaustive_orders=720)
    found = ev.best(b, m)
    if not math.isfinite(expected):
        assert found is None
        return
    assert found is not None
    assert found.pipeline_s <= expected * (1 + 1e-3)
    assert found.pipeline_s >= expected * (1 - 1e-9)  # it cannot beat the true optimum
    # memory holds on every stage, with the recompute set the planner chose
    p = len(found.devices)
    for j, d in enumerate(found.devices):
        need = estimate_stage_memory(profile, found.cuts[j], found.cuts[j + 1], found.recompute[j], b,
                                     in_flight(schedule, m, p, j), "adam")
        assert need <= tensor_budget(profile, d) * (1 + 1e-9), (j, need, tensor_budget(profile, d))


def test_vectorised_recompute_matches_scalar_greedy() -> None:
    rng = random.Random(7)
    cluster, profile = random_instance(rng, 3, 12, tight_memory=True)
    arrays = build_model_arrays(profile, "adam")
    for dev in cluster.devices:
        (table,) = build_stage_costs(profile, [dev], 2, 4, "gpipe", "adam")
        table.ensure_recompute(math.inf)
        for k in range(12):
            for l in range(k + 1, 13):
                scalar = choose_recompute(table.fwd_s, arrays, k, l, 2, 4, tensor_budget(profile, dev))
                if scalar is None:
                    assert not np.isfinite(table.time_s[k, l])
                else:
                    assert table.recompute(k, l) == scalar


@pytest.mark.parametrize("seed", range(6))
def test_stage_tables_shared_over_in_flight_counts_match_the_memory_rule(seed: int) -> None:
    """Tables built from one per-device table for every in-flight count n equal the rule evaluated for each n."""
    rng = random.Random(100 + seed)
    cluster, profile = random_instance(rng, 3, rng.randint(4, 14), tight_memory=True)
    arrays = build_model_arrays(profile, "adam")
    upper = arrays.upper
    for dev in cluster.devices:
        for b in (1, 3, 8):
            for n in (1, 2, 5, 17):
                (table,) = build_stage_costs(profile, [dev], b, n, "gpipe", "adam")
                loss = b * arrays.loss_table  # the last stage's loss transient
                budget = tensor_budget(profile, dev)  # its memory less the runtime's footprint and the margin
                step_fits = arrays.step_table <= budget  # weights + the optimizer step's transient
                fits = (arrays.weight_table + n * b * arrays.saved_table + loss <= budget) & upper & step_fits
                need_full = (arrays.weight_table + n * b * arrays.kept_full_table + b * arrays.transient_table
                             + loss)
                fits_full = upper & ~fits & (need_full <= budget) & step_fits
                assert np.array_equal(np.isfinite(table.time_s), fits)
                assert np.array_equal(table.pending, fits_full)
                assert np.array_equal(np.isfinite(table.full_s), fits | fits_full)


@pytest.mark.parametrize("seed", range(10))
def test_screening_partition_is_min_sum_at_the_min_max_bottleneck(seed: int) -> None:
    """The screening partition (full recomputation) against brute force over every cut: the smallest
    bottleneck, then the smallest sum among cuts within it (the banded, length-limited DP must not miss any)."""
    rng = random.Random(200 + seed)
    n = rng.randint(2, 5)
    cluster, profile = random_instance(rng, n, rng.randint(n, 11), tight_memory=seed % 2 == 0)
    b, m, schedule = rng.choice([1, 2, 4]), rng.randint(1, 8), rng.choice(["gpipe", "1f1b"])
    devices = list(cluster.devices)
    L, p = profile.num_layers, len(devices)
    stages = build_stage_costs(profile, devices, b, m, schedule, "adam")
    links = link_time_table(cluster, devices, build_model_arrays(profile, "adam"), b)
    scored = []
    for inner in itertools.combinations(range(1, L), p - 1):
        cuts = (0, *inner, L)
        terms = [stages[j].full_s[cuts[j], cuts[j + 1]] for j in range(p)] + [links[j][cuts[j]] for j in range(1, p)]
        if all(np.isfinite(terms)):
            scored.append((max(terms), sum(terms)))
    found = partition(cluster, profile, devices, b, m, schedule, "adam", full_recompute=True)
    if not scored:
        assert found is None
        return
    bottleneck = min(x for x, _ in scored)
    least_sum = min(s for x, s in scored if x <= bottleneck)
    assert found is not None
    assert found.max_s == pytest.approx(bottleneck, rel=1e-12)
    assert found.sum_s == pytest.approx(least_sum, rel=1e-9)


def test_recompute_lands_off_the_bottleneck() -> None:
    """Cost-balanced recomputation: the fast device with little memory recomputes; the slow one does not."""
    layers = tuple(LayerProfile(f"l{i}", 1e6, 1e5, 4e7, 1e10) for i in range(8))
    profile = ModelProfile("m", layers, 1e5, "fp32", 1.0)
    cluster = parse_cluster({"node": [{"name": "n", "intra_link": "100GB/s", "devices": [
        {"type": "fast", "tflops": 40, "memory": "300MB", "memory_bandwidth": "900GB/s"},
        {"type": "slow", "tflops": 10, "memory": "8GB", "memory_bandwidth": "900GB/s"},
    ]}]})
    r = partition(cluster, profile, list(cluster.devices), b=2, m=4, schedule="gpipe", optimizer="sgd")
    assert r is not None
    fast = next(j for j, d in enumerate(r.devices) if d.type_name == "fast")
    slow = 1 - fast
    assert r.recompute[fast] and not r.recompute[slow]
    # the fast device gets more layers despite recomputing, and stays off the bottleneck or ties it
    assert r.cuts[fast + 1] - r.cuts[fast] > r.cuts[slow + 1] - r.cuts[slow]


def test_cut_where_the_link_is_fast() -> None:
    """Pipe-Torch's point: with one huge activation, the cut avoids it on a slow link."""
    out = [1e5] * 6
    out[2] = 5e8  # layer 2's output is huge: never cut after it
    layers = tuple(LayerProfile(f"l{i}", 1e6, out[i], 1e5, 1e10) for i in range(6))
    profile = ModelProfile("m", layers, 1e5, "fp32", 1.0)
    cluster = parse_cluster({"node": [
        {"name": "a", "devices": [{"type": "x", "tflops": 10, "memory": "8GB", "memory_bandwidth": "500GB/s"}],
         "nic": "1Gbit/s"},
        {"name": "b", "devices": [{"type": "x", "tflops": 10, "memory": "8GB", "memory_bandwidth": "500GB/s"}],
         "nic": "1Gbit/s"}]})
    r = partition(cluster, profile, list(cluster.devices), b=1, m=8, schedule="1f1b", optimizer="sgd")
    assert r is not None
    assert r.cuts[1] != 3  # cutting after layer 2 would send 500 MB over 1 Gbit/s
    assert r.cuts[1] in (2, 4)


def test_water_filling_balances_finish_times() -> None:
    speeds = [1.0, 2.0, 5.0]
    times = [lambda b, s=s: b / s for s in speeds]
    alloc = _split_batch(times, 80)
    assert alloc is not None and sum(alloc) == 80
    assert alloc == [10, 20, 50]
    assert _split_batch(times, 2) is None  # fewer samples than VWs


def _heap_split(times, global_batch):  # type: ignore[no-untyped-def]
    """The water-filling one sample at a time, by a heap of (next time, VW): ``_split_batch``'s reference."""
    k = len(times)
    if global_batch < k or any(not math.isfinite(t(1)) for t in times):
        return None
    alloc = [1] * k
    heap = [(times[v](2), v) for v in range(k)]
    heapq.heapify(heap)
    for _ in range(global_batch - k):
        t, v = heapq.heappop(heap)
        if not math.isfinite(t):
            return None
        alloc[v] += 1
        heapq.heappush(heap, (times[v](alloc[v] + 1), v))
    return alloc


def test_water_filling_by_groups_is_the_one_sample_heap_on_random_step_functions() -> None:
    """Alike VWs (one function object) served level by level give what the heap gives one sample at a time: on
    step functions with flat runs, equal times across groups, an infinite tail and groups interleaved in VW order."""
    rng = random.Random(7)
    for _ in range(400):
        kinds = []
        for _ in range(rng.randint(1, 5)):
            step, flat = rng.choice([0.5, 1.0, 2.0]), rng.randint(1, 4)
            cap = rng.choice([None, rng.randint(2, 30)])
            kinds.append(lambda b, step=step, flat=flat, cap=cap:
                         math.inf if cap is not None and b > cap else step * ((b + flat - 1) // flat))
        times = [rng.choice(kinds) for _ in range(rng.randint(1, 12))]
        batch = rng.randint(1, 120)
        assert _split_batch(times, batch) == _heap_split(times, batch), (batch, len(times))


def test_candidate_orders_exhaustive_for_small_and_node_contiguous_for_large() -> None:
    rng = random.Random(3)
    cluster, _ = random_instance(rng, 4, 6, False)
    orders = candidate_orders(cluster, list(cluster.devices), 6, budget=1e9)
    assert len(orders) == 24
    big = parse_cluster({"node": [{"name": f"n{i}", "devices": [{"type": "T4", "count": 4}], "nic": "10Gbit/s"}
                                  for i in range(4)]})
    orders = candidate_orders(big, list(big.devices), 26, budget=1e9)
    assert 1 <= len(orders) <= 64
    for order in orders:
        nodes = [big.devices[q].node for q in order]
        # each node's devices are consecutive
        assert sum(1 for a, b in itertools.pairwise(nodes) if a != b) == 3


def test_set_partitions_count_bell_numbers() -> None:
    assert [sum(1 for _ in _set_partitions(list(range(n)))) for n in range(1, 7)] == [1, 2, 5, 15, 52, 203]


def test_formations_include_hetpipe_policies_and_pure_families() -> None:
    cluster = parse_cluster({"node": [
        {"name": "a", "devices": [{"type": "TITAN-V", "count": 2}], "nic": "10Gbit/s"},
        {"name": "b", "devices": [{"type": "P4000", "count": 2}], "nic": "10Gbit/s"},
        {"name": "c", "devices": [{"type": "T4", "count": 2}], "nic": "10Gbit/s"},
        {"name": "d", "devices": [{"type": "RTX2060", "count": 2}], "nic": "10Gbit/s"},
    ]})
    names = {f.name: f for f in build_formations(cluster, 26)}
    assert {"dp", "pp", "node", "paired", "spread-2"} <= set(names)
    assert len(names["node"].vws) == 4
    # spread-2 gives each VW one device of every type
    for vw in names["spread-2"].vws:
        assert sorted(cluster.devices[d].type_name for d in vw) == sorted(["TITAN-V", "P4000", "T4", "RTX2060"])
    # paired puts the fastest node with the slowest
    for vw in names["paired"].vws:
        assert len({cluster.devices[d].node for d in vw}) == 2


def _cloud():
    return parse_cluster({"node": [
        {"name": "fast", "devices": [{"type": "A100-40GB", "count": 4}], "intra_link": "nvlink3", "nic": "100Gbit/s"},
        {"name": "old", "devices": [{"type": "V100-16GB", "count": 2}], "intra_link": "pcie3", "nic": "10Gbit/s"},
        {"name": "box", "devices": [{"type": "T4", "count": 2}], "intra_link": "pcie3", "nic": "10Gbit/s"},
    ]})


@pytest.mark.slow  # plans and simulates a large cluster
def test_plan_beats_or_ties_the_pure_families_and_holds_memory() -> None:
    cluster = _cloud()
    profile = build_profile("gpt2-medium")
    best = plan(cluster, profile, 256, simulate_top_k=0)
    dp = plan(cluster, profile, 256, strategy="dp", simulate_top_k=0)
    pp = plan(cluster, profile, 256, strategy="pp", simulate_top_k=0)
    assert best.prediction.samples_per_s >= max(dp.prediction.samples_per_s, pp.prediction.samples_per_s) * 0.999
    assert dp.strategy == "dp" and all(len(vw.stages) == 1 for vw in dp.virtual_workers)
    assert pp.strategy == "pp" and len(pp.virtual_workers) == 1
    for m in best.prediction.memory:
        assert m.peak_bytes <= m.capacity_bytes
    assert sum(vw.mini_batch for vw in best.virtual_workers) == 256
    assert best.to_dict()["prediction"]["samples_per_s"] == best.prediction.samples_per_s


def test_batch_split_follows_speed_in_pure_dp() -> None:
    cluster = parse_cluster({"node": [
        {"name": "a", "devices": ["A100-40GB"], "nic": "100Gbit/s"},
        {"name": "b", "devices": ["T4"], "nic": "100Gbit/s"}]})
    p = plan(cluster, build_profile("resnet50"), 128, strategy="dp", simulate_top_k=0)
    by_device = {vw.stages[0].device: vw.mini_batch for vw in p.virtual_workers}
    assert by_device["a:0"] > 2 * by_device["b:0"]
    times = [vw.predicted_pipeline_s for vw in p.virtual_workers]
    assert max(times) / min(times) < 1.2


@pytest.mark.parametrize(("global_batch", "size"), [(32, 64), (32, 3), (32, 5), (32, 6), (8, 16)])
def test_fixed_micro_batch_splits_equal_devices_evenly(global_batch: int, size: int) -> None:
    """A micro-batch size the mini-batches do not divide, or one beyond them, still splits the batch evenly
    between two equal devices: each sample is priced, not each micro-batch at the size asked for (which
    had made 31 + 1 as fast as 16 + 16 under --micro-batch 64, and 17 + 15 under 3)."""
    cluster = parse_cluster({"node": [{"name": "n0", "devices": [{"type": "T4", "count": 2}], "nic": "10Gbit/s"}]})
    p = plan(cluster, build_profile("gpt-tiny"), global_batch, strategy="dp", micro_batch_sizes=(size,),
             simulate_top_k=0)
    assert [vw.mini_batch for vw in p.virtual_workers] == [global_batch // 2] * 2
    assert all(vw.micro_batch_size <= min(size, global_batch // 2) for vw in p.virtual_workers)


def test_vw_time_grows_with_every_sample_at_a_fixed_micro_batch_size() -> None:
    cluster = parse_cluster({"node": [{"name": "n0", "devices": [{"type": "T4", "count": 2}], "nic": "10Gbit/s"}]})
    ev = VWEvaluator(cluster, build_profile("gpt-tiny"), [cluster.devices[0]], "1f1b", "adam", True, 1e6, 4, (3,))
    times = [ev.estimate_time(b, 4) for b in range(1, 40)]
    assert all(a < b for a, b in itertools.pairwise(times))


@pytest.mark.slow  # plans and simulates a large cluster
def test_time_to_accuracy_prefers_smaller_global_batch_past_critical() -> None:
    cluster = _cloud()
    profile = build_profile("gpt2-small")
    opts = PlannerOptions(objective="time-to-accuracy", critical_batch=64, global_batch_choices=(64, 256, 1024),
                          simulate_top_k=0, max_tp=1, shard=None)  # TP and ZeRO are not what is tested
    tta = plan(cluster, profile, 256, opts)
    assert tta.prediction.time_to_accuracy_s is not None
    assert tta.global_batch in (64, 256, 1024)
    thr = plan(cluster, profile, 1024, simulate_top_k=0, max_tp=1, shard=None)
    # throughput alone would take the largest batch; past the critical batch TTA does not
    assert tta.global_batch < 1024 or thr.prediction.samples_per_s <= tta.prediction.samples_per_s


def test_model_that_fits_nowhere_says_what_it_needs() -> None:
    tiny = parse_cluster({"node": [{"name": "n", "devices": ["RTX2060", "RTX2060"], "intra_link": "pcie3"}]})
    with pytest.raises(PlannerError, match=r"gpt2-xl fits no arrangement.*needs at least [0-9.]+ GB.*offers is "
                                           r"[0-9.]+ GB"):
        plan(tiny, build_profile("gpt2-xl"), 8, simulate_top_k=0)


def test_global_batch_smaller_than_dp_vws_is_refused() -> None:
    with pytest.raises(PlannerError, match=r"global batch 4 is smaller than the 8 virtual workers.*>= 8"):
        plan(_cloud(), build_profile("gpt2-small"), 4, strategy="dp", simulate_top_k=0, max_tp=1)


def test_pure_pipeline_longer_than_the_model_is_refused() -> None:
    layers = tuple(LayerProfile(f"l{i}", 1e6, 1e5, 1e5, 1e9) for i in range(3))
    with pytest.raises(PlannerError, match="at most one device per layer"):
        plan(_cloud(), ModelProfile("m", layers, 1e3), 64, strategy="pp", simulate_top_k=0)


def test_bad_options_name_the_value() -> None:
    with pytest.raises(ValueError, match="strategy must be"):
        PlannerOptions(strategy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="critical_batch"):
        PlannerOptions(objective="time-to-accuracy")


@pytest.mark.slow  # plans and simulates a large cluster
def test_top_k_reranked_by_simulation() -> None:
    import hetrain

    unscored = plan(_cloud(), build_profile("gpt2-small"), 128, simulate_top_k=3)  # the planner alone: closed forms
    assert unscored.prediction.simulated_iteration_s is None
    p = hetrain.plan(_cloud(), build_profile("gpt2-small"), 128, simulate_top_k=3)  # handed the simulator
    assert p.prediction.simulated_iteration_s is not None
    assert p.prediction.simulated_iteration_s > 0


@pytest.mark.parametrize("seed", range(6))
def test_partition_with_blocking_transfers_matches_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    cluster, profile = random_instance(rng, n=rng.randint(2, 3), layers=rng.randint(3, 6), tight_memory=seed % 2 == 0)
    b, m = rng.choice([1, 2, 4]), rng.randint(1, 8)
    evaluator = VWEvaluator(cluster, profile, list(cluster.devices), "1f1b", "adam", True, 1e9, 10**6, None,
                            blocking=True)
    best = evaluator.best(b, m)
    expected = brute_force(cluster, profile, b, m, "1f1b", pipeline_time=estimate_blocking_pipeline_time)
    if best is None:
        assert not math.isfinite(expected)
        return
    assert expected * (1 - 1e-9) <= best.pipeline_s <= expected * (1 + 1e-3)  # as the search without blocking
    stage_s, link_s = list(best.stage_s), list(best.link_s)
    assert best.pipeline_s == pytest.approx(estimate_blocking_pipeline_time(stage_s, link_s, m), rel=1e-12)
    overlapped = evaluator_of(cluster, profile).best(b, m)
    assert overlapped is not None and overlapped.pipeline_s <= best.pipeline_s * (1 + 1e-12)
    screened = evaluator.best(b, m, fast=True)  # two orders, full recomputation where needed: an upper bound
    if screened is None:
        return
    assert screened.pipeline_s >= best.pipeline_s * (1 - 1e-9)
    assert screened.pipeline_s == pytest.approx(
        estimate_blocking_pipeline_time(list(screened.stage_s), list(screened.link_s), m), rel=1e-12)


def evaluator_of(cluster, profile) -> VWEvaluator:
    return VWEvaluator(cluster, profile, list(cluster.devices), "1f1b", "adam", True, 1e9, 10**6, None)


def test_a_gpipe_plan_that_does_not_fit_says_why_and_what_holds_less() -> None:
    """GPipe holds every micro-batch of a stage's share at once: at a batch where 1F1B fits, the refusal
    names the schedule and the ones that hold less (the one-sample bound it also gives would fit)."""
    cluster = _cloud()
    profile = build_profile("gpt2-medium")
    assert plan(cluster, profile, 512, strategy="pp", schedule="1f1b", simulate_top_k=0) is not None
    with pytest.raises(PlannerError) as err:
        plan(cluster, profile, 512, strategy="pp", schedule="gpipe", simulate_top_k=0)
    message = str(err.value)
    assert "Under --schedule gpipe each stage holds the activations of all its VW's micro-batches" in message
    assert "try --schedule 1f1b (or auto)" in message and "\n" not in message


@pytest.mark.slow  # plans and simulates a large cluster
def test_a_node_behind_a_slow_nic_is_left_out_where_that_is_faster() -> None:
    """Two RTX 3090s behind a 1 Gbit/s NIC beside 8 A100s on 100 Gbit/s: every plan that uses them sends a
    pipeline's activations or an all-reduce through that NIC. The planner also plans without the node of the
    slowest NIC and keeps that plan, the RTXs unused, where it is faster by 10% or more; asked to use every
    device, it does."""
    import hetrain
    from hetrain.planner.search import cluster_without, leave_out_candidates

    cluster = parse_cluster({"name": "mixed", "node": [
        {"name": "a", "devices": [{"type": "A100-40GB", "count": 4}], "intra_link": "nvlink3", "nic": "100Gbit/s"},
        {"name": "b", "devices": [{"type": "A100-40GB", "count": 4}], "intra_link": "nvlink3", "nic": "100Gbit/s"},
        {"name": "rtx", "devices": [{"type": "RTX3090", "count": 2}], "intra_link": "pcie4", "nic": "1Gbit/s"}]})
    profile = build_profile("gpt2-medium")
    assert leave_out_candidates(cluster, profile) == [frozenset({"rtx"})]  # slowest NIC and least compute
    part = cluster_without(cluster, frozenset({"rtx"}))
    assert [d.name for d in part.devices] == [d.name for d in cluster.devices[:8]]
    assert [d.index for d in part.devices] == list(range(8))

    every = hetrain.plan(cluster, profile, 256, leave_out=False, max_tp=1)
    best = hetrain.plan(cluster, profile, 256, max_tp=1)  # at TP 4 the RTX node forms no group: out anyway
    assert every.unused_devices == [] and best.unused_devices == ["rtx:0", "rtx:1"]
    assert best.options["left_out"] == ["rtx"] and best.cluster is cluster
    assert best.prediction.simulated_iteration_s < 0.9 * every.prediction.simulated_iteration_s
    # the same cluster's nodes alike in NIC and compute: nothing to leave out
    alike = parse_cluster({"name": "alike", "node": [
        {"name": n, "devices": [{"type": "A100-40GB", "count": 4}], "nic": "100Gbit/s"} for n in ("a", "b")]})
    assert leave_out_candidates(alike, profile) == []


@pytest.mark.parametrize("seed", range(4))
def test_a_coarse_partition_does_not_depend_on_which_vw_asked_first(seed: int) -> None:
    """VWs that share an evaluator ask for coarse partitions with their own reference micro-batch counts; each
    gets the one of its own count, whatever the others asked before (the search's call order decided it once)."""
    rng = random.Random(2000 + seed)
    cluster, profile = random_instance(rng, n=3, layers=rng.randint(4, 7), tight_memory=seed % 2 == 0)
    b, m_first, m_then = rng.choice([1, 2]), rng.randint(8, 16), rng.randint(24, 48)
    asked_both = evaluator_of(cluster, profile)
    asked_both.coarse(b, m_first)
    alone = evaluator_of(cluster, profile)
    got, want = asked_both.coarse(b, m_then), alone.coarse(b, m_then)
    assert (got is None) == (want is None)
    if want is not None and got is not None:
        assert (got.m, got.cuts, got.sum_s, got.max_s) == (want.m, want.cuts, want.sum_s, want.max_s)
        assert got.m == m_then
    assert asked_both.estimate_time(4 * b * m_then, m_then) == alone.estimate_time(4 * b * m_then, m_then)

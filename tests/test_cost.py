"""Cost formulas against hand-computed values."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hetrain.cluster import Link, parse_cluster
from hetrain.cost import (
    LOSS_BACKWARD_OUTPUTS,
    LOSS_KEPT_OUTPUTS,
    ZERO2_IN_FLIGHT_BYTES,
    allreduce_shape,
    estimate_1f1b_period,
    estimate_1f1b_pipeline_time,
    estimate_allreduce,
    estimate_blocking_pipeline_time,
    estimate_hierarchical_allreduce_time,
    estimate_layer_time,
    estimate_optimizer_step_memory,
    estimate_optimizer_time,
    estimate_p2p_time,
    estimate_pipeline_time,
    estimate_ring_allreduce_time,
    estimate_roofline_time,
    estimate_samples_to_accuracy_factor,
    estimate_stage_memory,
    estimate_weight_memory,
    in_flight,
    interpolate_measurements,
    loss_memory_per_sample,
    most_in_flight,
    zero2_transient_bytes,
)
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile


def test_p2p_is_latency_plus_bytes_over_bandwidth() -> None:
    assert estimate_p2p_time(1e9, Link(1.25e9, 10e-6)) == pytest.approx(0.8 + 10e-6)
    assert estimate_p2p_time(0, Link(1.25e9, 10e-6)) == 0.0


def test_ring_allreduce_hand_value() -> None:
    # 4 members, 100 MB, 10 GB/s, 5 us: 2*3*5us + 2*3/4 * 1e8/1e10 = 30us + 15 ms
    assert estimate_ring_allreduce_time(1e8, 4, 1e10, 5e-6) == pytest.approx(30e-6 + 0.015)
    assert estimate_ring_allreduce_time(1e8, 1, 1e10, 5e-6) == 0.0


def test_roofline_takes_the_binding_limit() -> None:
    # 1 TFLOP on 100 TFLOP/s = 10 ms; 1 GB over 1 TB/s = 1 ms; efficiency 0.5 doubles it
    assert estimate_roofline_time(1e12, 1e9, 100e12, 1e12, 0.5) == pytest.approx(0.02)
    assert estimate_roofline_time(1e9, 1e10, 100e12, 1e12, 1.0) == pytest.approx(0.01)


def test_pipeline_closed_form() -> None:
    # stages 2, 3, 1 s (+ a 0.5 s transfer as its own stage), 4 micro-batches: 6.5 + 3 * 3
    assert estimate_pipeline_time([2.0, 0.5, 3.0, 1.0], 4) == pytest.approx(15.5)
    with pytest.raises(ValueError, match="micro-batch count"):
        estimate_pipeline_time([1.0], 0)


def test_one_f_one_b_closed_form_by_hand() -> None:
    # stages 2, 3, 1 s, transfers 0.5 and 1 s (activation + gradient), 8 micro-batches. Cycles: stage 1 alone 3;
    # stages 0-1: (2 + 0.5 + 3) / 2 = 2.75; 1-2: (3 + 1 + 1) / 2 = 2.5; 0-2: (6 + 1.5) / 3 = 2.5. Period 3, as
    # GPipe's; with a 2.5 s link between stages 1 and 2 the pair turns in (3 + 2.5 + 1) / 2 = 3.25 s
    assert estimate_1f1b_period([2.0, 3.0, 1.0], [0.5, 1.0], 8) == pytest.approx(3.0)
    assert estimate_1f1b_period([2.0, 3.0, 1.0], [0.5, 2.5], 8) == pytest.approx(3.25)
    assert estimate_1f1b_pipeline_time([2.0, 3.0, 1.0], [0.5, 2.5], 8) == pytest.approx(9.0 + 7 * 3.25)
    # 4 stages of 1 s, links of 0.6 s: the whole pipeline's cycle, (4 + 1.8) / 4; under 1F1B-eager the cycles
    # through the last stage hold one micro-batch more, and stages 0-2 bind: (3 + 1.2) / 3
    assert estimate_1f1b_period([1.0] * 4, [0.6] * 3, 16) == pytest.approx(1.45)
    assert estimate_1f1b_period([1.0] * 4, [0.6] * 3, 16, "1f1b-eager") == pytest.approx(1.4)
    # 2 micro-batches: no stage but the last has a steady state (stage j's warm-up p - j - 1 > m - 2), no cycle
    assert estimate_1f1b_period([1.0] * 4, [0.6] * 3, 2) == pytest.approx(1.0)
    # no transfers: GPipe's form
    assert estimate_1f1b_pipeline_time([2.0, 3.0, 1.0], [0.0, 0.0], 4) == estimate_pipeline_time([2.0, 3.0, 1.0], 4)
    with pytest.raises(ValueError, match="2 links"):
        estimate_1f1b_period([1.0] * 3, [0.5], 4)
    with pytest.raises(ValueError, match="micro-batch count"):
        estimate_1f1b_pipeline_time([1.0], [], 0)


def test_in_flight_per_schedule() -> None:
    assert [in_flight("1f1b", 8, 4, j) for j in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 2, 4, j) for j in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 8, 4, j) for j in range(4)] == [8] * 4
    # one more on every stage but the last, never more than m
    assert [in_flight("1f1b-eager", 8, 4, j) for j in range(4)] == [5, 4, 3, 1]
    assert [in_flight("1f1b-eager", 3, 4, j) for j in range(4)] == [3, 3, 3, 1]
    assert [most_in_flight(s, 4) for s in ("1f1b", "1f1b-eager", "gpipe")] == [4, 5, None]


def test_weight_memory_per_optimizer() -> None:
    # 1e6 fp32 params (4 MB): params + grads = 8 MB; Adam adds 8 MB; SGD none
    assert estimate_weight_memory(4e6, 4, "sgd") == pytest.approx(8e6)
    assert estimate_weight_memory(4e6, 4, "adam") == pytest.approx(16e6)
    assert estimate_weight_memory(4e6, 4, "momentum") == pytest.approx(12e6)
    # 16-bit compute over the same 1e6 fp32 params: the same 16 MB, and autocast's 2-byte copy of each weight
    assert estimate_weight_memory(4e6, 2, "adam") == pytest.approx(16e6 + 2e6)
    assert estimate_weight_memory(4e6, 2, "sgd") == pytest.approx(8e6 + 2e6)


def _profile() -> ModelProfile:
    layers = (
        LayerProfile("a", 4e6, 100.0, 1000.0, 1e9),
        LayerProfile("b", 4e6, 200.0, 3000.0, 1e9),
        LayerProfile("c", 4e6, 50.0, 500.0, 1e9),
    )
    return ModelProfile("p", layers, 10.0, "fp32", 1.0)


def test_stage_memory_with_and_without_recompute() -> None:
    p = _profile()
    # layers [0, 2), b = 4, 2 in flight, SGD: weights 2 * 8 MB; activations 2 * 4 * (1000+3000)
    assert estimate_stage_memory(p, 0, 2, (), 4, 2, "sgd") == pytest.approx(16e6 + 8 * 4000)
    # recompute layer 1: it keeps its input (layer 0's output, 100 B) instead of 3000 B,
    # and its 3000 B/sample come back for one micro-batch of 4 while recomputed
    assert estimate_stage_memory(p, 0, 2, (1,), 4, 2, "sgd") == pytest.approx(16e6 + 8 * 1100 + 4 * 3000)


def test_the_optimizer_step_peaks_when_weights_dominate() -> None:
    """Adam's step holds one more fp32 word per parameter; the peak is the larger of that and the activations'."""
    assert estimate_optimizer_step_memory(8e6, 4, "adam") == 8e6
    assert estimate_optimizer_step_memory(8e6, 2, "adam") == 8e6  # the parameters are fp32 under 16-bit compute too
    assert estimate_optimizer_step_memory(8e6, 4, "momentum") == estimate_optimizer_step_memory(8e6, 4, "sgd") == 0
    p = _profile()
    weights = estimate_weight_memory(8e6, 4, "adam")  # layers [0, 2)
    # activations 2 * 4 * 4000 B are far below the step's 8 MB: the step sets the peak
    assert estimate_stage_memory(p, 0, 2, (), 4, 2, "adam") == pytest.approx(weights + 8e6)
    assert estimate_stage_memory(p, 0, 2, (), 4, 2, "adam", with_step=False) == pytest.approx(weights + 8 * 4000)
    # with SGD there is no step transient
    assert estimate_stage_memory(p, 0, 2, (), 4, 2, "sgd") == pytest.approx(16e6 + 8 * 4000)


def test_the_last_stage_holds_the_loss() -> None:
    """The loss keeps one last-layer output per sample in flight, and its backward holds two more."""
    p = _profile()
    assert loss_memory_per_sample(p) == (LOSS_KEPT_OUTPUTS * 50.0, LOSS_BACKWARD_OUTPUTS * 50.0)
    # layers [0, 3), b = 4, 2 in flight: 2 * 4 * (1000+3000+500 + 50) kept, 4 * 2 * 50 in the loss's backward
    assert estimate_stage_memory(p, 0, 3, (), 4, 2, "sgd") == pytest.approx(24e6 + 8 * 4550 + 4 * 100)
    # with layer 1 recomputed, its transient and the loss's add up (an upper bound where they coincide)
    assert estimate_stage_memory(p, 0, 3, (1,), 4, 2, "sgd") == pytest.approx(24e6 + 8 * 1650 + 4 * 3000 + 4 * 100)
    # a stage that does not end the model holds no loss
    assert estimate_stage_memory(p, 1, 2, (), 4, 2, "sgd") == pytest.approx(8e6 + 8 * 3000)


def test_layer_time_interpolates_scales_and_falls_back_to_roofline() -> None:
    layers = (LayerProfile("a", 0.0, 0.0, 0.0, 1e9, measured=(
        ("T4", (Measurement(1, 0.010, 0.020), Measurement(4, 0.025, 0.050))),)),)
    p = ModelProfile("p", layers, 0.0, "fp32", 1.0, measured_on=(("T4", DeviceFigures(8.1e12, 320e9)),))
    cluster = parse_cluster({"node": [{"name": "n", "devices": ["T4", "A100-40GB"]}]})
    t4, a100 = cluster.devices
    assert estimate_layer_time(p, 0, t4, 2) == pytest.approx((0.015, 0.030))
    # A100 fp32 is 19.5 / 8.1 faster on this compute-bound layer
    fwd, bwd = estimate_layer_time(p, 0, a100, 4)
    assert fwd == pytest.approx(0.025 * 8.1 / 19.5)
    assert bwd == pytest.approx(0.050 * 8.1 / 19.5)
    unmeasured = ModelProfile("q", (LayerProfile("a", 0.0, 0.0, 0.0, 1e9),), 0.0, "fp32", 0.5)
    assert estimate_layer_time(unmeasured, 0, a100, 2)[0] == pytest.approx(2e9 / 19.5e12 / 0.5)


def test_interpolation_outside_and_single_point() -> None:
    ms = (Measurement(2, 0.02, 0.04),)
    assert interpolate_measurements(ms, 6) == pytest.approx((0.06, 0.12))
    two = (Measurement(2, 0.02, 0.04), Measurement(4, 0.03, 0.06))
    assert interpolate_measurements(two, 8) == pytest.approx((0.05, 0.10))


def test_hierarchical_beats_flat_ring_across_slow_nodes() -> None:
    cluster = parse_cluster({"node": [
        {"name": "a", "devices": [{"type": "A100-40GB", "count": 4}], "intra_link": "nvlink3", "nic": "10Gbit/s"},
        {"name": "b", "devices": [{"type": "A100-40GB", "count": 4}], "intra_link": "nvlink3", "nic": "10Gbit/s"},
    ]})
    shape = allreduce_shape(cluster, range(8))
    assert shape.nodes == 2 and shape.intra_p == 4
    assert shape.ring_bandwidth_bytes_per_s == pytest.approx(1.25e9)
    t, algo = estimate_allreduce(1e9, shape)
    assert algo == "hierarchical"
    # intra: 3/4 * 1e9 / 300e9 + 3 * 2us, twice; inter: ring of 2 over 1.25 GB/s: 2 * 1/2 * 1e9/1.25e9 + 2 * 20us
    intra = 0.75 * 1e9 / 300e9 + 3 * 2e-6
    inter = 1e9 / 1.25e9 + 2 * 20e-6
    assert t == pytest.approx(2 * intra + inter)
    assert t == pytest.approx(estimate_hierarchical_allreduce_time(1e9, shape))


def test_ring_order_maximises_the_slowest_link() -> None:
    # four nodes; a-c and b-d are slow overrides: the best ring avoids both (a b c d a)
    nodes = [{"name": x, "devices": ["T4"], "nic": "100Gbit/s"} for x in "abcd"]
    links = [{"nodes": ["a", "c"], "bandwidth": "1Gbit/s"}, {"nodes": ["b", "d"], "bandwidth": "1Gbit/s"}]
    cluster = parse_cluster({"node": nodes, "link": links})
    shape = allreduce_shape(cluster, range(4))
    assert shape.ring_bandwidth_bytes_per_s == pytest.approx(100e9 / 8)
    order = [cluster.devices[d].node for d in shape.order]
    for x, y in zip(order, order[1:] + order[:1], strict=True):
        assert {x, y} not in ({"a", "c"}, {"b", "d"})


def test_optimizer_time_and_statistical_efficiency() -> None:
    cluster = parse_cluster({"node": [{"name": "n", "devices": ["A100-40GB"]}]})
    # Adam fp32, 4 GB of params: 16 GB of weight memory read and written at 1555 GB/s
    assert estimate_optimizer_time(4e9, 4, cluster.devices[0], "adam") == pytest.approx(32e9 / 1555e9)
    assert estimate_samples_to_accuracy_factor(256, 256) == 2.0
    assert math.isclose(estimate_samples_to_accuracy_factor(1, 1e9), 1.0, rel_tol=1e-6)


def _with_rates(rates: dict[str, dict[str, float]]) -> ModelProfile:
    """``_profile()`` with measured optimizer steps (seconds per parameter byte per type and optimizer)."""
    return dataclasses.replace(_profile(), optimizer_step_s_per_byte=tuple(
        (t, tuple(r.items())) for t, r in rates.items()))


def test_optimizer_time_uses_the_measured_rate_scaled_or_the_formula() -> None:
    cluster = parse_cluster({"node": [{"name": "n", "devices": ["T4", "A100-40GB", "V100-16GB"]}]})
    t4, a100, v100 = cluster.devices
    formula = 2 * 16e6 / 1555e9  # Adam fp32: 16 MB of weight memory read and written at the A100's 1555 GB/s
    bare = _profile()
    assert estimate_optimizer_time(4e6, 4, a100, "adam", bare) == pytest.approx(formula)
    assert estimate_optimizer_time(4e6, 4, a100, "adam") == pytest.approx(formula)
    p = dataclasses.replace(_with_rates({"A100-40GB": {"adam": 5e-11}, "T4": {"sgd": 1e-10}}),
                            measured_on=(("T4", DeviceFigures(8.1e12, 320e9)),))
    assert estimate_optimizer_time(4e6, 4, a100, "adam", p) == pytest.approx(4e6 * 5e-11)  # measured here
    assert estimate_optimizer_time(4e6, 4, a100, "adamw", p) == pytest.approx(4e6 * 5e-11)
    # measured on the T4 only: scaled by the memory bandwidths, the T4's from measured_on, the A100's 1555 GB/s
    assert estimate_optimizer_time(4e6, 4, a100, "sgd", p) == pytest.approx(4e6 * 1e-10 * 320e9 / 1555e9)
    # adam on the V100: the A100's rate (figures from the catalog) times 1555 / 900 GB/s
    assert estimate_optimizer_time(4e6, 4, v100, "adam", p) == pytest.approx(4e6 * 5e-11 * 1555e9 / 900e9)
    # momentum was measured nowhere: the formula (12 MB of weight memory at the T4's 320 GB/s)
    assert estimate_optimizer_time(4e6, 4, t4, "momentum", p) == pytest.approx(2 * 12e6 / 320e9)


def test_a_type_without_figures_is_not_scaled_from() -> None:
    cluster = parse_cluster({"node": [{"name": "n", "devices": ["A100-40GB"]}]})
    p = _with_rates({"my-npu": {"sgd": 1e-6}})  # neither in measured_on nor in the catalog
    assert estimate_optimizer_time(4e6, 4, cluster.devices[0], "sgd", p) == pytest.approx(2 * 8e6 / 1555e9)


def test_estimate_allreduce_can_be_held_to_the_flat_ring() -> None:
    from hetrain.cost import allreduce_shape, estimate_allreduce, estimate_ring_allreduce_time

    cluster = parse_cluster({"name": "2x2", "node": [
        {"name": n, "devices": [{"type": "cpu", "count": 2}], "intra_link": "100Gbit/s", "nic": "100Mbit/s"}
        for n in ("n0", "n1")]})
    shape = allreduce_shape(cluster, [0, 1, 2, 3])
    best, algorithm = estimate_allreduce(8e6, shape)
    ring, flat = estimate_allreduce(8e6, shape, "ring")
    assert (algorithm, flat) == ("hierarchical", "ring") and ring > best
    assert ring == estimate_ring_allreduce_time(8e6, 4, shape.ring_bandwidth_bytes_per_s, shape.ring_latency_s)
    held, forced = estimate_allreduce(8e6, shape, "hierarchical")  # a decision already taken (sync layout)
    assert (held, forced) == (best, "hierarchical")
    with pytest.raises(ValueError, match="one of auto, ring, hierarchical, got 'tree'"):
        estimate_allreduce(8e6, shape, "tree")


def test_the_blocking_pipeline_holds_each_stage_for_the_transfers_on_both_its_sides() -> None:
    # stages 1, 2, 1 s; links 0.5 and 0.25 s: the middle stage is held 2 + 0.5 + 0.25 = 2.75 s per micro-batch
    assert estimate_blocking_pipeline_time([1.0, 2.0, 1.0], [0.5, 0.25], 3) == pytest.approx(4.75 + 2 * 2.75)
    assert estimate_blocking_pipeline_time([3.0], [], 4) == pytest.approx(12.0)  # one stage: no transfer
    with pytest.raises(ValueError, match="3 stages have 2 links between them, got 1 link times"):
        estimate_blocking_pipeline_time([1.0, 2.0, 1.0], [0.5], 2)
    with pytest.raises(ValueError, match="micro-batch count must be >= 1, got 0"):
        estimate_blocking_pipeline_time([1.0], [], 0)


def test_zero2_transient_is_two_buckets_or_the_largest_layer_at_most_the_unkept_share() -> None:
    """Two DDP buckets by default, two of the plan's where given, the largest layer where it is larger; never more
    than the gradients the owner does not keep."""
    assert ZERO2_IN_FLIGHT_BYTES == 2 * 25 * 2**20
    assert zero2_transient_bytes(1e9, 10e6, 0.25) == ZERO2_IN_FLIGHT_BYTES
    assert zero2_transient_bytes(1e9, 80e6, 0.25) == 80e6
    assert zero2_transient_bytes(1e9, 10e6, 0.25, bucket_bytes=1e6) == 10e6
    assert zero2_transient_bytes(1e9, 1e6, 0.25, bucket_bytes=4e6) == 8e6
    assert zero2_transient_bytes(1e9, 10e6, 0.996, bucket_bytes=4e6) == pytest.approx(4e6)

"""Which segments DDP's reducer sums (``runtime.sync.reducer.reducer_segments``), and the caps that cut its buckets
where the plan cuts its own (``bucket_caps_mb``). No process group: the multi-rank runs are in
``tests/distributed/test_runtime_ddp.py``."""

from __future__ import annotations

import pytest
from torch import nn

from factories import make_cluster, make_plan, mlp_digits_profile
from hetrain.runtime.sync.reducer import bucket_caps_mb, reducer_segments

D = [f"n0:{k}" for k in range(4)]


def plan_of(vws: list[tuple[list[str], list[int], int, int]], **options: object):
    return make_plan(make_cluster({"n0": 4}), mlp_digits_profile(), vws, **options)


def test_pure_dp_and_stages_cut_alike_go_to_ddp() -> None:
    assert reducer_segments(plan_of([([D[0]], [0, 3], 8, 1), ([D[1]], [0, 3], 8, 1)])) == {0}
    same_cut = plan_of([([D[0], D[1]], [0, 1, 3], 8, 2), ([D[2], D[3]], [0, 1, 3], 8, 2)])
    assert [s.owners for s in same_cut.segments()] == [(D[0], D[2]), (D[1], D[3])]
    assert reducer_segments(same_cut) == {0, 1}


def test_segments_that_split_a_stage_keep_hetrains_buckets() -> None:
    cut_apart = plan_of([([D[0], D[1]], [0, 1, 3], 8, 2), ([D[2], D[3]], [0, 2, 3], 8, 2)])
    assert len(cut_apart.segments()) == 3 and reducer_segments(cut_apart) == frozenset()
    # one VW alone: nothing shared, nothing to sum
    assert reducer_segments(plan_of([([D[0], D[1]], [0, 1, 3], 8, 2)])) == frozenset()


def test_other_sync_modes_and_hierarchical_all_reduces_keep_hetrains_path() -> None:
    vws = [([D[0]], [0, 3], 8, 1), ([D[1]], [0, 3], 8, 1)]
    assert reducer_segments(plan_of(vws, sync="wsp")) == frozenset()
    cluster = make_cluster({"a": 2, "b": 2}, intra_link="100Gbit/s", nic="10Mbit/s")
    vws = [([d], [0, 3], 8, 1) for d in ("a:0", "a:1", "b:0", "b:1")]
    two_nodes = make_plan(cluster, mlp_digits_profile(), vws)
    (seg,) = two_nodes.segments()
    assert "hierarchical" in {seg.algorithm, *(b.algorithm for b in seg.buckets)}  # the layout's choice
    assert reducer_segments(two_nodes) == frozenset()
    ring = make_plan(cluster, mlp_digits_profile(), vws, allreduce="ring")
    assert reducer_segments(ring) == {0}


def test_caps_cut_where_the_plans_buckets_end_a_cut_parameter_going_to_the_later_layers() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)]  # elements: w0 [0,16) b0 [16,20) w1 [20,28) b1 [28,30)
    mib = 4 / 2**20  # bytes of one float32
    # buckets on parameter boundaries: [20, 30) and [0, 20)
    assert bucket_caps_mb(layers, [(20, 30), (0, 20)]) == pytest.approx([10 * mib, 20 * mib])
    # a bound inside w1 (at 24): w1 ends in the later bucket [24, 30), so it holds w1 and b1
    assert bucket_caps_mb(layers, [(24, 30), (0, 24)]) == pytest.approx([10 * mib, 20 * mib])
    # a bucket inside one parameter holds none: dropped
    assert bucket_caps_mb(layers, [(26, 30), (22, 26), (0, 22)]) == pytest.approx([10 * mib, 20 * mib])

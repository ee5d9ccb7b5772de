"""The sync layout: decided once from the stages and the options, written to plan.json, checked when read."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from factories import make_cluster, make_plan, replicas
from hetrain.cluster import Cluster, parse_cluster
from hetrain.errors import InputError
from hetrain.models.analytic import build_profile
from hetrain.plan import DeviceMemory, Plan, PlanError, Stage, VirtualWorker, parse_plan
from hetrain.schedule import ActionKind, build_schedule
from hetrain.sync_layout import (
    PsShard,
    SyncLayoutError,
    SyncOptions,
    cut_bounds,
    cut_buckets,
    cut_buckets_exact,
    group_segments,
    place_ps_shards,
)


def two_by_two(nic: str = "100Mbit/s") -> Cluster:
    return make_cluster({"n0": 2, "n1": 2}, intra_link="100Gbit/s", nic=nic, name="2x2")


def dp_plan(mode: str, **options: Any) -> Plan:
    """Four one-stage VWs of gpt-tiny over two nodes."""
    return make_plan(two_by_two(), build_profile("gpt-tiny"), replicas(("n0:0", "n0:1", "n1:0", "n1:1"), 6, 4),
                     sync=mode, **options)


def test_segments_group_layers_by_owner_set() -> None:
    stages = [[("a", 0, 2), ("b", 2, 6)], [("c", 0, 3), ("d", 3, 6)]]
    assert group_segments(6, stages) == [(0, 2, ("a", "c")), (2, 3, ("b", "c")), (3, 6, ("b", "d"))]


def test_segments_match_grouping_layer_by_layer() -> None:
    """``group_segments`` works run by run between stage bounds: against each layer's owners, grouped (stages
    dropped at random leave layers of no owner)."""
    rng = random.Random(0)
    for _ in range(200):
        num_layers = rng.randint(1, 12)
        layouts = []
        for v in range(rng.randint(1, 5)):
            cuts = sorted({0, num_layers, *rng.sample(range(1, num_layers + 1), rng.randint(0, num_layers - 1))})
            layouts.append([(f"d{v}.{j}", k, l) for j, (k, l) in enumerate(itertools.pairwise(cuts))
                            if rng.random() < 0.9])
        per_layer = [tuple(sorted(d for layout in layouts for d, k, l in layout if k <= i < l))
                     for i in range(num_layers)]
        expected, start = [], 0
        for owners, run in itertools.groupby(per_layer):
            end = start + len(list(run))
            expected.append((start, end, owners))
            start = end
        assert group_segments(num_layers, layouts) == expected


def test_buckets_are_cut_from_the_last_layers_and_never_split_a_layer() -> None:
    assert cut_buckets([1.0] * 6, 0, 6, 1.5, 2.5) == [(4, 6, 2.0), (1, 4, 3.0), (0, 1, 1.0)]
    assert cut_buckets([10.0, 1.0], 0, 2, 1.0, 100.0) == [(1, 2, 1.0), (0, 1, 10.0)]


def test_exact_buckets_close_at_their_size_inside_a_layer() -> None:
    # 1.5 bytes from the end: the last 75% of layer 5's 2 bytes; then 2.5 bytes at a time, the rest last
    assert cut_buckets_exact([2.0] * 6, 0, 6, 1.5, 2.5) == [
        (5.25, 6.0, 1.5), (4.0, 5.25, 2.5), (2.75, 4.0, 2.5), (1.5, 2.75, 2.5), (0.25, 1.5, 2.5), (0.0, 0.25, 0.5)]
    # a bound on a layer boundary stays there; the first layers' rest is the last bucket, whatever its size
    assert cut_buckets_exact([1.0, 1.0, 2.0], 0, 3, 2.0, 8.0) == [(2.0, 3.0, 2.0), (0.0, 2.0, 2.0)]
    # layers without parameters go with their neighbours; a segment of none is one empty bucket
    assert cut_buckets_exact([0.0, 4.0, 0.0], 0, 3, 1.0, 8.0) == [(1.75, 3.0, 1.0), (0.0, 1.75, 3.0)]
    assert cut_buckets_exact([0.0], 0, 1, 1.0, 8.0) == [(0.0, 1.0, 0.0)]


def test_exact_buckets_hold_the_segment_once_and_none_exceeds_its_size() -> None:
    sizes = [float(x.param_bytes) for x in build_profile("gpt-tiny").layers]
    for first_bytes, other_bytes in ((2**20, 25 * 2**20), (20_000.0, 60_000.0), (3e5, 1e5)):
        cuts = cut_buckets_exact(sizes, 1, 6, first_bytes, other_bytes)
        assert cuts[0][1] == 6.0 and cuts[-1][0] == 1.0
        assert all(a[0] == b[1] for a, b in itertools.pairwise(cuts))  # each ends where the one before starts
        assert sum(c[2] for c in cuts) == pytest.approx(sum(sizes[1:6]), rel=1e-12)
        assert cuts[0][2] == pytest.approx(min(first_bytes, sum(sizes[1:6])))
        assert all(c[2] <= other_bytes * (1 + 1e-12) for c in cuts[1:])
        for lo, hi, size in cuts:  # a bucket's bytes are the shares of the layers its bounds give
            share = sum(sizes[k] * (min(hi, k + 1) - max(lo, k)) for k in range(1, 6) if lo < k + 1 and hi > k)
            assert size == pytest.approx(share, rel=1e-9)


def test_exact_bucket_cut_is_an_option_recorded_in_the_plan() -> None:
    layer = dp_plan("bsp")
    assert layer.sync_options.bucket_cut == "layer"
    assert [(b.first_layer, b.end_layer, b.span) for b in layer.segments()[0].buckets] == [(3, 6, None), (0, 3, None)]
    plan = dp_plan("bsp", bucket_cut="exact")
    buckets = plan.segments()[0].buckets
    assert buckets[0].param_bytes == 2**20  # DistributedDataParallel's first bucket, to the byte
    lo, hi = buckets[0].span or (0, 0)
    assert (buckets[0].first_layer, buckets[0].end_layer, hi) == (3, 6, 6.0) and 3 < lo < 4
    assert (buckets[1].first_layer, buckets[1].end_layer, buckets[1].span) == (0, 4, (0.0, lo))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["sync"]["segments"][0]["buckets"][0]["span"] == [lo, 6.0]
    assert "span" not in json.loads(json.dumps(layer.to_dict()))["sync"]["segments"][0]["buckets"][0]
    back = parse_plan(data)
    assert back.layout == plan.layout and back.sync_options.bucket_cut == "exact"
    data["sync"]["segments"][0]["buckets"][0]["span"] = [3.5, 6.0]
    with pytest.raises(PlanError, match=r"sync.segments\[0\].buckets"):
        parse_plan(data)
    with pytest.raises(SyncLayoutError, match="bucket_cut must be one of layer, exact, got 'param'"):
        SyncOptions.from_items(["bucket_cut=param"])


def test_each_mode_records_only_what_it_uses() -> None:
    small = {"first_bucket_bytes": 20_000, "bucket_bytes": 60_000}
    bsp, wsp, daso = dp_plan("bsp", **small), dp_plan("wsp", **small), dp_plan("daso", **small)
    (seg,) = bsp.segments()
    layer_bytes = [x.param_bytes for x in bsp.profile.layers]
    cuts = cut_buckets(layer_bytes, 0, 6, 20_000, 60_000)
    assert [(b.first_layer, b.end_layer, b.param_bytes) for b in seg.buckets] == cuts and len(cuts) > 2
    assert not seg.ps_shards and not seg.local_groups
    # 100 Mbit/s between nodes, 100 Gbit/s inside: every all-reduce goes hierarchical
    assert seg.algorithm == "hierarchical" and {b.algorithm for b in seg.buckets} == {"hierarchical"}
    # one shard per node, even halves (equal NICs), kept by owner s mod 2 of each node: n0:0 and n1:0
    assert wsp.segments()[0].ps_shards == (PsShard("n0:0", 0.5), PsShard("n1:0", 0.5))
    assert not wsp.segments()[0].buckets
    assert daso.segments()[0].local_groups == (("n0:0", "n0:1"), ("n1:0", "n1:1"))
    ring = dp_plan("bsp", allreduce="ring", **small)
    assert {b.algorithm for b in ring.segments()[0].buckets} == {"ring"}


def test_schedule_reads_the_buckets_of_the_layout() -> None:
    plan = dp_plan("bsp", first_bucket_bytes=20_000, bucket_bytes=60_000)
    starts = [a for a in build_schedule(plan)["n0:0"] if a.kind is ActionKind.ALLREDUCE_START]
    assert [(a.segment, a.bucket) for a in starts] == [(0, b) for b in range(len(plan.segments()[0].buckets))]
    assert len(starts) > 2


def test_the_sync_section_round_trips() -> None:
    plan = dp_plan("hybrid-ps", staleness=2, aggregate=3)
    data = json.loads(json.dumps(plan.to_dict()))
    section = data["sync"]
    assert section["mode"] == "hybrid-ps" and section["options"]["staleness"] == 2
    assert section["segments"][0]["ps_shards"] == [{"host": "n0:0", "fraction": 0.5},
                                                   {"host": "n1:0", "fraction": 0.5}]
    assert section["segments"][0]["local_groups"]
    back = parse_plan(data)
    assert back.layout == plan.layout and back.sync_options == plan.sync_options


@pytest.mark.parametrize("field, value, words", [
    ("ps_shards", [{"host": "n0:0", "fraction": 1.0}], "sync.segments[0].ps_shards: [{'host': 'n0:0'"),
    ("ps_shards", [{"host": "n0:1", "fraction": 0.5}, {"host": "n1:0", "fraction": 0.5}],
     "sync.segments[0].ps_shards: [{'host': 'n0:1'"),
    ("ps_shards", [{"host": "n0:0", "fraction": 0.6}, {"host": "n1:0", "fraction": 0.4}],
     "sync.segments[0].ps_shards: [{'host': 'n0:0', 'fraction': 0.6}"),
    ("owners", ["n0:0", "n0:1"], "sync.segments[0].owners"),
    ("algorithm", "ring", "sync.segments[0].algorithm: 'ring'"),
    ("layers", [0, 5], "sync.segments[0].layers"),
])
def test_a_hand_edited_layout_is_refused_naming_the_segment(field: str, value: Any, words: str) -> None:
    data = json.loads(json.dumps(dp_plan("wsp").to_dict()))
    data["sync"]["segments"][0][field] = value
    with pytest.raises(PlanError) as e:
        parse_plan(data)
    assert words in str(e.value) and "hetrain plan --from" in str(e.value)
    parse_plan(data, check_layout=False)  # what --from reads: the layout is made anew


def test_a_missing_segment_is_refused() -> None:
    data = dp_plan("bsp").to_dict()
    data["sync"]["segments"] = []
    with pytest.raises(PlanError, match="sync has 0 segments, the stages give 1"):
        parse_plan(data)


@pytest.mark.parametrize("options, words", [
    ({"period": 0}, "period must be in [1, 100000], got 0"),
    ({"period": 2.5}, "period must be an integer in [1, 100000], got 2.5"),
    ({"staleness": True}, "staleness must be an integer"),
    ({"staleness": "2"}, None),  # a string that parses is read as the number
    ({"bucket_bytes": -1}, "bucket_bytes must be in [1, "),
    ({"placement": "far"}, "placement must be one of sharded, local, round-robin, got 'far'"),
    ({"lag": 2}, "unknown option 'lag'"),
    ({"period": 10**400}, "period must be an integer in [1, 100000]"),  # too large for a float: still one line
    ({"period": [4]}, "period must be an integer"),
])
def test_sync_options_in_a_plan_file_are_type_checked(options: dict[str, Any], words: str | None) -> None:
    data = dp_plan("wsp").to_dict()
    data["sync"]["options"] = {**data["sync"]["options"], **options}
    if words is None:
        assert parse_plan(data).sync_options.staleness == 2
        return
    with pytest.raises(InputError) as e:
        parse_plan(data)
    assert words in str(e.value) and "sync.options" in str(e.value)


def test_a_sync_option_among_the_plan_options_is_refused() -> None:
    with pytest.raises(PlanError, match=r"'period' is a sync option: it belongs in sync\.options"):
        make_plan(two_by_two(), build_profile("gpt-tiny"), dp_plan("bsp").virtual_workers,
                  planner_options={"period": 4})


def test_a_stage_that_does_not_fit_its_device_is_refused_with_the_numbers() -> None:
    cluster = parse_cluster({"name": "small", "node": [
        {"name": "n0", "devices": [{"type": "cpu", "count": 4, "memory": "8GB"}], "intra_link": "100Gbit/s",
         "nic": "1Gbit/s"}]})
    vws = tuple(VirtualWorker((Stage(d, 0, 6, (), 0.0, 0.0, 1e9),), 4, 1) for d in ("n0:0", "n0:1"))
    make_plan(cluster, build_profile("gpt-tiny"), vws)
    big = (VirtualWorker((Stage("n0:0", 0, 6, (), 0.0, 0.0, 9.1e9),), 4, 1), vws[1])
    with pytest.raises(PlanError, match=r"VW0 stage 0 on n0:0 needs 9\.1 GB, the device has 8\.0 GB"):
        make_plan(cluster, build_profile("gpt-tiny"), big)
    with pytest.raises(PlanError, match=r"VW1 stage 0 on n0:1 needs 12\.0 GB"):
        make_plan(cluster, build_profile("gpt-tiny"), vws, memory=[DeviceMemory("n0:1", 12e9, 8e9)])


def test_with_sync_makes_the_layout_anew() -> None:
    plan = dp_plan("bsp")
    wsp = plan.with_sync("wsp", SyncOptions(placement="round-robin"))
    assert wsp.sync == "wsp" and wsp.segments()[0].ps_shards == (PsShard("n0:0", 1.0),)
    assert not wsp.segments()[0].buckets
    assert plan.segments()[0].buckets and not plan.segments()[0].ps_shards


def test_the_transfers_option_is_overlap_by_default_and_checked() -> None:
    assert SyncOptions().transfers == "overlap"
    assert SyncOptions.from_items(["transfers=blocking"]).transfers == "blocking"
    assert SyncOptions.from_mapping({"transfers": "blocking"}).to_dict()["transfers"] == "blocking"
    with pytest.raises(SyncLayoutError, match="transfers must be one of overlap, blocking, got 'sometimes'"):
        SyncOptions.from_items(["transfers=sometimes"])


# --- sharded parameter servers ---------------------------------------------------------------------------------


def test_a_parameter_server_has_one_shard_per_node_sized_by_its_nic() -> None:
    owners = ["a:0", "a:1", "b:0", "c:0", "c:1"]
    nodes = ["a", "a", "b", "c", "c"]
    nic = {"a": 10e9, "b": 2.5e9, "c": 12.5e9}
    # one shard per node, in the nodes' order; within a node, owner s mod k keeps it
    assert place_ps_shards(owners, nodes, nic, 0) == (("a:0", 0.4), ("b:0", 0.1), ("c:0", 0.5))
    assert place_ps_shards(owners, nodes, nic, 1) == (("a:1", 0.4), ("b:0", 0.1), ("c:1", 0.5))
    # owners all on one node keep one shard; the one-host placements keep theirs
    assert place_ps_shards(["a:0", "a:1"], ["a", "a"], nic, 3) == (("a:1", 1.0),)
    assert place_ps_shards(owners, nodes, nic, 0, "local") == (("a:0", 1.0),)
    assert place_ps_shards(owners, nodes, nic, 1, "round-robin") == (("a:1", 1.0),)
    with pytest.raises(SyncLayoutError, match="placement must be one of sharded, local, round-robin, got 'near'"):
        place_ps_shards(owners, nodes, nic, 0, "near")


def test_shards_cut_the_flat_weights_into_contiguous_ranges() -> None:
    assert cut_bounds([0.4, 0.1, 0.5], 10) == [(0, 4), (4, 5), (5, 10)]
    assert cut_bounds([1.0], 7) == [(0, 7)]
    bounds = cut_bounds([0.333333333, 0.333333333, 0.333333334], 1000)
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def uneven_nics() -> Cluster:
    """Three nodes: two devices on a 10 Gbit/s NIC, two on 10, one on 20 Gbit/s."""
    node = [{"name": name, "devices": [{"type": "cpu", "count": count}], "intra_link": "100Gbit/s", "nic": nic}
            for name, count, nic in (("n0", 2, "10Gbit/s"), ("n1", 2, "10Gbit/s"), ("n2", 1, "20Gbit/s"))]
    return parse_cluster({"name": "uneven", "node": node})


def test_a_plan_shards_each_segment_over_its_owners_nodes_and_round_trips() -> None:
    devices = ("n0:0", "n0:1", "n1:0", "n1:1", "n2:0")
    plan = make_plan(uneven_nics(), build_profile("gpt-tiny"), replicas(devices, 6, 5), sync="wsp")
    (seg,) = plan.segments()
    assert seg.ps_shards == (PsShard("n0:0", 0.25), PsShard("n1:0", 0.25), PsShard("n2:0", 0.5))
    numel = 1001
    assert seg.ps_bounds(numel) == [(0, 250), (250, 500), (500, 1001)]
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["format_version"] == 5
    back = parse_plan(data)
    assert back.layout == plan.layout
    # pipelines: a segment whose owners share one node keeps one shard (segment s: owner s mod 2 of the node)
    vws = (VirtualWorker((Stage("n0:0", 0, 3), Stage("n1:0", 3, 6)), 4, 2),
           VirtualWorker((Stage("n0:1", 0, 3), Stage("n1:1", 3, 6)), 4, 2))
    pp = make_plan(uneven_nics(), build_profile("gpt-tiny"), vws, sync="hybrid-ps")
    assert [seg.ps_shards for seg in pp.segments()] == [(PsShard("n0:0", 1.0),), (PsShard("n1:1", 1.0),)]


def test_a_plan_of_format_4_loads_with_its_one_host_servers() -> None:
    """Format 4 kept each segment's server on one owner (``ps_host``), placed by ``placement``, default local:
    such a plan loads as it was made; one whose host does not follow from its stages is refused."""
    plan = dp_plan("wsp", placement="local")
    data = json.loads(json.dumps(plan.to_dict()))
    data["format_version"] = 4
    row = data["sync"]["segments"][0]
    host = row.pop("ps_shards")[0]["host"]
    row["ps_host"] = host
    del data["sync"]["options"]["placement"]  # the default then was local
    old = parse_plan(data)
    assert old.sync_options.placement == "local" and old.segments()[0].ps_shards == (PsShard(host, 1.0),)
    row["ps_host"] = "n1:1"
    with pytest.raises(PlanError, match=r"sync.segments\[0\].ps_shards: \[\{'host': 'n1:1'.*hetrain plan --from"):
        parse_plan(data)

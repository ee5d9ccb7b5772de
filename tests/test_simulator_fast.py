"""The fast event loop (``fast_engine.run_program_fast``, what ``simulate`` runs) replays exactly what the
reference engine (``engine.run_program``, ``simulate(plan, reference=True)``) does: on random small plans of
every sync mode and both schedules, and on plans whose identical virtual workers tie on shared NICs."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from factories import make_plan
from hetrain.cluster import Cluster, parse_cluster
from hetrain.plan import Plan, Stage, VirtualWorker
from hetrain.profile import LayerProfile, Measurement, ModelProfile
from hetrain.schedule import ActionKind, BucketSync, Compute, ScheduleError, build_schedule
from hetrain.schedule.sync import buckets_by_device
from hetrain.simulator import SimResult, simulate
from hetrain.simulator.compile import compile_program, estimate_stage_costs
from hetrain.simulator.engine import run_program
from hetrain.simulator.fast_engine import run_program_fast
from hetrain.simulator.links import LinkResources, allreduce_phases
from hetrain.simulator.ops import Backward
from hetrain.sync_layout import SyncOptions

TYPES = ("A100-40GB", "V100-16GB", "T4", "RTX3090")
MODES = ("bsp", "wsp", "local-sgd", "hybrid-ps", "daso")
SCHEDULES = ("gpipe", "1f1b")


def random_cluster(rng: random.Random) -> Cluster:
    """2 to 4 nodes of 1 to 4 devices; 2 to 4 device types (the first nodes take one each); links at random."""
    types = rng.sample(TYPES, rng.randint(2, 4))
    nodes = []
    for k in range(rng.randint(2, 4)):
        nodes.append({
            "name": f"n{k}", "devices": [{"type": types[k] if k < len(types) else rng.choice(types),
                                          "count": rng.randint(1, 4)}],
            "intra_link": {"bandwidth_bytes_per_s": rng.choice([1e9, 1e10, 1e11]),
                           "latency_s": rng.choice([0.0, 1e-6])},
            "nic": {"bandwidth_bytes_per_s": rng.choice([1e8, 1e9, 3e9]), "latency_s": rng.choice([0.0, 1e-5])}})
    return parse_cluster({"name": "random", "node": nodes})


def random_profile(rng: random.Random, types: set[str]) -> ModelProfile:
    measured = tuple((t, (Measurement(1, rng.uniform(1e-3, 1e-2), rng.uniform(2e-3, 2e-2)),
                          Measurement(4, rng.uniform(4e-3, 4e-2), rng.uniform(8e-3, 8e-2)))) for t in sorted(types))
    layers = tuple(LayerProfile(f"l{i}", rng.choice([1e5, 4e6, 3e7]), rng.choice([1e3, 1e5, 1e6]),
                                rng.choice([1e4, 1e6]), 1e9, measured) for i in range(rng.randint(3, 8)))
    return ModelProfile("random", layers, 1e3)


def random_plan(seed: int) -> Plan:
    """VWs of 1 to 4 stages over the shuffled devices (some left idle), random layer cuts and recompute sets,
    1 to 6 micro-batches of uneven sizes; the sync mode and schedule cycle with ``seed``, the options random."""
    rng = random.Random(seed)
    cluster = random_cluster(rng)
    profile = random_profile(rng, {d.type_name for d in cluster.devices})
    num_layers = len(profile.layers)
    devices = [d.name for d in cluster.devices]
    rng.shuffle(devices)
    vws, k = [], 0
    while k < len(devices):
        p = rng.randint(1, min(4, len(devices) - k, num_layers))
        bounds = [0, *sorted(rng.sample(range(1, num_layers), p - 1)), num_layers]
        stages = tuple(Stage(devices[k + j], bounds[j], bounds[j + 1],
                             tuple(x for x in range(bounds[j], bounds[j + 1]) if rng.random() < 0.2))
                       for j in range(p))
        m = rng.randint(1, 6)
        vws.append(VirtualWorker(stages, m * rng.randint(1, 3) + rng.randint(0, m - 1), m))
        k += p
    if len(vws) > 1 and rng.random() < 0.3:
        vws.pop()
    options = SyncOptions(staleness=rng.randint(0, 2), period=rng.randint(1, 4), aggregate=rng.randint(1, 3),
                          bucket_bytes=rng.choice([1e6, 25 * 2**20]), first_bucket_bytes=rng.choice([1e5, 2**20]),
                          allreduce=rng.choice(["auto", "ring"]), transfers=rng.choice(["overlap", "blocking"]),
                          placement=rng.choice(["sharded", "local", "round-robin"]))
    return make_plan(cluster, profile, vws, schedule=SCHEDULES[seed // len(MODES) % 2], sync=MODES[seed % len(MODES)],
                     optimizer=rng.choice(["sgd", "adam"]), strategy="hybrid", formation="random", sync_options=options)


def spread_plan(nodes: int, stages: int, micro_batches: int, transfers: str = "overlap") -> Plan:
    """Identical VWs, stage j of VW v on node j + stages * (v // 8), device v % 8: every stage boundary crosses
    NICs shared by 8 VWs, which ask for them at the same instants (ties broken by the queue's order)."""
    node = [{"name": f"n{k}", "devices": [{"type": TYPES[k % 2], "count": 8}],
             "intra_link": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
             "nic": {"bandwidth_bytes_per_s": 1e9 if k % 2 else 3e9, "latency_s": 1e-5}} for k in range(nodes)]
    cluster = parse_cluster({"name": "spread", "node": node})
    measured = tuple((t, (Measurement(1, 1e-3, 2e-3),)) for t in TYPES[:2])
    profile = ModelProfile("block", tuple(LayerProfile(f"b{i}", 1e7, 4e6, 1e7, 1e9, measured)
                                          for i in range(2 * stages)), 1e3)
    vws = tuple(VirtualWorker(tuple(Stage(f"n{j + stages * (v // 8)}:{v % 8}", 2 * j, 2 * j + 2)
                                    for j in range(stages)), micro_batches, micro_batches)
                for v in range(8 * (nodes // stages)))
    return make_plan(cluster, profile, vws, optimizer="adam", strategy="hybrid", formation="spread",
                     transfers=transfers)


def assert_same(fast: SimResult, reference: SimResult) -> None:
    """The figures to 1e-9, and the timelines (device, link and memory rows) event for event."""
    assert fast.iteration_s == pytest.approx(reference.iteration_s, rel=1e-9)
    assert fast.pipeline_s == pytest.approx(reference.pipeline_s, rel=1e-9)
    assert fast.samples_per_s == pytest.approx(reference.samples_per_s, rel=1e-9)
    assert list(fast.devices) == list(reference.devices)
    for name, ref in reference.devices.items():
        got = fast.devices[name]
        assert (got.vw, got.stage, got.max_in_flight) == (ref.vw, ref.stage, ref.max_in_flight), name
        for f in ("busy_s", "sync_s", "bubble_s", "peak_memory_bytes"):
            assert getattr(got, f) == pytest.approx(getattr(ref, f), rel=1e-9, abs=1e-12), (name, f)
    assert fast.timeline.devices == reference.timeline.devices
    assert fast.timeline.links == reference.timeline.links
    assert fast.timeline.memory == reference.timeline.memory


@pytest.mark.parametrize("seed", range(30))
def test_the_fast_replay_equals_the_reference_on_random_plans(seed: int) -> None:
    plan = random_plan(seed)
    assert_same(simulate(plan), simulate(plan, reference=True))


def test_the_random_plans_cover_every_mode_schedule_and_contention() -> None:
    plans = [random_plan(seed) for seed in range(30)]
    assert {(p.sync, p.schedule) for p in plans} == {(m, s) for m in MODES for s in SCHEDULES}
    assert any(p.sync_options.transfers == "blocking" for p in plans)
    assert any(len({d.type_name for d in p.cluster.devices}) == 4 for p in plans)
    assert any(len(vw.stages) > 1 and len(p.virtual_workers) > 1 for p in plans for vw in p.virtual_workers)
    # some transfers queue behind others: a link row with an event that starts when the one before it ends
    queued = 0
    for p in plans[:10]:
        for evs in simulate(p).timeline.links.values():
            queued += sum(b.start_s == a.end_s and b.start_s > 0 for a, b in itertools.pairwise(evs))
    assert queued > 0


@pytest.mark.parametrize("transfers", ["overlap", "blocking"])
def test_the_fast_replay_breaks_ties_on_shared_nics_as_the_reference(transfers: str) -> None:
    plan = spread_plan(nodes=8, stages=4, micro_batches=6, transfers=transfers)
    fast, reference = simulate(plan), simulate(plan, reference=True)
    assert_same(fast, reference)
    # the 8 VWs of a node group asked for the NIC at the same instant: the queue put them one after another
    nic = fast.timeline.links["n0 NIC out"]
    assert sum(e.start_s > 0 and e.start_s == prev.end_s for prev, e in itertools.pairwise(nic)) >= 7


def contig_plan(vws: int, stages: int, micro_batches: int, schedule: str, odd: str = "") -> Plan:
    """Identical VWs of ``stages`` stages each on consecutive devices of nodes of 4 (the planner's contiguous
    formations at scale): each VW's pipeline crosses NICs that the segments' bucket all-reduces, rings over
    stage j of every VW, use too. ``odd`` breaks the symmetry: ``"type"`` puts a slower device type on the last
    node, ``"batch"`` gives the last VW one micro-batch more, ``"order"`` reverses the last VW's devices."""
    num_devices = vws * stages
    node = [{"name": f"n{k}", "devices": [{"type": "T4" if odd == "type" and k == (num_devices - 1) // 4
                                           else TYPES[k % 2], "count": 4}],
             "intra_link": {"bandwidth_bytes_per_s": 1e10, "latency_s": 1e-6},
             "nic": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}} for k in range(-(-num_devices // 4))]
    cluster = parse_cluster({"name": "contig", "node": node})
    measured = tuple((t, (Measurement(1, 1e-3, 2e-3), Measurement(4, 3e-3, 6e-3))) for t in (*TYPES[:2], "T4"))
    profile = ModelProfile("block", tuple(LayerProfile(f"b{i}", 4e6, 1e6, 1e7, 1e9, measured)
                                          for i in range(2 * stages)), 1e3)
    devices = [f"n{g // 4}:{g % 4}" for g in range(num_devices)]
    out = []
    for v in range(vws):
        mine = devices[v * stages:(v + 1) * stages]
        if odd == "order" and v == vws - 1:
            mine.reverse()
        m = micro_batches + (odd == "batch" and v == vws - 1)
        out.append(VirtualWorker(tuple(Stage(mine[j], 2 * j, 2 * j + 2) for j in range(stages)), 2 * m, m))
    return make_plan(cluster, profile, out, schedule=schedule, optimizer="adam", strategy="hybrid", formation="contig",
                     bucket_bytes=4e6, first_bucket_bytes=1e6, allreduce="ring")


@pytest.mark.parametrize(("schedule", "odd"), [(s, o) for s in SCHEDULES for o in ("", "type", "batch", "order")])
def test_the_fast_replay_equals_the_reference_on_identical_and_near_identical_vws(schedule: str, odd: str) -> None:
    plan = contig_plan(vws=4, stages=8, micro_batches=5, schedule=schedule, odd=odd)
    fast, reference = simulate(plan), simulate(plan, reference=True)
    assert_same(fast, reference)
    # every VW crosses a NIC that bucket all-reduces cross too: pipeline transfers and rings queue on it
    kinds = [{e.kind for e in row} for name, row in fast.timeline.links.items() if "NIC" in name]
    assert sum("allreduce" in k and bool(k & {"send_f", "send_b"}) for k in kinds) >= 2 * len(plan.virtual_workers)
    if not odd:  # identical VWs tie: twin stages end their backwards at the same instants
        ends = [{e.end_s for e in fast.timeline.devices[vw.stages[0].device] if e.kind == "backward"}
                for vw in plan.virtual_workers]
        assert all(e == ends[0] for e in ends)


def test_the_fast_replay_stalls_as_the_reference() -> None:
    plan = spread_plan(nodes=4, stages=4, micro_batches=2)
    schedule = build_schedule(plan)
    first = next(iter(schedule))
    dropped = next(a for a in schedule[first] if str(a).startswith("SEND_F"))  # its receiver waits forever
    stalled = {d: [a for a in acts if a is not dropped] for d, acts in schedule.items()}
    with pytest.raises(ScheduleError) as ref_error:
        run_program(compile_program(plan, [stalled]))
    with pytest.raises(ScheduleError) as fast_error:
        run_program_fast(compile_program(plan, [stalled]))
    assert str(fast_error.value) == str(ref_error.value)


# --- what compile shares among devices is what each device would have had on its own ---------------------

def bsp_plan(seed: int) -> Plan:
    """A random plan under ``bsp`` with small buckets: several buckets per stage, segments of several owners."""
    plan = random_plan(seed * len(MODES))  # the seeds of bsp
    return plan.with_sync("bsp", replace(plan.sync_options, bucket_bytes=1e5, first_bucket_bytes=1e5))


@pytest.mark.parametrize("seed", range(6))
def test_each_backward_carries_its_own_devices_bucket_starts(seed: int) -> None:
    """The seconds into a backward at which each bucket's gradients are final, worked out afresh for every
    device (its own stage costs, no sharing), and the all-reduce each starts, named by its label."""
    plan = bsp_plan(seed)
    schedule = build_schedule(plan)
    program = compile_program(plan, [schedule])
    where = {s.device: (vw, s) for vw in plan.virtual_workers for s in vw.stages}
    devices = {d.name: d for d in plan.cluster.devices}
    starts = 0
    for d, name in enumerate(program.names):
        vw, stage = where[name]
        costs = estimate_stage_costs(plan, vw, stage, devices[name])
        f, g = costs.layer_times, costs.backward_s
        expected: dict[int, list[tuple[float, str]]] = {}
        last = -1
        for k, a in enumerate(schedule[name]):
            if isinstance(a, Compute) and a.kind is ActionKind.B:
                last = k
            elif isinstance(a, BucketSync) and a.kind is ActionKind.ALLREDUCE_START:
                bucket = plan.segments()[a.segment].buckets[a.bucket]
                i = schedule[name][last].micro_batch  # type: ignore[union-attr]
                fwd, bwd = f[vw.micro_batch_sizes[i]]
                later = [x for x in stage.recompute if x >= bucket.first_layer]
                offset = g[i] if bucket.first_layer <= stage.first_layer else costs.overhead_s + float(
                    bwd[bucket.first_layer:stage.end_layer].sum() + fwd[later].sum())
                expected.setdefault(last, []).append((offset, f"ALLREDUCE seg{a.segment} bucket{a.bucket}"))
        for k, rides in expected.items():
            op = program.ops[d][k]
            assert isinstance(op, Backward)
            assert [(o, program.collectives[c].label) for o, c in op.bucket_starts] == rides, (name, k)
            starts += len(rides)
    assert starts > len(program.names)  # more than one bucket per device on average


@pytest.mark.parametrize("seed", range(10))
def test_buckets_by_device_are_the_layouts(seed: int) -> None:
    plan = bsp_plan(seed) if seed % 2 else random_plan(seed)
    by_device = buckets_by_device(plan)
    for dev in plan.cluster.devices:
        assert by_device.get(dev.name, []) == plan.layout.device_buckets(dev.name), dev.name


def test_all_reduces_of_one_ring_share_its_links_numbered_as_on_their_own() -> None:
    plan = spread_plan(nodes=8, stages=4, micro_batches=2)
    cluster, owners = plan.cluster, [d.index for d in plan.cluster.devices if d.name.endswith(":0")]
    for algorithm in ("ring", "hierarchical"):
        shared = LinkResources()
        first = allreduce_phases(cluster, owners, 1e6, shared, algorithm)
        second = allreduce_phases(cluster, owners, 3e6, shared, algorithm)
        alone = LinkResources()
        again = allreduce_phases(cluster, owners, 3e6, alone, algorithm)
        assert [p.links for p in first] == [p.links for p in second] == [p.links for p in again]
        assert [p.duration_s for p in second] == [p.duration_s for p in again]
        assert shared.names == alone.names

"""Schedules: the action language, the generators against literal actions, the validator."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import pytest

import factories
from factories import A100, link, make_cluster, make_profile, replicas
from hetrain.cluster import Cluster, parse_cluster
from hetrain.plan import Plan
from hetrain.schedule import (
    ERROR_MARK,
    GENERATORS,
    Action,
    ActionKind,
    BucketSync,
    Compute,
    ScheduleError,
    SegmentSync,
    Step,
    SyncState,
    Transfer,
    advance_sync_state,
    build_schedule,
    format_grid,
    gpipe,
    initial_sync_state,
    one_f_one_b,
    one_f_one_b_eager,
    parse_action,
    parse_schedule,
    schedule_to_dict,
    validate,
)
from hetrain.sync_layout import Bucket, SyncLayoutError


def make_plan(vws: list[tuple[list[str], list[int], int, int]], schedule: str = "1f1b", sync: str = "bsp",
              options: dict[str, float] | None = None) -> Plan:
    """Six one-MB layers on one node of six A100s; ``vws``: (devices, layer boundaries, mini-batch, micro-batches)
    per VW; ``options``: sync options."""
    return factories.make_plan(six_a100s(), make_profile(6), vws, schedule=schedule, sync=sync,
                               **(options or {}))


def six_a100s() -> Cluster:
    return make_cluster({"n0": 6}, device_type=A100, intra_link=link(1e10, 1e-6), nic=link(1e10, 1e-6), name="t")


def two_stage_plan(schedule: str) -> Plan:
    return make_plan([(["n0:0", "n0:1"], [0, 3, 6], 3, 3)], schedule)


# --- the action language --------------------------------------------------------


@pytest.mark.parametrize("text", [
    "1F0", "1B3", "0F12", "SEND_F 1->2 mb0 to n0:2", "RECV_F 1->2 mb0 from n0:1", "SEND_B 2->1 mb3 to n0:1",
    "RECV_B 2->1 mb3 from n0:2", "SEND_F 1->2 mb0", "ALLREDUCE seg2", "STEP", "PUSH seg1", "AVERAGE_MERGE seg0",
    "ALLREDUCE_START seg2 bucket0", "ALLREDUCE_WAIT seg0 bucket3",
])
def test_action_print_parse_round_trip(text: str) -> None:
    a = parse_action(text)
    assert str(a) == text
    assert parse_action(str(a)) == a


def test_action_fields() -> None:
    a = parse_action("RECV_B 2->1 mb3 from n0:2")
    assert isinstance(a, Transfer)
    assert (a.kind, a.stage, a.micro_batch, a.peer) == (ActionKind.RECV_B, 1, 3, "n0:2")
    assert a.stages_joined == (2, 1)
    assert not a.is_send
    assert parse_action("ALLREDUCE seg4") == SegmentSync(ActionKind.ALLREDUCE, segment=4)
    assert str(Transfer(ActionKind.SEND_F, stage=1, micro_batch=0, peer="b:1")) == "SEND_F 1->2 mb0 to b:1"
    assert parse_action("0B2") == Compute(ActionKind.B, stage=0, micro_batch=2)
    assert parse_action("ALLREDUCE_WAIT seg1 bucket2") == BucketSync(ActionKind.ALLREDUCE_WAIT, segment=1, bucket=2)
    assert parse_action("STEP") == Step()


@pytest.mark.parametrize(("make", "text"), [
    (lambda: Compute(ActionKind.SEND_F, 0, 0), "a Compute action is one of B, F, not SEND_F"),
    (lambda: Transfer(ActionKind.F, 0, 0, "n0:1"), "a Transfer action is one of RECV_B, RECV_F, SEND_B, SEND_F, not F"),
    (lambda: SegmentSync(ActionKind.ALLREDUCE_START, 1), "a SegmentSync action is one of ALLREDUCE, AVERAGE, "),
    (lambda: BucketSync(ActionKind.ALLREDUCE, 1, 0), "a BucketSync action is one of ALLREDUCE_START, ALLREDUCE_WAIT, "
                                                     "not ALLREDUCE"),
    (lambda: Step(ActionKind.PUSH), "a Step action is one of STEP, not PUSH"),
])
def test_action_classes_reject_kinds_they_do_not_stand_for(make: Callable[[], Action], text: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(text)):
        make()


def test_a_transfer_without_peer_cannot_name_one() -> None:
    a = parse_action("SEND_F 1->2 mb0")
    assert isinstance(a, Transfer) and a.peer is None
    with pytest.raises(ScheduleError, match="SEND_F 1->2 mb0 names no peer device"):
        a.named_peer()
    assert Transfer(ActionKind.SEND_F, 1, 0, "n0:2").named_peer() == "n0:2"


@pytest.mark.parametrize("text", ["1X0", "SEND_F 1->3 mb0", "SEND_F 1->2 mb0 from n0:2", "ALLREDUCE", "STEP seg1",
                                  "F", "RECV_B 1->2 mb0", "ALLREDUCE seg1 bucket0", "ALLREDUCE_START seg1"])
def test_parse_action_rejects_malformed(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_action(text)


def test_schedule_dict_round_trip() -> None:
    schedule = build_schedule(make_plan([(["n0:0", "n0:1", "n0:2"], [0, 2, 4, 6], 4, 4),
                                         (["n0:3", "n0:4"], [0, 3, 6], 4, 2)]))
    assert parse_schedule(schedule_to_dict(schedule)) == schedule


# --- generators -----------------------------------------------------------------


def texts(actions: Sequence[Action]) -> list[str]:
    return [str(a) for a in actions]


def test_gpipe_compute_order() -> None:
    assert [texts(s) for s in gpipe(3, 2)] == [
        ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"],
        ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"],
    ]


def test_one_f_one_b_compute_order() -> None:
    assert [texts(s) for s in one_f_one_b(3, 2)] == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    ]
    # fewer micro-batches than the warm-up needs: all forwards, then all backwards
    assert texts(one_f_one_b(2, 4)[0]) == ["0F0", "0F1", "0B0", "0B1"]


def test_one_f_one_b_eager_warms_up_one_more_on_every_stage_but_the_last() -> None:
    assert [texts(s) for s in one_f_one_b_eager(4, 3)] == [
        ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"],
        ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"],
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"],
    ]
    assert GENERATORS["1f1b-eager"] is one_f_one_b_eager


def test_gpipe_schedule_p2_m3() -> None:
    assert schedule_to_dict(build_schedule(two_stage_plan("gpipe"))) == {
        "n0:0": ["0F0", "SEND_F 0->1 mb0 to n0:1", "0F1", "SEND_F 0->1 mb1 to n0:1",
                 "0F2", "SEND_F 0->1 mb2 to n0:1",
                 "RECV_B 1->0 mb0 from n0:1", "0B0", "RECV_B 1->0 mb1 from n0:1", "0B1",
                 "RECV_B 1->0 mb2 from n0:1", "0B2", "STEP"],
        "n0:1": ["RECV_F 0->1 mb0 from n0:0", "1F0", "RECV_F 0->1 mb1 from n0:0", "1F1",
                 "RECV_F 0->1 mb2 from n0:0", "1F2",
                 "1B0", "SEND_B 1->0 mb0 to n0:0", "1B1", "SEND_B 1->0 mb1 to n0:0",
                 "1B2", "SEND_B 1->0 mb2 to n0:0", "STEP"],
    }


def test_one_f_one_b_schedule_p2_m3() -> None:
    assert schedule_to_dict(build_schedule(two_stage_plan("1f1b"))) == {
        "n0:0": ["0F0", "SEND_F 0->1 mb0 to n0:1", "0F1", "SEND_F 0->1 mb1 to n0:1",
                 "RECV_B 1->0 mb0 from n0:1", "0B0", "0F2", "SEND_F 0->1 mb2 to n0:1",
                 "RECV_B 1->0 mb1 from n0:1", "0B1", "RECV_B 1->0 mb2 from n0:1", "0B2", "STEP"],
        "n0:1": ["RECV_F 0->1 mb0 from n0:0", "1F0", "1B0", "SEND_B 1->0 mb0 to n0:0",
                 "RECV_F 0->1 mb1 from n0:0", "1F1", "1B1", "SEND_B 1->0 mb1 to n0:0",
                 "RECV_F 0->1 mb2 from n0:0", "1F2", "1B2", "SEND_B 1->0 mb2 to n0:0", "STEP"],
    }


def hetero_plan(schedule: str = "1f1b") -> Plan:
    """Three VWs with different stage counts, partitions and micro-batch counts."""
    return make_plan([
        (["n0:0", "n0:1", "n0:2"], [0, 2, 4, 6], 8, 4),
        (["n0:3", "n0:4"], [0, 3, 6], 4, 2),
        (["n0:5"], [0, 6], 1, 1),
    ], schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-eager"])
def test_multi_vw_schedule_is_valid_and_syncs_every_shared_segment(schedule: str) -> None:
    plan = hetero_plan(schedule)
    built = build_schedule(plan)
    validate(built, plan)
    # segments: [0,2) [2,3) [3,4) [4,6), each shared by three devices
    segs = plan.segments()
    assert [(s.first_layer, s.end_layer) for s in segs] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # last layers first: the last stages finish their backward first; one bucket per segment (2 MB at most)
    assert texts(built["n0:4"])[-3:] == ["ALLREDUCE_WAIT seg3 bucket0", "ALLREDUCE_WAIT seg2 bucket0", "STEP"]
    assert texts(built["n0:5"]) == ["0F0", "0B0", *(f"ALLREDUCE_START seg{s} bucket0" for s in (3, 2, 1, 0)),
                                    *(f"ALLREDUCE_WAIT seg{s} bucket0" for s in (3, 2, 1, 0)), "STEP"]
    for dev, actions in built.items():
        v, j = plan.stage_of(dev)
        m = plan.virtual_workers[v].micro_batches
        assert sum(a.kind is ActionKind.F for a in actions) == m
        assert all(a.stage == j for a in actions if isinstance(a, (Compute, Transfer)))


def two_node_plan(sync: str, **options: int) -> Plan:
    """Four one-stage VWs on two nodes of two devices."""
    cluster = make_cluster({"n0": 2, "n1": 2}, device_type=A100, intra_link=link(1e10, 1e-6), nic=link(1e10, 1e-6),
                           name="t2")
    return factories.make_plan(cluster, make_profile(6), replicas(("n0:0", "n0:1", "n1:0", "n1:1"), 6, 2), sync=sync,
                               **options)


def sync_texts(plan: Plan, iteration: int = 0, steps: int | None = None, **kw: object) -> list[str]:
    state = dataclasses.replace(initial_sync_state(plan), iteration=iteration, **kw)  # type: ignore[arg-type]
    built = build_schedule(plan, state, steps)
    validate(built, plan)
    return [t for t in texts(built["n0:0"]) if not t[0].isdigit()]


def test_wsp_pushes_and_pulls_every_wave() -> None:
    plan = make_plan([(["n0:0"], [0, 6], 2, 2), (["n0:1"], [0, 6], 2, 2)], sync="wsp")
    assert sync_texts(plan) == ["STEP", "PUSH seg0", "PULL seg0"]
    assert plan.sync_options.staleness == 1


def test_local_sgd_averages_every_k_iterations() -> None:
    plan = two_node_plan("local-sgd", period=3)
    assert [sync_texts(plan, t) for t in range(3)] == [["STEP"], ["STEP"], ["STEP", "AVERAGE seg0"]]


def test_hybrid_ps_reduces_in_the_node_and_pushes_every_aggregate() -> None:
    plan = two_node_plan("hybrid-ps", aggregate=2)
    assert sync_texts(plan, 0) == ["LOCAL_ALLREDUCE seg0", "STEP"]
    assert sync_texts(plan, 1) == ["LOCAL_ALLREDUCE seg0", "STEP", "PUSH seg0", "PULL seg0"]


def test_daso_blocks_in_warmup_and_cooldown_and_starts_averages_between() -> None:
    plan = two_node_plan("daso", period=2, warmup=1, cooldown=1)
    assert sync_texts(plan, 0, steps=6) == ["LOCAL_ALLREDUCE seg0", "STEP", "AVERAGE seg0"]
    assert sync_texts(plan, 1, steps=6) == ["LOCAL_ALLREDUCE seg0", "STEP", "AVERAGE_START seg0"]
    assert sync_texts(plan, 2, steps=6, merge_pending=True) == ["LOCAL_ALLREDUCE seg0", "STEP",
                                                                "AVERAGE_MERGE seg0"]
    assert sync_texts(plan, 5, steps=6) == ["LOCAL_ALLREDUCE seg0", "STEP", "AVERAGE seg0"]


def test_the_sync_state_carries_a_started_daso_average_into_the_next_iteration() -> None:
    plan = two_node_plan("daso", period=2, warmup=1, cooldown=1)
    state, tails = initial_sync_state(plan), []
    for _ in range(6):
        tails.append([t for t in texts(build_schedule(plan, state, 6)["n0:0"]) if t.startswith("AVERAGE")])
        state = advance_sync_state(plan, state, 6)
    assert tails == [["AVERAGE seg0"], ["AVERAGE_START seg0"], ["AVERAGE_MERGE seg0"], ["AVERAGE_START seg0"],
                     ["AVERAGE_MERGE seg0"], ["AVERAGE seg0"]]
    assert state == SyncState(6, 2, False)
    # DASO adapts k: the trainer puts the new period in the state, the schedule follows it
    assert advance_sync_state(plan, SyncState(3, 4, False), 100).merge_pending is True
    assert advance_sync_state(plan, SyncState(3, 3, False), 100).merge_pending is False


def test_sync_options_are_checked() -> None:
    with pytest.raises(SyncLayoutError, match=r"period must be in \[1, 100000\], got 0"):
        two_node_plan("local-sgd", period=0)


# --- the validator and its grid ---------------------------------------------------


def without(schedule: dict[str, list[Action]], device: str, text: str) -> dict[str, list[Action]]:
    out = {d: list(a) for d, a in schedule.items()}
    out[device] = [a for a in out[device] if str(a) != text]
    assert len(out[device]) == len(schedule[device]) - 1
    return out


def marked_line(message: str) -> str:
    lines = [line for line in message.splitlines() if ERROR_MARK in line]
    assert len(lines) == 1, message
    return lines[0]


def test_missing_receive_is_rejected_with_the_grid() -> None:
    plan = two_stage_plan("1f1b")
    broken = without(build_schedule(plan), "n0:1", "RECV_F 0->1 mb1 from n0:0")
    with pytest.raises(ScheduleError) as err:
        validate(broken, plan)
    message = str(err.value)
    assert "RECV_F 0->1 mb1 from n0:0" in message and "missing receive" in message
    assert "step | n0:0" in message  # the grid's header: a column per device
    line = marked_line(message)
    # the failing cell is 1F1 on n0:1, at step 4 once the receive is gone
    assert line.split("|")[0].strip() == "4"
    assert "1F1  <-- ERROR HERE" in line.split("|")[2]


def test_missing_gradient_receive_is_rejected() -> None:
    plan = two_stage_plan("gpipe")
    broken = without(build_schedule(plan), "n0:0", "RECV_B 1->0 mb2 from n0:1")
    with pytest.raises(ScheduleError, match="0B2 runs before its gradient arrives") as err:
        validate(broken, plan)
    assert "0B2  <-- ERROR HERE" in marked_line(str(err.value))


def test_deadlock_is_reported_with_the_waiting_action() -> None:
    plan = two_stage_plan("gpipe")
    schedule = build_schedule(plan)
    # stage 0 waits for mb0's gradient before shipping mb0's activation: a cycle
    s0 = schedule["n0:0"]
    recv = parse_action("RECV_B 1->0 mb0 from n0:1")
    schedule["n0:0"] = [recv, *(a for a in s0 if a != recv)]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(schedule, plan)
    message = str(err.value)
    assert "RECV_B 1->0 mb0 from n0:1  <-- ERROR HERE" in message
    assert "<-- blocked" in message  # the peer it waits for is blocked too


def test_backward_before_forward_is_rejected() -> None:
    plan = make_plan([(["n0:0"], [0, 6], 2, 2)], "gpipe")
    schedule = {"n0:0": [parse_action(t) for t in ["0B0", "0F0", "0F1", "0B1", "STEP"]]}
    with pytest.raises(ScheduleError, match="F before B"):
        validate(schedule, plan)


def test_allreduce_missing_on_one_owner_is_rejected() -> None:
    plan = hetero_plan()
    schedule = build_schedule(plan)
    no_wait = without(schedule, "n0:5", "ALLREDUCE_WAIT seg1 bucket0")
    with pytest.raises(ScheduleError, match="STEP before ALLREDUCE_WAIT seg1 bucket0"):
        validate(no_wait, plan)
    no_start = without(schedule, "n0:5", "ALLREDUCE_START seg1 bucket0")
    with pytest.raises(ScheduleError, match="comes before its ALLREDUCE_START seg1 bucket0"):
        validate(no_start, plan)
    neither = without(no_start, "n0:5", "ALLREDUCE_WAIT seg1 bucket0")
    with pytest.raises(ScheduleError, match="STEP before ALLREDUCE_WAIT seg1 bucket0"):
        validate(neither, plan)


def blocking(schedule: dict[str, list[Action]]) -> dict[str, list[Action]]:
    """The schedule with one blocking ALLREDUCE per segment where it waits for the segment's buckets."""
    return {d: [SegmentSync(ActionKind.ALLREDUCE, segment=a.segment) if isinstance(a, BucketSync)
                and a.kind is ActionKind.ALLREDUCE_WAIT else a
                for a in acts if a.kind is not ActionKind.ALLREDUCE_START] for d, acts in schedule.items()}


def test_bucket_starts_in_different_orders_are_rejected() -> None:
    # segment 1 (layers [2, 6), owners n0:1 and n0:2) has two buckets: one process group, one order
    plan = make_plan([(["n0:0", "n0:1"], [0, 2, 6], 2, 2), (["n0:2"], [0, 6], 1, 1)],
                     options={"first_bucket_bytes": 1.5e6, "bucket_bytes": 2.5e6})
    schedule = build_schedule(plan)
    acts = schedule["n0:2"]
    assert texts(acts[2:4]) == ["ALLREDUCE_START seg1 bucket0", "ALLREDUCE_START seg1 bucket1"]
    schedule["n0:2"] = [*acts[:2], acts[3], acts[2], *acts[4:]]
    with pytest.raises(ScheduleError, match="start their bucket all-reduces in different orders: n0:2 starts "
                                            "seg1 bucket1 where n0:1 starts seg1 bucket0") as err:
        validate(schedule, plan)
    assert "ALLREDUCE_START seg1 bucket1  <-- ERROR HERE" in marked_line(str(err.value))
    # segments of different owner sets may start in any order (their process groups are apart)
    hetero = hetero_plan()
    swapped = build_schedule(hetero)
    acts = swapped["n0:5"]
    swapped["n0:5"] = [*acts[:2], acts[3], acts[2], *acts[4:]]
    validate(swapped, hetero)


def test_blocking_allreduces_are_valid_and_in_different_orders_deadlock() -> None:
    plan = hetero_plan()
    schedule = blocking(build_schedule(plan))
    validate(schedule, plan)
    assert texts(schedule["n0:5"]) == ["0F0", "0B0", *(f"ALLREDUCE seg{s}" for s in (3, 2, 1, 0)), "STEP"]
    tail = schedule["n0:5"][-5:]
    schedule["n0:5"] = [*schedule["n0:5"][:-5], tail[1], tail[0], *tail[2:]]  # seg2 before seg3
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(schedule, plan)


def test_buckets_cut_each_segment_from_its_last_layers() -> None:
    # layers of 1 MB; first bucket >= 1.5 MB, the others >= 2.5 MB; VW0 splits the model at layer 2
    plan = make_plan([(["n0:0", "n0:1"], [0, 2, 6], 2, 2), (["n0:2"], [0, 6], 1, 1)],
                     options={"first_bucket_bytes": 1.5e6, "bucket_bytes": 2.5e6})
    assert [list(seg.buckets) for seg in plan.segments()] == [
        [Bucket(0, 0, 0, 2, 2e6)], [Bucket(1, 0, 4, 6, 2e6), Bucket(1, 1, 2, 4, 2e6)]]
    # one layer above the size: a bucket per layer
    small = make_plan([(["n0:0"], [0, 6], 1, 1), (["n0:1"], [0, 6], 1, 1)], options={"first_bucket_bytes": 1,
                                                                                      "bucket_bytes": 1})
    assert [(b.first_layer, b.end_layer) for b in small.segments()[0].buckets] == [(k, k + 1)
                                                                                  for k in range(5, -1, -1)]
    with pytest.raises(SyncLayoutError, match=r"bucket_bytes must be in \[1, 1.09951e\+12\], got 0"):
        make_plan([(["n0:0"], [0, 6], 1, 1)], options={"bucket_bytes": 0})


def test_bucket_starts_follow_the_last_backward_and_waits_precede_step() -> None:
    plan = make_plan([(["n0:0", "n0:1"], [0, 2, 6], 2, 2), (["n0:2"], [0, 6], 1, 1)],
                     options={"first_bucket_bytes": 1.5e6, "bucket_bytes": 2.5e6})
    built = build_schedule(plan)
    validate(built, plan)
    # stage 1 of VW0 holds segment 1: its buckets start inside its last backward, before that backward's send
    assert texts(built["n0:1"])[-7:] == [
        "1B1", "ALLREDUCE_START seg1 bucket0", "ALLREDUCE_START seg1 bucket1", "SEND_B 1->0 mb1 to n0:0",
        "ALLREDUCE_WAIT seg1 bucket0", "ALLREDUCE_WAIT seg1 bucket1", "STEP"]
    assert texts(built["n0:0"])[-4:] == ["0B1", "ALLREDUCE_START seg0 bucket0", "ALLREDUCE_WAIT seg0 bucket0", "STEP"]
    # the lone stage of VW1 holds both segments: the last layers' first
    assert texts(built["n0:2"]) == ["0F0", "0B0", "ALLREDUCE_START seg1 bucket0", "ALLREDUCE_START seg1 bucket1",
                                    "ALLREDUCE_START seg0 bucket0", "ALLREDUCE_WAIT seg1 bucket0",
                                    "ALLREDUCE_WAIT seg1 bucket1", "ALLREDUCE_WAIT seg0 bucket0", "STEP"]
    assert parse_schedule(schedule_to_dict(built)) == built
    with pytest.raises(ScheduleError, match=r"segment 1 has buckets 0\.\.1"):
        validate({**built, "n0:2": [parse_action("ALLREDUCE_WAIT seg1 bucket2") if str(a) == "ALLREDUCE_WAIT seg1 "
                                    "bucket1" else a for a in built["n0:2"]]}, plan)


@pytest.mark.parametrize(("device", "old", "new", "match"), [
    ("n0:1", "1F0", "0F0", "holds stage 1"),
    ("n0:0", "SEND_F 0->1 mb0 to n0:1", "SEND_F 0->1 mb0 to n0:2", "peer must be n0:1"),
    ("n0:0", "0F2", "0F7", "outside 0..2"),
    ("n0:1", "1B0", "1F0", "appears twice"),
])
def test_static_errors_name_the_action(device: str, old: str, new: str, match: str) -> None:
    plan = two_stage_plan("gpipe")
    schedule = build_schedule(plan)
    schedule[device] = [parse_action(new) if str(a) == old else a for a in schedule[device]]
    with pytest.raises(ScheduleError, match=match) as err:
        validate(schedule, plan)
    assert ERROR_MARK in str(err.value)


def test_missing_device_and_extra_device() -> None:
    plan = two_stage_plan("gpipe")
    schedule = build_schedule(plan)
    with pytest.raises(ScheduleError, match="n0:1 holds stage 1"):
        validate({"n0:0": schedule["n0:0"]}, plan)
    with pytest.raises(ScheduleError, match="n0:5 holds no stage"):
        validate({**schedule, "n0:5": [parse_action("STEP")]}, plan)


def test_format_grid() -> None:
    grid = format_grid(build_schedule(two_stage_plan("1f1b")))
    lines = grid.splitlines()
    assert lines[0].split("|")[1].strip() == "n0:0" and lines[0].split("|")[2].strip() == "n0:1"
    assert lines[2].split("|")[1].strip() == "0F0"
    assert lines[2].split("|")[2].strip() == "RECV_F 0->1 mb0 from n0:0"
    assert len(lines) == 2 + 13


def test_large_schedule_error_shows_a_window() -> None:
    devs = [f"n0:{k}" for k in range(6)]
    plan = make_plan([([d], [0, 6], 60, 60) for d in devs], "gpipe")
    schedule = build_schedule(plan)
    schedule["n0:3"] = [a for a in schedule["n0:3"] if str(a) != "0F59"]
    with pytest.raises(ScheduleError) as err:
        validate(schedule, plan)
    assert len(str(err.value).splitlines()) < 60


def test_error_grid_of_a_wide_schedule_shows_the_failing_device() -> None:
    devs = [f"n0:{k}" for k in range(8)]
    cluster = parse_cluster({"name": "w", "node": [{"name": "n0", "devices": [{"type": "A100-40GB", "count": 12}],
                                                    "intra_link": "nvlink3", "nic": "ib-hdr"}]})
    plan = factories.make_plan(cluster, make_profile(6), replicas(devs, 6, 1), schedule="gpipe")
    schedule = {**build_schedule(plan), "n0:11": [parse_action("STEP")]}
    with pytest.raises(ScheduleError, match="n0:11 holds no stage") as err:
        validate(schedule, plan)
    header = str(err.value).split("schedule (8 of 9 devices):\n")[1].splitlines()[0]
    assert "n0:11" in header and "n0:7" not in header

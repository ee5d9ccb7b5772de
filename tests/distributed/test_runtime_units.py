"""The runtime's parts in one process: roles, headers, recompute stages, timeline merge, metrics."""

from __future__ import annotations

import json

import pytest
import torch

import factories
from factories import make_cluster
from hetrain.models.analytic import build_profile
from hetrain.models.layers import LayerRange
from hetrain.models.registry import build_layers, loss_fn, sample_batch
from hetrain.plan import Plan
from hetrain.runtime.lifecycle.roles import RoleError, assign_ranks, build_roles, local_node_name, match_hosts
from hetrain.runtime.report.metrics import MetricsLog, merge_timeline
from hetrain.runtime.step.executor import StageModule
from hetrain.runtime.step.p2p import decode_header, encode_header, grad_slots, spec_of
from hetrain.simulator import simulate
from hetrain.timeline import compare


def make_plan(vws: list[tuple[list[str], list[int], int, int]], nodes: dict[str, int] | None = None,
              recompute: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """gpt-tiny (6 layers) on CPU devices; ``vws``: (devices, layer boundaries, mini-batch, micro-batches)."""
    return factories.make_plan(make_cluster(nodes), build_profile("gpt-tiny"), vws, recompute=recompute)


TWO_VWS = [(["n0:0", "n1:0"], [0, 2, 6], 6, 3), (["n1:1"], [0, 6], 4, 2)]
NODES = {"n0": 2, "n1": 2}


# --- roles ------------------------------------------------------------------------------


def test_roles_follow_the_reported_devices_not_the_rank_numbers() -> None:
    plan = make_plan(TWO_VWS, NODES)
    reported = ["n1:1", "n1:0", "n0:1", "n0:0"]  # torchrun numbered the nodes the other way round
    assert assign_ranks(plan, reported) == {"n1:1": 0, "n1:0": 1, "n0:1": 2, "n0:0": 3}
    roles = build_roles(plan, reported)
    first, second, idle, single = roles[3], roles[1], roles[2], roles[0]
    assert (first.vw, first.j, first.next_rank, first.prev_rank, first.is_first, first.is_last) == \
        (0, 0, 1, None, True, False)
    assert (second.vw, second.j, second.prev_rank, second.prev_device, second.is_last) == (0, 1, 3, "n0:0", True)
    assert second.micro_batch_sizes == (2, 2, 2) and second.mini_batch_sizes == (6, 4)
    assert single.is_first and single.is_last and single.micro_batch_sizes == (2, 2)
    assert not idle.used and idle.stage is None and not idle.is_first


def test_a_world_that_does_not_match_names_every_problem_and_what_ranks_reported() -> None:
    plan = make_plan(TWO_VWS, NODES)
    with pytest.raises(RoleError) as err:
        assign_ranks(plan, ["n0:0", "n0:0", "box:1"])
    text = str(err.value)
    assert "ranks 0 and 1 both report device n0:0" in text
    assert "rank 2 reports device box:1, which is not in the plan's cluster" in text
    assert "no rank drives n1:0 (stage 1 of VW0, layers [2, 6))" in text
    assert "no rank drives n1:1 (stage 0 of VW1" in text
    assert "nodes n0 (n0:0, n0:1); n1 (n1:0, n1:1)" in text
    assert "rank 0 -> n0:0, rank 1 -> n0:0, rank 2 -> box:1" in text
    assert "HETRAIN_NODE" in text


def test_hosts_are_matched_to_nodes_by_shape_when_they_pair_up_one_to_one() -> None:
    one = make_plan([(["n0:0", "n0:1"], [0, 2, 6], 4, 2)], {"n0": 2})
    renamed, line = match_hosts(one, ["laptop:1", "laptop:0"])
    assert renamed == ["n0:1", "n0:0"]
    assert line == "hosts matched to the plan's nodes by their device counts: laptop -> n0 (2 rank(s))"
    roles = build_roles(one, renamed)
    assert (roles[1].device, roles[1].j, roles[0].prev_rank) == ("n0:0", 0, 1)

    two = make_plan(TWO_VWS, {"n0": 1, "n1": 3})  # devices n0:0, n1:0..2: shapes differ, so the pairing is known
    renamed, line = match_hosts(two, ["big:0", "small:0", "big:1", "big:2"])
    assert renamed == ["n1:0", "n0:0", "n1:1", "n1:2"]
    assert line is not None and "big -> n1 (3 rank(s)), small -> n0 (1 rank(s))" in line


def test_names_that_match_the_plan_or_hosts_that_do_not_pair_up_are_left_as_they_are() -> None:
    plan = make_plan(TWO_VWS, NODES)
    assert match_hosts(plan, ["n1:1", "n1:0", "n0:1", "n0:0"]) == (["n1:1", "n1:0", "n0:1", "n0:0"], None)
    for reported in (["box:0", "box:1", "box:2"],  # one host, two nodes
                     ["a:0", "a:1", "a:2", "b:0"],  # 3 + 1 ranks against 2 + 2 devices
                     ["a:0", "a:2", "b:0", "b:1"]):  # local ranks with a gap
        assert match_hosts(plan, reported) == (list(reported), None)
        with pytest.raises(RoleError, match="the world does not match the plan"):
            build_roles(plan, reported)


def test_hosts_that_could_be_either_node_need_hetrain_node() -> None:
    plan = make_plan(TWO_VWS, NODES)  # n0 and n1 both have 2 devices
    with pytest.raises(RoleError, match=r"host a \(2 ranks\) could be any of the plan's nodes n0, n1.*HETRAIN_NODE"):
        match_hosts(plan, ["a:0", "a:1", "b:0", "b:1"])
    renamed, line = match_hosts(plan, ["n0:0", "n0:1", "b:0", "b:1"])  # one host named as a node: the rest is known
    assert renamed == ["n0:0", "n0:1", "n1:0", "n1:1"] and line is not None and "b -> n1" in line


def test_node_name_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETRAIN_NODE", "fast,fast,slow")
    assert [local_node_name(r) for r in range(3)] == ["fast", "fast", "slow"]
    with pytest.raises(RoleError, match="has none for rank 3"):
        local_node_name(3)
    monkeypatch.setenv("HETRAIN_NODE", "solo")
    assert local_node_name(7) == "solo"


# --- headers ----------------------------------------------------------------------------


@pytest.mark.parametrize("tensors", [
    [torch.zeros(3, 64, 128)],
    [torch.zeros(2, 5, dtype=torch.float16), torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.bool)],
])
def test_a_header_round_trips_its_spec(tensors: list[torch.Tensor]) -> None:
    spec = spec_of(tensors, len(tensors) > 1)
    header = encode_header(spec, torch.device("cpu"))
    assert header.shape == (64,) and header.dtype == torch.int64
    assert decode_header(header) == spec
    assert grad_slots(tensors) == [k for k, t in enumerate(tensors) if t.dtype.is_floating_point]


def test_a_header_too_small_for_the_output_says_so() -> None:
    spec = spec_of([torch.zeros([1] * 8) for _ in range(8)], True)
    with pytest.raises(ValueError, match="does not fit a 64-entry header"):
        encode_header(spec, torch.device("cpu"))


# --- stages ------------------------------------------------------------------------------


def test_a_recompute_stage_gives_the_gradients_of_a_plain_one() -> None:
    config = {"hidden": 32, "heads": 2, "seq_len": 16}
    x, y = sample_batch("gpt-tiny", 4, torch.Generator().manual_seed(1), **config)
    grads = []
    for recompute in ((), (1, 2, 4), (0, 1, 2, 3, 4, 5)):
        stage = StageModule(build_layers("gpt-tiny", seed=3, **config), 0, recompute)
        loss_fn("gpt-tiny")(stage(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
        assert [rc for rc, _ in stage._runs] == ([False] if not recompute else [True] if len(recompute) == 6
                                                   else [False, True, False, True, False])
    names = set(grads[0])
    assert names == set(dict(LayerRange(build_layers("gpt-tiny", seed=3, **config)).named_parameters()))
    for other in grads[1:]:
        for n in names:
            torch.testing.assert_close(other[n], grads[0][n], rtol=1e-6, atol=1e-7)


def test_a_recompute_layer_outside_the_stage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"recompute layers \[0\] are outside the stage's layers \[1, 3\)"):
        StageModule(build_layers("mlp-digits", 1, 3), 1, (0, 2))


# --- timeline and metrics ------------------------------------------------------------------


def test_merged_parts_make_a_timeline_the_simulator_can_be_compared_with(tmp_path) -> None:
    plan = make_plan([(["n0:0", "n1:0"], [0, 3, 6], 4, 2)], NODES)
    parts = [
        {"device": "n0:0", "events": [(0.0, 1.0, "forward", "0F0", 0), (1.0, 2.0, "forward", "0F1", 1),
                                      (2.0, 5.0, "recv", "RECV_B 1->0 mb0 from n1:0", 0)],
         "sent": [("send_f", "n1:0", 0, 1.0, "SEND_F 0->1 mb0 n0:0->n1:0")], "received": [], "memory": []},
        {"device": "n1:0", "events": [(1.5, 2.5, "forward", "1F0", 0), (0.0, 1.5, "recv", "RECV_F 0->1 mb0", 0)],
         "sent": [], "received": [("send_f", "n0:0", 0, 1.5)], "memory": [(2.5, 1e6)]},
    ]
    tl = merge_timeline(parts, plan.cluster, {"step": 2})
    assert tl.source == "measured" and tl.meta == {"step": 2}
    assert [e.label for e in tl.devices["n1:0"]] == ["RECV_F 0->1 mb0", "1F0"]  # sorted by start
    assert set(tl.links) == {"n0 NIC out", "n1 NIC in"}  # the simulator's names for an inter-node transfer
    assert tl.links["n0 NIC out"][0][:3] == (1.0, 1.5, "send_f")
    assert tl.memory == {"n1:0": [(2.5, 1e6)]}
    tl.save(tmp_path / "t.json")
    rows = {(r.device, r.kind): r for r in compare(simulate(plan).timeline, tl).rows}
    assert rows[("n0:0", "forward")].measured_count == 2 and rows[("n0:0", "forward")].predicted_count == 2
    assert rows[("n0:0", "iteration")].measured_s == 5.0


def test_metrics_lines_are_appended_as_json(tmp_path) -> None:
    path = tmp_path / "m" / "metrics.jsonl"
    for start in (0, 1):
        log = MetricsLog(path, None, False, 2, start)
        log.log({"step": start + 1, "loss": 2.5 - start, "samples_per_s": 10.0, "step_time_s": 0.1})
        log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 1.5

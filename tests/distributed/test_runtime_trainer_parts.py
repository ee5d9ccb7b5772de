"""The Trainer's parts that run in one process: micro-batches, loss sums, a stage's checkpoint share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import factories
from factories import make_cluster
from hetrain.models.analytic import build_mlp_profile
from hetrain.plan import Plan
from hetrain.runtime.lifecycle.roles import build_roles
from hetrain.runtime.state.checkpoint import CheckpointError
from hetrain.runtime.state.stage_state import checkpoint_meta, owned_names, restore_stage, save_stage
from hetrain.runtime.step.batches import MicroBatches
from hetrain.runtime.step.executor import StageModule
from hetrain.runtime.step.losses import LossSums

DEVICES = ["n0:0", "n0:1", "n0:2", "n0:3"]


def make_plan(vws: list[tuple[list[str], list[int], int, int]]) -> Plan:
    """A 4-layer MLP on 4 CPU devices of one node; ``vws``: (devices, layer boundaries, mini-batch, micro-batches)."""
    return factories.make_plan(make_cluster({"n0": 4}), build_mlp_profile([3, 5, 5, 5, 2], name="mlp"), vws)


# VW0: n0:0 [0, 2) -> n0:1 [2, 4), 6 samples in 3 micro-batches; VW1: n0:2 [0, 4), 4 samples in 2; n0:3 unused
TWO_VWS = [(["n0:0", "n0:1"], [0, 2, 4], 6, 3), (["n0:2"], [0, 4], 4, 2)]


def layers(first: int, end: int) -> list[nn.Module]:
    widths = [3, 5, 5, 5, 2]
    out = []
    for k in range(first, end):
        torch.manual_seed(k)
        out.append(nn.Linear(widths[k], widths[k + 1]))
    return out


# --- batches ------------------------------------------------------------------------------


def test_each_stage_gets_its_vws_micro_batches_in_order() -> None:
    plan = make_plan(TWO_VWS)
    roles = build_roles(plan, DEVICES)
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10) + 100  # (N, 1), (N,)
    first, last, single, unused = (MicroBatches(roles[r], 10) for r in range(4))
    assert first.slices == [(0, 2), (2, 4), (4, 6)] and single.slices == [(6, 8), (8, 10)] and unused.slices == []
    inputs, targets = first((x, y), step=0)
    assert targets is None and [t[:, 0].tolist() for t in inputs] == [[0, 1], [2, 3], [4, 5]]
    inputs, targets = last((x, y), step=0)
    assert inputs is None and [t.tolist() for t in targets] == [[100, 101], [102, 103], [104, 105]]
    inputs, targets = single((x, y), step=0)
    assert [t[:, 0].tolist() for t in inputs] == [[6, 7], [8, 9]] and [t.tolist() for t in targets] == \
        [[106, 107], [108, 109]]
    assert unused((x, y), step=0) == (None, None)


def test_inputs_that_are_not_one_tensor_are_cut_the_same_way() -> None:
    plan = make_plan(TWO_VWS)
    single = MicroBatches(build_roles(plan, DEVICES)[2], 10)
    x = (torch.arange(10), torch.arange(10) * 2)  # two inputs per sample
    inputs, targets = single((x, torch.arange(10)), step=0)
    assert [(a.tolist(), b.tolist()) for a, b in inputs] == [([6, 7], [12, 14]), ([8, 9], [16, 18])]
    assert [t.tolist() for t in targets] == [[6, 7], [8, 9]]


def test_a_batch_of_the_wrong_size_or_shape_names_the_step_and_the_counts() -> None:
    first = MicroBatches(build_roles(make_plan(TWO_VWS), DEVICES)[0], 10)
    with pytest.raises(ValueError, match=r"step 7: a global batch of 9 inputs and 9 targets; .* global batch is 10"):
        first((torch.zeros(9, 1), torch.zeros(9)), step=7)
    with pytest.raises(ValueError, match=r"step 3: a global batch of 8 samples; .* global batch is 10"):
        first(((torch.zeros(8), torch.zeros(8)), torch.zeros(8)), step=3)
    with pytest.raises(TypeError, match="step 2: a global batch must be a pair"):
        first(torch.zeros(10), step=2)


# --- losses -------------------------------------------------------------------------------


def test_losses_come_back_one_flush_late_and_all_at_the_end() -> None:
    waits: list[str] = []
    sums = LossSums(group=None, ranks=1, wait=lambda work, what: waits.append(what))
    rows = [{"step": s, "loss": None} for s in (1, 2, 3)]
    sums.add(rows[0], torch.tensor(0.5))
    sums.add(rows[1], torch.tensor(0.25))
    assert sums.waiting == 2
    assert sums.flush() == []  # started, not read
    assert sums.waiting == 0 and rows[0]["loss"] is None
    sums.add(rows[2], torch.tensor(0.125))
    assert [r["loss"] for r in sums.flush()] == [0.5, 0.25]
    assert sums.drain() == [{"step": 3, "loss": 0.125}]
    assert sums.drain() == [] and waits == []  # one rank: nothing to sum, nothing to wait for


# --- stage state --------------------------------------------------------------------------


def test_every_layer_is_written_by_exactly_one_of_its_owners() -> None:
    plan = make_plan(TWO_VWS)
    stages = {s.device: StageModule(layers(s.first_layer, s.end_layer), s.first_layer)
              for vw in plan.virtual_workers for s in vw.stages}
    owned = {d: owned_names(plan, m, d) for d, m in stages.items()}
    every = set(StageModule(layers(0, 4)).state_dict())
    assert set().union(*owned.values()) == every
    assert sum(len(names) for names in owned.values()) == len(every)
    assert owned["n0:2"] == set()  # VW1's stage holds every layer, and VW0's devices own them first


def test_a_stage_comes_back_from_its_checkpoint_with_its_optimizer_state(tmp_path) -> None:
    plan = make_plan([(["n0:0"], [0, 4], 4, 2)])
    module = StageModule(layers(0, 4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    assert restore_stage(tmp_path, module, optimizer, "n0:0") is None  # nothing saved yet
    save_stage(tmp_path, 5, module, optimizer, plan, "n0:0", {}, checkpoint_meta(plan, 5, 1.5), timeout_s=10)

    fresh = StageModule(layers(0, 4))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    restored = restore_stage(tmp_path, fresh, fresh_optimizer, "n0:0")
    assert restored is not None and restored.step == 5
    assert (restored.meta["step"], restored.meta["loss"], restored.meta["samples_seen"]) == (5, 1.5, 20)
    for (name, p), q in zip(module.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(optimizer.state[p]["momentum_buffer"], fresh_optimizer.state[q]["momentum_buffer"]), name


def test_a_checkpoint_without_this_stages_layers_is_refused(tmp_path) -> None:
    plan = make_plan([(["n0:0", "n0:1"], [0, 2, 4], 4, 2)])
    module = StageModule(layers(0, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    save_stage(tmp_path, 1, module, optimizer, plan, "n0:0", {}, checkpoint_meta(plan, 1, None), timeout_s=10)
    other = StageModule(layers(2, 4), first=2)
    with pytest.raises(CheckpointError, match=r"layers\.2"):
        restore_stage(tmp_path, other, torch.optim.SGD(other.parameters(), lr=0.1), "n0:1")


def test_a_checkpoint_of_other_shapes_is_refused_naming_the_tensor_and_both_shapes(tmp_path) -> None:
    plan = make_plan([(["n0:0"], [0, 4], 4, 2)])
    module = StageModule(layers(0, 4))
    save_stage(tmp_path, 3, module, torch.optim.SGD(module.parameters(), lr=0.1), plan, "n0:0", {},
               checkpoint_meta(plan, 3, None), timeout_s=10)
    wider = StageModule([nn.Linear(3, 7), nn.Linear(7, 5), *layers(2, 4)])  # layers 0 and 1 of other widths
    with pytest.raises(CheckpointError) as err:
        restore_stage(tmp_path, wider, torch.optim.SGD(wider.parameters(), lr=0.1), "n0:0")
    message = str(err.value)
    assert "\n" not in message
    assert f"checkpoint step 3 ({tmp_path / 'step-00000003'}) holds 'layers.0.weight' of shape [5, 3]" in message
    assert "n0:0's stage has shape [7, 3] (and 2 more tensor(s) of other shapes)" in message, message


def test_optimizer_state_of_another_shape_is_refused_before_anything_is_loaded(tmp_path) -> None:
    plan = make_plan([(["n0:0"], [0, 4], 4, 2)])
    module = StageModule(layers(0, 4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    weight = dict(module.named_parameters())["layers.2.weight"]  # (5, 5)
    optimizer.state[weight] = {"momentum_buffer": torch.zeros(5, 4)}  # a state that is not its parameter's shape
    save_stage(tmp_path, 1, module, optimizer, plan, "n0:0", {}, checkpoint_meta(plan, 1, None), timeout_s=10)
    fresh = StageModule(layers(0, 4))
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match=r"holds the optimizer state 'momentum_buffer' of 'layers\.2\.weight' "
                                              r"of shape \[5, 4\], but n0:0's stage has shape \[5, 5\]"):
        restore_stage(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), "n0:0")
    assert all(torch.equal(p, q) for p, q in zip(before, fresh.parameters(), strict=True))


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(tmp_path) -> None:
    """SGD's momentum under a plan of AdamW had failed at the first step on a missing 'exp_avg'."""
    plan = make_plan([(["n0:0"], [0, 4], 4, 2)])
    module = StageModule(layers(0, 4))
    save_stage(tmp_path, 2, module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), plan, "n0:0", {},
               {**checkpoint_meta(plan, 2, None), "optimizer": "momentum"}, timeout_s=10)
    fresh = StageModule(layers(0, 4))
    with pytest.raises(CheckpointError) as err:
        restore_stage(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()), "n0:0", "adam")
    message = str(err.value)
    assert "\n" not in message and f"checkpoint step 2 in {tmp_path}" in message
    assert "trained with optimizer momentum, but the plan's is adam" in message, message
    # the same optimizer resumes
    assert restore_stage(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), "n0:0",
                         "momentum") is not None
    assert checkpoint_meta(plan, 2, None)["optimizer"] == plan.optimizer

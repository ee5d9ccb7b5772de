"""The Trainer's parts that run in one process: micro-batches, loss sums, a step's record, the pre-step hooks'
order, each iteration's Actions, a stage's checkpoint share."""

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
from hetrain.runtime.step.actions import StepActions
from hetrain.runtime.step.batches import MicroBatches
from hetrain.runtime.step.executor import StageModule
from hetrain.runtime.step.hooks import PreStepHooks
from hetrain.runtime.step.losses import EarlySum, LossSums
from hetrain.runtime.step.record import StepRecord
from hetrain.runtime.sync.daso import DasoAdaptation
from hetrain.schedule import COMPUTE_KINDS, P2P_KINDS
from hetrain.simulator import build_schedules
from hetrain.sync_layout import SyncOptions

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


def test_an_early_sum_adds_its_row_and_reads_the_batch_before() -> None:
    sums = LossSums(group=None, ranks=1, wait=lambda work, what: None)
    before = {"step": 1, "loss": None}
    sums.add(before, torch.tensor(0.5))
    assert sums.flush() == []
    early = EarlySum(sums, 2)
    assert early.read is None and early.row == {"step": 2, "loss": None}
    early(torch.tensor(0.25))  # the executor's on_losses, once the step's forwards are over
    assert early.read == [{"step": 1, "loss": 0.5}] and sums.waiting == 0
    assert sums.drain() == [{"step": 2, "loss": 0.25}] and early.row["loss"] == 0.25


# --- a step's record ----------------------------------------------------------------------


def record(**kw: object) -> StepRecord:
    base: dict[str, object] = dict(step=3, loss=torch.tensor(1.0), lr=0.01, step_time_s=0.5, elapsed_s=1.5,
                                   samples_per_s=20.0, sync_actions=("STEP",), allreduce_bytes=64, compute_s=0.1)
    return StepRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_a_records_metrics_are_the_rows_keys_in_their_order() -> None:
    assert list(record().metrics().items()) == [
        ("samples_per_s", 20.0), ("step_time_s", 0.5), ("elapsed_s", 1.5), ("sync_actions", ["STEP"]),
        ("lr", 0.01), ("allreduce_bytes", 64)]
    norm = torch.tensor(2.0)
    full = record(clipping=True, grad_norm=norm, loss_scale=1024.0, step_skipped=False, daso_period=2).metrics()
    assert list(full)[6:] == ["grad_norm", "loss_scale", "step_skipped", "daso_period"]
    assert full["grad_norm"] is norm and full["loss_scale"] == 1024.0 and full["step_skipped"] is False
    # clipping before any step was clipped (fp16 skipped the first): the key is there, its value None
    assert record(clipping=True).metrics()["grad_norm"] is None


# --- the pre-step hooks ---------------------------------------------------------------------


def test_the_pre_step_hooks_run_tied_then_loss_scale_then_clip_and_an_overflow_stops_them() -> None:
    calls: list[str] = []

    def hook(name: str, result: bool | None = None):  # type: ignore[no-untyped-def]
        return lambda step: calls.append(f"{name}{step}") or result

    hooks = PreStepHooks(hook("tied"), hook("scale", True), hook("clip"))  # type: ignore[arg-type]
    chained = hooks.as_hook()
    assert chained is not None and chained(4) is None and calls == ["tied4", "scale4", "clip4"]
    calls.clear()
    overflow = PreStepHooks(hook("tied"), hook("scale", False), hook("clip")).as_hook()  # type: ignore[arg-type]
    assert overflow is not None and overflow(5) is False and calls == ["tied5", "scale5"]  # step and clip skipped
    assert PreStepHooks().as_hook() is None
    only = hook("clip")
    assert PreStepHooks(clip=only).as_hook() is only  # type: ignore[arg-type]


# --- each iteration's Actions ----------------------------------------------------------------


def sync_tail(actions: list) -> list[str]:  # type: ignore[type-arg]
    return [str(a) for a in actions if a.kind not in COMPUTE_KINDS and a.kind not in P2P_KINDS]


@pytest.mark.parametrize("mode", ["bsp", "wsp", "hybrid-ps", "daso", "local-sgd"])
def test_the_actions_of_each_iteration_are_the_ones_the_simulator_replays(mode: str) -> None:
    plan = make_plan([(["n0:0"], [0, 4], 2, 1), (["n0:1"], [0, 4], 2, 1), (["n0:2"], [0, 4], 2, 1)]).with_sync(
        mode, SyncOptions(period=3, aggregate=2, warmup=1, cooldown=1))
    steps = 9
    replayed = build_schedules(plan, steps)
    daso = DasoAdaptation(plan.sync_options.period, None, 1, lambda work, what: None) if mode == "daso" else None
    actions = StepActions(plan, "n0:1", daso)
    actions.start(0)
    for i in range(steps):
        it = actions.next(steps)
        assert list(it.actions) == list(replayed[i]["n0:1"]), (mode, i)
        assert list(it.sync_actions) == sync_tail(it.actions)
        assert it.period == plan.sync_options.period


def test_dasos_period_goes_into_the_sync_state_and_its_checkpoint() -> None:
    plan = make_plan([(["n0:0"], [0, 4], 2, 1), (["n0:1"], [0, 4], 2, 1)]).with_sync(
        "daso", SyncOptions(period=4, warmup=0, cooldown=0))
    daso = DasoAdaptation(4, None, 1, lambda work, what: None)
    actions = StepActions(plan, "n0:0", daso)
    actions.start(5)
    daso.rate.period = 2  # as DasoRate halves k on a plateau
    it = actions.next(100)
    assert it.period == 2 and "AVERAGE_START seg0" in it.sync_actions  # iteration 5 ends a period of 2
    again = DasoAdaptation(4, None, 1, lambda work, what: None)
    again.load_state_dict(daso.state_dict())
    assert again.period == 2


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

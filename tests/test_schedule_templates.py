"""Schedules shared among devices (``ScheduleTemplates``) give every device the Actions that building them for it
alone gives, and the simulator's operations compiled from the templates are those compiled from every device's
own Actions: on random plans, on plans of identical VWs, and on ones broken so that twin devices must differ."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetrain.plan import Plan, Stage, VirtualWorker
from hetrain.schedule import (
    GENERATORS,
    Action,
    ActionKind,
    Schedule,
    ScheduleTemplates,
    SyncState,
    Transfer,
    add_bsp_sync,
    add_p2p,
    advance_sync_state,
    build_schedule,
    build_schedule_templates,
    build_sync_actions,
    initial_sync_state,
    schedule_to_dict,
)
from hetrain.schedule.sync import buckets_by_device
from hetrain.simulator import simulate
from hetrain.simulator.compile import Program, compile_program
from hetrain.simulator.engine import run_program
from hetrain.simulator.fast_engine import run_program_fast
from hetrain.simulator.replay import build_schedule_templates_of, build_schedules, simulated_iterations
from hetrain.simulator.result import build_result
from test_simulator_fast import MODES, SCHEDULES, assert_same, contig_plan, random_plan
from tiers import one_in, slow_where

K = ActionKind
ODD = ("", "type", "batch", "order", "cut", "recompute", "stages")


def direct_schedule(plan: Plan, state: SyncState | None = None, steps: int | None = None) -> Schedule:
    """Every device's Actions built for it alone: its VW's compute order, sends and receives naming its own
    neighbours, its own sync actions (what ``build_schedule`` did before devices shared templates)."""
    out: Schedule = {}
    buckets = buckets_by_device(plan)
    for vw in plan.virtual_workers:
        p, devices = len(vw.stages), vw.devices
        for j, compute in enumerate(GENERATORS[plan.schedule](vw.micro_batches, p)):
            actions = add_p2p(compute, devices[j - 1] if j > 0 else None, devices[j + 1] if j < p - 1 else None)
            if plan.sync == "bsp":
                out[devices[j]] = add_bsp_sync(actions, buckets.get(devices[j], []))
            else:
                out[devices[j]] = [*actions, *build_sync_actions(plan, devices[j], state, steps)]
    return out


def twin_plan(schedule: str, odd: str, sync: str = "bsp") -> Plan:
    """6 identical VWs of 4 stages (``contig_plan``), the last one broken by ``odd``: besides ``contig_plan``'s
    (``type``, ``batch``, ``order``), ``cut`` moves a layer between its first two stages (other segments and
    buckets), ``recompute`` recomputes one layer of its stage 1, ``stages`` runs it on 3 stages (its last
    device left idle)."""
    plan = contig_plan(vws=6, stages=4, micro_batches=5, schedule=schedule,
                       odd=odd if odd in ("type", "batch", "order") else "")
    vws = list(plan.virtual_workers)
    last = vws[-1]
    stages = list(last.stages)
    if odd == "cut":
        stages[0] = replace(stages[0], end_layer=3)
        stages[1] = replace(stages[1], first_layer=3)
    elif odd == "recompute":
        stages[1] = replace(stages[1], recompute=(stages[1].first_layer,))
    elif odd == "stages":
        stages = [stages[0], stages[1], Stage(stages[2].device, stages[2].first_layer, stages[3].end_layer)]
    vws[-1] = VirtualWorker(tuple(stages), last.mini_batch, last.micro_batches)
    plan = replace(plan, virtual_workers=tuple(vws))
    return plan if sync == "bsp" else plan.with_sync(sync, replace(plan.sync_options, period=2, aggregate=2))  # type: ignore[arg-type]


def twin_plans() -> list[Plan]:
    return [twin_plan(s, odd, sync) for s in SCHEDULES for odd in ODD for sync in MODES]


def states(plan: Plan, n: int) -> list[SyncState]:
    out = [initial_sync_state(plan)]
    for _ in range(n - 1):
        out.append(advance_sync_state(plan, out[-1], n))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_random_plans_shared_schedule_is_each_devices_own(seed: int) -> None:
    plan = random_plan(seed)
    n = simulated_iterations(plan)
    for state in states(plan, n):
        assert schedule_to_dict(build_schedule(plan, state, n)) == schedule_to_dict(direct_schedule(plan, state, n))


# 70 plans, each replayed over its iterations: a spread of 12 (both schedules, every mode) in the fast tier
@pytest.mark.parametrize("plan", slow_where(twin_plans(), one_in(6)), ids=lambda p: f"{p.schedule}-{p.sync}")
def test_twin_devices_share_a_template_and_broken_twins_do_not(plan: Plan) -> None:
    n = simulated_iterations(plan)
    for state in states(plan, n):
        shared = build_schedule_templates(plan, state, n)
        direct = direct_schedule(plan, state, n)
        assert list(shared.roles) == list(direct)  # the devices in the same order
        assert schedule_to_dict(shared.schedule()) == schedule_to_dict(direct)
        # the first five VWs are twins: stage j of each runs one template; the broken last VW may not
        for j in range(4):
            twins = {shared.roles[vw.stages[j].device].template for vw in plan.virtual_workers[:5]}
            assert len(twins) == 1, j
    assert len(shared.templates) < len(shared.roles)


@pytest.mark.parametrize("odd", ["batch", "cut", "recompute", "stages"])
def test_a_broken_twin_runs_its_own_actions(odd: str) -> None:
    """Where the last VW differs in what its Actions depend on, its devices get other templates (a shared
    template there would give it its twins' micro-batches, buckets or stage count)."""
    plan = twin_plan("1f1b", odd)
    shared = build_schedule_templates(plan)
    twin, broken = plan.virtual_workers[0], plan.virtual_workers[-1]
    differs = [shared.roles[a.device].template != shared.roles[b.device].template
               for a, b in zip(twin.stages, broken.stages, strict=False)]
    if odd == "recompute":  # the recompute set changes costs, not Actions: the template is rightly shared
        assert not any(differs)
    else:
        assert any(differs)
    mine = shared.actions(broken.stages[0].device)
    assert mine == direct_schedule(plan)[broken.stages[0].device]
    if odd == "batch":
        assert sum(str(a) == f"0F{broken.micro_batches - 1}" for a in mine) == 1
        assert broken.micro_batches == twin.micro_batches + 1


def test_a_templates_transfers_name_the_devices_own_neighbours() -> None:
    plan = twin_plan("gpipe", "order")
    shared = build_schedule_templates(plan)
    for vw in plan.virtual_workers:
        for j, stage in enumerate(vw.stages):
            template = shared.templates[shared.roles[stage.device].template]
            assert all(a.peer is None for a in template if isinstance(a, Transfer))
            for a in shared.actions(stage.device):
                if isinstance(a, Transfer):
                    to_next = a.kind in (K.SEND_F, K.RECV_B)
                    assert a.peer == vw.stages[j + 1 if to_next else j - 1].device, (stage.device, str(a))


def test_a_schedule_passed_in_round_trips_through_templates() -> None:
    plan = random_plan(7)
    schedule = build_schedule(plan)
    again = ScheduleTemplates.of(schedule)
    assert again.schedule() == schedule
    assert all(not isinstance(a, Transfer) or a.peer is not None for t in again.templates for a in t)


def compiled(plan: Plan, shared: bool) -> Program:
    n = simulated_iterations(plan)
    return compile_program(plan, build_schedule_templates_of(plan, n) if shared else build_schedules(plan, n))


def assert_same_program(got: Program, want: Program) -> None:
    """Operation for operation, collective for collective, link resource for link resource (and their order)."""
    assert got.names == want.names
    assert got.where == want.where
    for d, name in enumerate(want.names):
        assert len(got.ops[d]) == len(want.ops[d]), name
        for k, (a, b) in enumerate(zip(got.ops[d], want.ops[d], strict=True)):
            assert type(a) is type(b) and a == b, (name, k, a, b)
    assert got.collectives == want.collectives
    assert got.links.names == want.links.names
    assert got.schedule == want.schedule


# 38 plans, each compiled and replayed twice: 10 of them (6 twins, 4 random) in the fast tier
@pytest.mark.parametrize("plan", slow_where([*twin_plans()[::3], *(random_plan(s) for s in range(0, 40, 3))],
                                            one_in(4)), ids=lambda p: f"{p.schedule}-{p.sync}")
def test_operations_compiled_from_templates_are_each_devices_own(plan: Plan) -> None:
    shared, own = compiled(plan, True), compiled(plan, False)
    assert_same_program(shared, own)
    assert_same(build_result(shared, run_program_fast(shared)), build_result(own, run_program(own)))


@pytest.mark.parametrize("odd", ODD)
def test_the_simulation_of_twins_equals_the_reference(odd: str) -> None:
    plan = twin_plan("1f1b", odd)
    assert_same(simulate(plan), simulate(plan, reference=True))
    assert_same(simulate(plan), simulate(plan, schedule=direct_schedule(plan)))


def test_a_template_with_no_neighbour_for_a_transfer_is_refused() -> None:
    plan = twin_plan("1f1b", "")
    shared = build_schedule_templates(plan)
    first = plan.virtual_workers[0].stages[0].device
    role = shared.roles[first]
    template: list[Action] = [Transfer(K.RECV_F, 0, 0), *shared.templates[role.template]]
    broken = ScheduleTemplates([*shared.templates, template], {**shared.roles, first: role._replace(
        template=len(shared.templates))})
    with pytest.raises(Exception, match="names no peer"):
        compile_program(plan, [broken])

"""The sync modes' rules (``hetrain.sync_mode``): each mode's answers, one object per allowed name, and
unknown names refused in one line."""

from __future__ import annotations

from typing import get_args

import pytest

from hetrain import sync_layout
from hetrain.errors import InputError
from hetrain.plan import SYNC_MODES as PLAN_SYNC_MODES
from hetrain.sync_layout import SyncOptions
from hetrain.sync_mode import MODES, SYNC_MODES, Exchange, SyncModeError, SyncModeName, sync_mode

OPTIONS = SyncOptions(staleness=3, period=5, aggregate=7, warmup=2, cooldown=1)

#: name -> (synchronous, parameter servers, averages, local mean, posted, adaptive, period, overlap iterations,
#: the same actions every iteration), with OPTIONS (docs/sync.md)
EXPECTED = {
    "bsp": (True, False, False, False, False, False, 1, 0, True),
    "wsp": (False, True, False, False, False, False, 1, 3, True),
    "hybrid-ps": (False, True, False, True, False, False, 7, 3, False),
    "daso": (False, False, True, True, True, True, 5, 1, False),
    "local-sgd": (False, False, True, False, False, False, 5, 0, False),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_mode_answers_its_rules(name: str) -> None:
    mode = sync_mode(name)
    assert mode.name == name
    got = (mode.synchronous, mode.parameter_servers, mode.averages, mode.local_mean, mode.posted, mode.adaptive,
           mode.period(OPTIONS), mode.overlap_iterations(OPTIONS), mode.same_every_iteration)
    assert got == EXPECTED[name]
    # clipping, fp16's loss scaling and ties across devices need the gradients summed across VWs before the step
    assert mode.supports_clipping is mode.supports_fp16 is mode.supports_ties_across_devices is (name == "bsp")
    assert sum((mode.synchronous, mode.parameter_servers, mode.averages)) == 1  # one way across VWs


def test_every_allowed_name_has_one_object_and_every_object_an_allowed_name() -> None:
    assert SYNC_MODES == ("bsp", "wsp", "hybrid-ps", "daso", "local-sgd")
    assert get_args(SyncModeName) == SYNC_MODES
    assert tuple(m.name for m in MODES) == SYNC_MODES and len(set(MODES)) == len(MODES)
    for name in PLAN_SYNC_MODES:  # the names a plan accepts (``validate_plan``)
        assert sync_mode(name).name == name
    assert set(EXPECTED) == set(SYNC_MODES)


def test_a_plan_looks_its_mode_up_once_and_stores_the_name() -> None:
    from test_schedule import two_node_plan

    for name in SYNC_MODES:
        made = two_node_plan(name)
        assert made.sync == name and made.sync_mode is sync_mode(name)
        assert made.to_dict()["sync"]["mode"] == name
        assert made.with_sync("bsp" if name != "bsp" else "wsp").sync_mode is not made.sync_mode


def test_the_period_option_is_an_option_its_mode_reads() -> None:
    bounds = sync_layout._BOUNDS
    for mode in MODES:
        if mode.period_option is not None:
            assert mode.name in bounds[mode.period_option].modes
        for name, bound in bounds.items():  # every mode an option names is a known one
            assert set(bound.modes) <= set(SYNC_MODES), name
    assert {m.name for m in MODES if m.parameter_servers} == set(bounds["staleness"].modes)
    assert {m.name for m in MODES if m.posted} == set(bounds["warmup"].modes) == set(bounds["cooldown"].modes)


@pytest.mark.parametrize(("name", "where", "line"), [
    ("ssp", "", "sync mode must be one of bsp, wsp, hybrid-ps, daso, local-sgd, got 'ssp'"),
    ("BSP", "--sync", "--sync: sync mode must be one of bsp, wsp, hybrid-ps, daso, local-sgd, got 'BSP'"),
    ("", "plan.json: sync.mode", "plan.json: sync.mode: sync mode must be one of bsp, wsp, hybrid-ps, daso, "
                                 "local-sgd, got ''"),
])
def test_an_unknown_name_is_refused_in_one_line(name: str, where: str, line: str) -> None:
    with pytest.raises(SyncModeError) as caught:
        sync_mode(name, where)
    assert str(caught.value) == line and "\n" not in line
    assert isinstance(caught.value, InputError)


def test_the_exchanges_are_the_three_kinds() -> None:
    assert {m.exchange for m in MODES} == set(Exchange)

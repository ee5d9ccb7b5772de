"""The learning-rate schedule: warm-up, constant, cosine and linear decay against hand-computed values."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from typing import Any

import pytest

from hetrain.errors import InputError
from hetrain.runtime.step.lr_schedule import LR_SCHEDULES, LrSchedule, lr_at


def test_the_schedules_are_named() -> None:
    assert LR_SCHEDULES == ("constant", "cosine", "linear")


def test_constant_without_warm_up_is_the_rate_throughout() -> None:
    assert [lr_at(t, lr=0.1, total_steps=5) for t in range(1, 6)] == [0.1] * 5


def test_warm_up_rises_linearly_from_zero_and_the_first_step_already_moves() -> None:
    # lr · t / W with W = 4: 0.025, 0.05, 0.075, 0.1; then constant
    got = [lr_at(t, lr=0.1, total_steps=8, warmup_steps=4) for t in range(1, 7)]
    assert got == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1], abs=1e-15)


def test_cosine_halfway_is_the_mean_and_the_last_step_is_min_lr() -> None:
    # W = 0, T = 10: p = t / 10; lr(5) = (1 + cos(π/2)) / 2 = 0.5; lr(1) = (1 + cos(0.1π)) / 2
    assert lr_at(5, lr=1.0, total_steps=10, schedule="cosine") == pytest.approx(0.5, abs=1e-15)
    assert lr_at(1, lr=1.0, total_steps=10, schedule="cosine") == pytest.approx(0.9755282581475768, abs=1e-15)
    assert lr_at(10, lr=1.0, total_steps=10, schedule="cosine") == pytest.approx(0.0, abs=1e-15)


def test_cosine_after_warm_up_decays_to_min_lr() -> None:
    # W = 2, T = 12, min 0.1: at t = 7, p = 5/10, lr = 0.1 + 0.9 · 0.5 = 0.55; at t = 2 the peak; at t = 12 min_lr
    kw: dict[str, Any] = {"lr": 1.0, "total_steps": 12, "schedule": "cosine", "warmup_steps": 2, "min_lr": 0.1}
    assert lr_at(1, **kw) == 0.5
    assert lr_at(2, **kw) == 1.0
    assert lr_at(7, **kw) == pytest.approx(0.55, abs=1e-15)
    assert lr_at(12, **kw) == pytest.approx(0.1, abs=1e-15)
    rates = [lr_at(t, **kw) for t in range(2, 13)]
    assert all(a > b for a, b in itertools.pairwise(rates))


def test_linear_decay_after_warm_up() -> None:
    # W = 2, T = 10, lr 0.1, min 0.02: p = (t - 2) / 8; lr = 0.1 - 0.08 p
    kw: dict[str, Any] = {"lr": 0.1, "total_steps": 10, "schedule": "linear", "warmup_steps": 2, "min_lr": 0.02}
    want = {1: 0.05, 2: 0.1, 3: 0.09, 6: 0.06, 10: 0.02}
    for t, rate in want.items():
        assert lr_at(t, **kw) == pytest.approx(rate, abs=1e-15), t


def test_a_step_past_the_end_keeps_min_lr_and_a_long_warm_up_never_peaks() -> None:
    assert lr_at(15, lr=1.0, total_steps=10, schedule="linear", min_lr=0.25) == 0.25
    assert lr_at(15, lr=1.0, total_steps=10, schedule="cosine", min_lr=0.25) == pytest.approx(0.25, abs=1e-15)
    # W >= T: the run ends inside its warm-up
    assert lr_at(5, lr=0.1, total_steps=5, schedule="cosine", warmup_steps=10) == pytest.approx(0.05, abs=1e-15)
    assert lr_at(3, lr=0.1, total_steps=3, schedule="linear", warmup_steps=3) == pytest.approx(0.1, abs=1e-15)


def test_the_schedule_is_a_pure_function_of_the_step_so_a_resumed_run_continues_it() -> None:
    """A run resumed at step k asks for the rates of steps k+1..T, and gets those of the uninterrupted run."""
    schedule = LrSchedule(0.3, "cosine", warmup_steps=3, min_lr=0.01)
    whole = [schedule.at(t, total_steps=20) for t in range(1, 21)]
    resumed = [LrSchedule(0.3, "cosine", warmup_steps=3, min_lr=0.01).at(t, total_steps=20) for t in range(8, 21)]
    assert resumed == whole[7:]
    # the schedule's own total wins over fit's steps (one run made of several fit calls)
    fixed = LrSchedule(0.3, "cosine", warmup_steps=3, min_lr=0.01, total_steps=20)
    assert [fixed.at(t, total_steps=8) for t in range(1, 9)] == whole[:8]


@pytest.mark.parametrize("kwargs, needles", [
    ({"lr": -1.0}, ("learning rate", "-1.0")),
    ({"lr": 0.0}, ("learning rate", "0.0")),
    ({"lr": math.nan}, ("learning rate", "nan")),
    ({"lr": 0.1, "schedule": "step"}, ("'step'", "constant, cosine, linear")),
    ({"lr": 0.1, "warmup_steps": -2}, ("warm-up", "-2")),
    ({"lr": 0.1, "min_lr": 0.2}, ("minimum", "0.1", "0.2")),
    ({"lr": 0.1, "min_lr": -0.1}, ("minimum", "-0.1")),
    ({"lr": 0.1, "total_steps": 0}, ("total steps", "0")),
])
def test_bad_values_are_refused_with_the_value(kwargs: dict[str, object], needles: tuple[str, ...]) -> None:
    with pytest.raises(InputError) as e:
        LrSchedule(**kwargs)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_step_numbers_start_at_one() -> None:
    with pytest.raises(InputError, match="start at 1, got 0"):
        lr_at(0, lr=0.1, total_steps=3)


def test_importing_it_imports_no_torch() -> None:
    code = "import sys, hetrain.runtime.step.lr_schedule; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

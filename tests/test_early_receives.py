"""Which receives the runtime posts ahead of its RECVs (runtime.step.p2p.early_receives): pure, no ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from factories import make_cluster, make_plan
from hetrain.plan import Plan, load_plan
from hetrain.profile import LayerProfile, ModelProfile
from hetrain.runtime.step.p2p import early_receives
from hetrain.sync_layout import SyncLayoutError, SyncOptions

CLUSTER = make_cluster({"a": 2, "b": 2}, nic="100Mbit/s", name="two")


def plan_of(early: str | None = None) -> Plan:
    """One pipeline a:0 -> a:1 -> b:0 (b:1 unused), micro-batches of 4."""
    profile = ModelProfile("m", tuple(LayerProfile(f"l{k}", 1e3, 8e3, 0, 0) for k in range(6)), 0)
    options = SyncOptions() if early is None else SyncOptions(early_receives=early)
    return make_plan(CLUSTER, profile, [(["a:0", "a:1", "b:0"], [0, 2, 4, 6], 16, 4)], sync_options=options)


def test_by_default_every_stage_posts_the_receives_it_has_ahead() -> None:
    plan = plan_of()
    assert plan.sync_options.early_receives == "always"
    assert early_receives(plan, "a:0") == (False, True)   # first stage: gradients only
    assert early_receives(plan, "a:1") == (True, True)
    assert early_receives(plan, "b:0") == (True, False)   # last stage: activations only
    assert early_receives(plan, "b:1") == (False, False)  # unused


def test_never_posts_every_receive_at_its_recv() -> None:
    assert [early_receives(plan_of("never"), d) for d in ("a:0", "a:1", "b:0")] == [(False, False)] * 3


def test_the_option_survives_a_saved_plan_and_bad_values_are_refused(tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan_of("never").save(path)
    assert load_plan(path).sync_options.early_receives == "never"
    with pytest.raises(SyncLayoutError, match="early_receives"):
        replace(SyncOptions(), early_receives="sometimes")

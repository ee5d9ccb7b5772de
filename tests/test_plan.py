"""Plan as data: JSON round trip, validation errors, segments, agreement with the simulator."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hetrain.cluster import load_cluster, parse_cluster
from hetrain.models.analytic import build_profile
from hetrain.plan import PlanError, Stage, VirtualWorker, load_plan, parse_plan
from hetrain.planner import plan
from hetrain.simulator import simulate
from tiers import one_in, slow_where

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@pytest.fixture(scope="module")
def small_plan():
    cluster = parse_cluster({"node": [
        {"name": "a", "devices": [{"type": "A100-40GB", "count": 2}], "intra_link": "nvlink3", "nic": "25Gbit/s"},
        {"name": "b", "devices": [{"type": "T4", "count": 2}], "intra_link": "pcie3", "nic": "10Gbit/s"}]})
    return plan(cluster, build_profile("gpt2-small"), 64, simulate_top_k=0)


def test_json_round_trip(tmp_path: Path, small_plan) -> None:
    path = tmp_path / "plan.json"
    small_plan.save(path)
    again = load_plan(path)
    assert again.to_dict() == small_plan.to_dict()
    assert json.loads(path.read_text())["virtual_workers"][0]["stages"][0]["device"]
    assert not list(tmp_path.glob("*.tmp"))


def test_validation_names_the_problem(small_plan) -> None:
    data = small_plan.to_dict()
    data["virtual_workers"][0]["stages"][0]["layers"] = [0, 1]
    if len(data["virtual_workers"][0]["stages"]) == 1:
        with pytest.raises(PlanError, match=r"VW0: stages cover layers \[0, 1\) but the model has 14 layers"):
            parse_plan(data)
    else:
        with pytest.raises(PlanError, match="do not continue from layer 1"):
            parse_plan(data)
    data = small_plan.to_dict()
    data["global_batch"] = 1000
    with pytest.raises(PlanError, match="mini-batches add up to 64, global batch is 1000"):
        parse_plan(data)
    data = small_plan.to_dict()
    data["virtual_workers"][0]["stages"][0]["device"] = "zz:9"
    with pytest.raises(PlanError, match="device 'zz:9' is not in cluster"):
        parse_plan(data)


def test_a_device_in_two_stages_is_refused(small_plan) -> None:
    vw = small_plan.virtual_workers[0]
    dup = VirtualWorker((Stage(vw.stages[0].device, 0, 14),), 1, 1)
    with pytest.raises(PlanError, match="already holds another stage"):
        replace(small_plan, virtual_workers=(vw, dup), global_batch=vw.mini_batch + 1)


def test_segments_group_layers_by_owners(small_plan) -> None:
    segs = small_plan.segments()
    assert segs[0].first_layer == 0 and segs[-1].end_layer == 14
    for a, b in itertools.pairwise(segs):
        assert a.end_layer == b.first_layer and a.owners != b.owners
    n_vw = len(small_plan.virtual_workers)
    assert all(len(s.owners) == n_vw for s in segs)


def test_micro_batch_sizes_split_evenly() -> None:
    vw = VirtualWorker((Stage("a:0", 0, 1),), 10, 4)
    assert vw.micro_batch_sizes == [3, 3, 2, 2]
    assert vw.micro_batch_size == 3


# each plans gpt2-medium on an example cluster and simulates it: hetpipe in the fast tier
@pytest.mark.parametrize("name", slow_where(["hetpipe", "pipetorch", "cloud-mixed", "gpu256"], one_in(4)))
def test_simulated_peak_memory_agrees_with_closed_form(name: str) -> None:
    cluster = load_cluster(EXAMPLES / f"{name}.toml")
    p = plan(cluster, build_profile("gpt2-medium"), 512, simulate_top_k=0)
    sim = simulate(p)
    for m in p.prediction.memory:  # a TP group's devices hold what its first one does, which the simulator runs
        assert sim.devices[p.stage_on(m.device).device].peak_memory_bytes == pytest.approx(m.peak_bytes, rel=1e-9)
        assert m.peak_bytes <= m.capacity_bytes


# --- unknown keys: a hand edit with a slip is refused, not silently dropped -----------------------------

def _edited(data: dict, path: str, value: object) -> dict:
    """``data`` with ``value`` set at the dotted ``path`` (list indices as numbers)."""
    *parents, last = path.split(".")
    at: Any = data
    for part in parents:
        at = at[int(part)] if isinstance(at, list) else at[part]
    at[last] = value
    return data


@pytest.mark.parametrize(("path", "value", "needles"), [
    ("virtual_workers.0.stages.0.recomput", [1],
     ("virtual_workers[0].stages[0]: unknown key 'recomput' (= [1]); did you mean 'recompute'?",)),
    ("virtual_workers.0.micro_batch", 2,
     ("virtual_workers[0]: unknown key 'micro_batch' (= 2); did you mean 'micro_batches'?",)),
    ("shedule", "gpipe", ("the top level: unknown key 'shedule' (= 'gpipe'); did you mean 'schedule'?",)),
    ("prediction.iteration", 1.0, ("prediction: unknown key 'iteration'", "did you mean 'iteration_s'?")),
    ("prediction.memory.0.peak", 1.0, ("prediction.memory[0]: unknown key 'peak'", "did you mean 'peak_bytes'?")),
    ("sync.mod", "wsp", ("sync: unknown key 'mod' (= 'wsp'); did you mean 'mode'?",)),
    ("sync.segments.0.ps_host", "a:0", ("sync.segments[0]: unknown key 'ps_host'",)),
    ("virtual_workers.0.stages.0.colour", "red", ("virtual_workers[0].stages[0]: unknown key 'colour'", "a stage has")),
])
def test_an_unknown_key_is_refused_naming_file_place_and_key(tmp_path: Path, small_plan, path: str, value: object,
                                                            needles: tuple[str, ...]) -> None:
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(_edited(small_plan.to_dict(), path, value)))
    with pytest.raises(PlanError) as caught:
        load_plan(file)
    message = str(caught.value)
    assert message.startswith(f"{file}: ") and "\n" not in message
    for needle in needles:
        assert needle in message


def test_the_simulate_command_refuses_an_unknown_key_in_one_line(tmp_path: Path, small_plan, capsys) -> None:
    from hetrain.cli import main

    file = tmp_path / "plan.json"
    file.write_text(json.dumps(_edited(small_plan.to_dict(), "virtual_workers.0.stages.0.recomput", [1])))
    assert main(["simulate", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(file) in err and "'recomput'" in err and "'recompute'" in err


@pytest.mark.parametrize("mode", ["bsp", "wsp", "hybrid-ps", "daso", "local-sgd"])
def test_every_key_the_writer_emits_loads_back(tmp_path: Path, small_plan, mode: str) -> None:
    """Each mode writes different segment keys (buckets, ps_shards, local_groups); recompute and memory figures
    are written too: all of it loads."""
    stage = small_plan.virtual_workers[0].stages[0]
    vw = replace(small_plan.virtual_workers[0], stages=(replace(stage, recompute=(stage.first_layer,)),
                                                       *small_plan.virtual_workers[0].stages[1:]))
    edited = replace(small_plan, virtual_workers=(vw, *small_plan.virtual_workers[1:]),
                     prediction=replace(small_plan.prediction, simulated_iteration_s=1.0, time_to_accuracy_s=2.0))
    one = edited.with_sync(mode)
    one.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").to_dict() == one.to_dict()


def test_a_format_1_plan_still_upgrades_with_every_key_it_wrote(small_plan) -> None:
    from hetrain.plan import upgrade_plan_data

    data = small_plan.to_dict()
    data.update(format_version=1, sync=small_plan.sync, options={**data["options"], "staleness": 2})
    again = parse_plan(upgrade_plan_data(data), check_layout=False)
    assert again.virtual_workers == small_plan.virtual_workers and again.sync_options.staleness == 2


def test_with_options_is_replace_of_the_options_without_laying_the_plan_out_again() -> None:
    """``Plan.with_options``: the plan ``dataclasses.replace`` makes with other options (equal, the same JSON), whose
    derived layout is the original's object (no validation or layout again: nothing there reads the options); the
    original keeps its own options."""
    cluster = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "small-hetero.toml")
    p = plan(cluster, build_profile("mlp"), 16, time_budget_s=None, simulate_top_k=0)
    options = {**p.options, "note": {"a": 1}}
    fast, slow = p.with_options(options), replace(p, options=options)
    assert fast == slow and fast.to_dict() == slow.to_dict() and fast.options == options
    assert fast.layout is p.layout and slow.layout is not p.layout
    assert "note" not in p.options and fast.options is not options  # its own dict, not the caller's

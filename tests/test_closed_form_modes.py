"""The planner's closed form agrees with the simulator within 10% under every sync mode (issue 36): the planner
ranks candidates by the closed form, so a mode whose closed form is off ranks its plans wrongly.
benchmarks/closed_form_modes.py measures every example cluster; these are its fast cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.cluster import load_cluster
from hetrain.models.analytic import build_profile
from hetrain.planner import plan
from hetrain.planner.sync import SyncTerms, average_holds_pipeline_nics, plan_layouts, plan_traffic
from hetrain.simulator import simulate
from hetrain.sync_mode import SYNC_MODES

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def ratio(cluster: str, model: str, batch: int, mode: str, strategy: str = "dp") -> float:
    """Closed-form over simulated seconds per iteration of the ``--strategy`` plan under ``mode``."""
    p = plan(load_cluster(CLUSTERS / f"{cluster}.toml"), build_profile(model, precision="fp16"), batch,
             strategy=strategy, sync=mode)
    return p.prediction.iteration_s / simulate(p).iteration_s


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_closed_form_agrees_with_the_replay_on_pipetorch(mode: str) -> None:
    # eight 1-device VWs on 10 GbE; DASO's replay counted its blocking warm-up and cool-down (4 of 12 iterations:
    # 0.86) before it replayed a long run's steady iterations
    got = ratio("pipetorch", "gpt2-small", 256, mode)
    assert got == pytest.approx(1.0, abs=0.1), (mode, got)


@pytest.mark.parametrize("mode", ["wsp", "hybrid-ps", "daso"])
def test_closed_form_agrees_with_the_replay_where_the_exchange_outlasts_the_compute(mode: str) -> None:
    # twenty 1-device VWs, a 100 Gbit/s node among 25 and 10 Gbit/s ones: the exchange outlasts an iteration.
    # wsp: the A100 node's NIC carries a wave's pushes in and the previous wave's pulls out at once (0.62 when a
    # push waited for both directions to be free); daso: the posted average hides behind one iteration, not k - 1
    # (the closed form was 0.81 of the replay); hybrid-ps: the round trip hides behind the local all-reduces as
    # well as the compute (1.10 when the closed form added them)
    got = ratio("cloud-mixed", "gpt2-medium", 512, mode)
    assert got == pytest.approx(1.0, abs=0.1), (mode, got)


def test_closed_form_agrees_with_the_replay_where_pushes_and_activations_share_a_nic() -> None:
    # pipelined VWs under wsp: the NIC of a node that hosts a shard carries the activations beside the pushes
    # and pulls; the replay had the activations queue behind whole push and pull phases (0.52), the closed
    # form left them off the busiest link
    got = ratio("pipetorch", "gpt2-small", 256, "wsp", strategy="auto")
    assert got == pytest.approx(1.0, abs=0.1), got


def test_a_posted_average_that_holds_the_nics_pipelines_cross_hides_nothing() -> None:
    # cloud-mixed, gpt2-medium under daso, the planner's own plan: VWs of 2 and 3 stages across nodes, whose
    # transfers queue on their NICs behind the global average posted every 4th iteration; the closed form hid
    # the average behind the next iteration (0.80 of the replay). Priced as a blocking average it is 0.92.
    cluster = load_cluster(CLUSTERS / "cloud-mixed.toml")
    profile = build_profile("gpt2-medium", precision="fp16")
    p = plan(cluster, profile, 512, strategy="auto", sync="daso")
    layouts, traffic = plan_layouts(p), plan_traffic(p)
    assert any(len(vw.stages) > 1 for vw in p.virtual_workers)
    assert average_holds_pipeline_nics(cluster, profile, layouts, traffic)
    terms = SyncTerms(cluster, profile, layouts)
    k = p.sync_options.period
    assert p.prediction.sync_s == pytest.approx(terms.local_s() + terms.exchange_s() / k, rel=1e-9)
    got = p.prediction.iteration_s / simulate(p).iteration_s
    assert got == pytest.approx(1.0, abs=0.1), got
    # one-stage VWs send nothing between nodes: the average still hides behind an iteration
    dp = plan(cluster, profile, 512, strategy="dp", sync="daso")
    assert not average_holds_pipeline_nics(cluster, profile, plan_layouts(dp), plan_traffic(dp))


def test_an_exchange_that_halves_the_pipelines_links_is_in_the_closed_form() -> None:
    # cloud-mixed, gpt2-medium under wsp, every node planned (no node left out): VWs of 2 and 3 stages whose
    # transfers cross the T4 nodes' 10 Gbit/s NICs, which each wave's pushes and pulls hold a quarter of it. The
    # transfers meeting them run at half rate; the closed form left that out (0.85 of the replay)
    cluster = load_cluster(CLUSTERS / "cloud-mixed.toml")
    profile = build_profile("gpt2-medium", precision="fp16")
    p = plan(cluster, profile, 512, strategy="auto", sync="wsp", leave_out=False)
    assert any(len({s.device.split(":")[0] for s in vw.stages}) > 1 for vw in p.virtual_workers)
    assert p.prediction.sync_s > 0.05  # the pipelines' loss to the exchange: the only sync that shows
    got = p.prediction.iteration_s / simulate(p).iteration_s
    assert got == pytest.approx(1.0, abs=0.1), got


@pytest.mark.slow  # plans cloud-mixed three times
def test_schedule_auto_finds_what_1f1b_alone_finds() -> None:
    # cloud-mixed, wsp, every node: the candidate that ranks first is screened under 1F1B-eager's form; searched
    # for eager's cuts only it ended A100 first (1.216 s closed form), where 1F1B's search puts the T4s first
    # (1.095 s). Auto, which may run either schedule, must do no worse by its own closed form than 1F1B alone.
    cluster, profile = load_cluster(CLUSTERS / "cloud-mixed.toml"), build_profile("gpt2-medium", precision="fp16")
    auto = plan(cluster, profile, 512, sync="wsp", leave_out=False)
    one = plan(cluster, profile, 512, sync="wsp", leave_out=False, schedule="1f1b")
    assert auto.prediction.iteration_s <= one.prediction.iteration_s * (1 + 1e-9)
    # and the pipelines' transfers queue in the 1F1B cycle: eight VWs of four stages on nvlink-nodes, every
    # boundary across NICs busy 83% of a period, within 10% of the replay under 1F1B (0.91 without the queue)
    nvlink = load_cluster(CLUSTERS / "nvlink-nodes.toml")
    p = plan(nvlink, build_profile("gpt2-large", precision="fp16"), 512, sync="bsp", schedule="1f1b")
    assert [len(vw.stages) for vw in p.virtual_workers] == [4] * 8
    assert p.prediction.iteration_s / simulate(p).iteration_s == pytest.approx(1.0, abs=0.1)

"""The runtime-vs-torch benchmarks' own logic: paired ratios, CPU by thread, the CPU quota of ``--cpu-quota``.

The script is run as a user runs it for what it must refuse (a bad quota; no cgroup cpu
controller, in a mount namespace without cgroups); the quota's cgroup itself is made for
real where this host allows it (root and a cpu controller), else the test says why it skips.
"""

from __future__ import annotations

import math
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _vs_torch import (  # noqa: E402
    QUOTA_PERIOD_S,
    TORCH_NAMES,
    TORCH_SCHEDULES,
    build_plan,
    cpu_cgroup_of,
    cpu_ms_per_step,
    cpu_quota_group,
    cpu_quota_problem,
    ddp_bucket_caps_mb,
    local_cluster,
    paired_ratio,
    rank_quota_groups,
    thread_group,
)
from hetrain.emulate.cgroups import estimate_quota, find_cpu_cgroups  # noqa: E402

SCRIPT = BENCHMARKS / "runtime_vs_torch.py"


def run_script(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([*prefix, sys.executable, str(SCRIPT), *args, "--no-write"], env=env, text=True,
                          capture_output=True, timeout=120)


# --- pure helpers --------------------------------------------------------------


def test_ddp_bucket_caps_cut_ddp_at_hetrains_layer_boundaries() -> None:
    # --ddp-buckets hetrain: DistributedDataParallel's own bucketing (the function its reducer runs on the
    # parameters in the order their gradients become ready), given these caps, puts the same layers in
    # each bucket as hetrain's DP plan does
    import argparse

    import torch.distributed as dist

    from hetrain.models.registry import build_layers

    args = argparse.Namespace(model="gpt-tiny", config={}, global_batch=32, micro_batches=8, bucket_cut="layer")
    cluster = local_cluster(2)
    plan = build_plan("dp", args, 6, cluster)
    buckets = plan.layout.device_buckets("n0:0")
    assert [(b.first_layer, b.end_layer) for b in buckets] == [(3, 6), (0, 3)]  # 1.64 MB: past DDP's 1 MiB
    caps_mb = ddp_bucket_caps_mb(args, 6, cluster)
    assert caps_mb == [b.param_bytes / 2**20 for b in buckets]
    layer_of, params = [], []
    for k, layer in enumerate(build_layers("gpt-tiny", seed=0)):
        for p in layer.parameters():
            layer_of.append(k)
            params.append(p)
    ready = list(reversed(range(len(params))))  # last layers' gradients first
    limits = [int(cap * 2**20) for cap in caps_mb]  # as DistributedDataParallel reads bucket_cap_mb_list
    assignment, _ = dist._compute_bucket_assignment_by_size([params[i] for i in ready], limits)
    ddp = [sorted({layer_of[ready[i]] for i in bucket}) for bucket in assignment]
    assert ddp == [list(range(b.first_layer, b.end_layer)) for b in buckets]
    # the benchmarks' default plan cuts hetrain's buckets as DDP does (bucket_cut exact): 1 MiB first, inside layer 3
    exact = build_plan("dp", argparse.Namespace(**{**vars(args), "bucket_cut": "exact"}), 6, cluster)
    first = exact.segments()[0].buckets[0]
    assert (first.first_layer, first.end_layer, first.param_bytes) == (3, 6, 2**20)
    # and DDP's default (1 MiB first) cuts inside layer 3: its first bucket ends part-way through it
    default, _ = dist._compute_bucket_assignment_by_size([params[i] for i in ready], [2**20, 25 * 2**20])
    assert sorted({layer_of[ready[i]] for i in default[0]}) == [3, 4, 5]
    assert sorted({layer_of[ready[i]] for i in default[1]}) == [0, 1, 2, 3]


def test_paired_ratio_is_torch_over_hetrain_per_pair_with_quartiles() -> None:
    hetrain = [1.0, 2.0, 1.0, 1.0, 0.5]
    torch = [1.1, 2.0, 0.9, 1.2, 0.5]  # ratios 1.1, 1.0, 0.9, 1.2, 1.0
    q1, median, q3 = paired_ratio(hetrain, torch)
    assert median == pytest.approx(1.0)
    # quartiles of 0.9 1.0 1.0 1.1 1.2 at positions 1.5 and 4.5 of 5 (statistics.quantiles' exclusive method)
    assert (q1, q3) == (pytest.approx(0.95), pytest.approx(1.15))
    assert paired_ratio([2.0], [3.0]) == (1.5, 1.5, 1.5)


def test_paired_ratio_pairs_blocks_not_medians() -> None:
    # the load moved between pairs: each pair says hetrain's block was 10% shorter, whatever the medians
    hetrain = [1.0, 3.0, 1.0, 3.0]
    torch = [1.1, 3.3, 1.1, 3.3]
    assert paired_ratio(hetrain, torch) == pytest.approx((1.1, 1.1, 1.1))


def test_paired_ratio_refuses_unpaired_blocks() -> None:
    with pytest.raises(ValueError, match="1 of hetrain's and 2 of torch's"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_ratio([], [])


def test_cpu_ms_per_step_sums_ranks_by_thread_group() -> None:
    rank0 = {"dp": {"hetrain": {"main": 1.0, "hetrain-heartbeat": 0.02, "native": 0.1},
                    "torch": {"main": 0.9, "native": 0.3}}}
    rank1 = {"dp": {"hetrain": {"main": 2.0, "hetrain-allreduce-chain": 0.08},
                    "torch": {"main": 2.1}}}
    got = cpu_ms_per_step([rank0, rank1], "dp", 10, thread_group)
    assert got == {"main": pytest.approx((300.0, 300.0)), "native": pytest.approx((10.0, 30.0)),
                   "python": pytest.approx((10.0, 0.0))}
    ungrouped = cpu_ms_per_step([rank0], "dp", 10)
    assert set(ungrouped) == {"main", "hetrain-heartbeat", "native"}


def test_cpu_quota_problem_names_the_value_and_the_limit() -> None:
    assert cpu_quota_problem(1.2, 2) is None
    assert cpu_quota_problem(2.0, 2) is None
    assert cpu_quota_problem(0.0, 2) == "--cpu-quota must be a number of CPUs > 0, got 0"
    assert cpu_quota_problem(-1.0, 2) == "--cpu-quota must be a number of CPUs > 0, got -1"
    assert cpu_quota_problem(math.nan, 2) == "--cpu-quota must be a number of CPUs > 0, got nan"
    assert cpu_quota_problem(2.5, 2) == "--cpu-quota 2.5 is more than the 2 CPUs of this host"


def test_quota_of_more_than_one_cpu_is_quota_over_period() -> None:
    # 1.2 CPUs: 120 ms of CPU time in every 100 ms period, shared by every thread in the cgroup
    assert estimate_quota(1.2, QUOTA_PERIOD_S) == (120_000, 100_000)
    assert estimate_quota(0.005, QUOTA_PERIOD_S) == (1000, 200_000)  # the kernel's 1 ms minimum quota


def test_cpu_cgroup_of_reads_v1_cpu_line_else_v2() -> None:
    v1 = "4:memory:/x\n2:cpu,cpuacct:/hetrain-emu-1a2b3c/run\n0::/\n"
    assert cpu_cgroup_of(v1) == "/hetrain-emu-1a2b3c/run"
    assert cpu_cgroup_of("1:cpuset:/a\n0::/user.slice/job\n") == "/user.slice/job"
    assert cpu_cgroup_of("1:cpuset:/a\n") == ""


# --- the script, as a user runs it -----------------------------------------------


def run_main(script: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """The script's ``main()`` with ``sys.argv`` = SCRIPT ARGV, in this process (its refusals come before it starts
    anything; a fresh interpreter would spend seconds importing torch to print them): exit status, stdout, stderr."""
    namespace = runpy.run_path(str(script))  # its definitions, not its ``__main__`` block
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    capsys.readouterr()
    try:
        code = namespace["main"]()
    except SystemExit as e:  # argparse's errors
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess([str(script), *argv], code, out.out, out.err)


@pytest.mark.parametrize("value", ["0", "-1", str((os.cpu_count() or 1) + 1)])
def test_cpu_quota_refuses_bad_values_in_one_line(value: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(SCRIPT, ["--cpu-quota", value, "--no-write"], monkeypatch, capsys)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("runtime_vs_torch.py: --cpu-quota")
    assert f"{float(value):g}" in lines[0]
    assert done.stdout == ""


@pytest.mark.slow  # starts the benchmark script
def test_the_script_as_a_user_starts_it_refuses_a_bad_quota_in_one_line() -> None:
    done = run_script("--cpu-quota", "0")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["runtime_vs_torch.py: --cpu-quota must be a number of CPUs > 0, got 0"], done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to hide the cgroup mounts in a mount namespace")
@pytest.mark.slow  # starts the benchmark script
def test_cpu_quota_without_cpu_controller_says_so_in_one_line() -> None:
    hide = ("unshare", "-m", "sh", "-c", 'umount -R /sys/fs/cgroup 2>/dev/null; exec "$0" "$@"')
    done = run_script("--cpu-quota", "1", prefix=hide)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "runtime_vs_torch.py: cannot put the run under a CPU quota: no cgroup hierarchy with a cpu controller "
        "is mounted"]
    assert done.stdout == ""  # nothing started


def _cgroups_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    root, why = find_cpu_cgroups()
    if root is None:
        pytest.skip(f"no cgroup to make here: {why}")


def test_cpu_quota_group_holds_children_and_is_removed() -> None:
    _cgroups_or_skip()
    home = cpu_cgroup_of(Path("/proc/self/cgroup").read_text())
    with cpu_quota_group(1.0) as group:
        child = subprocess.run(["cat", "/proc/self/cgroup"], capture_output=True, text=True, check=True)
        assert cpu_cgroup_of(child.stdout).endswith(f"/{group.parent.name}/{group.name}")
        assert group.name == "run" and group.parent.name.startswith("hetrain-emu-")
    assert not group.exists() and not group.parent.exists()
    assert cpu_cgroup_of(Path("/proc/self/cgroup").read_text()) == home


def test_rank_quota_groups_hold_each_rank_apart_and_are_removed() -> None:
    _cgroups_or_skip()
    home = cpu_cgroup_of(Path("/proc/self/cgroup").read_text())
    with rank_quota_groups(2, 0.5) as procs:
        assert [p.parent.name for p in procs] == ["rank0", "rank1"] and procs[0].parent.parent == procs[1].parent.parent
        # a rank joins its own at its start: every thread it makes is held there
        joined = subprocess.run([sys.executable, "-c", "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()));"
                                 "print(open('/proc/self/cgroup').read())", str(procs[1])],
                                capture_output=True, text=True, check=True)
        assert cpu_cgroup_of(joined.stdout).endswith(f"/{procs[1].parent.parent.name}/rank1")
        assert cpu_cgroup_of(Path("/proc/self/cgroup").read_text()) == home  # this process stays outside
    assert not procs[0].parent.parent.exists()


def test_emulated_rows_read_a_jobs_result() -> None:
    import argparse

    from emulated_vs_torch import table_rows

    rank = {"dp": {"hetrain": {"main": 1.2, "hetrain-heartbeat": 0.012, "native": 0.3},
                   "torch": {"main": 1.2, "native": 0.6}}}
    saved = {"blocks": {"dp": {"hetrain": [1.0, 1.0, 2.0], "torch": [1.1, 1.0, 2.4]}},
             "cpu": [rank, rank], "threads": [[20, 20], [19, 20]]}
    args = argparse.Namespace(cases=["dp"], global_batch=32, blocks=3, block_steps=2)
    assert table_rows("network", "on", saved, args) == [
        # 64 samples per block, the median block 1.0 s (hetrain) and 1.1 s (torch); ratios 1.0, 1.1, 1.2;
        # CPU: 2 ranks x 1.2 s over 6 steps = 400 ms/step on the main thread
        "| network | on | dp (DistributedDataParallel) | 64.0 | 58.2 | 1.10x (1.00-1.20) | 400.0 / 400.0 | "
        "4.0 / 0.0 | 100.0 / 200.0 | 39 of 40 |"]


def test_a_run_of_other_cases_writes_a_section_of_its_own() -> None:
    from emulated_vs_torch import section_title

    assert section_title(["dp", "1f1b", "hybrid"], ["on", "off"]) == \
        "Runtime vs torch, emulated (isolate_comm on and off)"
    assert section_title(["hybrid"], ["off"]) == "Runtime vs torch, emulated (isolate_comm off): hybrid"


@pytest.mark.parametrize(("argv", "message"), [
    (["--global-batch", "30"], "--global-batch 30 must divide among the 4 devices"),
    (["--global-batch", "4", "--micro-batches", "8"], "hold the --micro-batches 8"),
    (["--blocks", "0"], "--blocks must be >= 1, got 0"),
    (["--global-batch", "36", "--cases", "hybrid"], "must split into 2 pipelines of --hybrid-micro-batches 4 equal"),
])
def test_emulated_script_refuses_bad_options(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(BENCHMARKS / "emulated_vs_torch.py", argv, monkeypatch, capsys)
    assert done.returncode == 2
    assert message in done.stderr


def test_the_benchmark_plans_carry_each_layers_measured_output_bytes() -> None:
    """gpt-tiny's blocks send seq_len x hidden floats per sample; ``--early-receives`` reaches the plan."""
    import argparse

    from hetrain.runtime.step.p2p import early_receives

    args = argparse.Namespace(model="gpt-tiny", config={}, global_batch=32, micro_batches=8, allreduce="ring")
    plan = build_plan("1f1b", args, 6, local_cluster(2))
    assert [x.output_bytes_per_sample for x in plan.profile.layers[:5]] == [64 * 128 * 4] * 5
    assert [early_receives(plan, d) for d in ("n0:0", "n0:1")] == [(False, True), (True, False)]
    at_recv = build_plan("1f1b", argparse.Namespace(**{**vars(args), "early_receives": "never"}), 6, local_cluster(2))
    assert [early_receives(at_recv, d) for d in ("n0:0", "n0:1")] == [(False, False), (False, False)]
    # hetrain's 1F1B-eager on the same partition, against torch's Schedule1F1B
    eager = build_plan("1f1b-eager", args, 6, local_cluster(2))
    assert (eager.schedule, plan.schedule) == ("1f1b-eager", "1f1b")
    assert [(s.first_layer, s.end_layer) for s in eager.virtual_workers[0].stages] == \
        [(s.first_layer, s.end_layer) for s in plan.virtual_workers[0].stages]
    assert (TORCH_SCHEDULES["1f1b-eager"], TORCH_NAMES["1f1b-eager"]) == ("1f1b", "Schedule1F1B")


def test_the_hybrid_case_is_the_network_scenarios_plan_shape_with_ddp_syncing_whole_stages() -> None:
    """hybrid: 2 VWs of 2 stages, stage j of VW v on device 2j + v (fast:0 -> slow:0, fast:1 -> slow:1), layers
    0-2 | 3-5 (the even split, the cut of the planner's 2 + 2 plan for that scenario), half the batch and 4
    micro-batches each; each stage's segment owned by its two replicas, a whole stage on both, so hetrain's
    runtime all-reduces it through DDP's reducer, as torch's hybrid does."""
    import argparse

    from emulated_speedup import SCENARIOS
    from hetrain.baselines import interleaved_replicas
    from hetrain.cluster import parse_cluster
    from hetrain.runtime.sync.reducer import reducer_segments

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    cluster = parse_cluster(tomllib.loads(SCENARIOS["network"]))
    args = argparse.Namespace(model="gpt-tiny", config={}, global_batch=32, micro_batches=8, allreduce="ring")
    plan = build_plan("hybrid", args, 6, cluster)
    assert [[(s.device, s.first_layer, s.end_layer) for s in vw.stages] for vw in plan.virtual_workers] == [
        [("fast:0", 0, 3), ("slow:0", 3, 6)], [("fast:1", 0, 3), ("slow:1", 3, 6)]]
    assert [(vw.mini_batch, vw.micro_batches) for vw in plan.virtual_workers] == [(16, 4), (16, 4)]
    assert (plan.schedule, plan.strategy, plan.sync) == ("1f1b", "hybrid", "bsp")
    assert [seg.owners for seg in plan.segments()] == [("fast:0", "fast:1"), ("slow:0", "slow:1")]
    assert reducer_segments(plan) == frozenset({0, 1})
    # torch's side runs the same ranks (rank k: device k of the cluster)
    devices = [d.name for d in cluster.devices]
    assert [[devices[r] for r in ranks] for ranks in interleaved_replicas(4, 2)] == \
        [[s.device for s in vw.stages] for vw in plan.virtual_workers]
    assert TORCH_NAMES["hybrid"] == "pipelining + DistributedDataParallel" and TORCH_SCHEDULES["hybrid"] == "1f1b"
    more = build_plan("hybrid", argparse.Namespace(**{**vars(args), "hybrid_micro_batches": 8}), 6, cluster)
    assert [vw.micro_batches for vw in more.virtual_workers] == [8, 8]


def _launch_bound(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(BENCHMARKS / "launch_bound.py"), *argv, "--no-write"], env=env,
                          text=True, capture_output=True, timeout=300)


@pytest.mark.slow  # starts the benchmark script
def test_launch_bound_script_times_both_runtimes_on_one_cpu_stage() -> None:
    """A smoke run of the one-device comparison (the GPU case's script) on the CPU: both runtimes train, a table."""
    done = _launch_bound("--device", "cpu", "--blocks", "2", "--block-steps", "1", "--warmup", "1",
                         "--repeats", "1", "--micro-batches", "8", "--global-batch", "16")
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 1 |"))
    hetrain_rate, torch_rate = (float(x) for x in row.split("|")[2:4])
    assert hetrain_rate > 0 and torch_rate > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cpu", "--global-batch", "4", "--micro-batches", "8"], "at least one sample per micro-batch"),
    pytest.param(["--device", "cuda"], "torch.cuda.is_available() is False here",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")),
])
@pytest.mark.slow  # starts the benchmark script
def test_launch_bound_script_refuses_bad_options(argv: list[str], message: str) -> None:
    done = _launch_bound(*argv)
    assert done.returncode == 2
    assert message in done.stderr


def test_reduce_dtype_rows_read_each_ratio_from_paired_blocks() -> None:
    """benchmarks/reduce_dtype.py's row: samples/s per runtime (median block) and each ratio (> 1: the first of the
    pair faster), here hetrain bf16 twice as fast as hetrain fp32, DDP bf16 1.5x DDP fp32, and hetrain bf16 at DDP's."""
    import reduce_dtype

    blocks = {"hetrain": [1.0, 1.0, 1.0, 1.0], "torch": [1.0, 1.0, 1.0, 1.0], "hetrain-fp32": [2.0, 2.0, 2.0, 2.0],
              "torch-fp32": [1.5, 1.5, 1.5, 1.5]}
    row = reduce_dtype.row("network", blocks, 96)
    assert row == ("| network | 96.0 | 96.0 | 48.0 | 64.0 | 2.00x (2.00-2.00) | 1.50x (1.50-1.50) | "
                   "1.00x (1.00-1.00) |")

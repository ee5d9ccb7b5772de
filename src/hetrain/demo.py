"""``hetrain demo``: the main job, end to end, on an emulated heterogeneous cluster.

On one Linux host (root), ``hetrain.emulate`` turns the default cluster below into
two network namespaces joined by shaped links, each device a CPU process held to
its share of a core. On it the demo runs the whole path a user runs on a real
cluster, each step a real ``torchrun`` job per node::

    1 profile   the model once per device type, on a device of that type (throttled)
    2 discover  the links (hetrain.profiler.network)          -> cluster with measured links
    2b calibrate a few steps of an even-split pipeline of small micro-batches: the runtime's
                overhead per action (hetrain.calibrate)       -> profile with action_overhead_s
    3 plan      hetrain's plan; pure DP (strategy="dp"); an even-split pipeline
    4 simulate  each plan                                      -> predicted timeline, samples/s
    5 train     each plan for the same steps on Shakespeare    -> metrics, measured timeline
    6 report    out/demo/report.md with pictures (hetrain.report)

Measured samples/s leave out the first ``warmup`` steps. Where the host cannot
emulate (not root, no namespaces), the demo says why and only plans (``--plan-only``).

The same steps serve ``benchmarks/emulated_speedup.py`` (``run_emulated_comparison``).

Workers run as ``python -m hetrain.demo profile-worker ...`` on every rank.

This module is the orchestration only, one function per step; the pieces it puts together live
where they belong: ``profiler.merge`` (one profile from the devices' profiles), ``cluster_fixups``
(the discovered links in the cluster), ``planner.baselines`` (the even-split pipeline, even DP),
``report`` (``PlanRun``, ``DemoResult``, the report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from hetrain.report import DemoResult, PlanRun

if TYPE_CHECKING:  # cheap imports for the workers
    from hetrain.calibrate import Calibration
    from hetrain.emulate import EmulatedCluster
    from hetrain.plan import Plan
    from hetrain.profile import ModelProfile

# The default emulated cluster; examples/clusters/small-hetero.toml holds the same.
DEFAULT_CLUSTER = """
# 2 nodes, 4 devices, all CPU processes on one host. "fast": two devices of a
# full share on a 1 Gbit/s NIC; "slow": two devices at 0.4 of that on 100 Mbit/s.
#
#   fast  2x cpu-fast (share 1.0)  loopback  nic 1 Gbit/s   ─┐
#                                                            ├─ 100 Mbit/s (the slower NIC)
#   slow  2x cpu-slow (share 0.4)  loopback  nic 100 Mbit/s ─┘
#
# cpu_scale 0.6 keeps the ratios and fits the 2.8 cores asked for into 1.7.
name = "small-hetero"

[[node]]
name = "fast"
devices = [
  { type = "cpu-fast", tflops = 0.012, memory = "4GB", memory_bandwidth = "10GB/s", cpu_share = 1.0, count = 2 },
]
intra_link = "loopback"
nic = "1Gbit/s"

[[node]]
name = "slow"
devices = [
  { type = "cpu-slow", tflops = 0.0048, memory = "4GB", memory_bandwidth = "4GB/s", cpu_share = 0.4, count = 2 },
]
intra_link = "loopback"
nic = "100Mbit/s"

[emulation]
cpu_scale = 0.6
"""

DEFAULT_OUT = "out/demo"
PROFILE_MICRO_BATCHES = (2, 4, 8, 16)
# Each layer is timed over back-to-back calls of at least this long (ten 10 ms CPU-quota periods):
# a single call shorter than a throttled device's quota runs at full speed (profiler.layers).
PROFILE_MIN_TIME_S = 0.1
# The planner chooses among the profiled sizes: the calibrated overhead per action (step 2b) prices
# small micro-batches, which without it were predicted up to 35% too fast (benchmarks/RESULTS.md).
MICRO_BATCH_SIZES = PROFILE_MICRO_BATCHES
# The calibration run: micro-batches of 2 (16 per pipeline at batch 32: 32 actions per stage and step, so
# the overhead is most of what the run adds to the profile), 11 steps of which the first 3 warm up: the
# 8 timed steps give the overhead and, from their quartiles, its spread from step to step.
CALIBRATION_MICRO_BATCH = 2
CALIBRATION_STEPS = 11
CALIBRATION_WARMUP = 3
# Messages from 256 KiB up: a tc token bucket lets the first ~128 KB of a message through at once, so
# smaller messages would measure the burst, not the NIC rate the gradients and activations meet. Five
# sizes, median of 7 round trips: each message meets a random quota stall at its receiver (0 to
# (1 - share) x period), and with 3 sizes and 3 round trips the fitted NIC of a 1 Gbit/s link came out
# at 1.19-1.31 Gbit/s and 4.7-10.5 ms over three runs, against 1.02-1.13 Gbit/s and 4.0-6.9 ms.
DISCOVER_ARGS = ("--sizes", "256KiB,512KiB,1MiB,2MiB,4MiB", "--repeats", "7")
PYTHON = "python"  # the interpreter each job runs, inside the emulated node


def _say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------
# step 1, per rank: profile the model on this device
# ---------------------------------------------------------------------------


#: the profile worker's options (what ``_profile_step`` passes) and their defaults; None: required
WORKER_OPTIONS: dict[str, str | None] = {"--model": None, "--out-dir": None,
                                         "--micro-batches": ",".join(map(str, PROFILE_MICRO_BATCHES)), "--repeats": "3",
                                         "--tp": "1"}


#: how long the profiling job's ranks wait for each other while timing TP layers (``_measure_tp``)
PROFILE_TP_TIMEOUT_S = 120.0


def worker_options(argv: Sequence[str]) -> dict[str, str]:
    """``["--model", "gpt-tiny", "--out-dir", "d"]`` -> ``{"--model": "gpt-tiny", "--out-dir": "d", ...}``: the
    profile worker's ``WORKER_OPTIONS``, each given as ``--name value``, with their defaults.

    Raises:
        InputError: an option it does not take, one without a value, or a required one missing, named.
    """
    from hetrain.errors import InputError

    usage = "takes " + " ".join(f"{k} {k[2:].upper().replace('-', '_')}" for k in WORKER_OPTIONS)
    given = dict(zip(argv[::2], argv[1::2], strict=False))
    unknown = [k for k in argv[::2] if k not in WORKER_OPTIONS]
    if unknown or len(argv) % 2:
        raise InputError(f"profile-worker: {unknown[0] if unknown else argv[-1] + ' has no value'}: it {usage}")
    values = {**WORKER_OPTIONS, **given}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise InputError(f"profile-worker: {missing[0]} is required; it {usage}")
    return {k: str(v) for k, v in values.items()}


def profile_worker(argv: Sequence[str]) -> int:
    """One rank of the profiling job: every rank profiles the model at once and saves its measurements
    (``profiler.merge.node_profile_path``); ``profiler.merge.merge_node_profiles`` takes the median per
    device type. ``argv``: ``worker_options``.

    All ranks measure together so that each device meets the CPU contention it meets in training
    (the emulated devices' shares add up to most of the host's cores); one device measuring alone
    on an idle host ran faster than it then trained.
    """
    options = worker_options(argv)
    model, out_dir = options["--model"], options["--out-dir"]
    import torch

    from hetrain.models.registry import build_layers, layer_names, sample_batch
    from hetrain.profiler.layers import measure_layers
    from hetrain.profiler.merge import node_profile_path

    torch.set_num_threads(1)
    node = os.environ.get("HETRAIN_NODE", "local")
    layers = build_layers(model, seed=0)
    generator = torch.Generator().manual_seed(0)
    sizes = [int(b) for b in options["--micro-batches"].split(",")]
    measured = measure_layers(layers, lambda b: sample_batch(model, b, generator)[0], sizes, "cpu",
                              int(options["--repeats"]), 1, "fp32", layer_names(model), unpack_tuples=False,
                              min_time_s=PROFILE_MIN_TIME_S)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    profile = measured.to_profile(model)
    k = int(options["--tp"])
    if k > 1:
        profile = _measure_tp(profile, layers, lambda b: sample_batch(model, b, torch.Generator().manual_seed(0))[0],
                              sizes, k, int(options["--repeats"]))
    profile.save(node_profile_path(out_dir, node, local_rank))
    return 0


def _measure_tp(profile: ModelProfile, layers: Any, sample: Any, sizes: list[int], k: int,
                repeats: int) -> ModelProfile:
    """``profile`` with its layers also timed on a rank of a TP group of ``k`` (``runtime.tp_measure``): the ranks
    of each node, ``k`` consecutive local ranks a group (a node's last ranks that fill none time nothing). Every
    rank of the job takes part in creating every group (collective), in node order."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hetrain.runtime.tp_measure import measure_layers_tp, with_measured_tp

    dist.init_process_group("gloo", timeout=timedelta(seconds=PROFILE_TP_TIMEOUT_S))
    try:
        where: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(where, (os.environ.get("HETRAIN_NODE", "local"), int(os.environ.get("LOCAL_RANK", "0"))))
        nodes: dict[str, list[tuple[int, int]]] = {}
        for rank, (node, local_rank) in enumerate(where):
            nodes.setdefault(str(node), []).append((int(local_rank), rank))
        mine = None
        for node in sorted(nodes):
            ranks = [r for _, r in sorted(nodes[node])]
            for g in range(0, len(ranks) - k + 1, k):
                members = ranks[g:g + k]
                group = dist.new_group(members, timeout=timedelta(seconds=PROFILE_TP_TIMEOUT_S))
                if dist.get_rank() in members:
                    mine = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(members, dtype=torch.int64))
        if mine is None:
            return profile
        timed = measure_layers_tp(layers, sample, sizes, mine, repeats=repeats, min_time_s=PROFILE_MIN_TIME_S)
        return with_measured_tp(profile, profile.measured_on[0][0], k, timed)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# step 3: the plans the demo compares
# ---------------------------------------------------------------------------


def build_plans(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> dict[str, Plan]:
    """hetrain's plan, pure data parallelism and the even-split pipeline, in that order: the plan and the pure
    families it is compared with (``planning.plan_families``), the pipeline split evenly by hand."""
    from hetrain.cluster import parse_cluster
    from hetrain.planner import PlannerOptions
    from hetrain.planner.baselines import even_split_plan
    from hetrain.planning import plan_families, plan_with_simulator
    from hetrain.simulator import with_simulated_prediction

    cluster = parse_cluster(cluster_dict)
    sizes = tuple(b for b in MICRO_BATCH_SIZES if b <= global_batch) or (1,)
    best = plan_with_simulator(cluster, profile, global_batch, simulate_top_k=5, micro_batch_sizes=sizes)
    dp, pp = (f.required() for f in plan_families(cluster, profile, global_batch,
                                                   PlannerOptions(simulate_top_k=3, micro_batch_sizes=sizes)))
    return {"hetrain": best, "dp": dp, "even-split": even_split_plan(pp, with_simulated_prediction)}


def calibration_plan(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> Plan:
    """The plan the demo trains to calibrate the overhead per action: one pipeline over every device,
    layers split evenly, micro-batches of ``CALIBRATION_MICRO_BATCH``: many actions per step."""
    from hetrain.cluster import parse_cluster
    from hetrain.planner.baselines import even_split_plan
    from hetrain.planning import plan_with_simulator
    from hetrain.simulator import with_simulated_prediction

    b = min(CALIBRATION_MICRO_BATCH, global_batch)
    pp = plan_with_simulator(parse_cluster(cluster_dict), profile, global_batch, strategy="pp",
                             micro_batch_sizes=(b,), simulate_top_k=0)
    return even_split_plan(pp, with_simulated_prediction)


# ---------------------------------------------------------------------------
# the whole comparison on one emulated cluster, a function per step
# ---------------------------------------------------------------------------


@dataclass
class _Jobs:
    """Runs the demo's jobs on the emulated cluster: each logged, timed (``timings_s[what]``), its output
    in ``jobs.log``; a job that exits non-zero raises ``RuntimeError``."""

    em: EmulatedCluster
    out: Path
    log: Callable[[str], None]
    log_file: TextIO
    timeout_s: float
    timings_s: dict[str, float]

    def run(self, what: str, command: list[str]) -> None:
        self.log(f"-- {what}: {' '.join(command)}")
        start = time.perf_counter()
        status = self.em.launch(command, timeout_s=self.timeout_s, stdout=self.log_file, stderr=self.log_file)
        self.timings_s[what] = time.perf_counter() - start
        self.log(f"   {what}: exit {status} in {self.timings_s[what]:.1f} s")
        if status != 0:
            raise RuntimeError(f"{what} failed with exit status {status}; see {self.out / 'jobs.log'}")


def _profile_step(jobs: _Jobs, nominal: dict[str, Any], model: str, tp: int = 1) -> tuple[ModelProfile, Path]:
    """Step 1: every device profiles the model (and, with ``tp`` > 1, its layers on a rank of a TP group of the
    node's devices: ``_measure_tp``); one profile per device type, saved as ``profile.json``."""
    from hetrain.profiler.merge import merge_node_profiles

    jobs.run("profile", [PYTHON, "-m", "hetrain.demo", "profile-worker", "--model", model, "--out-dir",
                         str(jobs.out), "--tp", str(tp)])
    profile = merge_node_profiles(nominal, jobs.out)
    profile_path = jobs.out / "profile.json"
    profile.save(profile_path)
    return profile, profile_path


def _discover_step(jobs: _Jobs, nominal: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Step 2: discover the links; the discovered cluster file's text, and the cluster the planner sees."""
    from hetrain.cluster_fixups import with_measured_links

    discovered_path = jobs.out / "discovered.toml"
    jobs.run("discover", [PYTHON, "-m", "hetrain.profiler.network", "-o", str(discovered_path), *DISCOVER_ARGS])
    discovered = discovered_path.read_text()
    return discovered, with_measured_links(nominal, tomllib.loads(discovered))


def _calibrate_step(jobs: _Jobs, planning: dict[str, Any], profile: ModelProfile, profile_path: Path, model: str,
                    global_batch: int, type_names: list[str]) -> tuple[ModelProfile, Calibration]:
    """Step 2b: train ``calibration_plan`` a few steps; the profile with the overhead per action it shows,
    saved over ``profile_path``, and what was found."""
    from hetrain.calibrate import fit_action_overhead, measured_step_times_s, with_action_overhead

    calib = calibration_plan(planning, profile, global_batch)
    calib_path, calib_metrics = jobs.out / "plan-calibration.json", jobs.out / "metrics-calibration.jsonl"
    calib.save(calib_path)
    calib_metrics.unlink(missing_ok=True)
    jobs.run("calibrate", [PYTHON, "-m", "hetrain.runtime.command", "--plan", str(calib_path), "--model", model,
                           "--data", "shakespeare", "--steps", str(CALIBRATION_STEPS), "--metrics-out",
                           str(calib_metrics), "--no-progress"])
    steps = measured_step_times_s(calib_metrics, CALIBRATION_WARMUP)
    calibration = fit_action_overhead(calib, sum(steps) / len(steps), steps_s=steps)
    jobs.log(f"   calibrate: {calibration.summary()}")
    profile = with_action_overhead(profile, calibration.overhead_s, type_names, calibration.spread_s)
    profile.save(profile_path)
    return profile, calibration


def _plan_and_simulate_step(jobs: _Jobs, plans: dict[str, Plan], train: Sequence[str], baselines: Sequence[str],
                            warmup: int) -> dict[str, PlanRun]:
    """Steps 3-4: save each plan to train (and hetrain's model of each torch baseline), simulate it, log it.

    Raises:
        ValueError: ``train`` names no built plan, or ``baselines`` no known baseline.
    """
    from hetrain.plan import Plan
    from hetrain.planner.baselines import even_dp_plan
    from hetrain.simulator import simulate, with_simulated_prediction

    unknown = [k for k in train if k not in plans] + [k for k in baselines if k not in ("ddp", "pipelining")]
    if unknown:
        raise ValueError(f"no plan or baseline named {', '.join(map(repr, unknown))}; plans: "
                         f"{', '.join(plans)}; baselines: ddp, pipelining")
    out, runs = jobs.out, {}
    for name in train:
        p = plans[name]
        path = out / f"plan-{name}.json"
        p.save(path)
        Plan.from_dict(json.loads(path.read_text()))  # the saved plan reads back
        runs[name] = PlanRun(name, p, simulate(p), path, out / f"metrics-{name}.jsonl",
                             out / f"timeline-{name}.json", warmup=warmup)
    for kind in baselines:
        name = f"torch-{kind}"
        p = even_dp_plan(plans["dp"], with_simulated_prediction) if kind == "ddp" else plans["even-split"]
        path = out / f"plan-{name}-model.json"
        p.save(path)
        runs[name] = PlanRun(name, p, simulate(p), path, out / f"metrics-{name}.jsonl",
                             out / f"timeline-{name}.json", warmup=warmup, runtime="torch")
    for name, r in runs.items():
        what = "plan" if r.runtime == "hetrain" else "baseline, as hetrain models it"
        jobs.log(f"\n{name} {what} (predicted {r.predicted_samples_per_s:.1f} samples/s):\n{r.plan.summary()}")
    return runs


def _train_with_hetrain(jobs: _Jobs, r: PlanRun, model: str, steps: int) -> None:
    """Step 5 for one plan: hetrain's runtime trains it; its metrics read back into ``r``."""
    start = time.perf_counter()
    jobs.run(f"train {r.name}", [PYTHON, "-m", "hetrain.runtime.command", "--plan", str(r.plan_path), "--model",
                                 model, "--data", "shakespeare", "--steps", str(steps), "--metrics-out",
                                 str(r.metrics_path), "--timeline-out", str(r.timeline_path), "--no-progress",
                                 "--log-every", "10"])
    r.wall_s = time.perf_counter() - start
    r.status = 0
    r.load_metrics()
    jobs.log(f"   {r.name}: {len(r.metrics)} steps, measured {r.measured_samples_per_s:.1f} samples/s "
             f"(predicted {r.predicted_samples_per_s:.1f})")


def _train_with_torch(jobs: _Jobs, r: PlanRun, model: str, global_batch: int, steps: int, optimizer: str) -> None:
    """Step 5 for one torch baseline (``hetrain.baselines``, run ``torch-<kind>``); its metrics read back."""
    from hetrain.planner.baselines import torch_pipelining_micro_batches, torch_schedule

    kind = r.name.removeprefix("torch-")
    extra = ([] if kind == "ddp" else
             ["--micro-batches", str(torch_pipelining_micro_batches(r.plan)),
              "--schedule", torch_schedule(r.plan.schedule)])
    start = time.perf_counter()
    jobs.run(f"train {r.name}", [PYTHON, "-m", "hetrain.baselines", kind, "--model", model, "--data", "shakespeare",
                                 "--global-batch", str(global_batch), "--steps", str(steps), "--optimizer",
                                 optimizer, "--metrics-out", str(r.metrics_path), "--timeout-s",
                                 str(round(jobs.timeout_s)), *extra])
    r.wall_s = time.perf_counter() - start
    r.status = 0
    r.load_metrics()
    jobs.log(f"   {r.name}: {len(r.metrics)} steps, measured {r.measured_samples_per_s:.1f} samples/s "
             f"(hetrain's model of it: {r.predicted_samples_per_s:.1f})")


def _train_step(jobs: _Jobs, runs: dict[str, PlanRun], optimizer: str, model: str, global_batch: int,
                steps: int) -> None:
    """Step 5: train every run in order, each from fresh metrics; ``optimizer`` is the plans'."""
    for r in runs.values():
        r.metrics_path.unlink(missing_ok=True)
        if r.runtime == "torch":
            _train_with_torch(jobs, r, model, global_batch, steps, optimizer)
        else:
            _train_with_hetrain(jobs, r, model, steps)


def run_emulated_comparison(cluster_text: str, out_dir: str | Path, model: str = "gpt-tiny", global_batch: int = 32,
                            steps: int = 20, warmup: int = 5, log: Callable[[str], None] = _say,
                            job_timeout_s: float = 300.0, train: Sequence[str] = ("hetrain", "dp", "even-split"),
                            baselines: Sequence[str] = (),
                            plan_builder: Callable[[dict[str, Any], ModelProfile, int], dict[str, Plan]] | None = None,
                            calibrate: bool = True, profile_tp: int = 1) -> DemoResult:
    """Profile, discover, plan, simulate and train plans (and torch baselines) on one emulated cluster.

    Args:
        cluster_text: the cluster file (TOML; its ``[emulation]`` table is honoured).
        out_dir: where profiles, plans, metrics, timelines go.
        model: a reference model (``hetrain.models.registry``).
        global_batch: samples per iteration, the same for every plan.
        steps: training steps per plan; ``warmup`` of them are left out of the rates.
        log: where progress lines go.
        job_timeout_s: the longest one emulated job may run.
        train: which of the built plans hetrain's runtime trains, in order.
        baselines: torch baselines to train after them (``hetrain.baselines``): ``ddp``
            (DistributedDataParallel, batch split evenly; predicted as ``planner.baselines.even_dp_plan``) and
            ``pipelining`` (torch.distributed.pipelining over every device, layers split evenly,
            the even-split plan's micro-batches and schedule; predicted as that plan). Their
            runs are keyed ``torch-ddp`` and ``torch-pipelining``.
        plan_builder: ``(cluster dict with the measured links, profile, global batch) -> {name: plan}``;
            ``build_plans`` by default. The baselines need its ``dp`` and ``even-split`` plans.
        calibrate: before planning, train ``calibration_plan`` for ``CALIBRATION_STEPS`` steps and put the
            overhead per action it shows into the profile (``hetrain.calibrate``); the result's
            ``calibration`` says what was found.
        profile_tp: also time the layers on a rank of a TP group of this many of a node's devices
            (``LayerProfile.measured_tp``); 1: not.

    Raises:
        EmulationError: the host cannot emulate (not root, no namespaces...).
        RuntimeError: a job failed (the message names it).
    """
    from hetrain.cluster import parse_cluster
    from hetrain.emulate import EmulatedCluster, parse_emulation_settings

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nominal = tomllib.loads(cluster_text)
    cluster_path = out / "cluster.toml"
    cluster_path.write_text(cluster_text)
    cluster = parse_cluster(nominal)
    settings = parse_emulation_settings(nominal.get("emulation"))
    timings: dict[str, float] = {}
    with open(out / "jobs.log", "w") as log_file, EmulatedCluster(cluster, settings, source=str(cluster_path)) as em:
        log(em.describe())
        jobs = _Jobs(em, out, log, log_file, job_timeout_s, timings)
        profile, profile_path = _profile_step(jobs, nominal, model, profile_tp)
        discovered, planning = _discover_step(jobs, nominal)
        calibration = None
        if calibrate:
            profile, calibration = _calibrate_step(jobs, planning, profile, profile_path, model, global_batch,
                                                   cluster.type_names)
        start = time.perf_counter()
        plans = (plan_builder or build_plans)(planning, profile, global_batch)
        timings["plan"] = time.perf_counter() - start
        runs = _plan_and_simulate_step(jobs, plans, train, baselines, warmup)
        _train_step(jobs, runs, next(iter(plans.values())).optimizer, model, global_batch, steps)
    return DemoResult(out, cluster_path, profile_path, runs, discovered, timings, plans, calibration)


# ---------------------------------------------------------------------------
# hetrain demo
# ---------------------------------------------------------------------------


def _plan_only_profile(model: str, type_names: Sequence[str], out_dir: str) -> ModelProfile | None:
    """The model's analytic profile; for a model without one, a profile measured on this host (unthrottled)
    filed under every device type; None if that profiling failed."""
    from hetrain.models.analytic import build_profile

    try:
        return build_profile(model)
    except (KeyError, ValueError):
        from hetrain.profile import load_profile, relabel_profile
        from hetrain.profile_combine import merge_profiles
        from hetrain.profiler.layers import run_profile_command

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "profile-local.json"
        if run_profile_command(model, PROFILE_MICRO_BATCHES, str(path)) != 0:
            return None
        local = load_profile(path)
        return merge_profiles([relabel_profile(local, t) for t in type_names])


def run_plan_only(args: argparse.Namespace) -> int:
    """Plan on the default cluster with nominal links and analytic costs; no emulation, no root."""
    from hetrain.cluster import parse_cluster
    from hetrain.models.registry import build_layers  # noqa: F401  (the model must exist)
    from hetrain.simulator import simulate

    nominal = tomllib.loads(_cluster_text(args))
    cluster = parse_cluster({k: v for k, v in nominal.items() if k != "emulation"})
    profile = _plan_only_profile(args.model, cluster.type_names, args.out)
    if profile is None:
        return 1
    print("plan only: nominal links from the cluster file, layer costs "
          f"{'estimated (analytic profile)' if not profile.measured_on else 'profiled on this host, unthrottled'}; "
          "nothing is emulated or trained")
    print(cluster.summary())
    plans = build_plans({k: v for k, v in nominal.items() if k != "emulation"}, profile, args.global_batch)
    for name, p in plans.items():
        sim = simulate(p)
        print(f"\n{name} plan: predicted {p.global_batch / sim.iteration_s:.1f} samples/s "
              f"(iteration {sim.iteration_s * 1e3:.1f} ms)")
        print(p.summary())
    return 0


def _cluster_text(args: argparse.Namespace) -> str:
    """The text of ``--cluster`` (a file that cannot be read is bad input, named), or ``DEFAULT_CLUSTER``."""
    from hetrain.cluster import ClusterError
    from hetrain.fields import read_text

    path = getattr(args, "cluster", None)
    return read_text(path, ClusterError, "cluster file") if path else DEFAULT_CLUSTER


def _print_outcome(result: DemoResult, report: Path, steps: int) -> None:
    """Step 6's last words: hetrain's plan, predicted vs measured, the speed-ups, where the report is."""
    best, dp = result.runs["hetrain"], result.runs["dp"]
    print("\n" + "=" * 72)
    print(f"hetrain's plan ({best.plan.strategy}, {len(best.plan.virtual_workers)} VW(s)):")
    print(best.plan.summary())
    print("\n" + result.table())
    print(f"\nmeasured speed-up of hetrain's plan: {result.speedup('dp'):.2f}x over pure data parallelism, "
          f"{result.speedup('even-split'):.2f}x over the even-split pipeline")
    print(f"(samples/s are the mean over steps {dp.warmup + 1}..{len(dp.metrics)} of {steps}; "
          f"the first {dp.warmup} are warm-up)")
    print(f"report: {report}")


def run_demo(args: argparse.Namespace) -> int:
    """``hetrain demo``: the main job end to end on the emulated default cluster; exit status."""
    from hetrain.emulate import EmulationError
    from hetrain.emulate.emulator import check_permissions
    from hetrain.report import write_report

    if getattr(args, "plan_only", False):
        return run_plan_only(args)
    try:
        check_permissions("up")
    except EmulationError as e:
        print(f"hetrain demo: cannot emulate the cluster here: {e}\n"
              "hetrain demo: planning only (no profiling, no training); run as root for the full demo\n",
              file=sys.stderr, flush=True)
        return run_plan_only(args)
    start = time.perf_counter()
    try:
        result = run_emulated_comparison(_cluster_text(args), args.out, args.model, args.global_batch, args.steps,
                                         args.warmup)
    except EmulationError as e:
        print(f"hetrain demo: cannot emulate the cluster here: {e}\nhetrain demo: planning only\n",
              file=sys.stderr, flush=True)
        return run_plan_only(args)
    except RuntimeError as e:
        print(f"hetrain demo: error: {e}", file=sys.stderr)
        return 1
    _print_outcome(result, write_report(result), args.steps)
    print(f"demo took {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.demo profile-worker ...``: the per-rank part of the demo's jobs."""
    from hetrain.errors import InputError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile-worker":
        try:
            return profile_worker(argv[1:])
        except InputError as e:
            print(f"python -m hetrain.demo: error: {e}", file=sys.stderr)
            return 2
    print("usage: python -m hetrain.demo profile-worker --model NAME --out-dir DIR (under torchrun); "
          "the demo itself is `hetrain demo`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

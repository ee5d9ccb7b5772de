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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

if TYPE_CHECKING:  # cheap imports for the workers
    from hetrain.calibrate import Calibration
    from hetrain.plan import Plan, Stage
    from hetrain.profile import ModelProfile
    from hetrain.simulator import SimResult

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
# the overhead is most of what the run adds to the profile), 8 steps of which the first 3 warm up.
CALIBRATION_MICRO_BATCH = 2
CALIBRATION_STEPS = 8
CALIBRATION_WARMUP = 3
# Messages from 256 KiB up: a tc token bucket lets the first ~128 KB of a message through at once, so
# smaller messages would measure the burst, not the NIC rate the gradients and activations meet. Five
# sizes, median of 7 round trips: each message meets a random quota stall at its receiver (0 to
# (1 - share) x period), and with 3 sizes and 3 round trips the fitted NIC of a 1 Gbit/s link came out
# at 1.19-1.31 Gbit/s and 4.7-10.5 ms over three runs, against 1.02-1.13 Gbit/s and 4.0-6.9 ms.
DISCOVER_ARGS = ("--sizes", "256KiB,512KiB,1MiB,2MiB,4MiB", "--repeats", "7")


def _say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------


@dataclass
class PlanRun:
    """One plan: its prediction, and what training it on the emulated cluster measured."""

    name: str
    plan: Plan
    sim: SimResult
    plan_path: Path
    metrics_path: Path
    timeline_path: Path
    status: int = -1
    metrics: list[dict[str, Any]] = field(default_factory=list)
    warmup: int = 0
    wall_s: float = 0.0
    runtime: str = "hetrain"  # or "torch": a torch baseline, whose ``plan`` is hetrain's model of it

    @property
    def predicted_iteration_s(self) -> float:
        return float(self.sim.iteration_s)

    @property
    def predicted_samples_per_s(self) -> float:
        return self.plan.global_batch / self.predicted_iteration_s

    @property
    def timed_steps(self) -> list[dict[str, Any]]:
        """The steps after warm-up (all of them when there are too few)."""
        rest = self.metrics[self.warmup:]
        return rest or self.metrics

    @property
    def measured_iteration_s(self) -> float:
        """Mean step time after warm-up; nan when nothing was measured."""
        steps = self.timed_steps
        if not steps:
            return math.nan
        return sum(float(s["step_time_s"]) for s in steps) / len(steps)

    @property
    def measured_samples_per_s(self) -> float:
        return self.plan.global_batch / self.measured_iteration_s

    @property
    def prediction_error(self) -> float:
        """``(predicted - measured) / measured`` iteration time."""
        return (self.predicted_iteration_s - self.measured_iteration_s) / self.measured_iteration_s

    def load_metrics(self) -> None:
        self.metrics = []
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if "step_time_s" in row:
                        self.metrics.append(row)


@dataclass
class Comparison:
    """What ``run_emulated_comparison`` produced: the plans, their runs, where things are."""

    out_dir: Path
    cluster_path: Path
    profile_path: Path
    runs: dict[str, PlanRun]
    discovered: str
    timings_s: dict[str, float]
    plans: dict[str, Plan] = field(default_factory=dict)  # build_plans' plans, trained or not
    calibration: Calibration | None = None  # the overhead per action found before planning

    def speedup(self, over: str, of: str = "hetrain") -> float:
        return self.runs[of].measured_samples_per_s / self.runs[over].measured_samples_per_s

    def table(self) -> str:
        """Predicted vs measured per plan, as a Markdown table."""
        lines = ["| plan | VWs x stages | predicted samples/s | measured samples/s | iteration error |",
                 "| --- | --- | ---: | ---: | ---: |"]
        for r in self.runs.values():
            shape = " + ".join(str(len(vw.stages)) for vw in r.plan.virtual_workers)
            err = "n/a" if math.isnan(r.measured_iteration_s) else f"{100 * r.prediction_error:+.1f}%"
            lines.append(f"| {r.name} | {shape} | {r.predicted_samples_per_s:.1f} | "
                         f"{r.measured_samples_per_s:.1f} | {err} |")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# profiles: one per device type, measured on an emulated device of that type
# ---------------------------------------------------------------------------


def relabel_profile(profile: ModelProfile, type_name: str, figures: tuple[float, float] | None = None) -> ModelProfile:
    """The profile with every measurement (layers, optimizer step) filed under ``type_name`` (and its
    peak figures, if given).

    A CPU process always profiles as type ``cpu``; an emulated device of type
    ``cpu-slow`` is a throttled CPU, so its measurements belong to ``cpu-slow``.
    """
    from hetrain.profile import parse_profile

    data = profile.to_dict()
    for layer in data["layers"]:
        measured = layer.get("measured", {})
        layer["measured"] = {type_name: [m for ms in measured.values() for m in ms]}
    rates = data.get("optimizer_step_s_per_byte", {})
    if rates:
        data["optimizer_step_s_per_byte"] = {type_name: {k: v for r in rates.values() for k, v in r.items()}}
    if figures is not None:
        data["measured_on"] = {type_name: {"peak_flops": figures[0], "memory_bandwidth_bytes_per_s": figures[1]}}
    else:
        figs = list(data.get("measured_on", {}).values())
        data["measured_on"] = {type_name: figs[0]} if figs else {}
    return parse_profile(data)


def profile_worker(argv: Sequence[str]) -> int:
    """One rank of the profiling job: every rank profiles the model at once and saves its measurements
    (``profile-node-<node>-<local rank>.json``); ``merge_node_profiles`` takes the median per device type.

    All ranks measure together so that each device meets the CPU contention it meets in training
    (the emulated devices' shares add up to most of the host's cores); one device measuring alone
    on an idle host ran faster than it then trained.
    """
    parser = argparse.ArgumentParser(prog="python -m hetrain.demo profile-worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--micro-batches", default=",".join(map(str, PROFILE_MICRO_BATCHES)))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from hetrain.models.registry import build_layers, layer_names, sample_batch
    from hetrain.profiler.layers import measure_layers

    torch.set_num_threads(1)
    node = os.environ.get("HETRAIN_NODE", "local")
    layers = build_layers(args.model, seed=0)
    generator = torch.Generator().manual_seed(0)
    sizes = [int(b) for b in args.micro_batches.split(",")]
    measured = measure_layers(layers, lambda b: sample_batch(args.model, b, generator)[0], sizes, "cpu",
                              args.repeats, 1, "fp32", layer_names(args.model), unpack_tuples=False,
                              min_time_s=PROFILE_MIN_TIME_S)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    measured.to_profile(args.model).save(Path(args.out_dir) / f"profile-node-{node}-{local_rank}.json")
    return 0


def merge_node_profiles(cluster_dict: dict[str, Any], out_dir: Path) -> ModelProfile:
    """One measurement set per device type: each device's profile (device ``<node>:<k>`` is local rank k
    of its node's job) filed under its type, the median over the devices of a type, the types merged."""
    from hetrain.cluster import parse_cluster
    from hetrain.profile import load_profile
    from hetrain.profiler.fit import average_profiles, merge_profiles

    cluster = parse_cluster(cluster_dict)
    by_type: dict[str, list[ModelProfile]] = {}
    for node in cluster.nodes:
        for k, dev in enumerate(node.devices):
            path = out_dir / f"profile-node-{node.name}-{k}.json"
            if not path.exists():
                raise RuntimeError(f"the profiling job wrote no profile for device {dev.name!r} ({path})")
            figures = (dev.peak_fp32_flops, dev.memory_bandwidth_bytes_per_s)
            by_type.setdefault(dev.type_name, []).append(relabel_profile(load_profile(path), dev.type_name, figures))
    return merge_profiles([average_profiles(ps) for ps in by_type.values()])


# ---------------------------------------------------------------------------
# the cluster the planner sees: the file's devices, the discovered links
# ---------------------------------------------------------------------------


def with_measured_links(nominal: dict[str, Any], discovered: dict[str, Any]) -> dict[str, Any]:
    """The nominal cluster (device types, shares) with the discovered intra links, NICs and [[link]]s,
    each link's latency raised by the quota stall of the emulated devices at its ends where the
    discovery could not have met it.

    A throttled device that has used its CPU quota stalls until its next period before it
    handles a message. With ``fill_idle`` (the default) every throttled device uses up its quota
    in every period, busy or idle, so the discovery's ping-pong meets the stall as training does
    (a message arriving at a random moment waits (1 - share)^2 x period / 2 on average), and it
    is in the measured latency: nothing is added. Without ``fill_idle``, an idle device banks
    quota and answers a ping at once, while a training device runs out of quota at every stretch
    of compute, so each message it sends or receives after one meets (1 - share) x period / 2
    on average (``emulate.cgroups.quota_stall``): that is added to the latency of every link at
    each throttled end (twice for a node's intra link), taking the node's most throttled device.
    """
    from hetrain.emulate import parse_emulation_settings
    from hetrain.emulate.cgroups import quota_stall

    out: dict[str, Any] = json.loads(json.dumps(nominal))
    found = {n["name"]: n for n in discovered.get("node", [])}
    settings = parse_emulation_settings(nominal.get("emulation"))
    stall: dict[str, float] = {}
    unseen = not settings.fill_idle  # with the filler, discovery met the stall: it is in the measured latency
    for node in out["node"]:
        shares = [float(d["cpu_share"]) * settings.cpu_scale for d in node.get("devices", [])
                  if isinstance(d, dict) and d.get("cpu_share") is not None]
        stall[node["name"]] = max((quota_stall(s, settings.cpu_period_s) for s in shares if unseen), default=0.0)
        d = found.get(node["name"])
        if d is None:
            continue
        for key, ends in (("intra_link", 2), ("nic", 1)):
            if isinstance(d.get(key), dict):
                node[key] = {**d[key], "latency_s": float(d[key].get("latency_s", 0.0)) + ends * stall[node["name"]]}
    if discovered.get("link"):
        out["link"] = [{**link, "latency_s": float(link.get("latency_s", 0.0))
                        + sum(stall.get(n, 0.0) for n in link["nodes"])} for link in discovered["link"]]
    out.pop("emulation", None)
    return out


# ---------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------


def _with_simulated_prediction(draft: Plan) -> Plan:
    """``draft`` with every predicted figure taken from one replay (a hand-built plan has no closed form):
    the iteration; its pipeline (to the last backward) and the rest after it, as the optimizer step
    (the longest, at most the rest) and sync; each VW's pipeline (to its last backward); each
    device's peak memory."""
    from hetrain.plan import DeviceMemory, Prediction
    from hetrain.simulator import simulate

    sim = simulate(draft)
    events = sim.timeline.devices
    rest = max(0.0, sim.iteration_s - sim.pipeline_s)
    optimizer_s = min(rest, max((e.end_s - e.start_s for evs in events.values() for e in evs
                                 if e.kind == "optimizer"), default=0.0))
    vws = tuple(replace(vw, predicted_pipeline_s=max(
        (e.end_s for d in vw.devices for e in events.get(d, ()) if e.kind == "backward"), default=0.0))
        for vw in draft.virtual_workers)
    memory = tuple(DeviceMemory(d.device, d.peak_memory_bytes, d.capacity_bytes) for d in sim.devices.values())
    pred = Prediction(iteration_s=sim.iteration_s, samples_per_s=sim.samples_per_s, pipeline_s=sim.pipeline_s,
                      sync_s=rest - optimizer_s, optimizer_s=optimizer_s,
                      memory=memory, simulated_iteration_s=sim.iteration_s)
    return replace(draft, virtual_workers=vws, prediction=pred)


def _stage(base: Plan, device_name: str, first: int, end: int, b: int) -> Stage:
    """Layers ``[first, end)`` on ``device_name`` at micro-batch ``b``, with the cost model's forward and
    backward times (the layers' and the overhead per action)."""
    from hetrain.cost import estimate_action_overhead, estimate_layer_times
    from hetrain.plan import Stage

    device = base.cluster.device(device_name)
    fwd, bwd = estimate_layer_times(base.profile, device, b)
    o = estimate_action_overhead(base.profile, device)
    return Stage(device_name, first, end, predicted_forward_s=float(fwd[first:end].sum()) + o,
                 predicted_backward_s=float(bwd[first:end].sum()) + o)


def even_split_plan(base: Plan, device_order: Sequence[str] | None = None) -> Plan:
    """One VW over all devices (cluster order), layers split as evenly as possible, earlier stages
    taking the extra layers; micro-batching and schedule from ``base`` (a ``strategy="pp"`` plan)."""
    from hetrain.plan import VirtualWorker

    devices = list(device_order or [d.name for d in base.cluster.devices])
    n, p = base.profile.num_layers, len(devices)
    p = min(p, n)
    q, r = divmod(n, p)
    m = max(vw.micro_batches for vw in base.virtual_workers)
    b = -(-base.global_batch // min(m, base.global_batch))  # the largest micro-batch
    stages, first = [], 0
    for j, dev in enumerate(devices[:p]):
        end = first + q + (1 if j < r else 0)
        stages.append(_stage(base, dev, first, end, b))
        first = end
    vw = VirtualWorker(tuple(stages), base.global_batch, min(m, base.global_batch))
    draft = replace(base, virtual_workers=(vw,), strategy="pp", formation="even-split",
                    prediction=replace(base.prediction, memory=()))
    return _with_simulated_prediction(draft)


def even_dp_plan(base: Plan) -> Plan:
    """DistributedDataParallel as hetrain models it: one replica per device of ``base`` (a ``strategy="dp"``
    plan), the global batch split evenly (a DDP user does not weigh the devices), all-reduce every step,
    over one flat ring of every device (plan option ``allreduce = "ring"``: DDP has no hierarchical scheme)."""
    from hetrain.data.sharding import split_evenly
    from hetrain.plan import VirtualWorker

    devices = [d.name for d in base.cluster.devices]
    n = base.profile.num_layers
    vws = []
    for dev, share in zip(devices, split_evenly(base.global_batch, len(devices)), strict=True):
        vws.append(VirtualWorker((_stage(base, dev, 0, n, share),), share, 1))
    draft = replace(base, virtual_workers=tuple(vws), strategy="dp", formation="even-batch",
                    prediction=replace(base.prediction, memory=()),
                    sync_options=replace(base.sync_options, allreduce="ring"))  # DDP's flat ring, never hierarchical
    return _with_simulated_prediction(draft)


def torch_pipelining_micro_batches(plan: Plan) -> int:
    """The micro-batch count of ``plan``'s one VW, lowered to a divisor of the global batch
    (torch.distributed.pipelining cuts the batch into equal micro-batches)."""
    m = plan.virtual_workers[0].micro_batches
    while plan.global_batch % m:
        m -= 1
    return m


def build_plans(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> dict[str, Plan]:
    """hetrain's plan, pure data parallelism and the even-split pipeline, in that order."""
    from hetrain import plan
    from hetrain.cluster import parse_cluster

    cluster = parse_cluster(cluster_dict)
    sizes = tuple(b for b in MICRO_BATCH_SIZES if b <= global_batch) or (1,)
    best = plan(cluster, profile, global_batch, simulate_top_k=5, micro_batch_sizes=sizes)
    dp = plan(cluster, profile, global_batch, strategy="dp", simulate_top_k=3, micro_batch_sizes=sizes)
    pp = plan(cluster, profile, global_batch, strategy="pp", simulate_top_k=3, micro_batch_sizes=sizes)
    return {"hetrain": best, "dp": dp, "even-split": even_split_plan(pp)}


def calibration_plan(cluster_dict: dict[str, Any], profile: ModelProfile, global_batch: int) -> Plan:
    """The plan the demo trains to calibrate the overhead per action: one pipeline over every device,
    layers split evenly, micro-batches of ``CALIBRATION_MICRO_BATCH``: many actions per step."""
    from hetrain import plan
    from hetrain.cluster import parse_cluster

    b = min(CALIBRATION_MICRO_BATCH, global_batch)
    pp = plan(parse_cluster(cluster_dict), profile, global_batch, strategy="pp", micro_batch_sizes=(b,),
              simulate_top_k=0)
    return even_split_plan(pp)


# ---------------------------------------------------------------------------
# the whole comparison on one emulated cluster
# ---------------------------------------------------------------------------


def run_emulated_comparison(cluster_text: str, out_dir: str | Path, model: str = "gpt-tiny", global_batch: int = 32,
                            steps: int = 20, warmup: int = 5, log: Callable[[str], None] = _say,
                            job_timeout_s: float = 300.0, train: Sequence[str] = ("hetrain", "dp", "even-split"),
                            baselines: Sequence[str] = (),
                            plan_builder: Callable[[dict[str, Any], ModelProfile, int], dict[str, Plan]] | None = None,
                            calibrate: bool = True) -> Comparison:
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
            (DistributedDataParallel, batch split evenly; predicted as ``even_dp_plan``) and
            ``pipelining`` (torch.distributed.pipelining over every device, layers split evenly,
            the even-split plan's micro-batches and schedule; predicted as that plan). Their
            runs are keyed ``torch-ddp`` and ``torch-pipelining``.
        plan_builder: ``(cluster dict with the measured links, profile, global batch) -> {name: plan}``;
            ``build_plans`` by default. The baselines need its ``dp`` and ``even-split`` plans.
        calibrate: before planning, train ``calibration_plan`` for ``CALIBRATION_STEPS`` steps and put the
            overhead per action it shows into the profile (``hetrain.calibrate``); the result's
            ``calibration`` says what was found.

    Raises:
        EmulationError: the host cannot emulate (not root, no namespaces...).
        RuntimeError: a job failed (the message names it).
    """
    from hetrain.cluster import parse_cluster
    from hetrain.emulate import EmulatedCluster, parse_emulation_settings
    from hetrain.plan import Plan
    from hetrain.simulator import simulate

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nominal = tomllib.loads(cluster_text)
    cluster_path = out / "cluster.toml"
    cluster_path.write_text(cluster_text)
    cluster = parse_cluster(nominal)
    settings = parse_emulation_settings(nominal.get("emulation"))
    timings: dict[str, float] = {}
    py = "python"

    def job(what: str, command: list[str]) -> None:
        log(f"-- {what}: {' '.join(command)}")
        start = time.perf_counter()
        status = em.launch(command, timeout_s=job_timeout_s, stdout=log_file, stderr=log_file)
        timings[what] = time.perf_counter() - start
        log(f"   {what}: exit {status} in {timings[what]:.1f} s")
        if status != 0:
            raise RuntimeError(f"{what} failed with exit status {status}; see {out / 'jobs.log'}")

    runs: dict[str, PlanRun] = {}
    with open(out / "jobs.log", "w") as log_file, EmulatedCluster(cluster, settings, source=str(cluster_path)) as em:
        log(em.describe())
        job("profile", [py, "-m", "hetrain.demo", "profile-worker", "--model", model, "--out-dir", str(out)])
        profile = merge_node_profiles(nominal, out)
        profile_path = out / "profile.json"
        profile.save(profile_path)
        discovered_path = out / "discovered.toml"
        job("discover", [py, "-m", "hetrain.profiler.network", "-o", str(discovered_path), *DISCOVER_ARGS])
        discovered = discovered_path.read_text()
        planning = with_measured_links(nominal, tomllib.loads(discovered))
        calibration = None
        if calibrate:
            from hetrain.calibrate import fit_action_overhead, measured_iteration_s, with_action_overhead

            calib = calibration_plan(planning, profile, global_batch)
            calib_path, calib_metrics = out / "plan-calibration.json", out / "metrics-calibration.jsonl"
            calib.save(calib_path)
            calib_metrics.unlink(missing_ok=True)
            job("calibrate", [py, "-m", "hetrain.runtime.command", "--plan", str(calib_path), "--model", model,
                              "--data", "shakespeare", "--steps", str(CALIBRATION_STEPS), "--metrics-out",
                              str(calib_metrics), "--no-progress"])
            calibration = fit_action_overhead(calib, measured_iteration_s(calib_metrics, CALIBRATION_WARMUP))
            log(f"   calibrate: {calibration.summary()}")
            profile = with_action_overhead(profile, calibration.overhead_s,
                                           cluster.type_names)
            profile.save(profile_path)
        start = time.perf_counter()
        plans = (plan_builder or build_plans)(planning, profile, global_batch)
        timings["plan"] = time.perf_counter() - start
        unknown = [k for k in train if k not in plans] + [k for k in baselines if k not in ("ddp", "pipelining")]
        if unknown:
            raise ValueError(f"no plan or baseline named {', '.join(map(repr, unknown))}; plans: "
                             f"{', '.join(plans)}; baselines: ddp, pipelining")
        for name in train:
            p = plans[name]
            path = out / f"plan-{name}.json"
            p.save(path)
            Plan.from_dict(json.loads(path.read_text()))  # the saved plan reads back
            runs[name] = PlanRun(name, p, simulate(p), path, out / f"metrics-{name}.jsonl",
                                 out / f"timeline-{name}.json", warmup=warmup)
        for kind in baselines:
            name, p = f"torch-{kind}", even_dp_plan(plans["dp"]) if kind == "ddp" else plans["even-split"]
            path = out / f"plan-{name}-model.json"
            p.save(path)
            runs[name] = PlanRun(name, p, simulate(p), path, out / f"metrics-{name}.jsonl",
                                 out / f"timeline-{name}.json", warmup=warmup, runtime="torch")
        for name, r in runs.items():
            what = "plan" if r.runtime == "hetrain" else "baseline, as hetrain models it"
            log(f"\n{name} {what} (predicted {r.predicted_samples_per_s:.1f} samples/s):\n{r.plan.summary()}")
        optimizer = next(iter(plans.values())).optimizer
        opt_name = {"adam": "adamw"}.get(optimizer, optimizer)
        for name, r in runs.items():
            r.metrics_path.unlink(missing_ok=True)
            if r.runtime == "torch":
                kind = name.removeprefix("torch-")
                extra = ([] if kind == "ddp" else
                         ["--micro-batches", str(torch_pipelining_micro_batches(r.plan)),
                          "--schedule", r.plan.schedule if r.plan.schedule in ("gpipe", "1f1b") else "1f1b"])
                start = time.perf_counter()
                job(f"train {name}", [py, "-m", "hetrain.baselines", kind, "--model", model, "--data", "shakespeare",
                                      "--global-batch", str(global_batch), "--steps", str(steps), "--optimizer",
                                      opt_name, "--metrics-out", str(r.metrics_path), "--timeout-s",
                                      str(round(job_timeout_s)), *extra])
                r.wall_s = time.perf_counter() - start
                r.status = 0
                r.load_metrics()
                log(f"   {name}: {len(r.metrics)} steps, measured {r.measured_samples_per_s:.1f} samples/s "
                    f"(hetrain's model of it: {r.predicted_samples_per_s:.1f})")
                continue
            start = time.perf_counter()
            job(f"train {name}", [py, "-m", "hetrain.runtime.command", "--plan", str(r.plan_path), "--model", model,
                                  "--data", "shakespeare", "--steps", str(steps), "--metrics-out", str(r.metrics_path),
                                  "--timeline-out", str(r.timeline_path), "--no-progress", "--log-every", "10"])
            r.wall_s = time.perf_counter() - start
            r.status = 0
            r.load_metrics()
            log(f"   {name}: {len(r.metrics)} steps, measured {r.measured_samples_per_s:.1f} samples/s "
                f"(predicted {r.predicted_samples_per_s:.1f})")
    return Comparison(out, cluster_path, profile_path, runs, discovered, timings, plans, calibration)


# ---------------------------------------------------------------------------
# hetrain demo
# ---------------------------------------------------------------------------


def run_plan_only(args: argparse.Namespace) -> int:
    """Plan on the default cluster with nominal links and analytic costs; no emulation, no root."""
    from hetrain.cluster import parse_cluster
    from hetrain.models.analytic import build_profile
    from hetrain.models.registry import build_layers  # noqa: F401  (the model must exist)

    nominal = tomllib.loads(_cluster_text(args))
    cluster = parse_cluster({k: v for k, v in nominal.items() if k != "emulation"})
    try:
        profile = build_profile(args.model)
    except (KeyError, ValueError):
        from hetrain.profiler.layers import run_profile_command

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "profile-local.json"
        if run_profile_command(args.model, PROFILE_MICRO_BATCHES, str(path)) != 0:
            return 1
        from hetrain.profile import load_profile

        local = load_profile(path)
        from hetrain.profiler.fit import merge_profiles

        profile = merge_profiles([relabel_profile(local, t) for t in
                                  cluster.type_names])
    print("plan only: nominal links from the cluster file, layer costs "
          f"{'estimated (analytic profile)' if not profile.measured_on else 'profiled on this host, unthrottled'}; "
          "nothing is emulated or trained")
    print(cluster.summary())
    plans = build_plans({k: v for k, v in nominal.items() if k != "emulation"}, profile, args.global_batch)
    from hetrain.simulator import simulate

    for name, p in plans.items():
        sim = simulate(p)
        print(f"\n{name} plan: predicted {p.global_batch / sim.iteration_s:.1f} samples/s "
              f"(iteration {sim.iteration_s * 1e3:.1f} ms)")
        print(p.summary())
    return 0


def _cluster_text(args: argparse.Namespace) -> str:
    path = getattr(args, "cluster", None)
    return Path(path).read_text() if path else DEFAULT_CLUSTER


def run_demo(args: argparse.Namespace) -> int:
    """``hetrain demo``: the main job end to end on the emulated default cluster; exit status."""
    from hetrain.emulate import EmulationError
    from hetrain.emulate.emulator import check_permissions

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
    from hetrain.report import write_report

    report = write_report(result)
    best, dp, even = (result.runs[k] for k in ("hetrain", "dp", "even-split"))
    print("\n" + "=" * 72)
    print(f"hetrain's plan ({best.plan.strategy}, {len(best.plan.virtual_workers)} VW(s)):")
    print(best.plan.summary())
    print("\n" + result.table())
    print(f"\nmeasured speed-up of hetrain's plan: {result.speedup('dp'):.2f}x over pure data parallelism, "
          f"{result.speedup('even-split'):.2f}x over the even-split pipeline")
    print(f"(samples/s are the mean over steps {dp.warmup + 1}..{len(dp.metrics)} of {args.steps}; "
          f"the first {dp.warmup} are warm-up)")
    _ = even
    print(f"report: {report}")
    print(f"demo took {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.demo profile-worker ...``: the per-rank part of the demo's jobs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile-worker":
        return profile_worker(argv[1:])
    print("usage: python -m hetrain.demo profile-worker --model NAME --out-dir DIR (under torchrun); "
          "the demo itself is `hetrain demo`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

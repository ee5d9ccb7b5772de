"""A node lost and added back, emulated: torchrun elastic restarts, hetrain re-plans and resumes (issue 20).

One emulated cluster of 2 nodes x 2 devices (hetrain.emulate: namespaces, tc-shaped NICs,
cgroup CPU quotas), gpt-tiny on Shakespeare, checkpoints every few steps:

    n1   2 devices at cpu_share 0.5, NIC 1 Gbit/s     hosts torchrun's c10d store: it must survive
    n2   2 devices at cpu_share 0.3, NIC 1 Gbit/s

    1. profile    every device profiles gpt-tiny (as the demo does); one profile per device type
    2. plan       hetrain's plan for the 4 devices (plan.json), and a fresh plan for n1 alone
    3. baselines  each trained alone on its cluster: the 4-device plan on n1 + n2, n1's plan on n1 only
    4. elastic    plan.json under torchrun --nnodes 1:2 --max-restarts 3 on n1 + n2, with two events:
                    kill n2 (every process of the node) at --kill-at-s: n1's ranks fail on the closed
                    connections, its agent restarts them, they re-plan for n1's 2 devices and resume from
                    the newest checkpoint
                    start n2 again --join-after-s later: its agent asks to join, n1's agent restarts its
                    workers to let it in (a membership change), the 4 devices resume on plan.json

Measured from the elastic run's metrics (one line per step, each stamped with this host's clock as it
is written) and the launcher's event lines: the steps lost at each restart (the last step logged before
it, less the step resumed from), the time from the event to the first step of the new world, samples/s
of the new world's steps in the 60 s after the kill against the fresh plan for n1 trained alone
(target >= 90%), samples/s after n2 is back against before, and that the job reached its last step with
no hand on it. Needs root (or is skipped, saying so).

    sudo -E .venv/bin/python benchmarks/elastic_nodes.py
    sudo -E .venv/bin/python benchmarks/elastic_nodes.py --quick    # shorter phases, no RESULTS.md
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from _emulated import ready_to_emulate
from _results import write_section

MODEL = "gpt-tiny"
WINDOW_S = 60.0  # the window after the failure
# the rendezvous of the elastic run: a killed node is dropped after 5 silent keep-alives of 1 s, and a round
# waits 3 s for more nodes once one is there (every node starts at once; a late one is let in by a restart).
# With 2 keep-alives of 1 s, n2 coming back found n1's last keep-alive older than 2 s on this loaded host,
# dropped n1 as dead and made a world of its own: two jobs on one checkpoint directory (docs/elastic.md).
RDZV = {"last_call_timeout": "3s", "keep_alive_interval": "1s", "keep_alive_max_attempt": 5}


def cluster_text(nodes: tuple[str, ...] = ("n1", "n2")) -> str:
    """The emulated cluster (``nodes``: which of n1, n2), with no [emulation] table."""
    spec = {"n1": ("cpu-a", 0.5, "1Gbit/s"), "n2": ("cpu-b", 0.3, "1Gbit/s")}
    out = ['name = "elastic-nodes"']
    for name in nodes:
        type_name, share, nic = spec[name]
        out.append(f"""
[[node]]
name = "{name}"
devices = [{{ type = "{type_name}", tflops = {0.02 * share:.4f}, memory = "4GB", \
memory_bandwidth = "{10 * share:.1f}GB/s", cpu_share = {share}, count = 2 }}]
intra_link = "loopback"
nic = "{nic}"
""")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# lines stamped with this host's clock as they appear
# ---------------------------------------------------------------------------


class StampedLines(io.TextIOBase):
    """A text stream that keeps each line with the time it was written (``time.monotonic``), and a log file."""

    def __init__(self, log: TextIO) -> None:
        self.log = log
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.partial = ""

    def write(self, text: str) -> int:
        now = time.monotonic()
        with self.lock:
            self.log.write(text)
            self.partial += text
            *done, self.partial = self.partial.split("\n")
            self.lines += [(now, line) for line in done]
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def first(self, words: str, after: float = -math.inf) -> float | None:
        """When the first line holding ``words`` (written after ``after``) appeared."""
        with self.lock:
            return next((t for t, line in self.lines if t > after and words in line), None)


@dataclass
class MetricsTail:
    """Reads a metrics JSONL file as the reporting rank appends to it; each row gets ``"t"``, when it was seen."""

    path: Path
    poll_s: float = 0.02
    rows: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True, name="metrics-tail")

    def __enter__(self) -> MetricsTail:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        offset, partial = 0, ""
        while True:
            stopping = self.stop.is_set()
            if self.path.exists():
                with open(self.path) as f:
                    f.seek(offset)
                    text = f.read()
                    offset = f.tell()
                now = time.monotonic()
                partial += text
                *done, partial = partial.split("\n")
                for line in done:
                    row = json.loads(line)
                    if "loss" in row:  # a step (not a validation record)
                        self.rows.append({**row, "t": now})
            if stopping:
                return
            time.sleep(self.poll_s)


def split_attempts(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows of each torchrun attempt: a new one starts where the step or the elapsed time goes back."""
    attempts: list[list[dict[str, Any]]] = []
    for row in rows:
        if not attempts or row["step"] <= attempts[-1][-1]["step"] or row["elapsed_s"] < attempts[-1][-1]["elapsed_s"]:
            attempts.append([])
        attempts[-1].append(row)
    return attempts


def rate(rows: list[dict[str, Any]], global_batch: int) -> float:
    """Samples/s over ``rows``: their samples over the sum of their step times (checkpoint writes included)."""
    took = sum(r["step_time_s"] for r in rows)
    return global_batch * len(rows) / took if took > 0 else float("nan")


# ---------------------------------------------------------------------------
# the jobs
# ---------------------------------------------------------------------------


def emulation_table(extra: str = "") -> str:
    return "\n[emulation]\n" + extra


def train_command(plan: Path, steps: int, metrics: Path, checkpoint_dir: Path | None, every: int) -> list[str]:
    cmd = ["python", "-m", "hetrain.runtime.command", "--plan", str(plan), "--model", MODEL, "--data", "shakespeare",
           "--steps", str(steps), "--metrics-out", str(metrics), "--log-every", "1", "--no-progress",
           "--timeout-s", "60"]  # a closed connection fails at once; 60 s leaves a loaded host time to start
    if checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(every)]
    return cmd


def launch(text: str, command: list[str], log: TextIO, timeout_s: float,
           stamped: StampedLines | None = None) -> tuple[int, float]:
    """Run ``command`` on the cluster of ``text`` (brought up for it, taken down after); status and start time."""
    import tomllib

    from hetrain.cluster import parse_cluster
    from hetrain.emulate import EmulatedCluster
    from hetrain.emulate.settings import parse_emulation_settings

    data = tomllib.loads(text)
    settings = parse_emulation_settings(data.get("emulation"))
    stream = stamped or log
    def note(message: str) -> None:
        print(f"hetrain emulate: {message}", file=stream)

    with EmulatedCluster(parse_cluster(data), settings, log=note) as em:
        log.write(f"\n-- {' '.join(command)}\n{em.describe()}\n")
        log.flush()
        t0 = time.monotonic()
        status = em.launch(command, timeout_s=timeout_s, stdout=stream, stderr=stream)
    return status, t0


def profile_and_plan(out: Path, global_batch: int, log: TextIO) -> tuple[Any, Any]:
    """Steps 1-2: the 4-device plan and the fresh plan for n1 alone, both from the measured profile."""
    import tomllib

    import hetrain
    from hetrain.cluster import parse_cluster
    from hetrain.demo import MICRO_BATCH_SIZES
    from hetrain.profiler.merge import merge_node_profiles

    status, _ = launch(cluster_text(), ["python", "-m", "hetrain.demo", "profile-worker", "--model", MODEL,
                                        "--out-dir", str(out / "profile")], log, 600)
    if status != 0:
        raise RuntimeError(f"profiling failed with exit status {status}; see {out / 'jobs.log'}")
    profile = merge_node_profiles(tomllib.loads(cluster_text()), out / "profile")
    profile.save(out / "profile.json")
    sizes = tuple(b for b in MICRO_BATCH_SIZES if b <= global_batch) or (1,)
    plans = []
    for nodes in (("n1", "n2"), ("n1",)):
        plans.append(hetrain.plan(parse_cluster(tomllib.loads(cluster_text(nodes))), profile, global_batch,
                                  simulate_top_k=5, micro_batch_sizes=sizes))
    return plans[0], plans[1]


def run_alone(text: str, plan_path: Path, steps: int, metrics: Path, log: TextIO) -> list[dict[str, Any]]:
    """A baseline: the plan trained on its own cluster, no events, no checkpoints; its metric rows."""
    metrics.unlink(missing_ok=True)
    status, _ = launch(text + emulation_table(), train_command(plan_path, steps, metrics, None, 0), log, 600)
    if status != 0:
        raise RuntimeError(f"training {plan_path} failed with exit status {status}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]


@dataclass
class ElasticRun:
    status: int
    rows: list[dict[str, Any]]
    lines: StampedLines
    t0: float
    steps: int


def run_elastic(out: Path, plan_path: Path, steps: int, every: int, kill_at_s: float, start_at_s: float,
                log: TextIO) -> ElasticRun:
    """Step 4: plan.json on n1 + n2; n2 killed at ``kill_at_s`` and started again at ``start_at_s``."""
    ckpt, metrics = out / "ckpt", out / "metrics-elastic.jsonl"
    shutil.rmtree(ckpt, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    table = emulation_table("max_restarts = 3\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in RDZV.items())
                            + f'\n[[emulation.event]]\nat_s = {kill_at_s:g}\nnode = "n2"\naction = "kill"\n'
                            + f'\n[[emulation.event]]\nat_s = {start_at_s:g}\nnode = "n2"\naction = "start"\n')
    stamped = StampedLines(log)
    os.environ.setdefault("LOGLEVEL", "INFO")  # torchrun's agents say in jobs.log how each rendezvous went
    with MetricsTail(metrics) as tail:
        status, t0 = launch(cluster_text() + table, train_command(plan_path, steps, metrics, ckpt, every), log,
                            start_at_s + 600, stamped)
    with open(out / "elastic-stamped.json", "w") as f:  # what the tables are read from, kept
        json.dump({"rows": tail.rows, "lines": stamped.lines}, f)
    return ElasticRun(status, tail.rows, stamped, t0, steps)


# ---------------------------------------------------------------------------
# reading the elastic run
# ---------------------------------------------------------------------------


@dataclass
class Restart:
    """One restart of the elastic run, read from its metrics and the launcher's lines."""

    event_t: float  # when the event's line appeared
    last_before: int  # the last step logged before the restart
    resumed_from: int  # the step the next attempt resumed from
    first_step_t: float  # when its first step was logged
    replan_t: float | None  # when rank 0 said it re-planned (None: the world was the plan's)

    @property
    def steps_lost(self) -> int:
        return self.last_before - self.resumed_from

    @property
    def to_first_step_s(self) -> float:
        return self.first_step_t - self.event_t


def read_restart(run: ElasticRun, before: list[dict[str, Any]], after: list[dict[str, Any]],
                 event_words: str) -> Restart:
    event_t = run.lines.first(event_words)
    if event_t is None:
        raise RuntimeError(f"no line {event_words!r} from the launcher")
    replan_t = run.lines.first("hetrain: the world changed", after=event_t)
    if replan_t is not None and replan_t > after[0]["t"]:
        replan_t = None
    return Restart(event_t, before[-1]["step"], after[0]["step"] - 1, after[0]["t"], replan_t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=64,
                        help="64: at 32 the planner's plan for the 4 devices was predicted no faster than n1 alone")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--kill-at-s", type=float, default=90.0,
                        help="n2 is killed this long after the job starts (its start took over 35 s on a loaded host)")
    parser.add_argument("--join-after-s", type=float, default=90.0, help="n2 starts again this long after the kill")
    parser.add_argument("--after-join-s", type=float, default=80.0,
                        help="steps enough for about this long of training after n2 is back")
    parser.add_argument("--baseline-s", type=float, default=60.0, help="how long each baseline trains, about")
    parser.add_argument("--quick", action="store_true", help="shorter phases, RESULTS.md left alone")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--out", default="out/bench-elastic-nodes")
    args = parser.parse_args()
    args.steps, args.warmup = 2, 1  # for ready_to_emulate's check only: the phases are sized in seconds
    if args.quick:
        args.kill_at_s, args.join_after_s, args.after_join_s, args.baseline_s = 60.0, 60.0, 40.0, 25.0
        args.no_write = True
    if not ready_to_emulate(parser, args):
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    from hetrain.planner.robust import describe_layout

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start, load0 = time.perf_counter(), os.getloadavg()
    uptime0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    N = args.global_batch
    say: Callable[[str], None] = lambda m: print(m, flush=True)  # noqa: E731
    with open(out / "jobs.log", "w") as log:
        plan4, plan2 = profile_and_plan(out, N, log)
        plan4.save(out / "plan.json")
        plan2.save(out / "plan-n1-alone.json")
        say(f"plan for 4 devices: {describe_layout(plan4)}, predicted {plan4.prediction.samples_per_s:.1f} samples/s; "
            f"for n1 alone: {describe_layout(plan2)}, predicted {plan2.prediction.samples_per_s:.1f}")

        # 3. baselines, sized from the predictions (a step count reaching about --baseline-s)
        def steps_for(seconds: float, samples_per_s: float) -> int:
            return max(10, math.ceil(seconds * samples_per_s / N))

        base4 = run_alone(cluster_text(), out / "plan.json", steps_for(args.baseline_s, plan4.prediction.samples_per_s),
                          out / "metrics-4-devices.jsonl", log)
        base2 = run_alone(cluster_text(("n1",)), out / "plan-n1-alone.json",
                          steps_for(args.baseline_s, plan2.prediction.samples_per_s), out / "metrics-n1-alone.jsonl",
                          log)
        warm = 5
        r4, r2 = rate(base4[warm:], N), rate(base2[warm:], N)
        say(f"alone: 4 devices {r4:.1f} samples/s ({len(base4)} steps), n1's 2 devices {r2:.1f} ({len(base2)} steps)")

        # 4. the elastic run: steps for every phase, counted generously before the join (startup 8 s, 10% faster
        # than measured, no downtime), so that at least --after-join-s of training is left once n2 is back
        join_at = args.kill_at_s + args.join_after_s
        before_join = (1.1 * r4 * (args.kill_at_s - 8) + 1.1 * r2 * args.join_after_s) / N
        steps = math.ceil(before_join + r4 * args.after_join_s / N)
        steps = math.ceil(steps / args.checkpoint_every) * args.checkpoint_every
        say(f"elastic run: {steps} steps, checkpoint every {args.checkpoint_every}; n2 killed at {args.kill_at_s:g} s, "
            f"started again at {join_at:g} s")
        run_ = run_elastic(out, out / "plan.json", steps, args.checkpoint_every, args.kill_at_s, join_at, log)
    took = time.perf_counter() - start
    load1 = os.getloadavg()
    uptime1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return report(args, run_, plan4, plan2, r4, r2, out, took, (load0, load1), (uptime0, uptime1))


def report(args: argparse.Namespace, run_: ElasticRun, plan4: Any, plan2: Any, r4: float, r2: float, out: Path,
           took: float, loads: tuple[Any, Any], uptimes: tuple[str, str]) -> int:
    from hetrain.elastic import plan_digest
    from hetrain.plan import load_plan
    from hetrain.planner.robust import describe_layout

    N = args.global_batch
    finished = run_.status == 0 and bool(run_.rows) and run_.rows[-1]["step"] == run_.steps \
        and (out / "ckpt" / f"step-{run_.steps:08d}").is_dir()
    say = print
    kill_t, start_t = run_.lines.first("node n2 kill"), run_.lines.first("node n2 start")
    if kill_t is None or not any(r["t"] < kill_t for r in run_.rows):
        say(f"the job trained no step before n2 was killed at {args.kill_at_s:g} s (it took longer to start on "
            f"this host): raise --kill-at-s; see {out / 'jobs.log'}")
        return 1
    # the 4-device attempt, n1's (which runs on until n2 is let in), then one on 4 devices if n2 was let in
    attempts = split_attempts(run_.rows)
    say(f"elastic run: exit status {run_.status}; attempts: " + "; ".join(
        f"steps {a[0]['step']}..{a[-1]['step']}" for a in attempts))
    if len(attempts) < 2 or (start_t is not None and attempts[1][0]["t"] >= start_t):
        say(f"expected 2 attempts before n2 came back (4 devices, n1 alone); see {out / 'jobs.log'}")
        return 1
    first, alone, after = attempts[0], attempts[1], attempts[2:]
    lost = read_restart(run_, first, alone, "node n2 kill")
    replanned_path = out / "ckpt" / "plans" / f"plan-step{lost.resumed_from}.json"
    replanned = load_plan(replanned_path) if replanned_path.exists() else None
    same_as_fresh = replanned is not None and describe_layout(replanned) == describe_layout(plan2)
    # the new world's steps in the 60 s after the kill, its first step (warm-up, a checkpoint load) left out
    window = [r for r in alone[1:] if r["t"] <= lost.event_t + WINDOW_S]
    in_window = rate(window, N) if window else float("nan")
    done_in_window = [r for r in alone if r["t"] <= lost.event_t + WINDOW_S]
    with_downtime = N * len(done_in_window) / WINDOW_S
    steady_alone = rate(alone[1:], N)
    steady_before = rate(first[5:], N)
    interval = args.checkpoint_every
    ok = "met" if in_window >= 0.9 * r2 else "NOT met"
    rows = [
        "| node lost (n2 killed) | measured | target |", "| --- | --- | --- |",
        f"| steps lost | {lost.steps_lost} (last step logged {lost.last_before}, resumed from checkpoint "
        f"{lost.resumed_from}) | <= {interval} (one checkpoint interval): "
        f"{'met' if lost.steps_lost <= interval else 'NOT met'} |",
        f"| kill -> re-planned (rank 0's line) | "
        f"{'-' if lost.replan_t is None else f'{lost.replan_t - lost.event_t:.1f} s'} | |",
        f"| kill -> first step of the new plan | {lost.to_first_step_s:.1f} s | |",
        f"| new plan | {describe_layout(replanned) if replanned else 'none written'}"
        f"{' (the fresh plan for n1 alone: the same layout)' if same_as_fresh else ''} | |",
        f"| samples/s of the new plan's steps in the {WINDOW_S:.0f} s after the kill ({len(window)} steps, "
        f"its first left out) | {in_window:.1f} = {100 * in_window / r2:.0f}% of n1's fresh plan alone "
        f"({r2:.1f}) | >= 90%: {ok} |",
        f"| samples/s over the {WINDOW_S:.0f} s after the kill, the restart's downtime included | "
        f"{with_downtime:.1f} = {100 * with_downtime / r2:.0f}% of {r2:.1f} | |",
        f"| samples/s of the new plan, all its {len(alone) - 1} steps but the first | {steady_alone:.1f} = "
        f"{100 * steady_alone / r2:.0f}% | |",
        f"| no human action | exit status {run_.status}, {'reached' if finished else 'did NOT reach'} step "
        f"{run_.steps} with its checkpoint | the job finishes: {'met' if finished else 'NOT met'} |",
    ]
    own_world = run_.lines.first("hetrain: the world changed (lost n1:0, n1:1)")
    if len(after) == 1 and own_world is None and start_t is not None and after[0][0]["t"] >= start_t:
        again = after[0]
        back = read_restart(run_, alone, again, "node n2 start")
        steady_again = rate(again[1:], N)
        rows2 = [
            "| node added back (n2 started again) | measured | |", "| --- | --- | --- |",
            f"| steps lost at the membership restart | {back.steps_lost} (last logged {back.last_before}, resumed "
            f"from {back.resumed_from}) | |",
            f"| start -> first step on 4 devices | {back.to_first_step_s:.1f} s | |",
            f"| plan | {'re-planned' if back.replan_t is not None else 'plan.json (the 4 devices are its world)'}: "
            f"{describe_layout(plan4)} | |",
            f"| samples/s with n1 alone -> with n2 back | {steady_alone:.1f} -> {steady_again:.1f} "
            f"({steady_again / steady_alone:.2f}x) | rise: {'met' if steady_again > steady_alone else 'NOT met'} |",
            f"| samples/s with n2 back vs before the kill vs the 4-device plan alone | {steady_again:.1f} vs "
            f"{steady_before:.1f} vs {r4:.1f} | |",
        ]
    else:
        why = ("n2 made a world of its own (its ranks re-planned for n2 alone): two jobs on one checkpoint directory"
               if own_world is not None else
               "n2 was not let in" + (" (its rendezvous timed out)" if run_.lines.first("RendezvousTimeoutError")
                                      else ""))
        rows2 = ["| node added back (n2 started again) | measured | |", "| --- | --- | --- |",
                 f"| let in | NO: {why}; attempts after the start: {len(after)} | |"]
    table = "\n".join(rows) + "\n\n" + "\n".join(rows2)
    shared = loads[0][0] > 0.5 or loads[1][0] > 2.5
    notes = (
        f"{MODEL} on Shakespeare, global batch {N}, plan.json = hetrain's plan for the 4 devices "
        f"({describe_layout(plan4)}, predicted {plan4.prediction.samples_per_s:.1f} samples/s); the fresh plan "
        f"for n1 alone {describe_layout(plan2)} (predicted {plan2.prediction.samples_per_s:.1f}), digest "
        f"{plan_digest(plan2)[:16]}. Emulated: n1 2 devices at cpu_share 0.5, n2 2 devices at 0.3, NICs "
        f"1 Gbit/s, each device pinned to a CPU (isolate_comm, fill_idle, keep_awake); torchrun "
        f"--nnodes 1:2 --max-restarts 3, rendezvous last_call_timeout 3 s, keep-alive 1 s x 5; checkpoints every "
        f"{interval} steps; {run_.steps} steps; n2 killed {args.kill_at_s:g} s after the job started and started "
        f"again {args.join_after_s:g} s later. Baselines trained alone on their own emulated clusters: "
        f"4 devices {r4:.1f} samples/s, n1 alone {r2:.1f} (steps after the first 5). Samples/s: samples over the "
        f"sum of step times (checkpoint writes included). Times: host clock as the launcher's event line and each "
        f"metrics line (--log-every 1) appeared, polled every 20 ms. "
        f"Took {took:.0f} s; host {'shared with other jobs' if shared else 'quiet'}: `uptime` {uptimes[0]!r} at the "
        f"start, {uptimes[1]!r} at the end (2 cores).")
    print(table)
    print(notes)
    if not args.no_write:
        command = "sudo -E .venv/bin/python benchmarks/elastic_nodes.py " + " ".join(sys.argv[1:])
        write_section("Elastic: a node lost and added back (emulated)", command.strip(), table, notes)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())

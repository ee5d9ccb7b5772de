"""How long do ``hetrain plan`` and ``hetrain simulate`` take, this tree against an older revision (issue 33)?

Each case runs the command as a user does, ``python -m hetrain ...`` in a fresh process, once with this
tree's sources and once with those of ``--old REV`` (extracted by ``git archive`` into a temporary
directory, put first on ``PYTHONPATH``), alternating, ``--repeats`` times each. The table gives the median
wall time and the spread (min to max) of each side, and whether the two printed the same (where the output
is deterministic: without a time budget, the planner's choice does not depend on the clock)::

    help        hetrain --help                                      (the command table imports no command)
    plan-256    hetrain plan, examples/clusters/gpu256.toml, gpt2-medium, global batch 512, default budget
    plan-256-nb the same with --time-budget none --json             (outputs compared, the seconds left out)
    plan-4      hetrain plan, examples/clusters/small-hetero.toml, gpt-tiny, 32, --time-budget none --json
    simulate    hetrain simulate of plan-256's plan with --timeline (the old command read and replayed it twice)

    python benchmarks/plan_command.py --old 6b0643f [--repeats 3] [--cases help plan-256 ...] [--no-write]

Timing on a shared machine only adds other programs' time; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _results import write_section

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "examples" / "clusters"
PLAN_256 = ["plan", "--cluster", str(CLUSTERS / "gpu256.toml"), "--model", "gpt2-medium", "--global-batch", "512"]
PLAN_4 = ["plan", "--cluster", str(CLUSTERS / "small-hetero.toml"), "--model", "gpt-tiny", "--global-batch", "32"]
#: case -> (argv after ``python -m hetrain``, whether the output is deterministic and compared)
CASES: dict[str, tuple[list[str], bool]] = {
    "help": (["--help"], True),
    "plan-256": (PLAN_256, False),
    "plan-256-nb": ([*PLAN_256, "--time-budget", "none", "--json"], True),
    "plan-4": ([*PLAN_4, "--time-budget", "none", "--json"], True),
    "simulate": (["simulate", "{plan}", "--timeline", "{timeline}"], True),
}


@dataclass(frozen=True)
class Row:
    """One case: each side's wall times, and whether their outputs agree (None: not compared)."""

    case: str
    old_s: tuple[float, ...]
    new_s: tuple[float, ...]
    same_output: bool | None


def extract(rev: str, into: Path) -> Path:
    """The ``src`` directory of ``rev`` (``git archive``), under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "old.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_once(src: Path, argv: list[str], cwd: Path) -> tuple[float, str]:
    """``python -m hetrain ARGV`` with ``src`` first on the path: (wall seconds, stdout with timings removed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "120"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hetrain", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} with {src}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    return took, re.sub(r'"(planning_s|comparison_s)": [0-9.e-]+', r'"\1": 0', done.stdout)


def run_case(name: str, old: Path, new: Path, repeats: int, work: Path) -> Row:
    argv, compared = CASES[name]
    argv = [a.format(plan=work / "plan-256.json", timeline=work / "timeline.json") for a in argv]
    times: dict[Path, list[float]] = {old: [], new: []}
    outputs: dict[Path, set[str]] = {old: set(), new: set()}
    for _ in range(repeats):
        for src in (old, new):
            took, out = run_once(src, argv, work)
            times[src].append(took)
            outputs[src].add(out)
    same = outputs[old] == outputs[new] and len(outputs[new]) == 1 if compared else None
    return Row(name, tuple(times[old]), tuple(times[new]), same)


def spread(times: tuple[float, ...]) -> str:
    return f"{statistics.median(times):7.2f} s ({min(times):.2f}..{max(times):.2f})"


def table(rows: list[Row], rev: str) -> str:
    lines = [f"| case | {rev} (median, min..max) | this tree (median, min..max) | new / old | same output |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = statistics.median(r.new_s) / statistics.median(r.old_s)
        same = "-" if r.same_output is None else ("yes" if r.same_output else "NO")
        lines.append(f"| {r.case} | {spread(r.old_s)} | {spread(r.new_s)} | {ratio:.2f} | {same} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="main", help="the revision to compare with (default main)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per case (3)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.old], capture_output=True, text=True,
                         check=True).stdout.strip()
    command = f"python benchmarks/plan_command.py --old {rev}" + \
        (f" --repeats {args.repeats}" if args.repeats != 3 else "") + \
        (f" --cases {' '.join(args.cases)}" if args.cases != list(CASES) else "")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old, new = extract(rev, work / "old"), ROOT / "src"
        if "simulate" in args.cases:  # the plan it simulates, made once by this tree
            _, out = run_once(new, [*PLAN_256, "--time-budget", "none", "-o", str(work / "plan-256.json"), "--json"],
                              work)
            json.loads(out)
        for name in args.cases:
            rows.append(run_case(name, old, new, args.repeats, work))
            print(table(rows[-1:], rev).splitlines()[-1], flush=True)
    text = table(rows, rev)
    print(text)
    load = f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared host)."
    print(load)
    if not args.no_write:
        write_section("hetrain plan and simulate, before and after the command table (issue 33)", command, text,
                      f"Wall time of `python -m hetrain ...` in a fresh process, {args.repeats} runs of each side, "
                      f"alternating; {rev} is the revision before the command table. plan-256: "
                      "examples/clusters/gpu256.toml (256 GPUs), gpt2-medium, global batch 512, the default 10 s "
                      "budget (most of the time is the budget); -nb: no budget, the outputs compared. simulate: "
                      "the 256-device plan with --timeline. Both sides run the planner once for the plan and once "
                      f"per pure family (dp, pp). {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

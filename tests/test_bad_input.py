"""Malformed input, as a new user writes it: every case is one line on stderr naming the file, the field
and the value, with a non-zero exit status, never a traceback and never a hang.

Each plan case corrupts one field of a real plan (planned here for a small cluster and model) and runs
``hetrain simulate`` on it: every other one as a real subprocess, the rest through the command's ``main``
in-process (both paths checked, and the file stays quick). Cluster, profile and argument cases run
in-process, except those that once hung or imported torch before refusing: those run as subprocesses
under a timeout.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetrain.cli import main
from hetrain.cluster import load_cluster
from hetrain.models.analytic import build_profile
from hetrain.planner import plan as build_plan
from tiers import slow_where

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "small-hetero.toml"
SUBPROCESS_TIMEOUT_S = 60.0  # a case that hangs fails here; a refused one takes well under a second
HANG_LIMIT_S = 10.0  # the sizes that once hung: refused at once, even on a loaded machine

Json = Any


# --- running a case and checking the refusal -------------------------------------------------------

def run_subprocess(argv: list[str], cwd: Path) -> tuple[int, str, float]:
    """``python -m hetrain ARGV`` in ``cwd``: (exit status, stderr, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hetrain", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    return done.returncode, done.stderr, time.monotonic() - start


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``hetrain.cli.main(ARGV)``: (exit status, stderr); argparse's own errors exit through SystemExit."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def check_refused(code: int, stderr: str, needles: tuple[str, ...], status: int = 2) -> None:
    """Refused with ``status``, no traceback, one error line (under argparse's usage, if any) holding every
    needle."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    if lines[0].startswith("usage:"):  # argparse: its usage, then its one error line
        lines = lines[-1:]
    assert len(lines) == 1, f"the error takes {len(lines)} lines:\n{stderr}"
    assert "error:" in lines[0], lines[0]
    missing = [n for n in needles if n not in lines[0]]
    assert not missing, f"{missing} not in: {lines[0]}"
    assert code == status, f"exit status {code}, expected {status}: {lines[0]}"


# --- the valid inputs the cases corrupt ------------------------------------------------------------

@pytest.fixture(scope="module")
def valid() -> dict[str, Json]:
    """A real plan (and its profile) for the small emulated cluster and the mlp model."""
    cluster = load_cluster(CLUSTER)
    profile = build_profile("mlp")
    made = build_plan(cluster, profile, 16, simulate_top_k=0)
    return {"plan": json.loads(json.dumps(made.to_dict())), "profile": json.loads(json.dumps(profile.to_dict()))}


def at(data: Json, path: str) -> tuple[Json, str | int]:
    """The container and key that ``path`` (``virtual_workers.0.stages.0.layers``) names."""
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in path.split(".")]
    for p in parts[:-1]:
        data = data[p]
    return data, parts[-1]


def setting(path: str, value: Json) -> Callable[[Json], Json]:
    def corrupt(data: Json) -> Json:
        holder, key = at(data, path)
        holder[key] = value
        return data
    return corrupt


def deleting(path: str) -> Callable[[Json], Json]:
    def corrupt(data: Json) -> Json:
        holder, key = at(data, path)
        del holder[key]
        return data
    return corrupt


def replacing(value: Json) -> Callable[[Json], Json]:
    return lambda data: value


DEEP_JSON = "[" * 2000 + "]" * 2000
RAW_FILES: dict[str, bytes] = {
    "empty": b"",
    "blank": b"  \n\n",
    "binary": bytes(range(256)) * 4,
    "latin-1": "name = 'Müller'\n".encode("latin-1"),
    "deep-json": DEEP_JSON.encode(),
}

# --- plan.json: each case one field of a real plan, run as `hetrain simulate plan.json` ----------------

PLAN_CASES: list[tuple[str, Callable[[Json], Json] | str, tuple[str, ...]]] = [
    ("top-list", replacing([]), ("plan.json", "JSON object", "[]")),
    ("top-null", replacing(None), ("plan.json", "JSON object", "None")),
    ("top-number", replacing(3), ("plan.json", "JSON object", "3")),
    ("top-string", replacing("plan"), ("plan.json", "JSON object", "'plan'")),
    ("empty-file", "empty", ("plan.json", "empty")),
    ("blank-file", "blank", ("plan.json", "empty")),
    ("binary-file", "binary", ("plan.json", "binary")),
    ("latin-1-file", "latin-1", ("plan.json", "UTF-8")),
    ("deep-nesting", "deep-json", ("plan.json", "nested too deeply")),
    ("truncated-json", "trunc", ("plan.json", "not valid JSON")),
    ("format_version-missing", deleting("format_version"), ("plan.json", "format_version", "missing")),
    ("format_version-future", setting("format_version", 99), ("plan.json", "format_version", "99")),
    ("format_version-string", setting("format_version", "1"), ("plan.json", "format_version", "'1'")),
    ("prediction-list", setting("prediction", []), ("plan.json", "prediction", "[]")),
    ("prediction-string", setting("prediction", "fast"), ("plan.json", "prediction", "'fast'")),
    ("prediction.iteration_s", setting("prediction.iteration_s", "1s"), ("prediction.iteration_s", "'1s'")),
    ("prediction.sync_s-negative", setting("prediction.sync_s", -1), ("prediction.sync_s", "-1")),
    ("prediction.memory-object", setting("prediction.memory", {}), ("prediction.memory", "{}")),
    ("prediction.memory[0].peak_bytes", setting("prediction.memory.0.peak_bytes", "9GB"),
     ("prediction.memory[0].peak_bytes", "'9GB'")),
    ("prediction.simulated_iteration_s", setting("prediction.simulated_iteration_s", "x"),
     ("prediction.simulated_iteration_s", "'x'")),
    ("virtual_workers-object", setting("virtual_workers", {}), ("plan.json", "virtual_workers", "{}")),
    ("virtual_workers-empty", setting("virtual_workers", []), ("virtual_workers", "at least 1")),
    ("virtual_workers-missing", deleting("virtual_workers"), ("virtual_workers", "missing")),
    ("virtual_workers[0]-number", setting("virtual_workers.0", 3), ("virtual_workers[0]", "3")),
    ("mini_batch-string", setting("virtual_workers.0.mini_batch", "16"), ("virtual_workers[0].mini_batch", "'16'")),
    ("mini_batch-huge", setting("virtual_workers.0.mini_batch", 10**13),
     ("virtual_workers[0].mini_batch", "10000000000000", "MAX_GLOBAL_BATCH")),
    ("micro_batches-zero", setting("virtual_workers.0.micro_batches", 0), ("virtual_workers[0].micro_batches", "0")),
    ("micro_batches-huge", setting("virtual_workers.0.micro_batches", 100_000_000),
     ("virtual_workers[0].micro_batches", "100000000", "MAX_MICRO_BATCHES")),
    ("micro_batches-null", setting("virtual_workers.0.micro_batches", None),
     ("virtual_workers[0].micro_batches", "None")),
    ("stages-string", setting("virtual_workers.0.stages", "all"), ("virtual_workers[0].stages", "'all'")),
    ("stages[0]-list", setting("virtual_workers.0.stages.0", []), ("virtual_workers[0].stages[0]", "[]")),
    ("layers-one", setting("virtual_workers.0.stages.0.layers", [0]),
     ("virtual_workers[0].stages[0].layers", "[0]")),
    ("layers-string-entry", setting("virtual_workers.0.stages.0.layers", ["a", 1]),
     ("virtual_workers[0].stages[0].layers[0]", "'a'")),
    ("layers-number", setting("virtual_workers.0.stages.0.layers", 5), ("virtual_workers[0].stages[0].layers", "5")),
    ("layers-huge", setting("virtual_workers.0.stages.0.layers", [0, 10**9]),
     ("virtual_workers[0].stages[0].layers[1]", "1000000000", "MAX_LAYERS")),
    ("device-number", setting("virtual_workers.0.stages.0.device", 3), ("virtual_workers[0].stages[0].device", "3")),
    ("device-unknown", setting("virtual_workers.0.stages.0.device", "zz:9"), ("plan.json", "'zz:9'")),
    ("recompute-string", setting("virtual_workers.0.stages.0.recompute", "all"),
     ("virtual_workers[0].stages[0].recompute", "'all'")),
    ("recompute-entry", setting("virtual_workers.0.stages.0.recompute", ["x"]),
     ("virtual_workers[0].stages[0].recompute[0]", "'x'")),
    ("predicted_forward_s", setting("virtual_workers.0.stages.0.predicted_forward_s", "slow"),
     ("virtual_workers[0].stages[0].predicted_forward_s", "'slow'")),
    ("format_version-1", setting("format_version", 1), ("plan.json", "format_version", "hetrain plan --from")),
    ("sync-string", setting("sync", "bsp"), ("plan.json", "sync", "'bsp'")),
    ("sync-missing", deleting("sync"), ("plan.json", "sync", "missing")),
    ("sync.mode-unknown", setting("sync.mode", "gossip"), ("plan.json", "sync mode", "'gossip'")),
    ("sync.mode-number", setting("sync.mode", 3), ("plan.json", "sync.mode", "3")),
    ("sync.options-list", setting("sync.options", []), ("plan.json", "sync.options", "[]")),
    ("sync.options.period-zero", setting("sync.options.period", 0), ("plan.json", "sync.options", "period", "0")),
    ("sync.options.staleness-word", setting("sync.options.staleness", "two"),
     ("plan.json", "sync.options.staleness", "'two'")),
    ("sync.options.placement", setting("sync.options.placement", "far"), ("plan.json", "placement", "'far'")),
    ("sync.options-unknown", setting("sync.options.lag", 2), ("plan.json", "sync.options", "'lag'")),
    ("sync.segments-owners-edited", setting("sync.segments.0.owners", ["x:0"]),
     ("plan.json", "sync.segments[0].owners", "hetrain plan --from")),
    ("sync.segments-empty", setting("sync.segments", []), ("plan.json", "sync has 0 segments")),
    ("sync.segments-string", setting("sync.segments", "all"), ("plan.json", "sync.segments", "'all'")),
    ("options-holds-a-sync-option", setting("options.period", 4), ("plan.json", "'period' is a sync option")),
    ("options-list", setting("options", []), ("plan.json", "options", "[]")),
    ("options-string", setting("options", "fast"), ("options", "'fast'")),
    ("model-number", setting("model", 5), ("plan.json", "model", "5")),
    ("strategy-list", setting("strategy", ["dp"]), ("strategy", "['dp']")),
    ("formation-object", setting("formation", {}), ("formation", "{}")),
    ("global_batch-string", setting("global_batch", "16"), ("global_batch", "'16'")),
    ("global_batch-huge", setting("global_batch", 10**13), ("global_batch", "10000000000000", "MAX_GLOBAL_BATCH")),
    ("global_batch-mismatch", setting("global_batch", 17), ("plan.json", "global batch is 17")),
    ("schedule-unknown", setting("schedule", "zigzag"), ("plan.json", "schedule", "'zigzag'")),
    ("optimizer-number", setting("optimizer", 3), ("plan.json", "optimizer", "3")),
    ("cluster-list", setting("cluster", []), ("plan.json", "cluster", "[]")),
    ("cluster-device-figure", setting("cluster.node.0.devices.0.peak_fp32_flops", "fast"),
     ("plan.json", "cluster:", "peak_fp32_flops", "'fast'")),
    ("cluster-count-huge", setting("cluster.node.0.devices.0.count", 10**8),
     ("plan.json", "cluster:", "100000000", "MAX_DEVICES")),
    ("profile-number", setting("profile", 3), ("plan.json", "profile", "3")),
    ("profile-layer-field", setting("profile.layers.0.param_bytes", "1MB"),
     ("plan.json", "profile:", "layers[0].param_bytes", "'1MB'")),
]
PLAN_CASE_NAMES = [c[0] for c in PLAN_CASES]


# the cases run in a real process (every other one) are slow: the in-process half is in the fast tier
@pytest.mark.parametrize("name, corrupt, needles", slow_where(PLAN_CASES, lambda k, _c: k % 2 == 0, ids=lambda c: c[0]))
def test_malformed_plan_is_one_line(name: str, corrupt: Callable[[Json], Json] | str, needles: tuple[str, ...],
                                    valid: dict[str, Json], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    if corrupt == "trunc":
        path.write_text(json.dumps(valid["plan"])[:200])
    elif isinstance(corrupt, str):
        path.write_bytes(RAW_FILES[corrupt])
    else:
        path.write_text(json.dumps(corrupt(copy.deepcopy(valid["plan"]))))
    if PLAN_CASE_NAMES.index(name) % 2 == 0:  # a real process (the cases marked slow)
        code, stderr, seconds = run_subprocess(["simulate", str(path)], tmp_path)
        assert seconds < HANG_LIMIT_S, f"{seconds:.1f} s to refuse"
    else:
        code, stderr = run_in_process(["simulate", str(path)], capsys)
    check_refused(code, stderr, needles)


def test_the_valid_plan_the_cases_start_from_simulates(valid: dict[str, Json], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(valid["plan"]))
    assert run_in_process(["simulate", str(path)], capsys)[0] == 0


# --- cluster TOML: `hetrain plan --cluster FILE`, in-process ---------------------------------------

NODE = '[[node]]\nname = "a"\nnic = "10gbe"\n'
CLUSTER_CASES: list[tuple[str, str | bytes, tuple[str, ...]]] = [
    ("empty-file", b"", ("c.toml", "empty")),
    ("binary-file", RAW_FILES["binary"], ("c.toml", "binary")),
    ("latin-1-file", RAW_FILES["latin-1"], ("c.toml", "UTF-8")),
    ("bad-toml", "[[node]\nname = 'a'\n", ("c.toml", "not valid TOML")),
    ("deep-array", "a = " + DEEP_JSON + "\n", ("c.toml", "nested too deeply")),
    ("deep-table", "a = " + "{b = " * 2000 + "1" + "}" * 2000 + "\n", ("c.toml", "nested too deeply")),
    ("count-huge", NODE + 'devices = [{type = "A100-40GB", count = 100000000}]\n',
     ("c.toml", "count", "100000000", "MAX_DEVICES")),
    ("count-sum-huge", NODE + 'devices = [{type = "cpu", count = 5000}, {type = "cpu", count = 5000}]\n',
     ("c.toml", "device #5000", "8192", "MAX_DEVICES")),
    ("count-string", NODE + 'devices = [{type = "cpu", count = "2"}]\n', ("c.toml", "count", "'2'")),
    ("count-float", NODE + 'devices = [{type = "cpu", count = 1.5}]\n', ("c.toml", "count", "1.5")),
    ("count-zero", NODE + 'devices = [{type = "cpu", count = 0}]\n', ("c.toml", "count", "0")),
    ("count-bool", NODE + 'devices = [{type = "cpu", count = true}]\n', ("c.toml", "count", "True")),
    ("type-number", NODE + "devices = [{type = 5}]\n", ("c.toml", "type", "5")),
    ("type-unknown", NODE + 'devices = ["A100-40G"]\n', ("c.toml", "device #0", "'A100-40G'")),
    ("devices-string", NODE + 'devices = "A100-40GB"\n', ("c.toml", "node 'a'", "devices", "'A100-40GB'")),
    ("devices-empty", NODE + "devices = []\n", ("c.toml", "node 'a'", "devices", "[]")),
    ("device-number", NODE + "devices = [3]\n", ("c.toml", "device #0", "3")),
    ("node-name-number", '[[node]]\nname = 3\ndevices = ["cpu"]\n', ("c.toml", "node #0", "name", "3")),
    ("cluster-name-list", 'name = []\n[[node]]\ndevices = ["cpu"]\n', ("c.toml", "name", "[]")),
    ("node-number", "node = 3\n", ("c.toml", "node", "3")),
    ("node-table", '[node]\nname = "a"\n', ("c.toml", "[[node]]")),
    ("nic-no-unit", '[[node]]\nname = "a"\nnic = 10\ndevices = ["cpu"]\n', ("c.toml", "nic", "10", "no unit")),
    ("nic-bool", '[[node]]\nname = "a"\nnic = true\ndevices = ["cpu"]\n', ("c.toml", "nic", "True")),
    ("nic-unknown", '[[node]]\nname = "a"\nnic = "fast"\ndevices = ["cpu"]\n', ("c.toml", "nic", "'fast'")),
    ("intra-negative", NODE + 'devices = ["cpu"]\nintra_link = {bandwidth = "-1Gbit/s"}\n',
     ("c.toml", "intra_link", "'-1Gbit/s'")),
    ("intra-nan", NODE + 'devices = ["cpu"]\nintra_link = {bandwidth_bytes_per_s = nan}\n',
     ("c.toml", "intra_link", "bandwidth_bytes_per_s", "nan")),
    ("nic-inf", '[[node]]\nname = "a"\ndevices = ["cpu"]\nnic = {bandwidth_bytes_per_s = inf}\n',
     ("c.toml", "nic", "bandwidth_bytes_per_s", "inf")),
    ("preset-number", '[[node]]\nname = "a"\ndevices = ["cpu"]\nnic = {preset = 5}\n', ("c.toml", "preset", "5")),
    ("tflops-string", NODE + 'devices = [{type = "X1", tflops = "fast", memory = "8GB", '
     'memory_bandwidth = "300GB/s"}]\n', ("c.toml", "tflops", "'fast'")),
    ("tflops-inf", NODE + 'devices = [{type = "X1", tflops = inf, memory = "8GB", memory_bandwidth = "300GB/s"}]\n',
     ("c.toml", "tflops", "inf")),
    ("memory-no-unit", NODE + 'devices = [{type = "cpu", memory = 16}]\n', ("c.toml", "memory", "16", "no unit")),
    ("memory-unreadable", NODE + 'devices = [{type = "cpu", memory = "sixteen GB"}]\n',
     ("c.toml", "memory", "'sixteen GB'")),
    ("cpu_share-huge", NODE + 'devices = [{type = "cpu", cpu_share = 100}]\n', ("c.toml", "cpu_share", "100")),
    ("link-one-node", NODE + 'devices = ["cpu"]\n[[link]]\nnodes = ["a"]\nbandwidth = "1Gbit/s"\n',
     ("c.toml", "link #0", "['a']")),
    ("link-node-numbers", NODE + 'devices = ["cpu"]\n[[link]]\nnodes = [1, 2]\nbandwidth = "1Gbit/s"\n',
     ("c.toml", "link #0", "[1, 2]")),
    ("link-number", 'link = 3\n' + NODE + 'devices = ["cpu"]\n', ("c.toml", "link", "3")),
    ("unknown-top-key", 'nodes = 3\n' + NODE + 'devices = ["cpu"]\n', ("c.toml", "'nodes'")),
    ("emulation-number", 'emulation = 3\n' + NODE + 'devices = ["cpu"]\n', ("c.toml", "emulation", "3")),
]


@pytest.mark.parametrize("name, text, needles", slow_where(CLUSTER_CASES, lambda _k, c: c[0].endswith("-huge"),
                                                           ids=lambda c: c[0]))  # real processes are slow
def test_malformed_cluster_is_one_line(name: str, text: str | bytes, needles: tuple[str, ...], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    argv = ["plan", "--cluster", str(path), "--model", "mlp", "--global-batch", "16"]
    if name.endswith("-huge"):  # these once hung: a real process under a timeout
        code, stderr, seconds = run_subprocess(argv, tmp_path)
        assert seconds < HANG_LIMIT_S, f"{seconds:.1f} s to refuse"
    else:
        code, stderr = run_in_process(argv, capsys)
    check_refused(code, stderr, needles)


# --- profile JSON: `hetrain plan --profile FILE`, in-process ---------------------------------------

PROFILE_CASES: list[tuple[str, Callable[[Json], Json] | str, tuple[str, ...]]] = [
    ("top-list", replacing([]), ("p.json", "JSON object", "[]")),
    ("top-null", replacing(None), ("p.json", "JSON object", "None")),
    ("top-number", replacing(3), ("p.json", "JSON object", "3")),
    ("empty-file", "empty", ("p.json", "empty")),
    ("binary-file", "binary", ("p.json", "binary")),
    ("deep-nesting", "deep-json", ("p.json", "nested too deeply")),
    ("layers-object", setting("layers", {}), ("p.json", "layers", "{}")),
    ("layers-empty", setting("layers", []), ("p.json", "layers", "at least 1")),
    ("layers-too-many", setting("layers", [{}] * 10_001), ("p.json", "layers", "10001", "10000")),
    ("layers[0]-number", setting("layers.0", 3), ("p.json", "layers[0]", "3")),
    ("param_bytes-string", setting("layers.1.param_bytes", "big"), ("p.json", "layers[1].param_bytes", "'big'")),
    ("param_bytes-negative", setting("layers.0.param_bytes", -1), ("p.json", "layers[0].param_bytes", "-1")),
    ("param_bytes-missing", deleting("layers.0.param_bytes"), ("p.json", "layers[0].param_bytes", "missing")),
    ("flops-nan", setting("layers.0.forward_flops_per_sample", float("nan")),
     ("p.json", "layers[0].forward_flops_per_sample", "nan")),
    ("measured-list", setting("layers.0.measured", []), ("p.json", "layers[0].measured", "[]")),
    ("measured-entry", setting("layers.0.measured", {"cpu": [{"micro_batch": "1", "forward_s": 0.1,
                                                               "backward_s": 0.2}]}),
     ("p.json", "layers[0].measured['cpu'][0].micro_batch", "'1'")),
    ("measured-not-list", setting("layers.0.measured", {"cpu": 3}), ("p.json", "layers[0].measured['cpu']", "3")),
    ("precision-unknown", setting("precision", "fp8"), ("p.json", "precision", "'fp8'")),
    ("precision-number", setting("precision", 16), ("p.json", "precision", "16")),
    ("compute_efficiency-big", setting("compute_efficiency", 2), ("p.json", "compute_efficiency", "2")),
    ("compute_efficiency-string", setting("compute_efficiency", "high"), ("p.json", "compute_efficiency", "'high'")),
    ("input_bytes-null", setting("input_bytes_per_sample", None), ("p.json", "input_bytes_per_sample", "None")),
    ("format_version-string", setting("format_version", "1"), ("p.json", "format_version", "'1'")),
    ("name-number", setting("name", 7), ("p.json", "name", "7")),
    ("measured_on-list", setting("measured_on", []), ("p.json", "measured_on", "[]")),
    ("action_overhead-string", setting("action_overhead_s", {"cpu": "fast"}),
     ("p.json", "action_overhead_s['cpu']", "'fast'")),
    ("iteration_overhead-negative", setting("iteration_overhead_s", {"cpu": -0.5}),
     ("p.json", "iteration_overhead_s['cpu']", "-0.5")),
    ("iteration_overhead-list", setting("iteration_overhead_s", [1]), ("p.json", "iteration_overhead_s", "[1]")),
    ("optimizer_rates-number", setting("optimizer_step_s_per_byte", {"cpu": 3}),
     ("p.json", "optimizer_step_s_per_byte['cpu']", "3")),
    ("split_points-string", setting("split_points", "model.layers.1"), ("p.json", "split_points", "'model.layers.1'")),
    ("split_points-empty-name", setting("split_points", ["model.layers.1", ""]), ("p.json", "split_points", "''")),
    # a hand edit's typo, which the reader had dropped without a word
    ("unknown-top-level-key", setting("compute_eficiency", 0.3),
     ("p.json", "unknown key 'compute_eficiency'", "0.3", "did you mean 'compute_efficiency'")),
    ("unknown-layer-key", setting("layers.1.param_byte", 5), ("p.json", "layers[1]", "'param_byte'", "'param_bytes'")),
    ("unknown-measurement-key", setting("layers.0.measured", {"cpu": [{"micro_batch": 1, "forward_s": 0.1,
                                                                        "backward_s": 0.2, "fwd_spread_s": 0.0}]}),
     ("p.json", "layers[0].measured['cpu'][0]", "'fwd_spread_s'")),
]


@pytest.mark.parametrize("name, corrupt, needles", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_malformed_profile_is_one_line(name: str, corrupt: Callable[[Json], Json] | str, needles: tuple[str, ...],
                                       valid: dict[str, Json], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    if isinstance(corrupt, str):
        path.write_bytes(RAW_FILES[corrupt])
    else:
        path.write_text(json.dumps(corrupt(copy.deepcopy(valid["profile"]))))
    code, stderr = run_in_process(["plan", "--cluster", str(CLUSTER), "--profile", str(path),
                                   "--global-batch", "16"], capsys)
    check_refused(code, stderr, needles)


# --- command-line arguments ------------------------------------------------------------------------

@pytest.fixture()
def files(valid: dict[str, Json], tmp_path: Path) -> dict[str, str]:
    """A valid plan, a file, and paths that cannot be written, for the argument cases."""
    (tmp_path / "plan.json").write_text(json.dumps(valid["plan"]))
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "binary.json").write_bytes(RAW_FILES["binary"])
    (tmp_path / "deep.json").write_text(DEEP_JSON)
    (tmp_path / "bad-step.jsonl").write_text('{"step": 1, "step_time_s": "fast"}\n')
    (tmp_path / "models.py").write_text(USER_MODULE)
    (tmp_path / "broken.py").write_text("import no_such_package_here\n")
    (tmp_path / "hf-empty").mkdir()
    write_hf_mismatch(tmp_path / "hf-bad")
    wsp = copy.deepcopy(valid["plan"])
    wsp["sync"]["mode"] = "wsp"
    (tmp_path / "wsp-plan.json").write_text(json.dumps(wsp))
    return {"plan": str(tmp_path / "plan.json"), "dir": str(tmp_path), "missing_dir": str(tmp_path / "no" / "x.json"),
            "under_file": str(tmp_path / "a-file" / "x.json"), "out": str(tmp_path / "out.json"),
            "metrics": str(tmp_path / "metrics.jsonl"), "list": str(tmp_path / "list.json"),
            "missing": str(tmp_path / "missing.json"), "binary": str(tmp_path / "binary.json"),
            "deep": str(tmp_path / "deep.json"), "bad_step": str(tmp_path / "bad-step.jsonl"),
            "models": str(tmp_path / "models.py"), "broken": str(tmp_path / "broken.py"),
            "wsp_plan": str(tmp_path / "wsp-plan.json"), "hf_empty": str(tmp_path / "hf-empty"),
            "hf_bad": str(tmp_path / "hf-bad")}


def write_hf_mismatch(path: Path) -> None:
    """A transformers GPT-2 directory whose model.safetensors holds a 16-wide wte for a 32-wide config."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "vocab_size": 100, "n_positions": 16, "bos_token_id": 0,
                                                  "eos_token_id": 0}))
    # safetensors by hand: an 8-byte little-endian header length, the JSON header, the raw float32 data
    header = json.dumps({"transformer.wte.weight": {"dtype": "F32", "shape": [100, 16],
                                                    "data_offsets": [0, 100 * 16 * 4]}}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(100 * 16 * 4))


# a user's module, as `--model FILE.py:FUNCTION` and `--data FILE.py:FUNCTION` load it
USER_MODULE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.conv(x) + x)


def residual():
    return Net()


def mixed():
    return [nn.Linear(4, 4), "relu"]


def number():
    return 3


def boom():
    raise RuntimeError("out of cheese")


def tied():
    a = nn.Linear(4, 4)
    return [a, nn.ReLU(), a]


def good():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def triples():
    return [(torch.zeros(4), 0, 1)] * 8


def wide():
    return torch.utils.data.TensorDataset(torch.zeros(8, 5), torch.zeros(8, dtype=torch.long))


setting = 3
"""


PLAN = ["plan", "--cluster", str(CLUSTER), "--model", "mlp"]
ARG_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("plan-global-batch-huge", [*PLAN, "--global-batch", "10000000000000"],
     ("--global-batch", "10000000000000", "MAX_GLOBAL_BATCH")),
    ("plan-global-batch-zero", [*PLAN, "--global-batch", "0"], ("--global-batch", "0")),
    ("plan-global-batch-word", [*PLAN, "--global-batch", "many"], ("--global-batch", "'many'")),
    ("plan-micro-batch-zero", [*PLAN, "--global-batch", "16", "--micro-batch", "0,1"], ("--micro-batch", "'0,1'")),
    ("plan-micro-batch-huge", [*PLAN, "--global-batch", "16", "--micro-batch", "99999999999"],
     ("--micro-batch", "99999999999", "MAX_MICRO_BATCH")),
    ("plan-target-samples-nan", [*PLAN, "--global-batch", "16", "--target-samples", "nan"],
     ("--target-samples", "'nan'")),
    ("plan-critical-batch-negative", [*PLAN, "--global-batch", "16", "--critical-batch", "-5"],
     ("--critical-batch", "'-5'")),
    ("plan-staleness-inf", [*PLAN, "--global-batch", "16", "--staleness-penalty", "inf"],
     ("--staleness-penalty", "'inf'")),
    ("plan-output-directory", [*PLAN, "--global-batch", "16", "-o", "{dir}"], ("-o", "{dir}", "directory")),
    ("plan-output-missing-dir", [*PLAN, "--global-batch", "16", "-o", "{missing_dir}"],
     ("-o", "{missing_dir}", "does not exist")),
    ("plan-output-under-file", [*PLAN, "--global-batch", "16", "-o", "{under_file}"],
     ("-o", "{under_file}", "not a directory")),
    ("plan-unknown-model", ["plan", "--cluster", str(CLUSTER), "--model", "gpt9", "--global-batch", "16"],
     ("'gpt9'",)),
    ("plan-missing-profile", ["plan", "--cluster", str(CLUSTER), "--profile", "{missing}", "--global-batch", "16"],
     ("{missing}", "cannot read")),
    ("plan-cluster-directory", ["plan", "--cluster", "{dir}", "--model", "mlp", "--global-batch", "16"],
     ("{dir}", "directory")),
    ("plan-cluster-missing", ["plan", "--cluster", "{missing}", "--model", "mlp", "--global-batch", "16"],
     ("{missing}", "cannot read")),
    ("simulate-missing-plan", ["simulate", "{missing}"], ("{missing}", "cannot read")),
    ("simulate-plan-directory", ["simulate", "{dir}"], ("{dir}", "directory")),
    ("simulate-trace-directory", ["simulate", "{plan}", "--trace", "{dir}"], ("--trace", "{dir}", "directory")),
    ("simulate-gantt-missing-dir", ["simulate", "{plan}", "--gantt", "{missing_dir}"],
     ("--gantt", "{missing_dir}", "does not exist")),
    ("simulate-timeline-under-file", ["simulate", "{plan}", "--timeline", "{under_file}"],
     ("--timeline", "{under_file}", "not a directory")),
    ("profile-output-directory", ["profile", "--model", "mlp", "-o", "{dir}"], ("-o", "{dir}", "directory")),
    ("profile-output-missing-dir", ["profile", "--model", "mlp", "-o", "{missing_dir}"],
     ("-o", "{missing_dir}", "does not exist")),
    ("profile-repeats-zero", ["profile", "--model", "mlp", "--repeats", "0"], ("--repeats", "0")),
    ("profile-repeats-huge", ["profile", "--model", "mlp", "--repeats", "1000000000"],
     ("--repeats", "1000000000", "MAX_REPEATS")),
    ("profile-micro-batch-word", ["profile", "--model", "mlp", "--micro-batch", "big"], ("--micro-batch", "'big'")),
    ("plan-user-model", [*PLAN, "--model", "{models}:good", "--global-batch", "16"],
     ("{models}:good", "profile it first", "hetrain profile --model {models}:good", "--profile profile.json")),
    ("profile-hf-missing-dir", ["profile", "--model", "hf:{dir}/nowhere"], ("{dir}/nowhere", "does not exist")),
    ("profile-hf-no-config", ["profile", "--model", "hf:{hf_empty}"], ("{hf_empty}/config.json", "is missing")),
    ("profile-hf-weights-mismatch", ["profile", "--model", "hf:{hf_bad}"],
     ("{hf_bad}/model.safetensors", "transformer.wte.weight", "(100, 16)", "(100, 32)", "do not match")),
    ("profile-user-missing-file", ["profile", "--model", "{dir}/nowhere.py:build"],
     ("{dir}/nowhere.py:build", "does not exist")),
    ("profile-user-no-module", ["profile", "--model", "no_such_module_here:build"],
     ("no_such_module_here:build", "no module named 'no_such_module_here'")),
    ("profile-user-import-fails", ["profile", "--model", "{broken}:build"],
     ("{broken}:build", "importing", "ModuleNotFoundError", "no_such_package_here")),
    ("profile-user-no-function", ["profile", "--model", "{models}:buld"],
     ("{models}:buld", "no function 'buld'", "good")),
    ("profile-user-not-callable", ["profile", "--model", "{models}:setting"], ("setting", "int", "not a function")),
    ("profile-user-no-colon-name", ["profile", "--model", "{models}:"], ("MODULE:FUNCTION",)),
    ("profile-user-raises", ["profile", "--model", "{models}:boom"],
     ("model function {models}:boom", "RuntimeError", "out of cheese")),
    ("profile-user-not-a-model", ["profile", "--model", "{models}:number"],
     ("{models}:number", "returned a int", "not a model", "nn.Sequential or a list of layers")),
    ("profile-user-uncuttable", ["profile", "--model", "{models}:residual"],
     ("{models}:residual", "its model is a module whose own forward hetrain traces to cut it",
      "define example_input() in {models}", "one micro-batch of its input")),
    ("profile-user-list-item", ["profile", "--model", "{models}:mixed"], ("item 1", "str", "not an nn.Module")),
    ("profile-user-shared-layer", ["profile", "--model", "{models}:tied"], ("same module", "layers 0 and 2")),
    ("profile-user-without-data", ["profile", "--model", "{models}:good", "-o", "{out}"],
     ("{models}:good", "is your own", "--data MODULE:FUNCTION")),
    ("profile-user-data-not-pairs", ["profile", "--model", "{models}:good", "--data", "{models}:triples",
                                     "-o", "{out}"],
     ("{models}:triples", "sample 0", "tuple of 3 items", "(input, target) pair")),
    ("profile-user-data-wrong-shape", ["profile", "--model", "{models}:good", "--data", "{models}:wide",
                                       "-o", "{out}"],
     ("model {models}:good on data {models}:wide", "layer 0 (linear0)", "(2, 5) float32", "2x5 and 4x4")),
    ("calibrate-output-directory", ["calibrate", "{plan}", "{metrics}", "-o", "{dir}"], ("-o", "{dir}", "directory")),
    ("calibrate-warmup-negative", ["calibrate", "{plan}", "{metrics}", "--warmup", "-1"], ("--warmup", "-1")),
    ("calibrate-plan-list", ["calibrate", "{list}", "{metrics}"], ("{list}", "JSON object", "[]")),
    ("calibrate-plan-missing", ["calibrate", "{missing}", "{metrics}"], ("{missing}", "cannot read")),
    ("calibrate-metrics-deep", ["calibrate", "{plan}", "{deep}"], ("{deep}:1", "nested too deeply")),
    ("calibrate-metrics-step-string", ["calibrate", "{plan}", "{bad_step}"], ("{bad_step}:1", "step_time_s", "'fast'")),
    ("compare-gantt-directory", ["compare", "{plan}", "{plan}", "--gantt", "{dir}"], ("--gantt", "{dir}")),
    ("compare-binary", ["compare", "{binary}", "{binary}"], ("{binary}", "binary")),
    ("compare-deep", ["compare", "{deep}", "{deep}"], ("{deep}", "nested too deeply")),
    ("compare-list", ["compare", "{list}", "{list}"], ("{list}", "JSON object", "[]")),
    ("compare-missing", ["compare", "{missing}", "{missing}"], ("{missing}", "cannot read")),
]
NEEDS_TRANSFORMERS = {"profile-hf-weights-mismatch", "hf-model-weights-mismatch"}  # read by transformers
# The cases that hung or imported torch before refusing: run as real subprocesses.
SUBPROCESS_ARGS = {"plan-global-batch-huge", "plan-output-directory", "simulate-trace-directory",
                   "profile-output-directory", "profile-repeats-huge", "plan-cluster-directory"}


@pytest.mark.parametrize("name, argv, needles", slow_where(  # a real process or a traced transformers model: slow
    ARG_CASES, lambda _k, c: c[0] in SUBPROCESS_ARGS | NEEDS_TRANSFORMERS, ids=lambda c: c[0]))
def test_bad_argument_is_one_line(name: str, argv: list[str], needles: tuple[str, ...], files: dict[str, str],
                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**files) for a in argv]
    needles = tuple(n.format(**files) for n in needles)
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    if name in SUBPROCESS_ARGS:
        code, stderr, seconds = run_subprocess(argv, tmp_path)
        assert seconds < HANG_LIMIT_S, f"{seconds:.1f} s to refuse"
    else:
        code, stderr = run_in_process(argv, capsys)
    check_refused(code, stderr, needles)


# --- `hetrain train`: refused before any process group -----------------------------------------------

TRAIN_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("steps-negative", ["--steps", "-1"], ("--steps", "-1")),
    ("steps-huge", ["--steps", "1000000000000"], ("--steps", "1000000000000", "MAX_STEPS")),
    ("timeout-zero", ["--timeout-s", "0"], ("--timeout-s", "'0'")),
    ("timeout-nan", ["--timeout-s", "nan"], ("--timeout-s", "'nan'")),
    ("lr-negative", ["--lr", "-1"], ("--lr", "'-1'")),
    ("lr-nan", ["--lr", "nan"], ("--lr", "'nan'")),
    ("lr-schedule-unknown", ["--lr-schedule", "step"], ("--lr-schedule", "'step'", "cosine")),
    ("warmup-steps-negative", ["--warmup-steps", "-3"], ("--warmup-steps", "-3")),
    ("min-lr-negative", ["--min-lr", "-0.1"], ("--min-lr", "'-0.1'")),
    ("min-lr-above-lr", ["--lr", "0.01", "--min-lr", "0.1"], ("minimum learning rate", "0.01", "0.1")),
    ("min-lr-above-default-lr", ["--min-lr", "1"], ("minimum learning rate", "0.001", "1")),
    ("clip-zero", ["--clip-grad-norm", "0"], ("--clip-grad-norm", "'0'")),
    ("clip-inf", ["--clip-grad-norm", "inf"], ("--clip-grad-norm", "'inf'")),
    ("clip-with-wsp", ["--plan", "{wsp_plan}", "--clip-grad-norm", "1"], ("clipping", "bsp", "'wsp'")),
    ("log-every-zero", ["--log-every", "0"], ("--log-every", "0")),
    ("checkpoint-every-negative", ["--checkpoint-every", "-1"], ("--checkpoint-every", "-1")),
    ("eval-batches-zero", ["--eval-batches", "0"], ("--eval-batches", "0")),
    ("set-without-value", ["--set", "n_blocks"], ("KEY=VALUE", "'n_blocks'")),
    ("sync-option-gone", ["--sync-option", "lag=2"], ("unrecognized arguments", "--sync-option")),
    ("optimizer-gone", ["--optimizer", "sgd"], ("unrecognized arguments", "--optimizer")),
    ("user-model-uncuttable", ["--model", "{models}:residual"], ("{models}:residual", "define example_input()")),
    ("user-model-raises", ["--model", "{models}:boom"], ("{models}:boom", "RuntimeError", "out of cheese")),
    ("user-model-with-set", ["--model", "{models}:good", "--set", "hidden=3"], ("--set hidden", "reference models")),
    ("user-model-without-data", ["--model", "{models}:good"], ("{models}:good", "no --data", "MODULE:FUNCTION")),
    ("user-model-synthetic-data", ["--model", "{models}:good", "--data", "synthetic"],
     ("--data synthetic", "reference models", "MODULE:FUNCTION")),
    ("hf-model-no-config", ["--model", "hf:{hf_empty}"], ("{hf_empty}/config.json", "is missing")),
    ("hf-model-weights-mismatch", ["--model", "hf:{hf_bad}"],
     ("{hf_bad}/model.safetensors", "transformer.wte.weight", "(100, 16)", "do not match")),
    ("user-data-missing-function", ["--data", "{models}:nothing"], ("{models}:nothing", "no function 'nothing'")),
    ("user-data-not-a-dataset", ["--model", "{models}:good", "--data", "{models}:number"],
     ("data function {models}:number", "int", "not a data set")),
    ("user-data-wrong-shape", ["--model", "{models}:good", "--data", "{models}:wide"],
     ("layer 0 (linear0)", "(2, 5) float32", "mat1 and mat2")),
    ("plan-missing", ["--plan", "{missing}"], ("{missing}", "cannot read")),
    ("plan-list", ["--plan", "{list}"], ("{list}", "JSON object", "[]")),
    ("plan-directory", ["--plan", "{dir}"], ("{dir}", "directory")),
    ("metrics-out-directory", ["--metrics-out", "{dir}"], ("--metrics-out", "{dir}", "directory")),
    ("timeline-out-directory", ["--timeline-out", "{dir}"], ("--timeline-out", "{dir}", "directory")),
    ("checkpoint-dir-file", ["--checkpoint-dir", "{metrics}"], ("--checkpoint-dir", "{metrics}", "is a file")),
]


@pytest.mark.parametrize("name, extra, needles", slow_where(  # a traced transformers model: slow
    TRAIN_CASES, lambda _k, c: c[0] in NEEDS_TRANSFORMERS, ids=lambda c: c[0]))
def test_bad_train_argument_is_one_line(name: str, extra: list[str], needles: tuple[str, ...],
                                        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    argv = ["train", "--plan", files["plan"], "--model", "mlp-digits", "--no-progress",
            *[a.format(**files) for a in extra]]
    code, stderr = run_in_process(argv, capsys)
    check_refused(code, stderr, tuple(n.format(**files) for n in needles))


@pytest.mark.slow  # starts hetrain train
def test_bad_train_plan_is_refused_by_a_real_process(files: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    code, stderr, _ = run_subprocess(["train", "--plan", files["list"], "--model", "mlp-digits"], tmp_path)
    check_refused(code, stderr, (files["list"], "JSON object"))


# --- `hetrain train`: token and text data, and the config file ------------------------------------------

@pytest.fixture()
def token_files(files: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """``files`` and token files, a text, and train.toml files, for the data and config cases."""
    import numpy as np

    def tokens(name: str, ids: Any) -> str:
        np.asarray(ids, dtype="<u2").tofile(tmp_path / name)
        return str(tmp_path / name)

    out = dict(files)
    out.update(good_bin=tokens("good.bin", np.arange(64 * 40) % 96), short_bin=tokens("short.bin", range(10)),
               vocab_bin=tokens("vocab.bin", np.arange(64 * 40) % 200),
               few_bin=tokens("few.bin", np.arange(64 * 6) % 96),
               missing_bin=str(tmp_path / "missing.bin"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    out["odd_bin"] = str(tmp_path / "odd.bin")
    (tmp_path / "words.txt").write_text("to be or not to be " * 200)
    out["words"] = str(tmp_path / "words.txt")
    for name, text in {"unknown": 'stepz = 3\n', "type": 'steps = "many"\n', "negative": "lr = -1\n",
                       "bool": "plan = true\n", "choice": 'lr_schedule = "step"\n', "flag": 'progress = "yes"\n',
                       "broken": "steps = \n"}.items():
        (tmp_path / f"{name}.toml").write_text(text)
        out[f"{name}_toml"] = str(tmp_path / f"{name}.toml")
    return out


DATA_CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("tokens-missing", ["--data", "tokens:{missing_bin}"], ("{missing_bin}", "no such file")),
    ("tokens-odd-size", ["--data", "tokens:{odd_bin}"], ("{odd_bin}", "3 bytes", "multiple of 2")),
    ("tokens-shorter-than-a-window", ["--data", "tokens:{short_bin}"], ("{short_bin}", "10 tokens", "seq_len 64")),
    ("tokens-beyond-vocab", ["--data", "tokens:{vocab_bin}"], ("{vocab_bin}", "token id 199", "vocabulary of 96")),
    ("tokens-fewer-than-a-batch", ["--data", "tokens:{few_bin}"],
     ("tokens:{few_bin}", "5 training sample(s)", "global batch of 16")),
    ("tokens-too-few-to-evaluate", ["--data", "tokens:{good_bin}", "--eval-every", "5"],
     ("tokens:{good_bin}", "3 validation sample(s)", "--eval-batches 8", "= 128")),
    ("tokens-seq-len-too-long", ["--data", "tokens:{good_bin}", "--seq-len", "65"], ("--seq-len 65", "seq_len 64")),
    ("tokens-not-a-gpt", ["--model", "mlp-digits", "--data", "tokens:{good_bin}"], ("token data", "GPT", "mlp")),
    ("tokens-own-model-without-seq-len", ["--model", "{models}:good", "--data", "tokens:{good_bin}"],
     ("{models}:good", "--seq-len")),
    ("val-data-missing", ["--data", "tokens:{good_bin}", "--val-data", "tokens:{missing_bin}"],
     ("{missing_bin}", "no such file")),
    ("val-data-without-tokens", ["--val-data", "tokens:{good_bin}"], ("--val-data", "tokens:FILE.bin")),
    ("text-bytes-beyond-vocab", ["--data", "text:{words}"], ("{words}", "token id 116", "vocabulary of 96")),
    ("text-missing", ["--data", "text:{missing}"], ("{missing}", "no such file")),
    ("tokenizer-missing", ["--data", "text:{words}", "--tokenizer", "{missing}"], ("--tokenizer", "{missing}")),
    ("tokenizer-not-json", ["--data", "text:{words}", "--tokenizer", "{words}"], ("--tokenizer {words}",
                                                                                   "not a tokenizer.json")),
    ("config-missing", ["--config", "{missing}"], ("--config {missing}", "cannot read")),
    ("config-not-toml", ["--config", "{broken_toml}"], ("--config {broken_toml}", "not a TOML file")),
    ("config-unknown-key", ["--config", "{unknown_toml}"], ("{unknown_toml}", "unknown key 'stepz'", "3")),
    ("config-wrong-type", ["--config", "{type_toml}"], ("{type_toml}", "steps", '"many"')),
    ("config-refused-value", ["--config", "{negative_toml}"], ("{negative_toml}", "lr = -1")),
    ("config-bool-for-a-path", ["--config", "{bool_toml}"], ("{bool_toml}", "plan = true", "string")),
    ("config-bad-choice", ["--config", "{choice_toml}"], ("{choice_toml}", "lr_schedule", '"step"', "cosine")),
    ("config-flag-not-bool", ["--config", "{flag_toml}"], ("{flag_toml}", "progress", "true or false")),
]


@pytest.mark.parametrize("name, extra, needles", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_train_data_or_config_is_one_line(name: str, extra: list[str], needles: tuple[str, ...],
                                              token_files: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    argv = ["train", "--plan", token_files["plan"], "--model", "gpt-tiny", "--no-progress",
            *[a.format(**token_files) for a in extra]]
    code, stderr = run_in_process(argv, capsys)
    check_refused(code, stderr, tuple(n.format(**token_files) for n in needles))

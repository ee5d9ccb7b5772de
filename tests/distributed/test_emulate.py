"""``hetrain emulate``: settings, the network and cgroup plans (pure), then real emulated clusters.

The tests that build namespaces and cgroups skip with the reason where that is not
possible (not root, no iproute2, no veth/bridge/htb). Every run they make has a
known run id and is removed by a fixture finalizer, whatever happens; each test
then checks that nothing of its run is left.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hetrain.cluster import load_cluster, parse_cluster
from hetrain.emulate import cgroups, cli, keepawake, network, rankwrap
from hetrain.emulate.cgroups import CgroupRoot, estimate_quota, find_cpu_cgroups
from hetrain.emulate.emulator import STATE_DIR, EmulatedCluster, assign_cpus, check_permissions, list_runs, remove_run
from hetrain.emulate.events import late_nodes
from hetrain.emulate.launch import UNSHARED_STORE_ENV, build_node_env, build_torchrun_command
from hetrain.emulate.rankwrap import CGROUPS_ENV, COMM_ENV, CPUS_ENV
from hetrain.emulate.rootless import probe_user_namespaces
from hetrain.emulate.settings import EmulationError, EmulationSettings, parse_emulation_settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TWO_NODES = """
name = "two"
[[node]]
name = "fast"
devices = [{ type = "cpu", cpu_share = 1.0 }, { type = "cpu", cpu_share = 0.5 }]
intra_link = "loopback"
nic = "1Gbit/s"

[[node]]
name = "slow"
devices = [{ type = "cpu", cpu_share = 0.5 }]
intra_link = "loopback"
nic = "200Mbit/s"
"""

THREE_NODES = """
name = "three"
[[node]]
name = "a"
devices = ["cpu"]
nic = "400Mbit/s"

[[node]]
name = "b"
devices = ["cpu"]
nic = "200Mbit/s"

[[node]]
name = "c"
devices = ["cpu"]
nic = "400Mbit/s"

[[link]]
nodes = ["a", "c"]
bandwidth = "100Mbit/s"

[emulation]
cpu_period = "20ms"
"""


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------
# pure: no root needed
# ---------------------------------------------------------------------------


def test_settings_from_the_emulation_table() -> None:
    s = parse_emulation_settings({"cpu_period": "20ms", "cpu_scale": 0.5, "throttle": "cgroup",
                                  "shape_intra": True, "rdzv_port": 29555, "join_timeout": "30s"})
    assert (s.cpu_period_s, s.cpu_scale, s.throttle, s.shape, s.shape_intra, s.rdzv_port, s.join_timeout_s) == (
        0.02, 0.5, "cgroup", True, True, 29555, 30.0)
    assert parse_emulation_settings(None) == EmulationSettings()
    assert parse_emulation_settings({"pin_cpus": False}).pin_cpus is False and EmulationSettings().pin_cpus
    assert parse_emulation_settings({"fill_idle": False}).fill_idle is False and EmulationSettings().fill_idle
    with pytest.raises(EmulationError, match="fill_idle must be true or false, got 'no'"):
        parse_emulation_settings({"fill_idle": "no"})
    off = parse_emulation_settings({"isolate_comm": False, "keep_awake": False})
    assert off.isolate_comm is False and EmulationSettings().isolate_comm
    assert off.keep_awake is False and EmulationSettings().keep_awake
    assert EmulationSettings.from_dict(off.to_dict()) == off
    assert EmulationSettings.from_dict(s.to_dict()) == s
    assert s.with_overrides(cpu_scale=None, shape=False).shape is False
    for bad, words in (({"cpu_period": "0.1ms"}, "between 1ms and 1s"), ({"cpu_scale": 0}, "cpu_scale"),
                       ({"throttle": "yes"}, "auto, cgroup, off"), ({"period": "1ms"}, "unknown keys ['period']"),
                       ({"cpu_period": 10}, "has no unit"), ({"shape": "no"}, "true or false")):
        with pytest.raises(EmulationError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_emulation_settings(bad)


def test_the_cluster_file_accepts_the_emulation_table(tmp_path: Path) -> None:
    path = write(tmp_path / "three.toml", THREE_NODES)
    assert load_cluster(path).num_devices == 3
    assert cli.load_settings(path, cpu_scale=0.5).cpu_period_s == 0.02


def test_network_plan_addresses_namespaces_and_shaping() -> None:
    cluster = parse_cluster(tomllib.loads(THREE_NODES))
    plan = network.build_network_plan(cluster, EmulationSettings(), "00beef")
    assert plan.hub == "hetrain-emu-00beef-hub"
    assert [n.namespace for n in plan.nodes] == ["hetrain-emu-00beef-0-a", "hetrain-emu-00beef-1-b",
                                                 "hetrain-emu-00beef-2-c"]
    assert [n.address for n in plan.nodes] == ["10.213.0.100", "10.213.0.101", "10.213.0.102"]
    assert sorted(network.node_address(k) for k in range(150)) == [network.node_address(k) for k in range(150)]
    assert plan.nodes[0].link_bytes_per_s == {"c": 12.5e6}
    text = [" ".join(c) for c in plan.commands]
    # a's NIC (egress in its namespace): default class at 400 Mbit/s, the [[link]] to c in its own class
    assert "tc -n hetrain-emu-00beef-0-a class add dev nic parent 1: classid 1:1 htb rate 400000000bit" in \
        " | ".join(text)
    assert any(t.startswith("tc -n hetrain-emu-00beef-0-a class add dev nic parent 1: classid 1:a htb "
                            "rate 100000000bit") for t in text)
    assert ("tc -n hetrain-emu-00beef-0-a filter add dev nic parent 1: protocol ip prio 1 u32 match ip dst "
            "10.213.0.102/32 flowid 1:a") in text
    # into c (egress of its hub port): the [[link]] from a picked by source address
    assert ("tc -n hetrain-emu-00beef-hub filter add dev v2 parent 1: protocol ip prio 1 u32 match ip src "
            "10.213.0.100/32 flowid 1:a") in text
    assert not any("netem" in t or "lo root" in t for t in text)
    assert network.run_id_of("hetrain-emu-00beef-2-c") == "00beef" and network.run_id_of("hetrain-x-a") is None
    unshaped = network.build_network_plan(cluster, EmulationSettings(shape=False, shape_intra=True), "00beef")
    assert not any(c[3] in ("qdisc", "class") and c[5] == "nic" for c in unshaped.commands if c[0] == "tc")
    assert sum("lo" in c and "tbf" in c for c in unshaped.commands) == 3
    with pytest.raises(EmulationError, match="6 hex digits"):
        network.build_network_plan(cluster, EmulationSettings(), "../x")


def test_cpu_quota_is_share_times_period() -> None:
    assert estimate_quota(1.0, 0.01) == (10000, 10000)
    assert estimate_quota(0.4, 0.01) == (4000, 10000)
    assert estimate_quota(2.0, 0.01) == (20000, 10000)   # two cores
    assert estimate_quota(0.05, 0.01) == (1000, 20000)   # the kernel's 1 ms minimum quota: longer period


def _fake_v2(tmp_path: Path) -> Path:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("memory\n")
    return root


def test_cgroup_detection_v1_then_v2_then_none(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu"
    v1.mkdir()
    v2 = _fake_v2(tmp_path)
    both = (f"cgroup2 {v2} cgroup2 rw,nosuid 0 0\n"
            f"cgroup {v1} cgroup rw,nosuid,cpu 0 0\n")
    assert find_cpu_cgroups(both) == (CgroupRoot(1, v1), "")
    assert find_cpu_cgroups(f"cgroup2 {v2} cgroup2 rw 0 0\n") == (CgroupRoot(2, v2), "")
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    root, why = find_cpu_cgroups(f"cgroup2 {v2} cgroup2 rw 0 0\n")
    assert root is None and "offers no cpu controller (it has: memory pids)" in why
    assert find_cpu_cgroups("proc /proc proc rw 0 0\n") == (None, "no cgroup hierarchy with a cpu controller is "
                                                                     "mounted")


def test_cgroup_files_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu"
    v1.mkdir()
    procs = cgroups.create_device_cgroup(CgroupRoot(1, v1), "00beef", "1-slow-0", 0.4, 0.01)
    assert procs == v1 / "hetrain-emu-00beef" / "1-slow-0" / "cgroup.procs"
    assert (procs.parent / "cpu.cfs_period_us").read_text() == "10000"
    assert (procs.parent / "cpu.cfs_quota_us").read_text() == "4000"
    assert (procs.parent.parent / "cpu.shares").read_text() == "10240"
    v2 = _fake_v2(tmp_path)
    procs = cgroups.create_device_cgroup(CgroupRoot(2, v2), "00beef", "0-fast-1", 0.5, 0.02)
    assert (procs.parent / "cpu.max").read_text() == "10000 20000"
    assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"               # the kernel would append it
    assert (v2 / "hetrain-emu-00beef" / "cgroup.subtree_control").read_text() == "+cpu"
    assert (v2 / "hetrain-emu-00beef" / "cpu.weight").read_text() == "1000"
    assert set(cgroups.list_run_dirs([CgroupRoot(1, v1), CgroupRoot(2, v2)])) == {"00beef"}


def test_the_comm_cgroup_has_its_weight_and_no_quota(tmp_path: Path) -> None:
    """comm_weight = 2: isolate_comm's threads use what the devices' quotas leave, in one child of the smallest
    weight against 1024 for each device's cgroup, instead of each thread weighing 1024 in the run's cgroup."""
    assert parse_emulation_settings({"comm_weight": 2}).comm_weight == 2
    assert EmulationSettings().comm_weight is None  # the default: the run's cgroup, as before
    assert EmulationSettings.from_dict(EmulationSettings(comm_weight=64).to_dict()).comm_weight == 64
    for bad in (1, 300000, "2", True):
        with pytest.raises(EmulationError, match="comm_weight must be an integer"):
            parse_emulation_settings({"comm_weight": bad})
    v1 = tmp_path / "cpu"
    v1.mkdir()
    cgroups.create_device_cgroup(CgroupRoot(1, v1), "00beef", "1-slow-0", 0.2, 0.01)
    tasks = cgroups.create_comm_cgroup(CgroupRoot(1, v1), "00beef", 2)
    assert tasks == v1 / "hetrain-emu-00beef" / "comm" / "tasks"
    assert (tasks.parent / "cpu.shares").read_text() == "2"
    assert not (tasks.parent / "cpu.cfs_quota_us").exists()  # no quota: unthrottled, only outweighed
    with pytest.raises(OSError, match="needs cgroup v1"):
        cgroups.create_comm_cgroup(CgroupRoot(2, _fake_v2(tmp_path)), "00beef", 2)


def test_throttling_falls_back_loudly_or_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetrain.emulate import emulator

    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    monkeypatch.setattr(emulator.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(emulator, "find_cpu_cgroups", lambda: (None, "no cgroup hierarchy with a cpu controller"))
    em = EmulatedCluster(cluster, EmulationSettings(), run_id="00beef")
    em._make_cgroups()
    assert "WARNING: cpu_share is NOT enforced: no cgroup hierarchy with a cpu controller" in " ".join(em.notes)
    assert "ask for 2 CPUs in all and this host has 1" in em.notes[0] and "cpu_scale = 0.5" in em.notes[0]
    assert em.node_cgroups(0) == ["", ""] and em.cgroup_root is None
    with pytest.raises(EmulationError, match='throttle = "cgroup"'):
        EmulatedCluster(cluster, EmulationSettings(throttle="cgroup"), run_id="00beef")._make_cgroups()
    v1 = tmp_path / "cpu"
    v1.mkdir()
    monkeypatch.setattr(emulator, "find_cpu_cgroups", lambda: (CgroupRoot(1, v1), ""))
    em = EmulatedCluster(cluster, EmulationSettings(cpu_scale=0.5), run_id="00beef")
    em._make_cgroups()
    assert em.node_cgroups(1) == [str(v1 / "hetrain-emu-00beef" / "1-slow-0" / "cgroup.procs")]
    assert (v1 / "hetrain-emu-00beef" / "0-fast-0" / "cpu.cfs_quota_us").read_text() == "5000"
    assert "fast:1         cpu_share 0.25: 2.5 ms CPU per 10 ms" in em.describe()


def test_devices_are_pinned_with_their_shares_spread_over_the_cpus() -> None:
    assert assign_cpus([("a", 0.6), ("b", 0.6), ("c", 0.2), ("d", 0.2)], [0, 1]) == {"a": 0, "b": 1, "c": 0, "d": 1}
    # the largest first, each on the least-loaded CPU: 0.5 | 0.4 + 0.3 -> 0.5 + 0.2 | 0.7
    assert assign_cpus([("x", 0.3), ("y", 0.5), ("z", 0.4), ("w", 0.2)], [2, 5]) == {
        "x": 5, "y": 2, "z": 5, "w": 2}
    assert assign_cpus([("a", 1.0)], []) == {}


def test_torchrun_command_and_node_environment() -> None:
    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    em = EmulatedCluster(cluster, EmulationSettings(rdzv_port=29555), run_id="00beef")
    cmd = build_torchrun_command(em, 1, ["python", "-m", "x", "--flag"])
    assert cmd[:3] == ["nsenter", "--net=/run/netns/hetrain-emu-00beef-1-slow", "--"]
    line = " ".join(cmd)
    for part in ("-m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d",
                 "--rdzv-endpoint 10.213.0.100:29555", "--rdzv-id hetrain-emu-00beef",
                 "--rdzv-conf is_host=0,join_timeout=120", "--local-addr 10.213.0.101",
                 "--no-python", "-m hetrain.emulate.rankwrap python -m x --flag"):
        assert part in line
    assert "is_host=1" in " ".join(build_torchrun_command(em, 0, ["true"]))
    env = build_node_env(em, 0, {"PATH": "/usr/bin", "RANK": "3", "TORCHELASTIC_RUN_ID": "x", "KEEP": "1"})
    assert env["HETRAIN_NODE"] == env["HETRAIN_HOST"] == "fast" and env["GLOO_SOCKET_IFNAME"] == "nic"
    assert "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env and env["KEEP"] == "1"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert json.loads(env[CGROUPS_ENV]) == ["", ""]  # not up: no cgroups yet


def test_rankwrap_names_the_step_it_could_not_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("HETRAIN_NODE", "slow")
    gone = tmp_path / "gone" / "cgroup.procs"
    monkeypatch.setenv(CGROUPS_ENV, json.dumps(["", str(gone)]))
    assert rankwrap.main(["true"]) == 1  # returns before exec: the step failed
    assert f"node slow local rank 1: cannot join cgroup {gone}: No such file or directory" in capsys.readouterr().err
    assert CGROUPS_ENV not in os.environ  # its variables never reach the command
    monkeypatch.setenv(CPUS_ENV, json.dumps([[], [1 << 20]]))
    assert rankwrap.main(["true"]) == 1
    assert f"local rank 1: cannot pin to CPUs [{1 << 20}]: Invalid argument" in capsys.readouterr().err
    monkeypatch.setenv(COMM_ENV, json.dumps(["", str(gone.with_name("tasks"))]))
    assert rankwrap.main(["true"]) == 1
    assert (f"local rank 1: cannot start the mover of its threads into {gone.with_name('tasks')}: No such file or "
            "directory") in capsys.readouterr().err


def test_keep_awake_requests_a_zero_wakeup_latency_while_it_holds_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-file")
    assert keepawake.can_keep_awake(missing) == f"{missing} does not exist (a kernel without PM QoS)"
    with keepawake.cpus_kept_awake(missing) as problem:
        assert problem == f"cannot open {missing}: No such file or directory"
    if keepawake.can_keep_awake() is not None:
        pytest.skip(f"cannot request a wake-up latency here: {keepawake.can_keep_awake()}")
    before = keepawake.wakeup_latency_request()
    with keepawake.cpus_kept_awake() as problem:
        assert problem is None
        assert keepawake.wakeup_latency_request() == 0
    assert keepawake.wakeup_latency_request() == before


def test_cli_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(cli, "run_emulate_command", lambda *a, **k: calls.append((a, k)) or 0)
    assert cli.main(["run", "c.toml", "--cpu-scale", "0.5", "--", "python", "-m", "x", "-o", "y"]) == 0
    assert cli.main(["run", "--attach", "00beef", "--", "python", "x.py"]) == 0
    assert cli.main(["up", "c.toml", "--no-shape", "--cpu-period", "20ms"]) == 0
    assert cli.main(["down", "00beef"]) == 0
    (a1, k1), (a2, k2), (a3, k3), (a4, k4) = calls
    assert a1 == ("run", "c.toml", ["python", "-m", "x", "-o", "y"]) and k1["cpu_scale"] == 0.5
    assert a2 == ("run",) and k2 == {"command": ["python", "x.py"], "run_id": "00beef", "attach": True,
                                     "timeout_s": None}
    assert a3 == ("up", "c.toml") and k3["shape"] is False and k3["cpu_period_s"] == 0.02
    assert a4 == ("down",) and k4 == {"run_id": "00beef"}
    assert cli.main(["run", "c.toml"]) == 2  # no command


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationError, match=r"needs root.*sudo.*NET_ADMIN"):
        check_permissions()


# ---------------------------------------------------------------------------
# real emulated clusters (root, namespaces, tc; cgroups where available)
# ---------------------------------------------------------------------------


def skip_without_tools() -> None:
    """Skip (with which) unless the commands an emulated cluster is made with are installed."""
    missing = [t for t in ("ip", "tc", "nsenter") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"emulation needs {', '.join(missing)} (iproute2, util-linux)")


@pytest.fixture(scope="module")
def can_emulate() -> None:
    """Skip (with why) unless this host lets us make namespaces, a bridge, veths and htb."""
    if os.geteuid() != 0:
        pytest.skip("emulation needs root (network namespaces, tc, cgroups)")
    skip_without_tools()
    probe = f"hetrain-probe-{secrets.token_hex(3)}"
    steps = [("ip", "netns", "add", probe), ("ip", "-n", probe, "link", "add", "br0", "type", "bridge"),
             ("ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"),
             ("tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "handle", "1:", "htb", "default", "1")]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                pytest.skip(f"cannot emulate here: `{' '.join(step)}` failed: {done.stderr.strip()}")
    finally:
        subprocess.run(("ip", "netns", "del", probe), capture_output=True, timeout=20)


@pytest.fixture
def fresh_run_ids() -> Iterator[Callable[[], str]]:
    """``new()`` gives a fresh run id; every run made with one is removed at teardown, whatever happened."""
    made: list[str] = []

    def new() -> str:
        made.append(secrets.token_hex(3))
        return made[-1]

    yield new
    for rid in made:
        remove_run(rid)


@pytest.fixture
def run_ids(can_emulate: None, fresh_run_ids: Callable[[], str]) -> Callable[[], str]:
    """``fresh_run_ids`` on a host that can emulate as root."""
    return fresh_run_ids


def assert_nothing_left(run_id: str) -> None:
    assert [ns for ns in network.list_namespaces() if network.run_id_of(ns) == run_id] == []
    assert run_id not in cgroups.list_run_dirs()
    assert not (STATE_DIR / f"{run_id}.json").exists()
    assert run_id not in [r.run_id for r in list_runs()]


GLOO_JOB = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
def cpu_cgroup(path):
    return [line.strip().split(":", 2)[2] for line in open(path) if line.split(":")[1] in ("cpu", "")]
time.sleep(0.2)  # the thread mover (isolate_comm) looks for new threads every 20 ms
cpu = cpu_cgroup("/proc/self/cgroup")
threads = {t: cpu_cgroup(f"/proc/self/task/{t}/cgroup") for t in os.listdir("/proc/self/task")}
children = [int(c) for c in open(f"/proc/self/task/{os.getpid()}/children").read().split()]
helpers = [{"pid": c, "idle": os.sched_getscheduler(c) == os.SCHED_IDLE, "cpus": sorted(os.sched_getaffinity(c)),
            "cgroup": cpu_cgroup(f"/proc/{c}/cgroup")} for c in children]
from hetrain.emulate.keepawake import can_keep_awake, wakeup_latency_request
awake = wakeup_latency_request() if can_keep_awake() is None else None
report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "wakeup_latency": awake,
          "node": os.environ["HETRAIN_NODE"], "local_rank": int(os.environ["LOCAL_RANK"]), "cgroup": cpu,
          "cpus": sorted(os.sched_getaffinity(0)), "fillers": [h for h in helpers if h["idle"]],
          "movers": [h for h in helpers if not h["idle"]], "main": str(os.getpid()), "threads": threads}
sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: the node's ranks share its output pipe
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_gloo_job_runs_across_two_emulated_nodes(tmp_path: Path, run_ids: Callable[[], str]) -> None:
    cluster = load_cluster(write(tmp_path / "two.toml", TWO_NODES))
    script = write(tmp_path / "job.py", GLOO_JOB)
    out, err = io.StringIO(), io.StringIO()
    rid = run_ids()
    with EmulatedCluster(cluster, EmulationSettings(), run_id=rid) as em:
        assert len(network.list_namespaces()) >= 3 and (STATE_DIR / f"{rid}.json").exists()
        latency_before = keepawake.wakeup_latency_request() if keepawake.can_keep_awake() is None else None
        status = em.launch(["python", str(script)], timeout_s=100, stdout=out, stderr=err)
        throttled = em.cgroup_root is not None
        isolated = throttled and em.cgroup_root.version == 1  # type: ignore[union-attr]
        pins = [cpus for k in range(len(cluster.nodes)) for cpus in em.node_cpus(k)]
        awake = em.keeps_awake() and latency_before is not None
    assert status == 0, err.getvalue()[-3000:]
    reports = sorted(((json.loads(line.split("REPORT ", 1)[1]), line.split("]", 1)[0].strip("[ "))
                      for line in out.getvalue().splitlines() if "REPORT " in line), key=lambda r: r[0]["rank"])
    # global ranks follow the cluster file's device order: fast:0, fast:1, slow:0
    assert [(r["rank"], r["node"], r["local_rank"], prefix) for r, prefix in reports] == [
        (0, "fast", 0, "fast"), (1, "fast", 1, "fast"), (2, "slow", 0, "slow")]
    assert all(r["world"] == 3 and r["sum"] == 6.0 for r, _ in reports)
    if throttled:
        assert [r["cgroup"][0].rsplit("/", 2)[-2:] for r, _ in reports] == [
            [f"hetrain-emu-{rid}", "0-fast-0"], [f"hetrain-emu-{rid}", "0-fast-1"], [f"hetrain-emu-{rid}", "1-slow-0"]]
        # each throttled device runs pinned to the CPU assign_cpus gave it (largest shares spread first)
        host = sorted(os.sched_getaffinity(0))
        assert pins == [[c] for c in assign_cpus([("fast:0", 1.0), ("fast:1", 0.5), ("slow:0", 0.5)], host).values()]
        assert [r["cpus"] for r, _ in reports] == pins
        # an idle filler beside each device throttled below one CPU (fast:1, slow:0), in its cgroup, on its CPU
        assert [len(r["fillers"]) for r, _ in reports] == [0, 1, 1]
        for r, _ in reports[1:]:
            (f,) = r["fillers"]
            assert f["idle"] and f["cpus"] == r["cpus"] and f["cgroup"] == r["cgroup"]
        # keep_awake: while the job runs the CPUs may not sleep (a 0 us wake-up latency request); after it, as before
        if awake:
            assert [r["wakeup_latency"] for r, _ in reports] == [0, 0, 0]
            assert keepawake.wakeup_latency_request() == latency_before
    if isolated:
        # isolate_comm: the main thread computes under the device's quota; every other thread of the rank
        # (Gloo's) and the mover itself run in the run's unthrottled cgroup
        run_cgroup = [r["cgroup"][0].rsplit("/", 1)[0] for r, _ in reports]
        for (r, _), outer in zip(reports, run_cgroup, strict=True):
            assert outer.endswith(f"hetrain-emu-{rid}")
            assert r["threads"][r["main"]] == r["cgroup"]
            others = {tid: cg for tid, cg in r["threads"].items() if tid != r["main"]}
            assert others and all(cg[0] == outer for cg in others.values()), others
            (mover,) = r["movers"]
            assert mover["cgroup"][0] == outer
    # the fillers and movers ended with their ranks
    for r, _ in reports:
        for f in r["fillers"] + r["movers"]:
            stat = Path(f"/proc/{f['pid']}/stat")
            assert not stat.exists() or stat.read_text().split()[2] == "Z"
    assert_nothing_left(rid)


@pytest.mark.timeout(330)
def test_discovery_measures_the_shaped_nics_and_link(tmp_path: Path, run_ids: Callable[[], str],
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """``hetrain discover`` under emulation: each pair measured within 10% of its shaped rate.

    TCP/IP and Ethernet headers take about 4% of each 1500-byte frame, so about 0.95x is expected.
    """
    path = write(tmp_path / "three.toml", THREE_NODES)
    nominal = load_cluster(path)
    # The links are shaped; the CPU is shared with whatever else runs on this host, and a
    # starved rank reads as a slow link. Up to three runs; the last must be within 10% everywhere.
    for attempt in range(3):
        measured_path = tmp_path / f"measured-{attempt}.toml"
        rid = run_ids()
        status = cli.run(path, ["python", "-m", "hetrain.profiler.network", "-o", str(measured_path), "--sizes",
                                "512KiB,2MiB", "--repeats", "2", "--timeout", "30", "--allreduce-bytes", "256KiB"],
                         timeout_s=100, run_id=rid)
        captured = capfd.readouterr()
        assert status == 0, captured.err[-3000:]
        assert "latency is not emulated" in captured.err
        assert_nothing_left(rid)
        measured = load_cluster(measured_path)
        assert [n.name for n in measured.nodes] == ["a", "b", "c"]
        lines, close = [], True
        for a, b in ((0, 1), (0, 2), (1, 2)):
            want, got = nominal.link(a, b).bandwidth_bytes_per_s, measured.link(a, b).bandwidth_bytes_per_s
            lines.append(f"{'abc'[a]}-{'abc'[b]}: shaped {want * 8e-6:.0f} Mbit/s, measured {got * 8e-6:.1f} Mbit/s")
            close = close and got == pytest.approx(want, rel=0.10)
        print("\n".join(lines))
        if close:
            break
    assert close, "\n".join(lines)


SLOW_LINK = """
name = "slow-link"
[[node]]
name = "fast"
devices = [{ type = "cpu", cpu_share = 1.0 }]
nic = "1Gbit/s"

[[node]]
name = "slow"
devices = [{ type = "cpu", cpu_share = 1.0 }]
nic = "50Mbit/s"
"""

PAUSED_MESSAGES_JOB = r"""
import datetime, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
msg, ack, times = torch.zeros(32768), torch.zeros(1), []   # 128 KiB, the size of a small activation
for i in range(7):
    if dist.get_rank() == 0:
        time.sleep(0.2)   # a pause: the token bucket refills, as between a pipeline's micro-batches
        t = time.perf_counter()
        dist.send(msg, 1)
        dist.recv(ack, 1)
        times.append(time.perf_counter() - t)
    else:
        dist.recv(msg, 0)
        dist.send(ack, 0)
if dist.get_rank() == 0:
    sys.stdout.write("TIMES " + " ".join(f"{x:.5f}" for x in times) + "\n")
    sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_small_message_after_a_pause_meets_the_shaped_rate(tmp_path: Path, run_ids: Callable[[], str]) -> None:
    """A 128 KiB message on a 50 Mbit/s link takes about 21 ms, not the ~1 ms a 128 KB htb burst allowed."""
    cluster = load_cluster(write(tmp_path / "slow.toml", SLOW_LINK))
    script = write(tmp_path / "job.py", PAUSED_MESSAGES_JOB)
    out, err = io.StringIO(), io.StringIO()
    rid = run_ids()
    with EmulatedCluster(cluster, EmulationSettings(), run_id=rid) as em:
        status = em.launch(["python", str(script)], timeout_s=100, stdout=out, stderr=err)
    assert status == 0, err.getvalue()[-3000:]
    times = sorted(float(x) for line in out.getvalue().splitlines() if "TIMES " in line
                   for x in line.split("TIMES ", 1)[1].split())
    ideal = 32768 * 4 / (50e6 / 8)
    assert len(times) == 7
    assert times[3] >= 0.7 * ideal, f"median {times[3] * 1e3:.1f} ms for 128 KiB at 50 Mbit/s ({ideal * 1e3:.1f} ms)"
    assert_nothing_left(rid)


BURN_JOB = r"""
import os, pathlib, sys, time
flags = pathlib.Path(sys.argv[1])
rank = int(os.environ["LOCAL_RANK"])
for round in range(5):  # the two ranks take turns, so their loops do not compete with each other
    turn = flags / f"{round}-{rank}"
    wait_for = flags / (f"{round}-0" if rank == 1 else f"{round - 1}-1")
    while (rank == 1 or round > 0) and not wait_for.exists():
        time.sleep(0.005)
    t0, c0 = time.perf_counter(), time.process_time()
    x = 0
    for i in range(3_000_000):
        x += i * i
    sys.stdout.write(f"BURN {rank} {time.perf_counter() - t0:.4f} {time.process_time() - c0:.4f}\n")
    sys.stdout.flush()
    turn.write_text("done")
"""


@pytest.mark.timeout(90)
def test_half_cpu_share_takes_about_twice_as_long(tmp_path: Path, run_ids: Callable[[], str]) -> None:
    """Each rank runs the same loop five times, taking turns; the best of five rounds is compared (three let one
    busy stretch of the shared host decide: share 0.5's best round once took 0.95 s against share 1.0's 0.27 s).

    The quota caps the CPU a rank uses per second of wall time: share 0.5 uses half a core, share 1.0
    a whole one where the host has it (else the test skips), so the same work takes about twice as long.
    """
    cluster = load_cluster(write(tmp_path / "cpu.toml", """
        [[node]]
        name = "n"
        devices = [{ type = "cpu", cpu_share = 1.0 }, { type = "cpu", cpu_share = 0.5 }]
    """))
    script = write(tmp_path / "burn.py", BURN_JOB)
    (tmp_path / "flags").mkdir()
    out, err = io.StringIO(), io.StringIO()
    rid = run_ids()
    with EmulatedCluster(cluster, EmulationSettings(), run_id=rid) as em:
        if em.cgroup_root is None:
            pytest.skip(f"cgroups with a cpu controller are not available: {' '.join(em.notes)}")
        status = em.launch(["python", str(script), str(tmp_path / "flags")], timeout_s=60, stdout=out, stderr=err)
    assert status == 0, err.getvalue()[-3000:]
    rounds: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    for line in out.getvalue().splitlines():
        if "BURN " in line:
            rank, wall, cpu = line.split("BURN ", 1)[1].split()
            rounds[int(rank)].append((float(wall), float(cpu)))
    (wall_full, cpu_full), (wall_half, cpu_half) = (min(rounds[r]) for r in (0, 1))
    use_full = max(c / w for w, c in rounds[0])
    use_half = max(c / w for w, c in rounds[1])
    print(f"share 1.0: {wall_full:.2f} s wall, {cpu_full:.2f} s CPU; share 0.5: {wall_half:.2f} s wall, "
          f"{cpu_half:.2f} s CPU; wall ratio {wall_half / wall_full:.2f}; most of a core used: {use_full:.0%} "
          f"at share 1.0, {use_half:.0%} at share 0.5")
    assert 0.35 < use_half < 0.6                 # the quota caps it, whatever else runs on the host
    if use_full < 0.8:
        pytest.skip(f"the host is too busy to compare speeds: the rank with share 1.0 got {use_full:.0%} of a core")
    assert 1.6 < use_full / use_half < 2.6
    # loose: on a busy host (2 vCPUs that may share a physical core) the same loop can need 1.5x the CPU
    # time in one run as in another, so the wall-time ratio varies more than the CPU-use ratio
    assert 1.2 < wall_half / wall_full < 3.5
    assert_nothing_left(rid)


COMM_BURN_JOB = r"""
import hashlib, json, sys, threading, time
data = bytes(1 << 20)  # hashlib lets go of the GIL on data this large: the threads run in parallel
stop = threading.Event()
def spin():
    while not stop.is_set():
        hashlib.sha256(data).digest()
helpers = [threading.Thread(target=spin, daemon=True) for _ in range(3)]
for h in helpers:
    h.start()
time.sleep(0.3)  # the thread mover (isolate_comm) looks for new threads every 20 ms
t0, c0 = time.perf_counter(), time.thread_time()
while time.perf_counter() - t0 < 2.0:
    hashlib.sha256(data).digest()
use = (time.thread_time() - c0) / (time.perf_counter() - t0)
def cpu_cgroup(path):
    return [line.strip().split(":", 2)[2] for line in open(path) if line.split(":")[1] in ("cpu", "")][0]
helpers = [cpu_cgroup(f"/proc/self/task/{h.native_id}/cgroup") for h in helpers]
stop.set()
sys.stdout.write("REPORT " + json.dumps({"main_use": use, "helpers": helpers}) + "\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(150)
def test_busy_communication_threads_leave_the_device_its_quota_with_comm_weight(
        tmp_path: Path, run_ids: Callable[[], str]) -> None:
    """A device at share 0.8 computes on its main thread while three other threads of its rank (Gloo's, as
    isolate_comm sees them) spin on its CPU.

    By default the moved threads each weigh as much as the device's whole cgroup, so the four split the CPU
    and the main thread gets about a quarter of it; in a ``comm`` cgroup of weight 2 (``comm_weight = 2``)
    they get what the quota leaves, and the main thread about its quota.
    """
    cluster = load_cluster(write(tmp_path / "one.toml", """
        [[node]]
        name = "n"
        devices = [{ type = "cpu", cpu_share = 0.8 }]
    """))
    script = write(tmp_path / "comm_burn.py", COMM_BURN_JOB)
    use: dict[int | None, float] = {}
    for weight in (None, 2):
        out, err = io.StringIO(), io.StringIO()
        rid = run_ids()
        with EmulatedCluster(cluster, EmulationSettings(comm_weight=weight), run_id=rid) as em:
            if em.cgroup_root is None or em.cgroup_root.version != 1:
                pytest.skip("isolate_comm needs cgroup v1 with a cpu controller: "
                            f"{em.cgroup_root.describe() if em.cgroup_root else ' '.join(em.notes)}")
            tree = cgroups.run_dir(em.cgroup_root, rid)
            weights = {g.name: (g / "cpu.shares").read_text().strip() for g in tree.iterdir() if g.is_dir()}
            assert weights == ({"0-n-0": "1024"} if weight is None else {"0-n-0": "1024", "comm": "2"})
            status = em.launch(["python", str(script)], timeout_s=60, stdout=out, stderr=err)
        assert status == 0, err.getvalue()[-3000:]
        (report,) = [json.loads(line.split("REPORT ", 1)[1]) for line in out.getvalue().splitlines()
                     if "REPORT " in line]
        # every helper thread was moved: to the run's cgroup by default, to its comm child with a weight
        assert {cg.rsplit("/", 1)[1] for cg in report["helpers"]} == {f"hetrain-emu-{rid}" if weight is None
                                                                      else "comm"}
        use[weight] = report["main_use"]
        assert_nothing_left(rid)
    print(f"the main thread used {use[None]:.0%} of a CPU by default and {use[2]:.0%} with comm_weight 2 "
          "(quota 80%) beside three busy communication threads")
    # loose: other work on the host takes from the run's whole tree, but far less than 3/4 of the CPU
    assert 0.5 < use[2] < 0.9
    assert use[None] < use[2] - 0.15


@pytest.mark.timeout(90)
def test_a_failing_command_still_tears_everything_down(tmp_path: Path, run_ids: Callable[[], str]) -> None:
    path = write(tmp_path / "two.toml", TWO_NODES)
    rid = run_ids()
    status = cli.run(path, ["python", "-c", "import os, sys; sys.exit(3 if os.environ['HETRAIN_NODE'] == 'slow' "
                                            "else 0)"], timeout_s=60, run_id=rid)
    assert status != 0
    assert_nothing_left(rid)


@pytest.mark.timeout(90)
def test_ctrl_c_tears_everything_down(tmp_path: Path, run_ids: Callable[[], str],
                                      clean_env: dict[str, str]) -> None:
    path = write(tmp_path / "two.toml", TWO_NODES)
    rid = run_ids()
    p = subprocess.Popen([sys.executable, "-m", "hetrain.emulate", "run", str(path), "--run-id", rid, "--",
                          "python", "-c", "import sys, time; sys.stdout.write('READY\\n'); sys.stdout.flush(); "
                          "time.sleep(120)"],
                         env=clean_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        ready = threading.Event()

        def watch() -> None:
            assert p.stdout is not None
            seen = 0
            for line in p.stdout:
                seen += line.count("READY")
                if seen == 3:  # all three ranks are running
                    ready.set()

        threading.Thread(target=watch, daemon=True).start()
        assert ready.wait(60), "the ranks did not start"
        assert len([ns for ns in network.list_namespaces() if network.run_id_of(ns) == rid]) == 3
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        stopped_s = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.stderr is not None
    stderr = p.stderr.read()
    assert p.returncode == 130, stderr[-3000:]
    assert "stopped by SIGINT; the emulated cluster was removed" in stderr
    print(f"stopped and torn down {stopped_s:.1f} s after SIGINT")
    assert_nothing_left(rid)


@pytest.mark.timeout(90)
def test_up_attach_status_and_down(tmp_path: Path, run_ids: Callable[[], str],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "two.toml", TWO_NODES)
    rid = run_ids()
    assert cli.run_emulate_command("up", path, run_id=rid) == 0
    assert f"hetrain emulate run --attach {rid}" in capsys.readouterr().out
    assert cli.run_emulate_command("up", path, run_id=rid) == 2  # the id is taken: refused, nothing removed
    assert "already in use" in capsys.readouterr().err
    status = cli.run_emulate_command("run", command=["python", "-c", "import os, sys; sys.stdout.write('NODE ' + "
                                                     "os.environ['HETRAIN_NODE'] + '\\n')"], run_id=rid, attach=True)
    assert status == 0
    assert cli.run_emulate_command("status") == 0
    out = capsys.readouterr().out
    assert out.count("] NODE fast") == 2 and out.count("] NODE slow") == 1
    assert f"run {rid}: cluster 'two'" in out and "kept up by `hetrain emulate up`" in out
    assert [r.processes for r in list_runs() if r.run_id == rid] == [0]  # the job left nothing running
    assert cli.run_emulate_command("down", run_id=rid) == 0
    assert f"removed run {rid}: 3 namespaces" in capsys.readouterr().out
    assert_nothing_left(rid)


@pytest.mark.timeout(60)
def test_down_removes_the_leftovers_of_a_killed_launcher(tmp_path: Path, run_ids: Callable[[], str],
                                                         clean_env: dict[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "two.toml", TWO_NODES)
    rid = run_ids()
    crash = ("import os, sys; from hetrain.cluster import load_cluster; "
             "from hetrain.emulate.emulator import EmulatedCluster; "
             f"EmulatedCluster(load_cluster(sys.argv[1]), run_id={rid!r}).up(); os._exit(9)")
    done = subprocess.run([sys.executable, "-c", crash, str(path)], env=clean_env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 9, done.stderr[-2000:]
    assert cli.run_emulate_command("status") == 0
    assert "which is gone: remove with `hetrain emulate down`" in capsys.readouterr().out
    assert cli.run_emulate_command("down", run_id=rid) == 0
    assert_nothing_left(rid)


@pytest.mark.timeout(60)
def test_rootless_run_leaves_nothing_on_the_host(tmp_path: Path, fresh_run_ids: Callable[[], str],
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """The whole run inside a user namespace (the default without root; forced here): needs no root."""
    skip_without_tools()
    why = probe_user_namespaces()
    if why is not None:
        pytest.skip(f"no user namespaces here: {why}")
    path = write(tmp_path / "two.toml", TWO_NODES)
    rid = fresh_run_ids()
    status = cli.run(path, ["python", "-c", "import os, sys; sys.stdout.write('AT ' + os.environ['HETRAIN_NODE'] + "
                                            "' ' + os.environ['RANK'] + '\\n')"], timeout_s=40, run_id=rid,
                     rootless=True)
    out, err = capfd.readouterr()
    assert status == 0, err[-3000:]
    assert "inside a user namespace (rootless)" in err
    assert sorted(line.split("] ", 1)[1] for line in out.splitlines() if "] AT " in line) == [
        "AT fast 0", "AT fast 1", "AT slow 2"]
    assert_nothing_left(rid)


# ---------------------------------------------------------------------------
# scripted events (emulate.events)
# ---------------------------------------------------------------------------

EVENTS = TWO_NODES + """
[emulation]
max_restarts = 2

[[emulation.event]]
at_s = 1.0
node = "fast"
nic = "50Mbit/s"

[[emulation.event]]
at_s = 0.5
device = "slow:0"
cpu_share = 0.25
"""


def test_events_are_read_in_time_order_and_refused_by_name(tmp_path: Path) -> None:
    settings = parse_emulation_settings(tomllib.loads(EVENTS)["emulation"])
    assert [e.describe() for e in settings.events] == [
        "at 0.5 s: device slow:0 cpu_share 0.25", "at 1 s: node fast nic 50 Mbit/s"]
    assert settings.max_restarts == 2
    assert EmulationSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    bad = parse_emulation_settings({"event": [{"at_s": 1, "device": "slow:7", "cpu_share": 0.5}]})
    with pytest.raises(EmulationError, match=r"device 'slow:7' is not in the cluster; its devices: fast:0"):
        EmulatedCluster(cluster, bad)
    for event, message in (
            ({"at_s": -1, "node": "fast", "action": "kill"}, r"\]\] 0: at_s must be a number of seconds >= 0, got -1"),
            ({"at_s": 1, "node": "fast", "action": "pause"}, r"action must be one of kill, stop, resume, start"),
            ({"at_s": 1, "device": "fast:0", "cpu_share": 0}, r"cpu_share must be a number in \(0, 64\], got 0"),
            ({"at_s": 1, "node": "fast", "nic": "fast"}, r"nic"),
            ({"at_s": 1, "node": "fast"}, r"a node event takes node with nic, or node with action")):
        with pytest.raises(EmulationError, match=message):
            parse_emulation_settings({"event": [event]})


def test_a_node_that_starts_late_makes_the_rendezvous_elastic() -> None:
    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    settings = parse_emulation_settings({"max_restarts": 3, "event": [{"at_s": 5, "node": "slow", "action": "start"}]})
    em = EmulatedCluster(cluster, settings, run_id="abc123")
    cmd = build_torchrun_command(em, 0, ["python", "x.py"])
    assert cmd[cmd.index("--nnodes") + 1] == "1:2" and cmd[cmd.index("--max-restarts") + 1] == "3"
    changes = network.nic_change_commands(em.network, 1, 12.5e6)
    assert [c[:6] for c in changes] == [("tc", "-n", em.network.nodes[1].namespace, "class", "change", "dev"),
                                        ("tc", "-n", em.network.hub, "class", "change", "dev")]
    assert all("100000000bit" in c for c in changes)  # 12.5 MB/s


KILL_AND_START = [{"at_s": 8, "node": "slow", "action": "kill"}, {"at_s": 10, "node": "slow", "action": "start"}]


def test_a_node_killed_or_started_again_makes_the_rendezvous_go_on_without_it() -> None:
    """A killed node must not hold the survivors' restart (fixed ``--nnodes 2`` waited for it until join_timeout),
    and a node killed and then started again is there from the job's start."""
    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    tuned = {"max_restarts": 2, "last_call_timeout": "2s", "keep_alive_interval": "1s", "keep_alive_max_attempt": 2}
    for events in (KILL_AND_START[:1], KILL_AND_START):
        settings = parse_emulation_settings({**tuned, "event": events})
        assert late_nodes(settings.events) == set()
        assert EmulationSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
        em = EmulatedCluster(cluster, settings, run_id="abc124")
        for k in (0, 1):
            cmd = build_torchrun_command(em, k, ["python", "x.py"])
            assert cmd[cmd.index("--nnodes") + 1] == "1:2"
            assert cmd[cmd.index("--rdzv-conf") + 1] == (f"is_host={int(k == 0)},join_timeout=120,last_call_timeout=2,"
                                                         "keep_alive_interval=1,keep_alive_max_attempt=2")
            # a node joining a running job waited for a master address no round wrote, with the store shared
            assert build_node_env(em, k, {"PATH": "/usr/bin"})[UNSHARED_STORE_ENV] == "1"
    fixed = build_torchrun_command(EmulatedCluster(cluster, EmulationSettings(), run_id="abc125"), 1, ["true"])
    assert fixed[fixed.index("--nnodes") + 1] == "2" and "last_call" not in " ".join(fixed)
    assert UNSHARED_STORE_ENV not in build_node_env(EmulatedCluster(cluster, EmulationSettings(), run_id="abc125"), 1,
                                                    {"PATH": "/usr/bin"})
    with pytest.raises(EmulationError, match=r"keep_alive_interval must be between 1s and 3600s, got 0\.5 s"):
        parse_emulation_settings({"keep_alive_interval": "0.5s"})
    with pytest.raises(EmulationError, match=r"keep_alive_max_attempt must be an integer, got 1\.5"):
        parse_emulation_settings({"keep_alive_max_attempt": 1.5})


@pytest.mark.timeout(120)
def test_a_node_started_again_after_a_kill_fails_the_job_when_it_fails(tmp_path: Path,
                                                                       run_ids: Callable[[], str]) -> None:
    """The kill's pardon covers the killed torchrun only: the node's next torchrun failing fails the job
    (the launcher pardoned the node, so the job hung until its time limit)."""
    script = write(tmp_path / "job.py", f"""
        import os, pathlib, sys, time
        if os.environ["HETRAIN_NODE"] == "slow":
            flag = pathlib.Path({str(tmp_path)!r}) / "slow-ran"
            if flag.exists():
                sys.exit(3)  # the node started again fails
            flag.touch()
        time.sleep(60)
    """)
    cluster = parse_cluster(tomllib.loads(TWO_NODES))
    settings = parse_emulation_settings({"last_call_timeout": "2s", "keep_alive_interval": "1s",
                                         "keep_alive_max_attempt": 2, "throttle": "off", "event": KILL_AND_START})
    out, err = io.StringIO(), io.StringIO()
    with EmulatedCluster(cluster, settings, run_id=run_ids()) as em:
        start = time.monotonic()
        status = em.launch(["python", str(script)], timeout_s=60, stdout=out, stderr=err)
        took = time.monotonic() - start
    log = err.getvalue()
    assert (tmp_path / "slow-ran").exists(), log[-3000:]  # the first torchrun's rank ran before the kill
    assert "event at 8 s: node slow kill: node slow: kill sent to" in log, log[-3000:]
    assert "event at 10 s: node slow start: node slow started" in log, log[-3000:]
    assert status not in (0, 124) and "node slow failed with exit status" in log, log[-3000:]
    assert took < 55, f"{took:.0f} s"


@pytest.mark.timeout(120)
def test_events_change_a_share_and_a_nic_while_a_job_runs(tmp_path: Path, run_ids: Callable[[], str]) -> None:
    cluster = load_cluster(write(tmp_path / "events.toml", EVENTS))
    settings = load_emulation_settings_from(tmp_path / "events.toml")
    out, err = io.StringIO(), io.StringIO()
    with EmulatedCluster(cluster, settings, run_id=run_ids()) as em:
        throttled = em.cgroup_root is not None
        status = em.launch(["python", "-c", "import time; time.sleep(2.5)"], timeout_s=60, stdout=out, stderr=err)
        shaped = subprocess.run(("tc", "-n", em.network.nodes[0].namespace, "class", "show", "dev", network.NIC),
                                capture_output=True, text=True, timeout=20).stdout
        quotas = {t.device: t for t in em.throttles}
        if throttled:
            group = quotas["slow:0"].procs_file.parent  # type: ignore[union-attr]
            v1 = em.cgroup_root.version == 1  # type: ignore[union-attr]
            quota = (group / ("cpu.cfs_quota_us" if v1 else "cpu.max")).read_text().split()[0]
            period = quotas["slow:0"].period_us
    assert status == 0, err.getvalue()[-3000:]
    log = err.getvalue()
    assert "event at 1 s: node fast nic 50 Mbit/s: node fast's NIC shaped to 50 Mbit/s each way" in log, log
    assert "rate 50Mbit" in shaped, shaped
    if throttled:
        assert "event at 0.5 s: device slow:0 cpu_share 0.25: device slow:0: cpu share 0.5 -> 0.25" in log, log
        assert int(quota) == round(0.25 * period)  # type: ignore[operator]
        assert quotas["slow:0"].cpu_share == 0.25 and quotas["fast:1"].cpu_share == 0.5


def load_emulation_settings_from(path: Path) -> EmulationSettings:
    from hetrain.emulate.settings import load_emulation_settings

    return load_emulation_settings(path)

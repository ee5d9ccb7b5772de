"""`hetrain discover` on Gloo ranks on loopback: a cluster file that loads, and errors that name the rank."""

from __future__ import annotations

import textwrap
import time

from worker_ranks import run_ranks

from hetrain.cluster import load_cluster

#: ``python -m hetrain.profiler.network`` as a rank forked from the fork server (the ``fork_rank`` fixture)
NETWORK = ["-m", "hetrain.profiler.network"]


def rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_four_ranks_on_two_fake_hosts_write_a_cluster_that_loads(tmp_path, clean_env):
    out = tmp_path / "discovered.toml"
    env = {**clean_env, "HETRAIN_HOST": "hostA,hostA,hostB,hostB"}
    stdout = "".join(run_ranks(NETWORK[0], [*NETWORK[1:], "-o", str(out), "--sizes", "4KiB,64KiB,1MiB", "--repeats",
                                            "3", "--timeout", "30"], 4, 120, env))
    cluster = load_cluster(out)
    assert [n.name for n in cluster.nodes] == ["hostA", "hostB"]
    assert [len(n.devices) for n in cluster.nodes] == [2, 2]
    assert all(d.type_name == "cpu" for d in cluster.devices)
    text = out.read_text()
    assert text.count("[[link]]") == 1 and "ranks 0-1" in text and "ranks 2-3" in text and "ranks 0-2" in text
    for a, b in ((0, 1), (2, 3), (0, 2)):
        link = cluster.link(a, b)
        assert 1e6 < link.bandwidth_bytes_per_s < 1e12 and link.latency_s >= 0
    assert "all-reduce of 1.0 MB over 4 ranks: measured" in stdout and "error" in stdout
    # each measured link also has one step of a collective, timed by a two-rank all-reduce
    assert text.count("collective step") == 4  # both intra links, the nic on both nodes
    for a, b in ((0, 0), (1, 1), (0, 1)):
        step = cluster.node_link(a, b).collective_latency_s
        assert step is not None and 0 < step < 0.05


def test_a_rank_that_never_starts_is_named(tmp_path, fork_rank, clean_env, free_port):
    start = time.monotonic()
    p = fork_rank([*NETWORK, "-o", str(tmp_path / "c.toml"), "--timeout", "2"],
                  rank_env(clean_env, 0, 2, free_port()))
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "rank 1 did not join within 2 s" in stderr
    assert time.monotonic() - start < 30
    assert not (tmp_path / "c.toml").exists()


def test_a_peer_that_stops_answering_is_named(tmp_path, fork_rank, clean_env, free_port):
    """Rank 1 joins the process group, then never answers rank 0's ping: a timeout naming rank 1, no hang."""
    script = tmp_path / "silent_peer.py"
    script.write_text(textwrap.dedent("""
        import datetime, os, sys, time
        import torch.distributed as dist
        from hetrain.profiler.network import DiscoveryError, measure_pingpong
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        if dist.get_rank() == 1:
            time.sleep(60)
            sys.exit(0)
        t0 = time.monotonic()
        try:
            measure_pingpong(1, [4096], initiator=True, timeout_s=2)
        except DiscoveryError as e:
            print(f"{e} [after {time.monotonic() - t0:.1f} s]", flush=True)
            os._exit(3)
        os._exit(0)
    """))
    port = free_port()
    ranks = [fork_rank([str(script)], rank_env(clean_env, r, 2, port)) for r in (0, 1)]
    stdout, stderr = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == 3, stderr[-2000:]
    assert "rank 0: no answer from rank 1 within 2 s" in stdout
    waited = float(stdout.rsplit("[after ", 1)[1].split(" s]")[0])
    assert 1.5 < waited < 10


def test_ranks_that_disagree_about_the_plan_are_named(tmp_path, fork_rank, clean_env, free_port):
    port = free_port()
    ranks = [fork_rank([*NETWORK, "-o", str(tmp_path / "c.toml"), "--timeout", "20", "--sizes", sizes],
                   rank_env(clean_env, r, 2, port))
             for r, sizes in ((0, "4KiB,64KiB"), (1, "4KiB,16KiB"))]
    for p in ranks:
        _, stderr = p.communicate(timeout=60)
        assert p.returncode == 1
        assert "ranks disagree about the measurement plan" in stderr
        assert "rank 1 has sizes=[4096, 16384] where rank 0 has sizes=[4096, 65536]" in stderr

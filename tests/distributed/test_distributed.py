"""hetrain.distributed on a real TCPStore (ranks as threads) and real Gloo ranks (processes).

The barrier names the rank that did not come, tells a rank that never beat from one
that stopped, and waits for a slow rank that beats; errors posted by one rank are
read back by name; keys of two torchrun attempts never meet; ``wait_work`` names
the peers it waited on.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.health import Health, Heartbeat, beat_counter, read_beat
from hetrain.distributed.store import JobStore, attempt_prefix
from hetrain.distributed.work import PeerError, WaitError, completed_within, is_connection_loss, wait_work


@pytest.fixture
def server() -> Any:
    """A TCPStore server on a free port; each rank (thread) connects a client of its own."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    yield store


def client(server: Any, scope: str = "test", number: int = 0) -> JobStore:
    base = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return JobStore(base, scope, "the test store", number)


def run_ranks(fns: dict[int, Callable[[], Any]], timeout_s: float = 15.0) -> dict[int, Any]:
    """Run one function per rank in threads; each rank's return value or the exception it raised."""
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = fns[r]()
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank did not return"
    return out


# ---------------------------------------------------------------------------
# barrier
# ---------------------------------------------------------------------------


def test_the_barrier_names_the_rank_that_did_not_arrive(server):
    """Ranks 0 and 1 of 3 meet; rank 2 never comes: both name rank 2 after the timeout, not before."""
    stores = {r: client(server) for r in range(3)}
    start = time.monotonic()
    got = run_ranks({r: lambda r=r: Barrier(stores[r], r, 3, 1.0).sync("b", "the test barrier") for r in (0, 1)})
    waited = time.monotonic() - start
    for r in (0, 1):
        assert isinstance(got[r], BarrierError), got[r]
        assert got[r].late == [2]
        assert str(got[r]) == f"rank 2 did not reach the test barrier within 1 s (rank {r} waited)"
    assert 0.9 < waited < 5
    # once rank 2 comes, the same barrier passes for everyone and gathers every payload
    got = run_ranks({r: lambda r=r: Barrier(stores[r], r, 3, 5.0).gather("g", "the gather", f"from {r}")
                     for r in range(3)})
    assert all(got[r] == ["from 0", "from 1", "from 2"] for r in range(3)), got


def test_the_barrier_tells_a_rank_that_never_beat_from_one_that_stopped(server):
    """With heartbeats the timeout bounds silence: rank 1 beats then stops, rank 2 never beats."""
    stores = {r: client(server) for r in range(3)}
    heart = Heartbeat(stores[1], 1, period_s=0.1)
    heart.start()
    time.sleep(0.3)
    heart.stop()  # rank 1 is now silent; rank 2 never beat
    barrier = Barrier(stores[0], 0, 3, 1.0, beats=beat_counter(stores[0]))
    with pytest.raises(BarrierError) as info:
        barrier.sync("b", "joining")
    assert info.value.late == [2] and info.value.silent == [1]
    assert str(info.value) == ("rank 2 did not join within 1 s (waiting at joining); "
                               "rank 1 stopped answering: no heartbeat for 1 s while waiting at joining")
    # a rank that went silent alone is named as such
    stores[2].set("b/2", "")
    with pytest.raises(BarrierError, match=r"^rank 1 stopped answering: no heartbeat for 1 s while waiting at "
                                           r"joining$") as info:
        barrier.wait("b", "joining")
    assert info.value.silent == [1] and info.value.late == []


def test_the_barrier_waits_for_a_slow_rank_that_beats(server):
    """Rank 1 arrives after 2.5 timeouts but beats all along: no error."""
    stores = {r: client(server) for r in range(2)}

    def slow() -> None:
        heart = Heartbeat(stores[1], 1, period_s=0.1)
        heart.start()
        time.sleep(2.5)
        Barrier(stores[1], 1, 2, 1.0, beats=beat_counter(stores[1])).sync("b", "slow")
        heart.stop()

    start = time.monotonic()
    got = run_ranks({0: lambda: Barrier(stores[0], 0, 2, 1.0, beats=beat_counter(stores[0])).sync("b", "slow"),
                     1: slow})
    assert got == {0: None, 1: None}
    assert time.monotonic() - start > 2.4


# ---------------------------------------------------------------------------
# posted errors
# ---------------------------------------------------------------------------


def test_a_posted_error_is_read_back_by_name_and_stops_the_waiting_ranks(server):
    stores = {r: client(server) for r in range(3)}

    def fail() -> None:
        time.sleep(0.2)
        stores[1].post_error(1, "rank 1: CUDA out of memory\nTraceback ...")

    start = time.monotonic()
    got = run_ranks({0: lambda: Barrier(stores[0], 0, 3, 10.0).sync("b", "step 3"),
                     2: lambda: Barrier(stores[2], 2, 3, 10.0).sync("b", "step 3"), 1: fail})
    assert time.monotonic() - start < 3  # told at once, not after the 10 s timeout
    for r in (0, 2):
        assert isinstance(got[r], BarrierError), got[r]
        assert got[r].failed == {1: "rank 1: CUDA out of memory\nTraceback ..."}
        assert str(got[r]) == f"rank {r} stops at step 3: rank 1 failed: rank 1: CUDA out of memory"
    assert stores[0].posted_errors(range(3)) == {1: "rank 1: CUDA out of memory\nTraceback ..."}
    assert stores[1].posted_errors(range(3), exclude=1) == {}


def test_health_names_ranks_by_device_and_describes_them(server):
    stores = {r: client(server, "train/0") for r in range(3)}
    healths = {r: Health(r, ["n0:0", "n0:1", "n1:0"], period_s=0.1, store=stores[r]) for r in range(3)}
    for r in (1, 2):
        healths[r].doing = (4, f"RECV_F mb{r}")
        healths[r].start()
    time.sleep(0.3)
    healths[2].stop()
    healths[1].post_error("rank 1 (n0:1): a bad batch")
    time.sleep(0.5)
    assert read_beat(stores[0], 1).doing == "step 4: RECV_F mb1"
    error = healths[0].peer_error("no answer", [1])
    text = str(error)
    assert text.startswith("rank 0 (n0:0): no answer\n")
    assert "  rank 1 (n0:1): last heard" in text and "at step 4: RECV_F mb1" in text
    assert "  rank 2 (n1:0): silent for" in text and "at step 4: RECV_F mb2" in text
    assert "  rank 1 (n0:1) reported: rank 1 (n0:1): a bad batch" in text
    assert isinstance(error, PeerError)
    # a posted error names its rank before a silent one does
    assert healths[0].failed_peer(1.0) == "rank 1 (n0:1) failed: rank 1 (n0:1): a bad batch"
    healths[1].stop()


# ---------------------------------------------------------------------------
# attempts
# ---------------------------------------------------------------------------


def test_keys_of_two_attempts_never_meet(server, monkeypatch):
    """A restarted job (attempt 1) sees none of attempt 0's beats, errors or arrivals."""
    dead = client(server, "train/0", number=0)
    dead.set("beat/1", '{"n": 3, "t": 0.0, "doing": "step 9"}')
    dead.post_error(1, "rank 1: killed")
    dead.set("b/1", "")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the store outlives the attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = client(server, "train/0", number=None)
    assert restarted.prefix == "hetrain/attempt_1/train/0/" == attempt_prefix() + "train/0/"
    assert read_beat(restarted, 1) is None
    assert restarted.posted_errors(range(2)) == {}
    assert Barrier(restarted, 0, 2, 0.3).missing("b", [0, 1]) == [0, 1]
    assert dead.posted_errors(range(2)) == {1: "rank 1: killed"}  # still there for attempt 0
    # scopes inside one attempt are apart too
    assert client(server, "train/1", number=0).posted_errors(range(2)) == {}
    assert dead.child("pg").prefix == "hetrain/attempt_0/train/0/pg/"


def test_ranks_of_agents_with_other_restart_counts_meet_on_a_store_of_their_own(server, monkeypatch):
    """A node that joins a running job counts its restarts from 0, the node it joins from its own: where
    each attempt has a new store (no agent store), both use one prefix, so they meet at a barrier."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = client(server, "checkpoint/200", number=None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    joined = client(server, "checkpoint/200", number=None)
    assert restarted.prefix == joined.prefix == "hetrain/attempt_0/checkpoint/200/"
    Barrier(restarted, 0, 2, 5.0).arrive("b")
    Barrier(joined, 1, 2, 5.0).arrive("b")
    # a c10d set does not wait for the server's answer, so a check on another connection may run
    # before it lands: wait (polling) as ranks do; under two prefixes this raises after 5 s
    Barrier(joined, 1, 2, 5.0).wait("b", "the test barrier")
    Barrier(restarted, 0, 2, 5.0).wait("b", "the test barrier")


# ---------------------------------------------------------------------------
# wait_work, with Gloo ranks
# ---------------------------------------------------------------------------


def rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_wait_work_names_the_peers_it_waited_on(fork_rank, clean_env, free_port):
    """Three Gloo ranks: rank 2 never joins the all-reduce, rank 0's waits time out naming ranks 1 and 2."""
    port = free_port()
    ranks = [fork_rank([__file__, "wait"], rank_env(clean_env, r, 3, port)) for r in range(3)]
    stdout, stderr = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert lines[0] == "landed True"
    assert lines[1] == "landed False"
    assert lines[2] == "timed_out True peers [0, 1, 2]"
    assert lines[3] == "no answer from rank 1, rank 2 within 1 s, waiting at the test all-reduce"
    waited = float(lines[4])
    assert 0.9 < waited < 5
    assert lines[5] == "no answer from rank 2 within 1 s, waiting at RECV from rank 2"


def test_a_send_to_a_dead_peer_raises_at_once_and_the_health_names_the_peer(fork_rank, clean_env, free_port):
    """Gloo raises when a send to a peer that died is posted, not at its wait, so ``wait_work`` never sees it:
    the trainer asks ``Health.failed_peer`` who died (rank 1 exits without posting; its beat stops)."""
    port = free_port()
    ranks = [fork_rank([__file__, "dies"], rank_env(clean_env, r, 2, port)) for r in range(2)]
    stdout, stderr = ranks[0].communicate(timeout=60)
    assert ranks[0].returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert lines[0] == "connection loss True", stdout
    assert lines[1].startswith("rank 1 (n0:1) failed or stopped: silent for "), stdout
    assert lines[1].endswith(", at step 3: SEND_F 0->1 mb0"), stdout
    assert lines[2] == "timeout is a connection loss False", stdout


def _dies() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    health = Health(rank, ["n0:0", "n0:1"], period_s=0.2)
    health.doing = (3, "SEND_F 0->1 mb0")
    health.start()
    x = torch.ones(4)
    wait_work(dist.all_reduce(x, async_op=True), "the first all-reduce", [0, 1], 10.0)
    if rank == 1:
        time.sleep(0.5)  # a beat or two
        os._exit(17)
    time.sleep(1.0)
    try:
        wait_work(dist.isend(x, 1), "SEND_F 0->1 mb0", [1], 5.0)
        print("connection loss False (the send went through)", flush=True)
    except RuntimeError as e:  # raw Gloo: "Connection closed by peer" / "reset by peer"
        print(f"connection loss {is_connection_loss(e) and not isinstance(e, WaitError)}", flush=True)
    print(health.failed_peer(5.0), flush=True)
    print(f"timeout is a connection loss {is_connection_loss(RuntimeError('Timed out waiting 5000ms'))}", flush=True)
    health.stop()
    os._exit(0)


def _worker(mode: str) -> None:
    if mode == "dies":
        _dies()
    assert mode == "wait"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    x = torch.ones(1)
    first = dist.all_reduce(x, async_op=True)  # every rank: lands by itself
    if rank == 0:
        print(f"landed {completed_within([first], 10.0)}", flush=True)
    wait_work(first, "the first all-reduce", [0, 1, 2], 10.0)
    if rank == 2:  # never joins the next all-reduce; the test ends this process
        time.sleep(60)
        os._exit(0)
    second = dist.all_reduce(x, async_op=True)
    if rank == 1:  # waits in the all-reduce rank 2 never joins, connections open; the test ends it
        time.sleep(60)
        os._exit(0)
    if rank == 0:
        print(f"landed {completed_within([second], 0.3)}", flush=True)
        start = time.monotonic()
        try:
            wait_work(second, "the test all-reduce", [0, 1, 2], 1.0)
        except WaitError as e:
            print(f"timed_out {e.timed_out} peers {e.peers}\n{e}\n{time.monotonic() - start:.2f}", flush=True)
        try:
            wait_work(dist.irecv(torch.zeros(1), 2), "RECV from rank 2", [2], 1.0)
        except WaitError as e:
            print(e, flush=True)
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1])

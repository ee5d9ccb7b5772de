"""Helpers for tests that start processes: a spawner that always cleans up, a free port, a clean environment."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator

import pytest
import worker_ranks
from worker_ranks import Rank, fork_server, start_fork_server

Spawn = Callable[..., subprocess.Popen]

start_fork_server()  # the ranks' fork server imports torch and hetrain while pytest collects the tests


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(cmd, env)`` starts a process in its own session; teardown kills its whole group."""
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.communicate()


@pytest.fixture
def fork_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[list[str], dict[str, str]], Rank]]:
    """``fork_rank([SCRIPT, *ARGS], env)`` runs ``python SCRIPT ARGS`` (``["-m", MODULE, *ARGS]``: ``python -m
    MODULE ARGS``) as a rank forked from the session's fork server (``worker_ranks``: torch and hetrain already
    imported), in a session of its own; its ``communicate`` and ``returncode`` are Popen's. Teardown kills every
    rank's process group."""
    ranks: list[Rank] = []
    logs = tmp_path_factory.mktemp("rank-logs")
    fork_server()  # started here, not in the test's own time

    def start(cmd: list[str], env: dict[str, str]) -> Rank:
        ranks.append(Rank(cmd[0], cmd[1:], env, logs, len(ranks)))
        return ranks[-1]

    yield start
    for rank in ranks:
        rank.kill()


@pytest.fixture
def free_port() -> Callable[[], int]:
    """``free_port()``: a port nothing listens on now (``worker_ranks.free_port``)."""
    return worker_ranks.free_port


@pytest.fixture
def clean_env() -> dict[str, str]:
    """This process's environment without torchrun's variables, single-threaded, unbuffered."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HETRAIN_HOST")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env

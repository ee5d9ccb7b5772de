"""The job store: keys of one torchrun attempt in a c10d store, and the errors ranks post there.

torchrun (2.13) keeps one store for every attempt of a job: after ``--max-restarts``
a restarted rank would read what the dead attempt wrote (its heartbeats, its
errors, the addresses its process group published: pytorch/pytorch#135712).
Every key hetrain writes therefore lives under the attempt's prefix, which the
agents of a job restart together (``TORCHELASTIC_RESTART_COUNT``; 0 where each
attempt has a store of its own, see ``attempt``)::

    hetrain/attempt_0/pg/...                  the default process group (attempt_store)
    hetrain/attempt_0/train/0/beat/2          a heartbeat (distributed.health)
    hetrain/attempt_0/train/0/error/2         the error rank 2 posted; errors: how many did
    hetrain/attempt_0/checkpoint/3/...        a checkpoint's barrier (runtime.state.checkpoint)
    hetrain/attempt_1/...                     the restarted job: never reads attempt_0's keys

A ``JobStore`` has the c10d store's methods (``set``, ``get``, ``add``, ``check``);
a store that cannot be reached raises ``StoreError``.

Example:
    >>> job = JobStore(dist.HashStore(), "train/0")           # doctest: +SKIP
    >>> job.post_error(1, "rank 1: out of memory"); job.posted_errors(range(2))   # doctest: +SKIP
    {1: 'rank 1: out of memory'}
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hetrain.distributed.work import PeerError, first_line

ATTEMPT_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
ERROR_CHARS = 2000  # a posted error is cut to this length


class StoreError(PeerError):
    """The job store cannot be reached (its host, rank 0 or the torchrun agent, has gone); names it."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def attempt() -> int:
    """This process's torchrun attempt: 0, then 1, 2, ... after each restart of the job, where the store
    outlives attempts (torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE``); else 0.

    Without the agent's store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or no torchrun) rank 0 serves a
    new store each attempt, so nothing old is there to avoid; and the agents' restart counts need not agree
    (a node that joins a running job counts from 0, the node it joins from its own restarts): under them,
    ranks of one attempt waited at a checkpoint barrier under two prefixes, each for the others.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return 0
    try:
        return int(os.environ.get(ATTEMPT_VARIABLE, "0"))
    except ValueError:
        return 0


def attempt_prefix(number: int | None = None) -> str:
    """``"hetrain/attempt_0/"``: the prefix of every key of an attempt (default: this process's)."""
    return f"hetrain/attempt_{attempt() if number is None else number}/"


def attempt_store(timeout: timedelta) -> Any:
    """Under torchrun's agent store, a store for the default process group whose keys belong to this
    attempt only; else None (``init_process_group``'s own ``env://`` store is then fresh per attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # type: ignore[attr-defined]
                         int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(), base)  # type: ignore[attr-defined]


def hosts_store(rank: int) -> bool:
    """Whether this process serves the job's store: rank 0, unless torchrun's agent serves it."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


class JobStore:
    """A c10d store seen through one attempt's prefix and a scope: ``hetrain/attempt_{n}/{scope}/``.

    Args:
        base: a ``torch.distributed`` Store (TCPStore, HashStore, the default group's store).
        scope: this user's keys (``"train/0"``, ``"checkpoint/3"``); the same on every rank.
        where: how to name the store in errors (``"127.0.0.1:29500 (hosted by rank 0)"``).
        number: the attempt; default this process's (``attempt()``).
    """

    def __init__(self, base: Any, scope: str, where: str = "the process group's store",
                 number: int | None = None) -> None:
        self.base, self.scope, self.where = base, scope.strip("/"), where
        self.attempt = attempt() if number is None else number
        self.prefix = f"{attempt_prefix(self.attempt)}{self.scope}/"
        self.raw: Any = dist.PrefixStore(self.prefix, base)  # type: ignore[attr-defined]

    @classmethod
    def of_default_group(cls, scope: str) -> JobStore | None:
        """The default process group's store under ``scope``; None without one."""
        try:
            base = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return None
        return cls(base, scope)

    @classmethod
    def connect(cls, scope: str, rank: int, timeout_s: float) -> JobStore:
        """The store at ``MASTER_ADDR:MASTER_PORT``, served by rank 0 unless torchrun's agent serves it.

        Raises:
            StoreError: it cannot be reached within ``timeout_s`` (names the address and its host).
        """
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        host = "rank 0" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) else "the torchrun agent"
        where = f"{addr}:{port} (hosted by {host})"
        try:
            base = dist.TCPStore(addr, port, world_size=None, is_master=hosts_store(rank),  # type: ignore[attr-defined]
                                 timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
        except (RuntimeError, OSError) as e:
            raise StoreError(f"rank {rank}: cannot reach the job store at {where} within {timeout_s:g} s: "
                             f"{first_line(e)}", e) from None
        return cls(base, scope, where)

    def child(self, name: str) -> JobStore:
        """The keys under ``{scope}/{name}/``, on the same connection."""
        return JobStore(self.base, f"{self.scope}/{name}", self.where, self.attempt)

    def clone(self) -> JobStore:
        """The same keys on a connection of its own, for another thread (the heartbeat's).

        Raises:
            StoreError: the store cannot be cloned or reached.
        """
        try:
            base = self.base.clone()
        except (RuntimeError, NotImplementedError, AttributeError, OSError) as e:
            raise StoreError(f"the job store at {self.where} cannot be shared with a thread: {first_line(e)}",
                             e) from None
        return JobStore(base, self.scope, self.where, self.attempt)

    # --- the c10d store's methods, with errors that name the store ----------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._call(self.raw.set, key, value)

    def get(self, key: str) -> bytes:
        """The value of ``key``; waits for it up to the store's own timeout."""
        return bytes(self._call(self.raw.get, key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.raw.add, key, amount))

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set (one request)."""
        return bool(self._call(self.raw.check, keys))

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:
            raise StoreError(f"lost the job store at {self.where}: {first_line(e)}", e) from None

    # --- errors ranks post ---------------------------------------------------------------

    def post_error(self, rank: int, message: str) -> None:
        """Tell the other ranks why ``rank`` stops: ``error/{rank}``, and one more in ``errors``."""
        self.set(f"error/{rank}", message[:ERROR_CHARS])
        self.add("errors", 1)

    def posted_errors(self, ranks: Iterable[int], exclude: int | None = None) -> dict[int, str]:
        """The errors ``ranks`` posted (but ``exclude``), by rank; one request when none did."""
        if self.add("errors", 0) == 0:
            return {}
        out: dict[int, str] = {}
        for r in ranks:
            if r != exclude and self.check([f"error/{r}"]):
                out[r] = self.get(f"error/{r}").decode(errors="replace")
        return out

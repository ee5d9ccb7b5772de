"""Barriers through the job store that name the ranks that did not come, and why.

A rank arrives by setting ``{key}/{rank}`` (with a payload, for a gather) and waits
until every expected rank's key is there. While it waits it polls, backing off from
1 ms to 50 ms, one request for the arrivals and one for posted errors::

    arrive        set {key}/{rank} = payload
    wait          until {key}/{r} is set for every expected r
                  a rank posted an error           -> BarrierError(failed={r: message})
                  timeout_s passed (no heartbeats)  -> BarrierError(late=[...])
                  with heartbeats: a missing rank's heartbeat stood still for timeout_s
                                                    -> BarrierError(late=[never beat], silent=[stopped])

With heartbeats a slow rank that is alive is waited for as long as it beats, so
the timeout bounds silence, not work.

Example:
    >>> barrier = Barrier(job, rank, world, timeout_s=60)                 # doctest: +SKIP
    >>> reports = barrier.gather("ckpt", "the checkpoint barrier", json.dumps(mine))  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hetrain.distributed.store import JobStore
from hetrain.distributed.work import NameFn, PeerError, rank_name, ranks_text

POLL_MIN_S = 0.001
POLL_MAX_S = 0.05


class BarrierError(PeerError):
    """Ranks did not arrive at a barrier, or one posted an error while this rank waited.

    Attributes:
        what: the barrier (``"the checkpoint barrier"``).
        late: ranks that did not arrive in time (with heartbeats: that never beat).
        silent: ranks whose heartbeat stopped (only with heartbeats).
        failed: errors other ranks posted, by rank.
    """

    def __init__(self, message: str, what: str, late: Sequence[int] = (), silent: Sequence[int] = (),
                 failed: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.late, self.silent = list(late), list(silent)
        self.failed = dict(failed or {})


def poll(ready: Callable[[], bool], timeout_s: float, check: Callable[[], None] | None = None) -> bool:
    """Call ``ready`` until it is true (True) or ``timeout_s`` passes (False), backing off 1 ms to 50 ms.

    ``check`` runs before each try and may raise (a posted error, a silent peer).
    """
    deadline = time.monotonic() + timeout_s
    delay = POLL_MIN_S
    while True:
        if check is not None:
            check()
        if ready():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, POLL_MAX_S)


class Barrier:
    """Barriers of ``world`` ranks over one ``JobStore``.

    Args:
        store: the job store (every rank with the same scope).
        rank, world: this rank and how many take part.
        timeout_s: how long to wait (with ``beats``: how long a missing rank may be silent).
        beats: ``rank -> beat count or None``, to tell a dead rank from a slow one
            (``Heartbeat.count``); None: wait at most ``timeout_s``.
        name: how a rank is named in messages.
    """

    def __init__(self, store: JobStore, rank: int, world: int, timeout_s: float, *,
                 beats: Callable[[int], int | None] | None = None, name: NameFn = rank_name) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.beats, self.name = beats, name

    def arrive(self, key: str, payload: str = "") -> None:
        """Tell the others that this rank is at ``key`` (with ``payload``); returns at once."""
        self.store.set(f"{key}/{self.rank}", payload)

    def wait(self, key: str, what: str, ranks: Sequence[int] | None = None) -> None:
        """Wait until ``ranks`` (default all) have arrived at ``key``.

        Raises:
            BarrierError: one of them is late or silent, or a rank posted an error (named).
            StoreError: the store is gone.
        """
        expected = list(range(self.world)) if ranks is None else list(ranks)
        keys = [f"{key}/{r}" for r in expected]
        seen: dict[int, tuple[int | None, float]] = {}  # rank -> (beat count, when it last changed)
        next_look = [0.0]

        def check() -> None:
            failed = self.store.posted_errors(range(self.world), exclude=self.rank)
            if failed:
                r = min(failed)
                raise BarrierError(f"{self.name(self.rank)} stops at {what}: {self.name(r)} failed: "
                                   f"{(failed[r].strip().splitlines() or [''])[0]}", what, failed=failed)
            now = time.monotonic()
            if self.beats is not None and now >= next_look[0]:
                next_look[0] = now + min(0.5, self.timeout_s / 4)
                self._look(key, what, expected, seen, now)

        timeout_s = float("inf") if self.beats is not None else self.timeout_s
        if not poll(lambda: self.store.check(keys), timeout_s, check):
            late = self.missing(key, expected)
            raise BarrierError(f"{self._names(late)} did not reach {what} within {self.timeout_s:g} s "
                               f"({self.name(self.rank)} waited)", what, late=late)

    def sync(self, key: str, what: str, payload: str = "") -> None:
        """``arrive`` and ``wait`` for every rank."""
        self.arrive(key, payload)
        self.wait(key, what)

    def gather(self, key: str, what: str, payload: str) -> list[str]:
        """``sync``, then every rank's payload, by rank."""
        self.sync(key, what, payload)
        return [self.store.get(f"{key}/{r}").decode() for r in range(self.world)]

    def missing(self, key: str, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have not arrived at ``key``."""
        return [r for r in ranks if not self.store.check([f"{key}/{r}"])]

    def _look(self, key: str, what: str, expected: Sequence[int], seen: dict[int, tuple[int | None, float]],
              now: float) -> None:
        """Raise when a missing rank's heartbeat has not moved for ``timeout_s``."""
        assert self.beats is not None
        never: list[int] = []
        silent: list[int] = []
        for r in self.missing(key, expected):
            count = self.beats(r)
            last = seen.get(r)
            if last is None or count != last[0]:
                seen[r] = (count, now)
            elif now - last[1] > self.timeout_s:
                (never if not count else silent).append(r)
        parts = []
        if never:
            parts.append(f"{self._names(never)} did not join within {self.timeout_s:g} s (waiting at {what})")
        if silent:
            parts.append(f"{self._names(silent)} stopped answering: no heartbeat for {self.timeout_s:g} s "
                         f"while waiting at {what}")
        if parts:
            raise BarrierError("; ".join(parts), what, late=never, silent=silent)

    def _names(self, ranks: Sequence[int]) -> str:
        if self.name is rank_name:
            return ranks_text(ranks)
        return ", ".join(self.name(r) for r in ranks)

"""Who is alive and what each rank is doing, so that a failed wait names the culprit.

Every rank of a job beats into the job store (``distributed.store``) once a second
from a background thread, with what its main thread is doing (``"step 3: RECV_B 2->1
mb0 from n0:2"``). A rank that fails posts its error there. When a wait fails,
the error message says, for the ranks concerned, when each was last heard of and
where it was; a SIGSTOPped or killed rank stops beating, a busy one does not::

    rank 1 (n0:1): no answer from rank 0 (n0:0), rank 2 (n0:2) within 5 s, waiting at ALLREDUCE seg0 bucket0
      rank 2 (n0:2): silent for 6.1 s, at step 2: 2B1
      rank 0 (n0:0): last heard 0.4 s ago, at step 2: ALLREDUCE seg0 bucket0

The keys carry the torchrun attempt, so a restarted job does not read its
predecessor's beats. A beat is ``beat/{rank}`` = ``{"n": count, "t": wall-clock
time, "doing": text}``: ``n`` tells a watcher on another host that the rank is
alive without comparing clocks (``Barrier``), ``t`` says how long ago it beat.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hetrain.distributed.barrier import poll
from hetrain.distributed.store import JobStore, StoreError, hosts_store
from hetrain.distributed.work import PeerError, WaitError, first_line, wait_work

__all__ = ["Beat", "Health", "Heartbeat", "PeerError", "beat_counter", "read_beat"]

_INSTANCES = itertools.count()  # Health objects of this process: keeps two trainers' keys apart


class Beat(NamedTuple):
    """A rank's last heartbeat: how many it has beaten, seconds since the last one, what it was doing."""

    beats: int
    age_s: float
    doing: str


def read_beat(store: JobStore, rank: int) -> Beat | None:
    """``rank``'s last beat, or None when it has not beaten yet.

    Raises:
        StoreError: the store is gone.
    """
    if not store.check([f"beat/{rank}"]):
        return None
    beat = json.loads(store.get(f"beat/{rank}"))
    return Beat(int(beat.get("n", 1)), time.time() - float(beat["t"]), str(beat.get("doing", "")))


def beat_counter(store: JobStore) -> Callable[[int], int | None]:
    """``rank -> beats so far`` (None before the first), for ``Barrier(beats=...)``."""
    def count(rank: int) -> int | None:
        beat = read_beat(store, rank)
        return None if beat is None else beat.beats
    return count


class Heartbeat:
    """A daemon thread that writes this rank's beat every ``period_s``.

    Args:
        store: the job store; the thread uses a clone of it (a connection of its own).
        rank: this rank.
        period_s: seconds between beats.
        doing: what the main thread is doing, read at each beat.

    ``start`` raises ``StoreError`` when the store cannot be shared with a thread.
    """

    def __init__(self, store: JobStore, rank: int, period_s: float, doing: Callable[[], str] = lambda: "") -> None:
        self.store, self.rank, self.period_s, self.doing = store, rank, period_s, doing
        self.count = 0
        self._own: JobStore | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Beat once now, then every ``period_s`` from the thread."""
        if self._thread is not None:
            return
        self._own = self.store.clone()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="hetrain-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)
            self._thread = None

    def beat(self) -> None:
        self.count += 1
        store = self._own or self.store
        store.set(f"beat/{self.rank}", json.dumps({"n": self.count, "t": time.time(), "doing": self.doing()}))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except Exception:  # the store is gone (its host died): stop beating, the main thread will see it
                return

class Health:
    """Heartbeats, the main thread's current action, and posted errors of one job's ranks.

    Args:
        rank: this process's rank.
        devices: device name of every rank (``devices[rank]``), for messages.
        period_s: seconds between beats.
        store: the job store to beat into; default the default process group's, under
            ``train/{k}``, ``k`` counting this process's Health objects (created in the same
            order on every rank), so several trainers in one process group do not mix.
    """

    def __init__(self, rank: int, devices: Sequence[str], period_s: float = 1.0,
                 store: JobStore | None = None) -> None:
        self.rank = rank
        self.devices = list(devices)
        self.period_s = period_s
        self.doing: Any = "setting up"  # a text, or (step, action) formatted when beating
        self.store = store if store is not None else JobStore.of_default_group(f"train/{next(_INSTANCES)}")
        self._heart = None if self.store is None else Heartbeat(self.store, rank, period_s, self._doing_text)

    def name(self, rank: int) -> str:
        """``"rank 2 (n0:2)"``."""
        return f"rank {rank} ({self.devices[rank]})" if 0 <= rank < len(self.devices) else f"rank {rank}"

    # --- beating ---------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread (a no-op without a store that can be shared with a thread)."""
        if self._heart is not None:
            with contextlib.suppress(StoreError):
                self._heart.start()

    def stop(self) -> None:
        if self._heart is not None:
            self._heart.stop()

    def _doing_text(self) -> str:
        doing = self.doing
        return f"step {doing[0]}: {doing[1]}" if isinstance(doing, tuple) else str(doing)

    # --- waiting ---------------------------------------------------------------

    def wait(self, work: Any, what: object, peers: Sequence[int], timeout_s: float) -> None:
        """``wait_work`` with ranks named by device; its error as a PeerError that describes ``peers``.

        Raises:
            PeerError: the operation timed out or failed (names ``what``, the peers, the timeout).
        """
        try:
            wait_work(work, what, peers, timeout_s, name=self.name)
        except WaitError as e:
            raise self.peer_error(str(e), e.peers, e.cause) from None

    # --- errors ----------------------------------------------------------------

    def post_error(self, message: str) -> None:
        """Tell the other ranks why this one stops (first line kept short)."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):
            self.store.post_error(self.rank, message)

    def posted_errors(self) -> dict[int, str]:
        """Errors other ranks posted, by rank."""
        if self.store is None:
            return {}
        try:
            return self.store.posted_errors(range(len(self.devices)), exclude=self.rank)
        except StoreError:
            return {}

    def _beats(self) -> dict[int, Beat] | None:
        """Every rank's last beat; ranks not beating yet are left out. None when the store cannot be read."""
        if self.store is None:
            return None
        out = {}
        for r in range(len(self.devices)):
            try:
                beat = read_beat(self.store, r)
            except (StoreError, ValueError, KeyError):
                return None
            if beat is not None:
                out[r] = beat
        return out

    @property
    def stale_s(self) -> float:
        """How long a rank may go without a beat before it counts as silent (dead, stopped or hung)."""
        return 2.5 * self.period_s

    def hosts_store(self) -> bool:
        """Whether this process serves the job store: rank 0 unless torchrun's agent serves it."""
        return hosts_store(self.rank)

    def linger(self, grace_s: float) -> None:
        """On the store's host, after a failure: wait until every other rank has posted its error or
        gone silent (so that they can still read the heartbeats that name the culprit), at most ``grace_s``.
        """
        if self.store is None or not self.hosts_store():
            return
        others = set(range(len(self.devices))) - {self.rank}

        def all_told() -> bool:
            beats = self._beats() or {}
            silent = {r for r, beat in beats.items() if beat.age_s > self.stale_s}
            return others <= silent | set(self.posted_errors())

        poll(all_told, grace_s)

    def failed_peer(self, grace_s: float) -> str | None:
        """After this rank's connection to a peer broke: which peer failed, waiting at most ``grace_s`` for
        one to post its error or fall silent (a killed process posts nothing; its beat stops).

        Returns ``"rank 1 (n0:1) failed: <its error>"`` / ``"rank 1 (n0:1) failed or stopped: silent for
        2.6 s, at step 7: FWD 1"``, or None when every peer still beats and none posted an error.
        """
        if self.store is None:
            return None
        found: list[str] = []

        def culprit() -> bool:
            errors = self.posted_errors()
            if errors:
                r = min(errors)
                found.append(f"{self.name(r)} failed: {errors[r].splitlines()[0]}")
                return True
            beats = self._beats() or {}
            silent = sorted((r for r, beat in beats.items() if r != self.rank and beat.age_s > self.stale_s),
                            key=lambda r: -beats[r].age_s)
            if silent:
                r = silent[0]
                found.append(f"{self.name(r)} failed or stopped: silent for {beats[r].age_s:.1f} s, "
                             f"at {beats[r].doing}")
            return bool(silent)

        poll(culprit, grace_s)
        return found[-1] if found else None

    def describe(self, ranks: Sequence[int], stale_s: float, max_lines: int = 8) -> str:
        """What ``ranks`` and every silent rank last reported, and the errors other ranks posted.

        One line per rank: ``silent for 6.1 s`` when its heartbeat stopped (dead, stopped or
        hung), else when it was last heard of; and what it was doing then.
        """
        if self.store is None:
            return ""
        beats = self._beats()
        if beats is None:
            return ("  (the other ranks' heartbeats cannot be read: the job store is gone, "
                    "its host has exited)")
        silent = [r for r, beat in sorted(beats.items()) if beat.age_s > stale_s and r not in ranks]
        lines = []
        for r in [*ranks, *silent][:max_lines]:
            if r == self.rank:
                continue
            if r not in beats:
                lines.append(f"  {self.name(r)}: never heard of")
                continue
            age = beats[r].age_s
            state = f"silent for {age:.1f} s" if age > stale_s else f"last heard {age:.1f} s ago"
            lines.append(f"  {self.name(r)}: {state}, at {beats[r].doing}")
        errors = self.posted_errors()
        lines += [f"  {self.name(r)} reported: {msg.splitlines()[0]}" for r, msg in sorted(errors.items())]
        return "\n".join(lines)

    def peer_error(self, message: str, ranks: Sequence[int], cause: BaseException | None = None) -> PeerError:
        """A PeerError: ``message``, the underlying error's first line, then the state of ``ranks``."""
        text = f"{self.name(self.rank)}: {message}"
        if cause is not None:
            text += f"\n  cause: {first_line(cause)}"
        described = self.describe(ranks, stale_s=self.stale_s)
        if described:
            text += "\n" + described
        return PeerError(text)

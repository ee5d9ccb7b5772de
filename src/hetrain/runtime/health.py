"""Who is alive and what each rank is doing, so that a failed wait names the culprit.

Every rank of a job beats into the rendezvous store once a second from a
background thread, with what its main thread is doing (``"step 3: RECV_B 2->1
mb0 from n0:2"``). A rank that fails posts its error there. When a wait fails,
the error message says, for the ranks concerned, when each was last heard of and
where it was; a SIGSTOPped or killed rank stops beating, a busy one does not::

    rank 1 (n0:1): ALLREDUCE seg0 did not finish within 5 s
      rank 2 (n0:2): silent for 6.1 s, at step 2: 2B1
      rank 0 (n0:0): last heard 0.4 s ago, at step 2: ALLREDUCE seg0

Under ``torchrun --max-restarts`` the keys carry the restart count, so a
restarted job does not read its predecessor's beats.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from hetrain.errors import RunError

_INSTANCES = iter(range(1 << 30))


class PeerError(RunError):
    """A peer died, stopped answering, or failed: names it and the action that waited for it."""


def _default_store() -> Any:
    """The default process group's store, or None where it cannot be had."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class Health:
    """Heartbeats, the main thread's current action, and posted errors of one job's ranks.

    Args:
        rank: this process's rank.
        devices: device name of every rank (``devices[rank]``), for messages.
        period_s: seconds between beats.

    Each instance has its own keys (instances are created in the same order on
    every rank), so several trainers in one process group do not mix.
    """

    def __init__(self, rank: int, devices: Sequence[str], period_s: float = 1.0) -> None:
        self.rank = rank
        self.devices = list(devices)
        self.period_s = period_s
        self.doing: Any = "setting up"  # a text, or (step, action) formatted when beating
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"hetrain/train/{restart}/{next(_INSTANCES)}/"
        base = _default_store()
        self.store: Any = dist.PrefixStore(prefix, base) if base is not None else None  # type: ignore[attr-defined]
        self._beat_store: Any = None
        if base is not None:
            with contextlib.suppress(RuntimeError, NotImplementedError, AttributeError):
                self._beat_store = dist.PrefixStore(prefix, base.clone())  # type: ignore[attr-defined]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def name(self, rank: int) -> str:
        """``"rank 2 (n0:2)"``."""
        return f"rank {rank} ({self.devices[rank]})" if 0 <= rank < len(self.devices) else f"rank {rank}"

    # --- beating ---------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread (a no-op without a store that can be shared with a thread)."""
        if self._beat_store is None or self._thread is not None:
            return
        self._beat()
        self._thread = threading.Thread(target=self._run, name="hetrain-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)
            self._thread = None

    def _beat(self) -> None:
        doing = self.doing
        text = f"step {doing[0]}: {doing[1]}" if isinstance(doing, tuple) else str(doing)
        self._beat_store.set(f"beat/{self.rank}", json.dumps({"t": time.time(), "doing": text}))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
            except Exception:  # the store is gone (its host died): stop beating, the main thread will see it
                return

    # --- errors ----------------------------------------------------------------

    def post_error(self, message: str) -> None:
        """Tell the other ranks why this one stops (first line kept short)."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):
            self.store.set(f"error/{self.rank}", message[:2000])
            self.store.add("errors", 1)

    def posted_errors(self) -> dict[int, str]:
        """Errors other ranks posted, by rank."""
        if self.store is None:
            return {}
        out: dict[int, str] = {}
        try:
            if not self.store.check(["errors"]) or int(self.store.add("errors", 0)) == 0:
                return {}
            for r in range(len(self.devices)):
                if r != self.rank and self.store.check([f"error/{r}"]):
                    out[r] = self.store.get(f"error/{r}").decode(errors="replace")
        except Exception:
            return out
        return out

    def _beats(self) -> dict[int, tuple[float, str]] | None:
        """Every rank's last beat: (seconds since, what it was doing); ranks not beating yet are left out.

        None when the store cannot be read (its host has exited).
        """
        now = time.time()
        out = {}
        for r in range(len(self.devices)):
            try:
                if self.store.check([f"beat/{r}"]):
                    beat = json.loads(self.store.get(f"beat/{r}"))
                    out[r] = (now - float(beat["t"]), str(beat["doing"]))
            except Exception:
                return None
        return out

    def hosts_store(self) -> bool:
        """Whether this process serves the rendezvous store: rank 0 unless torchrun's agent serves it."""
        return self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"

    def linger(self, grace_s: float) -> None:
        """On the store's host, after a failure: wait until every other rank has posted its error or
        gone silent (so that they can still read the heartbeats that name the culprit), at most ``grace_s``.
        """
        if self.store is None or not self.hosts_store():
            return
        deadline = time.monotonic() + grace_s
        others = set(range(len(self.devices))) - {self.rank}
        while time.monotonic() < deadline:
            beats = self._beats() or {}
            silent = {r for r, (age, _) in beats.items() if age > 2.5 * self.period_s}
            if others <= silent | set(self.posted_errors()):
                return
            time.sleep(0.05)

    def describe(self, ranks: Sequence[int], stale_s: float, max_lines: int = 8) -> str:
        """What ``ranks`` and every silent rank last reported, and the errors other ranks posted.

        One line per rank: ``silent for 6.1 s`` when its heartbeat stopped (dead, stopped or
        hung), else when it was last heard of; and what it was doing then.
        """
        if self.store is None:
            return ""
        beats = self._beats()
        if beats is None:
            return ("  (the other ranks' heartbeats cannot be read: the rendezvous store is gone, "
                    "its host has exited)")
        silent = [r for r, (age, _) in sorted(beats.items()) if age > stale_s and r not in ranks]
        lines = []
        for r in [*ranks, *silent][:max_lines]:
            if r == self.rank:
                continue
            if r not in beats:
                lines.append(f"  {self.name(r)}: never heard of")
                continue
            age, doing = beats[r]
            state = f"silent for {age:.1f} s" if age > stale_s else f"last heard {age:.1f} s ago"
            lines.append(f"  {self.name(r)}: {state}, at {doing}")
        errors = self.posted_errors()
        lines += [f"  {self.name(r)} reported: {msg.splitlines()[0]}" for r, msg in sorted(errors.items())]
        return "\n".join(lines)

    def peer_error(self, message: str, ranks: Sequence[int], cause: BaseException | None = None) -> PeerError:
        """A PeerError: ``message``, the underlying error's first line, then the state of ``ranks``."""
        text = f"{self.name(self.rank)}: {message}"
        if cause is not None:
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            text += f"\n  cause: {first}"
        described = self.describe(ranks, stale_s=2.5 * self.period_s)
        if described:
            text += "\n" + described
        return PeerError(text)

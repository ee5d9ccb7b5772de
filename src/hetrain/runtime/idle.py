"""Ranks whose device the plan leaves unused: they idle, joining only the checkpoint writes.

A checkpoint write is collective over the whole job (``runtime.checkpoint``), so
an unused rank must take part in each, with nothing to write. The reporting rank
posts numbered events to the job's store; unused ranks read them in order::

    reporting rank:  event/0 {"kind": "checkpoint", "step": 50, "meta": ...}   event/1 {"kind": "done"}
    unused rank:     wait event/0 -> join save_checkpoint(step 50)             wait event/1 -> return

While waiting, an unused rank watches the reporting rank's heartbeat and the
errors other ranks post, so it fails (naming the peer) rather than wait forever.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hetrain.runtime.checkpoint import save_checkpoint
from hetrain.runtime.health import PeerError
from hetrain.runtime.job import Job


class JobEvents:
    """The events the reporting rank posts to unused ranks, counted on both sides.

    Args:
        job: this rank's job.
        checkpoint_dir: where checkpoints go (None: no checkpoints, so no events).
    """

    def __init__(self, job: Job, checkpoint_dir: Path | None) -> None:
        self.job = job
        self.checkpoint_dir = checkpoint_dir
        self.count = 0  # events posted (reporting rank) or read (unused rank)

    def post(self, event: dict[str, Any]) -> None:
        """On the reporting rank: tell unused ranks what to join (checkpoint writes) or that training is done."""
        job = self.job
        if job.rank != job.report_rank or len(job.used_ranks) == job.world or self.checkpoint_dir is None:
            return
        if job.health.store is not None:
            job.health.store.set(f"event/{self.count}", json.dumps(event))
        self.count += 1

    def idle(self, step: int) -> int:
        """On an unused rank: join each checkpoint write until training is done; returns the last step joined.

        Raises:
            PeerError: a rank posted an error, or the reporting rank fell silent for ``timeout_s``.
        """
        job = self.job
        if self.checkpoint_dir is None or job.health.store is None:
            return step
        store = job.health.store
        job.health.doing = "idle (device unused by the plan)"
        while True:
            key = f"event/{self.count}"
            self._wait_for(key)
            event = json.loads(store.get(key))
            self.count += 1
            if event["kind"] == "done":
                return step
            step = int(event["step"])
            save_checkpoint(self.checkpoint_dir, step, {}, {}, event["meta"], owned_names=set(),
                            timeout_s=job.timeout_s)

    def _wait_for(self, key: str) -> None:
        job, health = self.job, self.job.health
        last_seen = time.monotonic()
        while not health.store.check([key]):
            errors = health.posted_errors()
            if errors:
                r, msg = min(errors.items())
                raise PeerError(f"{health.name(job.rank)} (idle): {health.name(r)} failed: {msg.splitlines()[0]}")
            if self._reporting_rank_alive():
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > job.timeout_s:
                raise health.peer_error(f"idle, waiting for news from {health.name(job.report_rank)}",
                                        [job.report_rank])
            time.sleep(0.2)

    def _reporting_rank_alive(self) -> bool:
        store = self.job.health.store
        key = f"beat/{self.job.report_rank}"
        try:
            if not store.check([key]):
                return True  # not beating yet
            beat = json.loads(store.get(key))
        except Exception:
            return False
        return bool(time.time() - float(beat["t"]) < 3 * self.job.health.period_s)

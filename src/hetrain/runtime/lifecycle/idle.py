"""Ranks whose device the plan leaves unused: they idle, joining only the checkpoint writes.

A checkpoint write is collective over the whole job (``runtime.state.checkpoint``), so
an unused rank must take part in each, with nothing to write. The reporting rank
posts numbered events to the job's store; unused ranks read them in order::

    reporting rank:  event/0 {"kind": "checkpoint", "step": 50, "meta": ...}   event/1 {"kind": "done"}
    unused rank:     wait event/0 -> join save_checkpoint(step 50)             wait event/1 -> return

While waiting, an unused rank watches the reporting rank's heartbeat and the
errors other ranks post, so it fails (naming the peer) rather than wait forever.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.health import PeerError, beat_counter
from hetrain.runtime.lifecycle.drift_watch import DriftSwitch
from hetrain.runtime.lifecycle.job import Job
from hetrain.runtime.state.checkpoint import save_checkpoint


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
        self.fits = 0  # fits ended (``leave``)

    def post(self, event: dict[str, Any]) -> None:
        """On the reporting rank: tell unused ranks what to join (checkpoint writes) or that training is done."""
        job = self.job
        if job.rank != job.report_rank or len(job.used_ranks) == job.world or self.checkpoint_dir is None:
            return
        if job.health.store is not None:
            Barrier(job.health.store, job.rank, job.world, job.timeout_s).arrive(f"event/{self.count}",
                                                                                json.dumps(event))
        self.count += 1

    def leave(self) -> None:
        """On every rank, at the end of a fit: say so. The rank that serves the job's store (rank 0, unless
        torchrun's agent serves it) then waits for every other rank: returning at once, its process could
        exit and take the store with it while a peer still polls it for the last event or checkpoint.

        Raises:
            PeerError: a rank posted an error, or fell silent for ``timeout_s`` before leaving (named).
        """
        job, store = self.job, self.job.health.store
        if store is None or job.world == 1:
            return
        key = f"left/{self.fits}"
        self.fits += 1
        barrier = Barrier(store, job.rank, job.world, job.timeout_s, beats=beat_counter(store), name=job.health.name)
        barrier.arrive(key)
        if not job.health.hosts_store():
            return
        others = [r for r in range(job.world) if r != job.rank]
        try:
            barrier.wait(key, "the end of training (this rank serves the job's store)", ranks=others)
        except BarrierError as e:
            raise job.health.peer_error("waiting for every rank to end training", e.late or e.silent or others,
                                        e) from None

    def idle(self, step: int) -> int:
        """On an unused rank: join each checkpoint write until training is done; returns the last step joined.

        Raises:
            PeerError: a rank posted an error, or the reporting rank fell silent for ``timeout_s``.
        """
        job = self.job
        if self.checkpoint_dir is None or job.health.store is None:
            return step
        store, health = job.health.store, job.health
        health.doing = "idle (device unused by the plan)"
        barrier = Barrier(store, job.rank, job.world, job.timeout_s, beats=beat_counter(store), name=health.name)
        reporter = health.name(job.report_rank)
        while True:
            key = f"event/{self.count}"
            try:
                barrier.wait(key, f"news from {reporter}", ranks=[job.report_rank])
            except BarrierError as e:
                if e.failed:
                    r = min(e.failed)
                    raise PeerError(f"{health.name(job.rank)} (idle): {health.name(r)} failed: "
                                    f"{e.failed[r].splitlines()[0]}") from None
                raise health.peer_error(f"idle, waiting for news from {reporter}", [job.report_rank], e) from None
            event = json.loads(store.get(f"{key}/{job.report_rank}"))
            self.count += 1
            if event["kind"] == "done":
                return step
            if event["kind"] == "switch":  # the used ranks switch plans (lifecycle.drift_watch): leave with them
                raise DriftSwitch(f"switching plans at step {event['step']} (drift)", int(event["step"]), None)
            step = int(event["step"])
            save_checkpoint(self.checkpoint_dir, step, {}, {}, event["meta"], owned_names=set(),
                            timeout_s=job.timeout_s)

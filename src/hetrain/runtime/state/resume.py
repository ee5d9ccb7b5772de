"""Which checkpoint a run resumes from: the newest intact one, chosen once and the same on every rank.

A checkpoint is intact when its manifest reads and every file it lists has the size and
SHA-256 the manifest gives (``checkpoint.check_file``). At start-up every rank of the job
calls ``find_resume`` (``runtime.lifecycle.job.build_job``), which tries the checkpoints
newest first::

    every rank   read the manifest (one that does not read: damaged, try the next)
                 check its share of the files: rank r the r-th, (r+W)-th, ... of the manifest's,
                 so the job reads the checkpoint once, not once per rank
    barrier      all-gather the damaged files found (the job store, hetrain.distributed.barrier)
    every rank   none found: resume from it; else pass it over and try the next older one

Every rank sees the same lists, so every rank takes the same checkpoint. A checkpoint
passed over is named in one line (``ResumePoint.notice``), which rank 0 prints::

    hetrain: passing over damaged checkpoint step 20 (ckpt/step-00000020/layers.1.pt is damaged: its
    SHA-256 differs from the manifest's); resuming from step 10, the newest intact checkpoint in ckpt

When no checkpoint is intact the run is refused in one line that names every damaged file.
Damaged data is never loaded: loading a given checkpoint (``load_checkpoint``, and so
``hetrain export``) still refuses a damaged file, and the checkpoint passed over is left
where it is, for a person to look at.

Example:
    >>> resume = find_resume("ckpt", timeout_s=60)                        # doctest: +SKIP
    >>> start = 0 if resume is None else resume.step                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from hetrain.distributed.barrier import Barrier, BarrierError
from hetrain.distributed.store import JobStore, StoreError
from hetrain.distributed.work import first_line, ranks_text
from hetrain.runtime.state.checkpoint import CheckpointError, check_file, complete_checkpoints, load_manifest

__all__ = ["Damaged", "ResumePoint", "find_resume"]

_CHECKS = itertools.count()  # find_resume calls in this process: keeps the store keys of two calls apart


@dataclass(frozen=True)
class Damaged:
    """A checkpoint passed over: its step and what is wrong, one clause per file (naming it)."""

    step: int
    problems: tuple[str, ...]

    def describe(self, limit: int = 3) -> str:
        """``checkpoint step 20 (…/layers.1.pt is damaged: …; and 2 more files)``."""
        shown = "; ".join(self.problems[:limit])
        more = len(self.problems) - limit
        return f"checkpoint step {self.step} ({shown}{f'; and {more} more files' if more > 0 else ''})"


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from (``find_resume``).

    Attributes:
        step: its step.
        path: its directory (``step-NNNNNNNN/``).
        damaged: the newer checkpoints passed over, newest first.
    """

    step: int
    path: Path
    damaged: tuple[Damaged, ...] = ()

    def notice(self) -> str | None:
        """One line naming the checkpoints passed over and the step resumed from; None when none was."""
        if not self.damaged:
            return None
        passed = _describe_all(self.damaged)
        return (f"passing over damaged {passed}; resuming from step {self.step}, the newest intact checkpoint in "
                f"{self.path.parent}")


def find_resume(directory: str | os.PathLike[str], timeout_s: float = 60.0) -> ResumePoint | None:
    """The newest intact checkpoint in ``directory``; a collective over the default group when torch.distributed
    is up (every rank calls it, with the same directory, and gets the same answer).

    Args:
        directory: where ``save_checkpoint`` writes.
        timeout_s: how long a rank waits for the others to check their share of a checkpoint's files.

    Returns:
        The checkpoint to resume from, with the newer ones passed over; None when ``directory`` holds no
        complete checkpoint (none, or only interrupted saves).

    Raises:
        CheckpointError: every complete checkpoint is damaged (one line naming each damaged file), or a rank
            did not check its share within ``timeout_s`` (named).
    """
    directory = Path(directory)
    share = _Share(timeout_s)
    damaged: list[Damaged] = []
    for step, path in reversed(complete_checkpoints(directory)):
        try:
            files = load_manifest(directory, step)["files"]
        except CheckpointError as e:  # every rank reads the same manifest alike: nothing to share
            damaged.append(Damaged(step, (str(e),)))
            continue
        mine = [f for k, f in enumerate(files) if k % share.world == share.rank]
        found = [wrong for f in mine if (wrong := check_file(path / f, files[f])) is not None]
        problems = share.all_gather(step, found)
        if problems:
            damaged.append(Damaged(step, tuple(problems)))
            continue
        return ResumePoint(step, path, tuple(damaged))
    if damaged:
        share.finish()
        raise CheckpointError(f"no intact checkpoint to resume from in {directory}: "
                              f"{_describe_all(damaged)}; move the damaged step directories "
                              f"aside to start from step 0, or put back intact copies of their files")
    return None


class _Share:
    """Which files this rank checks, and the all-gather of what the ranks found, through the job store.

    Keys live under ``checkpoint-resume/{k}/checked/{step}/{rank}`` (``k`` counting this process's calls, the
    same on every rank). Without torch.distributed, with one rank or without a store, this rank checks every
    file and the all-gather is its own list.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        self.barrier: Barrier | None = None
        if world > 1:
            store = JobStore.of_default_group(f"checkpoint-resume/{next(_CHECKS)}")
            if store is not None:
                self.barrier = Barrier(store, rank, world, timeout_s)
        self.rank, self.world = (rank, world) if self.barrier is not None else (0, 1)

    def all_gather(self, step: int, found: list[str]) -> list[str]:
        """Every rank's ``found`` for checkpoint ``step``, joined in rank order."""
        if self.barrier is None:
            return found
        try:
            lists = self.barrier.gather(f"checked/{step}", f"its share of checkpoint step {step}'s files",
                                        json.dumps(found))
        except BarrierError as e:  # nothing is posted under these keys: a rank is late
            raise CheckpointError(f"finding the checkpoint to resume from: {ranks_text(e.late)} did not check "
                                  f"{e.what} within {self.timeout_s:g} s (rank {self.rank} waited)") from None
        except StoreError as e:
            raise CheckpointError(f"finding the checkpoint to resume from: rank {self.rank} lost the process "
                                  f"group's store: {first_line(e.cause)}") from None
        return [problem for text in lists for problem in json.loads(text)]

    def finish(self) -> None:
        """Before every rank leaves: rank 0, which usually serves the store, waits (at most ``timeout_s``) until
        every other rank has read the last lists, so that none loses the store before it has them."""
        if self.barrier is None:
            return
        with contextlib.suppress(BarrierError, StoreError):
            self.barrier.arrive("read")
            if self.rank == 0:
                self.barrier.wait("read", "the end of the checks")


def _describe_all(damaged: list[Damaged] | tuple[Damaged, ...], limit: int = 5) -> str:
    """The first ``limit`` checkpoints passed over, described, then how many more."""
    shown = ", ".join(d.describe() for d in damaged[:limit])
    return shown + (f" and {len(damaged) - limit} more damaged checkpoints" if len(damaged) > limit else "")

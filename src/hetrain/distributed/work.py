"""Wait for a torch.distributed operation, at most a timeout, and name the peers it waited on.

Every collective, send and receive of hetrain is posted with ``async_op=True`` and
waited for here, so that one place tells a timeout from a failure::

    wait_work(dist.irecv(t, 2), "RECV_F 1->2 mb0", [2], 3.0)
    WaitError: no answer from rank 2 within 3 s, waiting at RECV_F 1->2 mb0
    WaitError: rank 2 failed or closed its connection while this rank waited at RECV_F 1->2 mb0

Gloo raises when a wait times out and when a peer goes away (its message says
which: "timed out" / "Connection closed by peer"); a wait that returns ``False``
has timed out too. ``completed_within`` asks whether operations finished by
themselves, without waiting on them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from hetrain.errors import RunError

NameFn = Callable[[int], str]


class PeerError(RunError):
    """A peer died, stopped answering, or failed: names it and the action that waited for it."""


class WaitError(PeerError):
    """An operation with peers did not finish within its timeout, or failed.

    Attributes:
        what: the action that waited (``"RECV_F 1->2 mb0"``).
        peers: the ranks it waited on.
        timeout_s: how long it waited at most.
        timed_out: True when it ran out of time, False when it failed.
        cause: the underlying error (None when the wait returned False).
    """

    def __init__(self, message: str, what: object, peers: Sequence[int], timeout_s: float, timed_out: bool,
                 cause: BaseException | None) -> None:
        super().__init__(message)
        self.what = what
        self.peers = list(peers)
        self.timeout_s = timeout_s
        self.timed_out = timed_out
        self.cause = cause


def rank_name(rank: int) -> str:
    """``"rank 2"``: how a peer is named where no device names are known."""
    return f"rank {rank}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 3"`` / ``"ranks 1, 3"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def first_line(e: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_timeout(e: BaseException) -> bool:
    """Whether a torch.distributed error says that a wait ran out of time (rather than that a peer failed)."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def is_connection_loss(e: BaseException) -> bool:
    """Whether ``e`` is a torch.distributed error that says a peer's connection broke (Gloo's "Connection
    reset by peer" / "closed by peer" when posting to a peer that died, NCCL's remote errors): the peer
    failed, not this rank's model. Timeouts are not connection losses."""
    import torch.distributed as dist

    text = str(e).lower()
    if is_timeout(e):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("connection reset", "connection closed", "closed by peer", "broken pipe", "gloo/transport"))


def wait_work(work: Any, what: object, peers: Sequence[int], timeout_s: float, *, name: NameFn = rank_name) -> None:
    """Wait for ``work`` (a ``torch.distributed`` Work handle) at most ``timeout_s``.

    Args:
        work: what ``dist.isend`` / ``dist.all_reduce(..., async_op=True)`` and the like return.
        what: the action that waits, for the message (``"ALLREDUCE seg0 bucket1"``).
        peers: the ranks the operation depends on; this rank, if listed, is left out of the message.
        timeout_s: the longest wait.
        name: how a rank is named (``Health.name`` gives ``"rank 2 (n0:2)"``).

    Raises:
        WaitError: the operation timed out or failed; names ``what``, the peers and the timeout.

    Example:
        >>> wait_work(dist.all_reduce(x, async_op=True), "the loss all-reduce", [0, 1], 30.0)  # doctest: +SKIP
    """
    try:
        done = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise _error(what, peers, timeout_s, is_timeout(e), e, name) from None
    if done is False:
        raise _error(what, peers, timeout_s, True, None, name)


def _error(what: object, peers: Sequence[int], timeout_s: float, timed_out: bool, cause: BaseException | None,
           name: NameFn) -> WaitError:
    me = _own_rank()
    others = [p for p in peers if p != me]
    who = ", ".join(name(p) for p in others) if others else "the other ranks of the group"
    if timed_out:
        message = f"no answer from {who} within {timeout_s:g} s, waiting at {what}"
    else:
        one = "" if len(others) == 1 else "one of "
        message = f"{one}{who} failed or closed its connection while this rank waited at {what}"
    return WaitError(message, what, peers, timeout_s, timed_out, cause)


def _own_rank() -> int | None:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def completed_within(works: Sequence[Any], timeout_s: float) -> bool:
    """Whether every one of ``works`` completes (or fails) within ``timeout_s``, without waiting on them.

    Watches each operation's future instead of calling ``wait``, so nothing here drives
    the operations or synchronises a CUDA stream: it tells whether they land by themselves.
    """
    deadline = time.monotonic() + timeout_s
    for work in works:
        if work.is_completed():
            continue
        landed = threading.Event()
        work.get_future().add_done_callback(lambda _future, event=landed: event.set())
        if not landed.wait(max(0.0, deadline - time.monotonic())):
            return False
    return True

"""The event engine: runs a compiled ``Program`` in global time order.

A queue holds ``Wake`` events, earliest first (first queued first among equal
times). Each has an ``EventKind`` and one handler:

- ``DEVICE_READY`` (a device): run the device's operations from where it stands
  until one takes time (it queues the device's next ``DEVICE_READY``) or waits
  (whoever it waits for advances it and wakes it). One handler per operation type.
- ``BUCKET_READY`` (a bucket's all-reduce): one more owner has computed the
  bucket's gradients; after the last, the all-reduce starts.
- ``PHASE_DONE`` (a collective): its current phase ended, or it starts: run the
  next phase on its links (queued behind what holds them), or end it.

A blocking collective (``Collective``) holds its owners until it ends; a posted
one (``AverageStart``, a bucket's all-reduce) lets them go on, and wakes whoever
waits for it (``AverageMerge``, ``BucketWait``) when it ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

from hetrain.schedule import ScheduleError, validate
from hetrain.simulator.compile import Program
from hetrain.simulator.links import occupy, occupy_each, share
from hetrain.simulator.ops import (
    AverageMerge,
    AverageStart,
    Backward,
    BucketStart,
    BucketWait,
    Collective,
    Forward,
    OptimizerStep,
    Pull,
    Push,
    Recv,
    Send,
    TransferKey,
)
from hetrain.timeline import Event


class EventKind(IntEnum):
    """What a queued ``Wake`` means; its ``subject`` is a device for ``DEVICE_READY``, else a collective."""

    DEVICE_READY = 0
    PHASE_DONE = 1
    BUCKET_READY = 2


class Wake(NamedTuple):
    """One queued event. ``seq`` orders events of equal time: first queued, first run."""

    time_s: float
    seq: int
    kind: EventKind
    subject: int


class Flow(IntEnum):
    """What a device does after one of its operations."""

    NEXT = 0  # runs its next operation now
    LATER = 1  # runs its next operation when its queued DEVICE_READY comes
    BLOCKED = 2  # the operation waits; it runs again, or is passed, when the device is woken


_DEVICE_READY, _PHASE_DONE, _BUCKET_READY = EventKind
_NEXT, _LATER, _BLOCKED = Flow
_new = tuple.__new__  # Event(...) / Wake(...) without NamedTuple's Python-level __new__: the hot path


@dataclass(frozen=True)
class Replayed:
    """What the replay measured, per device number (``Program.names``), over all iterations."""

    finish_s: list[float]  # when each device ran its last operation
    last_backward_s: float  # the end of the last backward on any device
    events: list[list[Event]]
    memory: list[list[tuple[float, float]]]  # (time_s, bytes) steps
    busy_s: list[float]  # forward, backward, optimizer step
    sync_s: list[float]  # held by a collective, a bucket's all-reduce or a pull
    max_in_flight: list[int]  # micro-batches whose activations were held at once


def run_program(program: Program) -> Replayed:
    """Replay ``program``; raises ScheduleError (with ``validate``'s grid where it finds one) if it stalls."""
    engine = _Engine(program)
    try:
        return engine.run()
    finally:
        engine.release()


class _Engine:
    """The replay's state and its handlers: one per event kind, one per operation type."""

    def __init__(self, program: Program) -> None:
        n = len(program.names)
        self.program = program
        self.ops = program.ops
        self.collectives = program.collectives
        self.free_at, self.link_events = program.links.free_at, program.links.events
        # parameter-server phases, in the background (``links.share``): per link, when the last one queued on it
        # ends and which collective it belongs to; per collective, when its running phase ends once shared
        self.shares = any(ph.holds_s is not None for c in program.collectives for ph in c.phases)
        self.shared_until = [0.0] * len(self.free_at)
        self.shared_by = [-1] * len(self.free_at)
        self.phase_end: dict[int, float] = {}
        self.queue: list[Wake] = [Wake(0.0, d, _DEVICE_READY, d) for d in range(n)]
        self.seq = itertools.count(n)
        self.pc = [0] * n  # per device: its next operation
        self.finish = [0.0] * n
        self.last_backward = 0.0
        self.events: list[list[Event]] = [[] for _ in range(n)]
        self.memory = list(program.weights_bytes)
        self.curves: list[list[tuple[float, float]]] = [[(0.0, w)] for w in program.weights_bytes]
        self.in_flight = [0] * n
        self.max_in_flight = [0] * n
        self.busy = [0.0] * n
        self.sync = [0.0] * n
        # point-to-point: transfer -> when it arrives (sent first) / (receiver, since when) (receiver first)
        self.arrivals: dict[TransferKey, float] = {}
        self.receivers: dict[TransferKey, tuple[int, float]] = {}
        # a blocking transfer sent before its receiver reached it: (when it started on its links, duration)
        self.blocking_sent: dict[TransferKey, tuple[float, float]] = {}
        # collectives: owners arrived, the phase that runs next, when it started
        self.arrived: dict[int, list[int]] = {}
        self.phase_of: dict[int, int] = {}
        self.sync_start: dict[int, float] = {}
        self.posted_end: dict[int, float] = {}  # posted averages and bucket all-reduces: end (-1 while running)
        self.bucket_owners_ready: dict[int, int] = {}  # bucket all-reduce -> owners whose gradients of it are final
        self.posted_waiters: dict[int, list[int]] = {}
        self.waits_since: dict[int, float] = {}
        self.on_event: tuple[Callable[[float, int], None], ...] = (
            self._device_ready, self._phase_done, self._bucket_ready)
        self.on_op: dict[type, Callable[[float, int, Any], Flow]] = {
            Forward: self._forward, Backward: self._backward, Send: self._send, Recv: self._recv,
            Collective: self._collective, AverageStart: self._average_start, AverageMerge: self._average_merge,
            BucketStart: self._bucket_start, BucketWait: self._bucket_wait, Push: self._push, Pull: self._pull,
            OptimizerStep: self._optimizer_step,
        }

    def release(self) -> None:
        """Drop the handler tables once the replay is over. Their bound methods refer to the engine, a reference
        cycle that kept the whole replay (every operation, event and link reservation: 850,000 objects on a
        4096-device plan) alive until the cyclic garbage collector scanned it all (0.2 to 0.5 s per simulation);
        without them it is freed as soon as the result is."""
        del self.on_event, self.on_op

    def run(self) -> Replayed:
        queue, pop, on_event = self.queue, heapq.heappop, self.on_event
        while queue:
            t, _, kind, subject = pop(queue)
            on_event[kind](t, subject)
        return self.finished()

    def finished(self) -> Replayed:
        """What the replay measured, once the queue is empty; ScheduleError if a device never finished."""
        program = self.program
        stuck = [program.names[d] for d, ops in enumerate(self.ops) if self.pc[d] < len(ops)]
        if stuck:
            validate(program.schedule, program.plan)  # raises with the grid
            raise ScheduleError(f"simulation stalled with {', '.join(stuck[:4])} unfinished")
        return Replayed(self.finish, self.last_backward, self.events, self.curves, self.busy, self.sync,
                        self.max_in_flight)

    def _wake(self, t: float, kind: EventKind, subject: int) -> None:
        heapq.heappush(self.queue, _new(Wake, (t, next(self.seq), kind, subject)))

    # --- event kinds --------------------------------------------------------

    def _device_ready(self, t: float, d: int) -> None:
        """Run device ``d``'s operations from its next one until one takes time or waits."""
        ops, on_op = self.ops[d], self.on_op
        k, count = self.pc[d], len(ops)
        while k < count:
            op = ops[k]
            flow = on_op[op.__class__](t, d, op)
            if flow is _NEXT:
                k += 1
            elif flow is _LATER:
                k += 1
                break
            else:
                break
        else:
            self.finish[d] = t
        self.pc[d] = k

    def _bucket_ready(self, t: float, s: int) -> None:
        """One more owner has computed the gradients of bucket all-reduce ``s``: start it after the last."""
        ready = self.bucket_owners_ready[s] = self.bucket_owners_ready.get(s, 0) + 1
        if ready == len(self.collectives[s].owners):
            self.posted_end[s] = -1.0
            self._start_collective(t, s)

    def _phase_done(self, t: float, s: int) -> None:
        """Collective ``s``'s phase ended at ``t`` (or it starts): run its next phase, or end it. A background
        phase that transfers shared its links with ends later (``links.share``): wait for that first."""
        later = self.phase_end.pop(s, t)
        if later > t:
            self._wake(later, _PHASE_DONE, s)
            return
        k = self.phase_of[s]
        spec = self.collectives[s]
        if k == len(spec.phases):
            self._end_collective(t, s)
            return
        phase = spec.phases[k]
        if phase.holds_s is None:
            start, end = self._take(phase.links, t, phase.duration_s)
            for r in phase.links:
                self.link_events[r].append(Event(start, end, phase.kind, f"{spec.label} {phase.name}"))
        else:  # in the background: queued behind the phases before it, beside the transfers (links.share)
            spans = occupy_each(self.shared_until, phase.links, t, phase.holds_s)
            for r, (begin, finish) in zip(phase.links, spans, strict=True):
                self.link_events[r].append(Event(begin, finish, phase.kind, f"{spec.label} {phase.name}"))
                self.shared_by[r] = s
            start, end = min(b for b, _ in spans), max(f for _, f in spans)
        if k == 0:
            self.sync_start[s] = start
        self.phase_of[s] = k + 1
        self._wake(end, _PHASE_DONE, s)

    def _take(self, links: tuple[int, ...], t: float, duration_s: float) -> tuple[float, float]:
        """``occupy`` the links (FIFO), sharing them with the background phases it meets (``links.share``)."""
        start, end = occupy(self.free_at, links, t, duration_s)
        if self.shares:
            end, delayed = share(self.shared_until, links, start, duration_s)
            self._delay(delayed)
            for r in links:
                self.free_at[r] = end
        return start, end

    def _delay(self, delayed: list[int]) -> None:
        """The background phases on links ``delayed`` end later: as late as their links now say."""
        for r in delayed:
            s = self.shared_by[r]
            if self.shared_until[r] > self.phase_end.get(s, 0.0):
                self.phase_end[s] = self.shared_until[r]

    def _start_collective(self, t: float, s: int) -> None:
        self.phase_of[s] = 0
        self.sync_start[s] = t
        self._wake(t, _PHASE_DONE, s)

    def _end_collective(self, t: float, s: int) -> None:
        """A posted collective wakes who waits for it; a blocking one releases its owners (their wait is sync)."""
        if s in self.posted_end:
            self.posted_end[s] = t
            for w in self.posted_waiters.pop(s, []):
                self._wake(t, _DEVICE_READY, w)
            return
        spec, start = self.collectives[s], self.sync_start[s]
        for o in spec.owners:
            if t > start:
                self.events[o].append(Event(start, t, "sync", spec.label))
                self.sync[o] += t - start
            self.pc[o] += 1
            self._wake(t, _DEVICE_READY, o)

    # --- operations ---------------------------------------------------------

    def _forward(self, t: float, d: int, op: Forward) -> Flow:
        end = t + op.duration_s
        self.events[d].append(_new(Event, (t, end, "forward", op.label, op.micro_batch)))
        self.busy[d] += end - t
        memory = self.memory[d] = self.memory[d] + op.activation_bytes
        self.curves[d].append((end, memory))
        in_flight = self.in_flight[d] = self.in_flight[d] + 1
        if in_flight > self.max_in_flight[d]:
            self.max_in_flight[d] = in_flight
        self._wake(end, _DEVICE_READY, d)
        return _LATER

    def _backward(self, t: float, d: int, op: Backward) -> Flow:
        """Computes; its buckets' gradients become final on the way (``BUCKET_READY`` of each)."""
        end = t + op.duration_s
        self.events[d].append(_new(Event, (t, end, "backward", op.label, op.micro_batch)))
        self.busy[d] += end - t
        if op.transient_bytes > 0:
            self.curves[d].append((t, self.memory[d] + op.transient_bytes))
        memory = self.memory[d] = self.memory[d] - op.activation_bytes
        self.curves[d].append((end, memory))
        self.in_flight[d] -= 1
        if end > self.last_backward:
            self.last_backward = end
        for offset_s, cid in op.bucket_starts:
            self._wake(t + offset_s, _BUCKET_READY, cid)
        self._wake(end, _DEVICE_READY, d)
        return _LATER

    def _optimizer_step(self, t: float, d: int, op: OptimizerStep) -> Flow:
        end = t + op.duration_s
        self.events[d].append(Event(t, end, "optimizer", op.label))
        if op.transient_bytes > 0:
            self.curves[d].append((t, self.memory[d] + op.transient_bytes))
            self.curves[d].append((end, self.memory[d]))
        self.busy[d] += end - t
        self._wake(end, _DEVICE_READY, d)
        return _LATER

    def _send(self, t: float, d: int, op: Send) -> Flow:
        """Posts the transfer on its links (FIFO) and goes on; a receiver already waiting is woken at its end.

        A blocking transfer holds the sender until it ends; the receiver is held for its duration from
        when both it has reached its ``RECV`` and the transfer has started (``_recv``)."""
        start, end = self._take(op.links, t, op.duration_s)
        for r in op.links:
            self.link_events[r].append(_new(Event, (start, end, op.kind, op.label, op.micro_batch)))
        receiver = self.receivers.pop(op.key, None)
        if receiver is None:
            if op.blocking:
                self.blocking_sent[op.key] = (start, op.duration_s)
            else:
                self.arrivals[op.key] = end
        else:
            w, since = receiver
            if end > since:
                recv = self.ops[w][self.pc[w]]
                assert isinstance(recv, Recv)
                self.events[w].append(_new(Event, (since, end, "recv", recv.label, op.micro_batch)))
            self.pc[w] += 1
            self._wake(end, _DEVICE_READY, w)
        if not op.blocking:
            return _NEXT
        if end > t:
            self.events[d].append(_new(Event, (t, end, "send", op.label, op.micro_batch)))
        self._wake(end, _DEVICE_READY, d)
        return _LATER

    def _recv(self, t: float, d: int, op: Recv) -> Flow:
        sent = self.blocking_sent.pop(op.key, None)
        if sent is not None:  # a blocking transfer: the receiver spends its duration on it from here
            end = max(t, sent[0]) + sent[1]
            if end > t:
                self.events[d].append(_new(Event, (t, end, "recv", op.label, op.micro_batch)))
                self._wake(end, _DEVICE_READY, d)
                return _LATER
            return _NEXT
        at = self.arrivals.pop(op.key, None)
        if at is None:
            self.receivers[op.key] = (d, t)
            return _BLOCKED
        if at > t:
            self.events[d].append(_new(Event, (t, at, "recv", op.label, op.micro_batch)))
            self._wake(at, _DEVICE_READY, d)
            return _LATER
        return _NEXT

    def _arrive(self, d: int, s: int) -> bool:
        """Device ``d`` reached collective ``s``: whether every owner has now."""
        here = self.arrived.setdefault(s, [])
        here.append(d)
        return len(here) == len(self.collectives[s].owners)

    def _collective(self, t: float, d: int, op: Collective) -> Flow:
        """Blocking: every owner resumes when the collective ends."""
        if self._arrive(d, op.collective):
            self._start_collective(t, op.collective)
        return _BLOCKED

    def _average_start(self, t: float, d: int, op: AverageStart) -> Flow:
        if self._arrive(d, op.collective):
            self.posted_end[op.collective] = -1.0
            self._start_collective(t, op.collective)
        return _NEXT

    def _average_merge(self, t: float, d: int, op: AverageMerge) -> Flow:
        at = self.posted_end.get(op.collective, -1.0)
        if at < 0:
            self.posted_waiters.setdefault(op.collective, []).append(d)
            return _BLOCKED
        if at > t:  # (woken at ``at``: never later than now)
            self.events[d].append(Event(t, at, "sync", op.label))
        return _NEXT

    def _bucket_start(self, t: float, d: int, op: BucketStart) -> Flow:
        return _NEXT  # started by the backward before it (``_bucket_ready``)

    def _bucket_wait(self, t: float, d: int, op: BucketWait) -> Flow:
        """Holds the device until the bucket's all-reduce has ended; the time held counts as sync."""
        if self.posted_end.get(op.collective, -1.0) < 0:
            self.posted_waiters.setdefault(op.collective, []).append(d)
            self.waits_since.setdefault(d, t)
            return _BLOCKED
        since = self.waits_since.pop(d, t)
        if t > since:
            self.events[d].append(Event(since, t, "sync", op.label))
            self.sync[d] += t - since
        return _NEXT

    def _push(self, t: float, d: int, op: Push) -> Flow:
        """Joins the wave's exchange with the segment's shards and goes on; the last owner starts it."""
        if self._arrive(d, op.collective):
            self.posted_end[op.collective] = -1.0
            self._start_collective(t, op.collective)
        return _NEXT

    def _pull(self, t: float, d: int, op: Pull) -> Flow:
        """Holds the device until the exchange of the wave it takes has ended; the time held counts as sync."""
        if op.collective < 0:
            return _NEXT
        if self.posted_end.get(op.collective, -1.0) < 0:
            self.posted_waiters.setdefault(op.collective, []).append(d)
            self.waits_since.setdefault(d, t)
            return _BLOCKED
        since = self.waits_since.pop(d, t)
        if t > since:
            self.events[d].append(Event(since, t, "sync", op.label))
            self.sync[d] += t - since
        return _NEXT

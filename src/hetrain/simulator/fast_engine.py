"""The event engine's hot loop, with the common operations inlined: the same replay, fewer calls per event.

``engine._Engine`` is the reference: one handler per event kind and per operation, each a method
call. On a 4096-device plan nearly every event is a device running a ``Forward``, a ``Backward``,
a ``Send`` or a ``Recv``, and the calls, the ``Flow`` returned and the attribute lookups are most
of the replay's time; on a plan of many layers, its buckets' starts and waits, one per owner and
bucket, come next. ``run_program_fast`` runs the same ``Program`` with those six operations and
``BUCKET_READY`` written out in one loop over local names, and hands every other operation and
event kind to the reference's own handlers.

It is the same replay, event for event: every event is queued in the same order and popped in
the same order (earliest time first, the first queued first among equal times: the reference's
heap orders (time, sequence number), this engine's calendar keeps one FIFO per distinct time),
every timeline event, memory step and link reservation is made by the same arithmetic in the
same order. ``tests/test_simulator_fast.py`` checks that on random plans, against ``engine.run_program``.

    calendar: times  [0.0, 0.7, 1.3]          (a heap of the distinct times queued)
              slots  {0.0: [3, 4, ~6], ...}   (per time, its events in the order queued)

    queue ──pop──► DEVICE_READY d ──► while d's next op:   Forward / Backward      (inline; queue d's end)
              │                                            Send / Recv             (inline)
              │                                            BucketStart / BucketWait (inline)
              │                                            anything else           (the reference's handler)
              ├──► BUCKET_READY ──► inline (the last owner starts the all-reduce: the reference's handler)
              └──► PHASE_DONE ──► the reference's handler
"""

from __future__ import annotations

import heapq
from collections import deque

from hetrain.simulator.compile import Program
from hetrain.simulator.engine import _BUCKET_READY, _DEVICE_READY, _PHASE_DONE, EventKind, Flow, Replayed, _Engine
from hetrain.simulator.links import share
from hetrain.simulator.ops import Backward, BucketStart, BucketWait, Forward, Recv, Send
from hetrain.timeline import Event

_new = tuple.__new__  # an Event without NamedTuple's Python-level __new__


def run_program_fast(program: Program) -> Replayed:
    """Replay ``program`` as ``engine.run_program`` does, with the hot operations inlined; the same result."""
    engine = _FastEngine(program)
    try:
        return engine.run()
    finally:
        engine.release()  # the engine's handler tables make it a reference cycle: break it (``_Engine.release``)


class _FastEngine(_Engine):
    """``_Engine`` whose ``DEVICE_READY`` runs ``Forward``, ``Backward``, ``Send``, ``Recv``, ``BucketStart`` and
    ``BucketWait`` inline, and ``BUCKET_READY`` too; its queue is a calendar (``times``, ``slots``)."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        n = len(program.names)
        # The reference's queue as a calendar: the distinct times queued (a heap) and per time its events, in
        # the order queued (a FIFO), each an int (``_wake``). It pops what the heap of (time, seq) pops: the
        # earliest time, and at that time the first queued. Identical VWs queue most events at times already
        # queued (99% of them on 128 VWs), which is then a dict look-up and an append instead of a heap push.
        self.times: list[float] = [0.0] if n else []
        self.slots: dict[float, deque[int]] = {0.0: deque(range(n))} if n else {}

    def _wake(self, t: float, kind: EventKind, subject: int) -> None:
        """Queue an event: a ``DEVICE_READY`` as its device number, a ``PHASE_DONE`` / ``BUCKET_READY`` of
        collective s as ``~(2 s)`` / ``~(2 s + 1)`` (negative)."""
        slot = self.slots.get(t)
        if slot is None:
            slot = self.slots[t] = deque()
            heapq.heappush(self.times, t)
        slot.append(subject if kind is _DEVICE_READY else ~(2 * subject + (kind is _BUCKET_READY)))

    def run(self) -> Replayed:  # one loop, on purpose: each call saved is saved per event
        times, slots, push_time, pop_time, fifo = self.times, self.slots, heapq.heappush, heapq.heappop, deque
        all_ops, pc, finish = self.ops, self.pc, self.finish
        events, curves, memory, busy = self.events, self.curves, self.memory, self.busy
        in_flight, max_in_flight = self.in_flight, self.max_in_flight
        free_at, link_events = self.free_at, self.link_events
        shares, shared_until = self.shares, self.shared_until
        arrivals, receivers, blocking_sent = self.arrivals, self.receivers, self.blocking_sent
        on_op, on_event = self.on_op, self.on_event
        last_backward = self.last_backward
        collectives, posted_end, owners_ready = self.collectives, self.posted_end, self.bucket_owners_ready
        posted_waiters, waits_since, sync = self.posted_waiters, self.waits_since, self.sync
        while times:
            t = times[0]
            now = slots[t]
            d = now.popleft()
            if not now:  # the last event at t: whatever is queued at t from here on is a new slot, after it
                del slots[t]
                pop_time(times)
            if d < 0:
                c = ~d
                if c & 1:  # BUCKET_READY of all-reduce c >> 1 (see _Engine._bucket_ready): one per owner and bucket
                    s = c >> 1
                    ready = owners_ready[s] = owners_ready.get(s, 0) + 1
                    if ready == len(collectives[s].owners):
                        posted_end[s] = -1.0
                        self._start_collective(t, s)
                else:  # PHASE_DONE
                    on_event[_PHASE_DONE](t, c >> 1)
                continue
            ops = all_ops[d]
            k, count = pc[d], len(ops)
            while k < count:
                op = ops[k]
                if op.__class__ is Forward:  # class identity, not isinstance: the ops are final records
                    i, label, duration_s, activation_bytes = op
                    end = t + duration_s
                    events[d].append(_new(Event, (t, end, "forward", label, i)))
                    busy[d] += end - t
                    mem = memory[d] = memory[d] + activation_bytes
                    curves[d].append((end, mem))
                    n = in_flight[d] = in_flight[d] + 1
                    if n > max_in_flight[d]:
                        max_in_flight[d] = n
                    slot = slots.get(end)
                    if slot is None:
                        slot = slots[end] = fifo()
                        push_time(times, end)
                    slot.append(d)
                    k += 1
                    break
                if op.__class__ is Backward:  # its buckets' gradients become final on the way (BUCKET_READY of each)
                    i, label, duration_s, activation_bytes, transient_bytes, bucket_starts = op
                    end = t + duration_s
                    events[d].append(_new(Event, (t, end, "backward", label, i)))
                    busy[d] += end - t
                    curve = curves[d]
                    if transient_bytes > 0:
                        curve.append((t, memory[d] + transient_bytes))
                    mem = memory[d] = memory[d] - activation_bytes
                    curve.append((end, mem))
                    in_flight[d] -= 1
                    if end > last_backward:
                        last_backward = end
                    for offset_s, cid in bucket_starts:
                        at_s = t + offset_s
                        slot = slots.get(at_s)
                        if slot is None:
                            slot = slots[at_s] = fifo()
                            push_time(times, at_s)
                        slot.append(~(2 * cid + 1))
                    slot = slots.get(end)
                    if slot is None:
                        slot = slots[end] = fifo()
                        push_time(times, end)
                    slot.append(d)
                    k += 1
                    break
                if op.__class__ is Send:  # posted on its links (FIFO, engine.occupy); see _Engine._send
                    i, label, key, duration_s, links, link_kind, blocking = op  # one unpacking, not 12 look-ups
                    start = t
                    for r in links:
                        if free_at[r] > start:
                            start = free_at[r]
                    end = start + duration_s
                    if shares:  # beside the parameter servers' background phases (links.share)
                        end, delayed = share(shared_until, links, start, duration_s)
                        self._delay(delayed)
                    for r in links:
                        free_at[r] = end
                    if links:
                        carried = _new(Event, (start, end, link_kind, label, i))
                        for r in links:
                            link_events[r].append(carried)
                    receiver = receivers.pop(key, None)
                    if receiver is None:
                        if blocking:
                            blocking_sent[key] = (start, duration_s)
                        else:
                            arrivals[key] = end
                    else:
                        w, since = receiver
                        if end > since:  # the label of the Recv it waits at (every operation has one)
                            events[w].append(_new(Event, (since, end, "recv", all_ops[w][pc[w]].label, i)))
                        pc[w] += 1
                        slot = slots.get(end)
                        if slot is None:
                            slot = slots[end] = fifo()
                            push_time(times, end)
                        slot.append(w)
                    if not blocking:
                        k += 1
                        continue
                    if end > t:
                        events[d].append(_new(Event, (t, end, "send", label, i)))
                    slot = slots.get(end)
                    if slot is None:
                        slot = slots[end] = fifo()
                        push_time(times, end)
                    slot.append(d)
                    k += 1
                    break
                if op.__class__ is Recv:  # see _Engine._recv
                    i, label, key = op
                    sent = blocking_sent.pop(key, None) if blocking_sent else None  # none unless blocking
                    if sent is not None:
                        end = (t if t > sent[0] else sent[0]) + sent[1]
                        k += 1
                        if end > t:
                            events[d].append(_new(Event, (t, end, "recv", label, i)))
                            slot = slots.get(end)
                            if slot is None:
                                slot = slots[end] = fifo()
                                push_time(times, end)
                            slot.append(d)
                            break
                        continue
                    at = arrivals.pop(key, None)
                    if at is None:
                        receivers[key] = (d, t)
                        break
                    k += 1
                    if at > t:
                        events[d].append(_new(Event, (t, at, "recv", label, i)))
                        slot = slots.get(at)
                        if slot is None:
                            slot = slots[at] = fifo()
                            push_time(times, at)
                        slot.append(d)
                        break
                    continue
                if op.__class__ is BucketStart:  # started by the backward before it
                    k += 1
                    continue
                if op.__class__ is BucketWait:  # see _Engine._bucket_wait
                    cid = op.collective
                    if posted_end.get(cid, -1.0) < 0:
                        posted_waiters.setdefault(cid, []).append(d)
                        waits_since.setdefault(d, t)
                        break
                    since = waits_since.pop(d, t)
                    if t > since:
                        events[d].append(Event(since, t, "sync", op.label))
                        sync[d] += t - since
                    k += 1
                    continue
                flow = on_op[op.__class__](t, d, op)
                if flow is Flow.NEXT:
                    k += 1
                elif flow is Flow.LATER:
                    k += 1
                    break
                else:
                    break
            else:
                finish[d] = t
            pc[d] = k
        self.last_backward = last_backward
        return self.finished()

"""The validator's dynamic part: every device's actions executed abstractly, waits and all.

A device runs its actions in order until one must wait: a RECV for its SEND, a blocking collective
for every member, an ALLREDUCE_WAIT for every owner's start of its bucket. If nothing can run while
actions remain, that is a deadlock, explained by what the first stuck device waits for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from hetrain.schedule.actions import (
    COLLECTIVE_KINDS,
    COUNTERPART,
    Action,
    ActionKind,
    BucketSync,
    Compute,
    ScheduleError,
    SegmentSync,
    Step,
    Transfer,
)
from hetrain.schedule.grid import schedule_error
from hetrain.schedule.roles import StageRole, action_ident

K = ActionKind


_SendKey = tuple[ActionKind, str, str, int]  # (send kind, sender, receiver, micro-batch)


class Interpreter:
    """``validate``'s dynamic part: every device runs its actions in order until one must wait (a RECV
    for its SEND, a collective for its members, an ALLREDUCE_WAIT for its bucket's starts); what
    completes a wait makes the waiting devices runnable again. The messages are built only on
    failure: this runs once per action of the cluster.
    """

    def __init__(self, schedule: Mapping[str, Sequence[Action]], roles: Mapping[str, StageRole],
                 owners: Mapping[int, set[str]], node_of: Mapping[str, str] | None = None, bsp: bool = True,
                 num_buckets: Sequence[int] = ()) -> None:
        self.schedule = schedule
        self.roles = roles
        self.owners = owners
        self.nodes = node_of or {}
        self.bsp = bsp
        self.num_buckets = num_buckets
        self.pc = dict.fromkeys(schedule, 0)
        self.done: dict[str, set[tuple[ActionKind, object]]] = {dev: set() for dev in schedule}
        self.backwards = dict.fromkeys(schedule, 0)  # backwards done per device
        self.posted: dict[_SendKey, int] = {}  # send key -> step of the send
        self.received: set[_SendKey] = set()
        self.waiting: dict[_SendKey, str] = {}
        self.arrived: dict[tuple[ActionKind, int, str], set[str]] = {}  # (kind, segment, node or "") -> devices
        self.started: dict[tuple[int, int], set[str]] = {}  # (segment, bucket) -> devices that started it
        self.bucket_waiters: dict[tuple[int, int], list[str]] = {}
        self.runnable = deque(schedule)

    def run(self) -> None:
        """Run every device as far as it goes; raise on a deadlock or a send never received."""
        while self.runnable:
            self._advance(self.runnable.popleft())
        stuck = [dev for dev in self.schedule if self.pc[dev] < len(self.schedule[dev])]
        if stuck:
            raise self._deadlock(stuck)
        for sent, k in self.posted.items():
            if sent not in self.received:
                kind, src, dst, i = sent
                recv = Transfer(COUNTERPART[kind], self.roles[dst].j, i, src)
                raise self._fail(src, k, f"{self.schedule[src][k]} is never received: {dst} has no {recv}")

    def _fail(self, dev: str | None, k: int | None, message: str,
              also: Mapping[tuple[str, int], str] | None = None) -> ScheduleError:
        return schedule_error(self.schedule, self.roles, dev, k, message, also)

    def _advance(self, dev: str) -> None:
        """Run ``dev``'s actions from where it stands until one must wait or none remain."""
        actions = self.schedule[dev]
        mine = self.done[dev]
        k = self.pc[dev]
        while k < len(actions):
            a = actions[k]
            match a:
                case Compute():
                    self._compute(dev, k, a)
                case Transfer():
                    if not self._transfer(dev, k, a):
                        break
                case _:
                    if not self._sync(dev, k, a):
                        break
            mine.add((a.kind, action_ident(a)))
            k += 1
        self.pc[dev] = k

    def _compute(self, dev: str, k: int, a: Compute) -> None:
        """F needs its RECV_F; B needs its F and its RECV_B."""
        role, mine, i = self.roles[dev], self.done[dev], a.micro_batch
        if a.kind is K.F:
            if role.prev is not None and (K.RECV_F, i) not in mine:
                raise self._fail(dev, k, f"{a} runs before its input arrives: no "
                                 f"{Transfer(K.RECV_F, role.j, i, role.prev)} precedes it (missing receive)")
            return
        if (K.F, i) not in mine:
            raise self._fail(dev, k, f"{a} runs before {Compute(K.F, role.j, i)} (F before B for every micro-batch)")
        if role.next is not None and (K.RECV_B, i) not in mine:
            raise self._fail(dev, k, f"{a} runs before its gradient arrives: no "
                             f"{Transfer(K.RECV_B, role.j, i, role.next)} precedes it (missing receive)")
        self.backwards[dev] += 1

    def _transfer(self, dev: str, k: int, a: Transfer) -> bool:
        """A send is posted (after the compute it ships); a receive goes on once its send is posted."""
        i = a.micro_batch
        if a.is_send:
            source = K.F if a.kind is K.SEND_F else K.B
            if (source, i) not in self.done[dev]:
                raise self._fail(dev, k, f"{a} sends what {Compute(source, self.roles[dev].j, i)} has not "
                                 "computed yet")
            key: _SendKey = (a.kind, dev, a.named_peer(), i)
            self.posted[key] = k
            if key in self.waiting:
                self.runnable.append(self.waiting.pop(key))
            return True
        key = (COUNTERPART[a.kind], a.named_peer(), dev, i)
        if key not in self.posted:
            self.waiting[key] = dev
            return False
        self.received.add(key)
        return True

    def _sync(self, dev: str, k: int, a: SegmentSync | BucketSync | Step) -> bool:
        """Sync actions and STEP come after every backward; whether ``a`` went on or must wait."""
        role = self.roles[dev]
        if self.backwards[dev] < role.m:
            missing = next(b for b in range(role.m) if (K.B, b) not in self.done[dev])
            raise self._fail(dev, k, f"{a} comes before {Compute(K.B, role.j, missing)}: "
                             "gradients are complete only after every backward")
        match a:
            case Step():
                if self.bsp:
                    self._check_reduced(dev, k)
                return True
            case BucketSync():
                return self._bucket(dev, k, a)
            case SegmentSync():  # the asynchronous kinds (PUSH, PULL...) wait for no one here
                return self._collective(dev, a) if a.kind in COLLECTIVE_KINDS else True

    def _check_reduced(self, dev: str, k: int) -> None:
        """Under bsp, STEP comes after every shared segment of ``dev`` is all-reduced (whole or bucket by bucket)."""
        mine, num_buckets = self.done[dev], self.num_buckets
        left = sorted(s for s, devs in self.owners.items() if dev in devs and len(devs) > 1
                      and (K.ALLREDUCE, s) not in mine
                      and not all((K.ALLREDUCE_WAIT, (s, b)) in mine for b in range(num_buckets[s])))
        if left:
            s = left[0]
            b = next(b for b in range(num_buckets[s]) if (K.ALLREDUCE_WAIT, (s, b)) not in mine)
            raise self._fail(dev, k, f"STEP before ALLREDUCE_WAIT seg{s} bucket{b} (or ALLREDUCE seg{s}): {dev} "
                             f"shares segment {s} with {', '.join(sorted(self.owners[s] - {dev}))}")

    def _bucket(self, dev: str, k: int, a: BucketSync) -> bool:
        """ALLREDUCE_START goes on; ALLREDUCE_WAIT waits until every owner of the segment started the bucket."""
        sb = (a.segment, a.bucket)
        if a.kind is K.ALLREDUCE_START:
            there = self.started.setdefault(sb, set())
            there.add(dev)
            if len(there) == len(self.owners[a.segment]):
                self.runnable.extend(self.bucket_waiters.pop(sb, []))
            return True
        if (K.ALLREDUCE_START, sb) not in self.done[dev]:
            raise self._fail(dev, k, f"{a} comes before its {BucketSync(K.ALLREDUCE_START, *sb)} on {dev}")
        if len(self.started.get(sb, ())) < len(self.owners[a.segment]):
            self.bucket_waiters.setdefault(sb, []).append(dev)
            return False
        return True

    def _collective(self, dev: str, a: SegmentSync) -> bool:
        """A blocking collective: ``dev`` waits until every member arrived; the last to arrive completes it for all."""
        kind, s = a.kind, a.segment
        if kind is K.LOCAL_ALLREDUCE:  # the owners on dev's node
            members = {o for o in self.owners[s] if self.nodes.get(o) == self.nodes.get(dev)}
        else:
            members = set(self.owners[s])
        at = (kind, s, self.nodes.get(dev, "") if kind is K.LOCAL_ALLREDUCE else "")
        there = self.arrived.setdefault(at, set())
        there.add(dev)
        if len(there) < len(members):
            return False
        for other in there - {dev}:  # the collective completes for all owners
            self.done[other].add((kind, s))
            self.pc[other] += 1
            self.runnable.append(other)
        return True

    def _deadlock(self, stuck: list[str]) -> ScheduleError:
        """Explain why the first stuck device cannot go on."""
        dev = stuck[0]
        k = self.pc[dev]
        a = self.schedule[dev][k]
        also = {(d, self.pc[d]): "<-- blocked" for d in stuck if d != dev}
        match a:
            case Transfer():
                return self._fail(dev, k, f"deadlock: {a} waits for {self._missing_send(dev, a)}", also)
            case BucketSync():
                came = set(self.started.get((a.segment, a.bucket), set()))
                verb = "start"
            case SegmentSync():
                came = set().union(*(devs for (kind, s, _), devs in self.arrived.items()
                                     if kind is a.kind and s == a.segment))
                verb = "reach"
            case _:  # F, B and STEP never wait
                return self._fail(dev, k, f"deadlock: {a} cannot run", also)
        pc, schedule = self.pc, self.schedule
        absent = sorted(self.owners[a.segment] - came)
        where = "; ".join(
            f"{d} is at step {pc[d]} ({schedule[d][pc[d]]})" if pc[d] < len(schedule[d]) else f"{d} finished without it"
            for d in absent[:4])
        return self._fail(dev, k, f"deadlock: {a} waits for {', '.join(absent)} to {verb} it: {where}", also)

    def _missing_send(self, dev: str, a: Transfer) -> str:
        """The send receive ``a`` of ``dev`` waits for, and why it never comes."""
        peer = a.named_peer()
        send = Transfer(COUNTERPART[a.kind], self.roles[peer].j, a.micro_batch, dev)
        theirs = self.schedule[peer]
        at = [n for n, b in enumerate(theirs) if b == send]
        if not at:
            why = f"{peer} never sends it (missing {send} on {peer})"
        elif self.pc[peer] < len(theirs):
            why = f"{peer} would send it at step {at[0]} but is itself blocked at step {self.pc[peer]} " \
                  f"({theirs[self.pc[peer]]})"
        else:
            why = f"{peer} finished without sending it"
        return f"{send} and {why}"

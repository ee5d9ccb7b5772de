"""Timed operations: each Action of a device compiled to the figures the replay needs.

One small record per kind, with named fields; ``compile.compile_program`` builds
them, ``engine`` interprets them. Collectives are numbered (``collective``: an
index into ``Program.collectives``), so every owner's operation names the same one.

    Action                       operation      what the device does
    jFi                          Forward        computes for duration_s
    jBi                          Backward       computes; starts its buckets' all-reduces on the way
    SEND_F / SEND_B              Send           posts the transfer and goes on (blocking: held until it ends)
    RECV_F / RECV_B              Recv           waits until the transfer has arrived (blocking: and for its
                                                duration from when the receiver reaches it)
    ALLREDUCE, LOCAL_ALLREDUCE,
    AVERAGE                      Collective     waits until every owner has arrived and the phases ended
    AVERAGE_START                AverageStart   joins a posted average and goes on
    AVERAGE_MERGE                AverageMerge   waits until that average has ended
    ALLREDUCE_START              BucketStart    nothing (its Backward starts the bucket's all-reduce)
    ALLREDUCE_WAIT               BucketWait     waits until the bucket's all-reduce has ended
    PUSH                         Push           joins its wave's exchange with the segment's shards, goes on
    PULL                         Pull           waits until the exchange of an earlier wave has ended
    STEP                         OptimizerStep  computes for duration_s
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from hetrain.simulator.links import Phase
from hetrain.sync_layout import Bucket

#: Names one point-to-point transfer: the sender's ``Send`` and the receiver's ``Recv`` hold equal keys, one per
#: (direction, sender, receiver, micro-batch) (``compile._Compiler.transfer_key``): an int, which the replay
#: hashes faster than a tuple of the four.
TransferKey: TypeAlias = int


class Forward(NamedTuple):
    micro_batch: int
    label: str
    duration_s: float
    activation_bytes: float  # kept from the forward's end until the backward's end


class Backward(NamedTuple):
    micro_batch: int
    label: str
    duration_s: float
    activation_bytes: float  # freed at the backward's end
    transient_bytes: float  # the recomputed layer's activations, held during the backward
    bucket_starts: tuple[tuple[float, int], ...] = ()  # (seconds into the backward, collective) per bucket made final


class Send(NamedTuple):
    micro_batch: int
    label: str
    key: TransferKey
    duration_s: float
    links: tuple[int, ...]
    kind: str  # the link event's kind: "send_f" or "send_b"
    blocking: bool = False  # the plan's transfers="blocking": sender and receiver held for the duration


class Recv(NamedTuple):
    micro_batch: int
    label: str  # str() of its action: the timeline's label when the device waits
    key: TransferKey


class Collective(NamedTuple):
    collective: int
    label: str


class AverageStart(NamedTuple):
    collective: int
    label: str


class AverageMerge(NamedTuple):
    collective: int
    label: str


class BucketStart(NamedTuple):
    collective: int
    label: str
    bucket: Bucket


class BucketWait(NamedTuple):
    collective: int
    label: str


class Push(NamedTuple):
    collective: int  # the segment's exchange with its shards of this wave (``links.ps_phases``)
    label: str


class Pull(NamedTuple):
    collective: int  # the exchange of the wave whose weights it takes; -1: none yet, nothing to wait for
    label: str


class OptimizerStep(NamedTuple):
    label: str
    duration_s: float
    transient_bytes: float  # held during the step


Op: TypeAlias = (Forward | Backward | Send | Recv | Collective | AverageStart | AverageMerge | BucketStart | BucketWait
      | Push | Pull | OptimizerStep)


class CollectiveSpec(NamedTuple):
    """One all-reduce (or average, or parameter-server exchange) among ``owners`` (device numbers of the replay),
    run as ``phases``."""

    phases: list[Phase]
    owners: list[int]
    label: str

"""Synchronisation decided once: the sync mode's options, segments, buckets, algorithms and PS hosts.

This module is the one place that groups layers into segments, cuts gradient
buckets, picks each all-reduce's algorithm and places parameter-server shards
(DESIGN.md decision 1). ``Plan`` builds its ``SyncLayout`` here when it is made,
writes it to plan.json's ``"sync"`` section, and refuses a loaded plan whose
section does not match; the schedule, the simulator and the runtime only read
it. Pure Python, no torch::

    VW0: d0 [0..4)  d1 [4..8)        segment 0: [0..3) owners {d0, d2}
    VW1: d2 [0..3)  d3 [3..8)        segment 1: [3..4) owners {d0, d3}
                                     segment 2: [4..8) owners {d1, d3}

    bsp        each segment's gradients in buckets (last layers first), each bucket
               all-reduced by "ring" or "hierarchical", whichever the cost model finds cheaper
    wsp        each segment's parameter server, sharded across its owners' nodes (``ps_shards``)
    hybrid-ps  the same, plus the owners of a segment on one node (``local_groups``)
    daso       node-local groups, and a whole-segment average (``algorithm``)
    local-sgd  a whole-segment average (``algorithm``)

Example:
    >>> SyncOptions.from_items(["period=8", "placement=round-robin"]).period
    8

A segment's parameter server is sharded as a parameter server usually is (Li et al., OSDI 2014): one
shard per node that holds an owner, each a contiguous range of the segment's flat weights sized by the
node's NIC bandwidth, so every node's NIC carries a share of the pushes and pulls instead of one NIC
carrying them all (``place_ps_shards``). This is hetrain's own code because the shards are uneven: torch
has no sharded parameter server, and its even shardings (FSDP, ``reduce_scatter``) would let the slowest
NIC set the pace.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from hetrain.cluster import Cluster
from hetrain.cost import allreduce_shape, estimate_allreduce, tp_rank_profile
from hetrain.errors import InputError
from hetrain.profile import ModelProfile
from hetrain.sync_mode import MODES, SYNC_MODES, SyncModeError, sync_mode

#: where a segment's parameter server lives; the first is the default: ``sharded`` across the owners' nodes
#: (by NIC bandwidth), or all of it on one owner (``local``: on the node with the most owners; ``round-robin``:
#: owner s mod n), the layouts of plans before format_version 5
PLACEMENTS: tuple[str, ...] = ("sharded", "local", "round-robin")
#: ``allreduce`` option: the cheaper of ring and hierarchical per all-reduce, or always the flat ring
ALLREDUCE_CHOICES: tuple[str, ...] = ("auto", "ring")
#: ``transfers`` option: a stage-to-stage transfer overlaps compute (hetrain's runtime: ``isend``, ``irecv``
#: posted ahead), or blocks its sender and its receiver for its duration (DeepSpeed's PipelineEngine)
TRANSFER_CHOICES: tuple[str, ...] = ("overlap", "blocking")
#: ``early_receives`` option: the runtime posts a stage's receives one ahead of the RECV that waits for them,
#: or at it (``runtime.step.p2p``)
EARLY_RECEIVES: tuple[str, ...] = ("always", "never")
#: ``bucket_cut`` option: a bucket ends on a layer boundary (holding at least its size), or exactly at its size,
#: inside a layer where it falls there (as DistributedDataParallel cuts between parameters)
BUCKET_CUTS: tuple[str, ...] = ("layer", "exact")
#: ``reduce_dtype`` option: the dtype bsp's gradient all-reduces travel in; the first is the default
REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
#: ``shard`` option: what bsp's owners of a segment shard among them (ZeRO stage 1 and 2, Rajbhandari et al. 2020):
#: nothing, the optimizer state, or the optimizer state and the gradients; the first is the default
SHARD_MODES: tuple[str, ...] = ("none", "optimizer", "optimizer+gradients")
#: ``shard_by`` option: an owner's shard in proportion to the memory its stage leaves free (Cephalo's rule),
#: or to its speed
SHARD_BY: tuple[str, ...] = ("memory", "speed")
#: bytes on the wire per byte of (fp32) gradient, by ``reduce_dtype``
REDUCE_WIRE: dict[str, float] = {"fp32": 1.0, "bf16": 0.5}
#: DistributedDataParallel's default bucket size (``bucket_cap_mb=25``)
BUCKET_BYTES = 25 * 2**20
#: its first bucket's (``_DEFAULT_FIRST_BUCKET_BYTES``), so the last layers' all-reduce starts early
FIRST_BUCKET_BYTES = 2**20

T = TypeVar("T")
Layout = Sequence[tuple[int, int, int]]  # (device index, first layer, end layer) per stage of one VW


class SyncLayoutError(InputError):
    """Sync options out of bounds, or a plan's ``"sync"`` section that does not match its stages."""


# ---------------------------------------------------------------------------
# options: defaults and bounds, written once
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bound:
    """How one option is read and checked: an integer or a number within [least, most], or one of ``choices``."""

    kind: type
    least: float = 0
    most: float = 0
    choices: tuple[str, ...] = ()
    help: str = ""
    modes: tuple[str, ...] = ()  # the sync modes that read it; () for every mode

    def describe(self, name: str) -> str:
        if self.choices:
            return f"{name}={'|'.join(self.choices)}"
        kind = "N" if self.kind is int else "BYTES"
        return f"{name}={kind} ({self.least:g}..{self.most:g})"


_BOUNDS: dict[str, _Bound] = {
    "staleness": _Bound(int, 0, 1000, help="waves a VW may run ahead of the slowest (wsp, hybrid-ps)",
                        modes=("wsp", "hybrid-ps")),
    "period": _Bound(int, 1, 100_000, help="iterations between global averages (local-sgd, daso's first k)",
                     modes=("local-sgd", "daso")),
    "aggregate": _Bound(int, 1, 100_000, help="iterations aggregated into one push (hybrid-ps)", modes=("hybrid-ps",)),
    "warmup": _Bound(int, 0, 10**9, help="first iterations of daso that average globally, blocking", modes=("daso",)),
    "cooldown": _Bound(int, 0, 10**9, help="last iterations of daso that do the same", modes=("daso",)),
    "placement": _Bound(str, choices=PLACEMENTS, help="where a segment's parameter server lives: sharded across "
                        "its owners' nodes, or on one owner (local, round-robin)",
                        modes=("wsp", "hybrid-ps")),
    "bucket_bytes": _Bound(float, 1, 2**40, help="gradient bucket size (bsp)", modes=("bsp",)),
    "first_bucket_bytes": _Bound(float, 1, 2**40, help="the first (last layers') bucket's size (bsp)",
                                 modes=("bsp",)),
    "bucket_cut": _Bound(str, choices=BUCKET_CUTS, modes=("bsp",),
                         help="layer: buckets end on layer boundaries; exact: at their size, inside a layer (bsp)"),
    "allreduce": _Bound(str, choices=ALLREDUCE_CHOICES, help="auto: ring or hierarchical, the cheaper; ring: always"),
    "transfers": _Bound(str, choices=TRANSFER_CHOICES,
                        help="overlap: a p2p transfer overlaps compute; blocking: it holds sender and receiver"),
    "early_receives": _Bound(str, choices=EARLY_RECEIVES,
                             help="always: a stage's receives posted one ahead of its RECVs; never: at them"),
    "reduce_dtype": _Bound(str, choices=REDUCE_DTYPES, modes=("bsp",),
                           help="the dtype gradients are all-reduced in: fp32, or bf16 (half the bytes; bsp)"),
    "shard": _Bound(str, choices=SHARD_MODES, modes=("bsp",),
                    help="what a segment's owners shard: none, optimizer (ZeRO-1), optimizer+gradients (ZeRO-2)"),
    "shard_by": _Bound(str, choices=SHARD_BY, modes=("bsp",),
                       help="an owner's shard in proportion to its free memory, or to its speed (bsp)"),
}
SYNC_OPTION_HELP = ", ".join(b.describe(name) for name, b in _BOUNDS.items())


@dataclass(frozen=True)
class SyncOptions:
    """The sync mode's parameters (docs/sync.md); bounds in ``_BOUNDS``, checked on construction.

    Attributes:
        staleness: D of ``wsp`` and ``hybrid-ps``: how many waves a VW may run ahead of the slowest.
        period: k of ``local-sgd`` and ``daso``: iterations between global averages (DASO's initial k).
        aggregate: iterations of ``hybrid-ps`` whose updates are aggregated into one push.
        warmup: first iterations of ``daso`` that average globally every iteration, blocking.
        cooldown: last iterations of ``daso`` that do the same.
        placement: where a segment's parameter server lives: ``sharded`` (the default: one shard per node that
            holds an owner, sized by the node's NIC bandwidth, ``place_ps_shards``), or all of it on one owner,
            ``local`` (on the node with the most owners) or ``round-robin`` (owner s mod n): what plans before
            format_version 5 did, kept so that they load as they were made and for comparison.
        bucket_bytes: gradient bucket size of ``bsp`` (DistributedDataParallel's 25 MiB).
        first_bucket_bytes: the first bucket's (DistributedDataParallel's 1 MiB).
        bucket_cut: ``layer`` (a bucket ends on a layer boundary, so it holds at least its size: the first
            bucket of gpt-tiny is 1.6 MB, three layers) or ``exact`` (it ends at its size, inside a layer where
            it falls there, as DistributedDataParallel's ends between two parameters: the first all-reduce
            starts a part of a layer earlier in the backward; ``cut_buckets_exact``).
        allreduce: ``auto`` (ring or hierarchical, the cheaper, per all-reduce) or ``ring``.
        transfers: how the runtime runs a stage-to-stage transfer: ``overlap`` (it overlaps compute: hetrain's
            runtime, benchmarks/transfer_blocking.py) or ``blocking`` (it holds its sender and its receiver for
            its duration: DeepSpeed's PipelineEngine and other synchronous runtimes). A property of the runtime
            that runs the plan, read by the simulator and the planner's closed forms (docs/sync.md).
        early_receives: whether hetrain's runtime posts a stage's receives one ahead of the RECV that waits
            for them, so that the transfer lands while the stage computes (``always``, the default), or at the
            RECV (``never``, torch.distributed.pipelining's way: 4% faster on an unthrottled CPU host whose
            pipeline moves many 1 kB transfers, much slower where the ranks' CPU is the bottleneck;
            ``runtime.step.p2p``). A runtime setting: the simulator and the planner do not read it.
        reduce_dtype: the dtype ``bsp``'s gradient all-reduces travel in: ``fp32`` (the default) or ``bf16``
            (each bucket cast to bfloat16 for its all-reduce and back into the fp32 gradients after it: half
            the bytes on every link, at bfloat16's 8-bit mantissa in the sum; DistributedDataParallel's
            ``bf16_compress_hook``, Megatron-LM's default under bf16). The cost model prices the all-reduces
            at ``REDUCE_WIRE`` bytes per gradient byte and the memory model counts the copies. Other modes
            average weights or push to parameter servers in fp32 and refuse ``bf16`` (``check_mode_options``).
        shard: what the owners of each shared segment shard among them under ``bsp``: ``none``, ``optimizer``
            (ZeRO-1: each owner keeps the optimizer state of its part only, steps it, and hands the updated
            weights to the others) or ``optimizer+gradients`` (ZeRO-2: each owner also keeps only its part of
            the gradients, which every backward reduces to it). Shards are uneven: ``Segment.shard_fractions``.
            Where a plan shards its segments alike, every shared segment's mode; where it chooses per segment
            (``Plan.segment_shards``), the most any segment shards, so that ``none`` still says that nothing is.
            The relaxed modes refuse it: their replicas step their own optimizers on their own gradients
            (local-sgd, daso) or on a parameter server's (wsp, hybrid-ps), so no replica's state is another's.
        shard_by: what sizes an owner's shard: ``memory`` (in proportion to the bytes its stage leaves free,
            Cephalo's rule) or ``speed``; the weights themselves are the plan's (``Plan.shard_weights``).
    """

    staleness: int = 1
    period: int = 4
    aggregate: int = 4
    warmup: int = 2
    cooldown: int = 2
    placement: str = PLACEMENTS[0]
    bucket_bytes: float = float(BUCKET_BYTES)
    first_bucket_bytes: float = float(FIRST_BUCKET_BYTES)
    bucket_cut: str = BUCKET_CUTS[0]
    allreduce: str = ALLREDUCE_CHOICES[0]
    transfers: str = TRANSFER_CHOICES[0]
    early_receives: str = EARLY_RECEIVES[0]
    reduce_dtype: str = REDUCE_DTYPES[0]
    shard: str = SHARD_MODES[0]
    shard_by: str = SHARD_BY[0]
    #: the options a user set (``from_items``, ``--sync-option``), which ``check_mode_options`` refuses where
    #: the mode does not read them; not an option: not compared, not written (``to_dict``)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in self.option_names():
            _check(name, getattr(self, name), "sync options")

    @staticmethod
    def option_names() -> tuple[str, ...]:
        """The options' names, in declaration order (``given`` is not one)."""
        return tuple(f.name for f in fields(SyncOptions) if f.name != "given")

    @property
    def reduce_wire(self) -> float:
        """Bytes a gradient reduction moves per byte of fp32 gradient, against a ring all-reduce of it: half in
        bf16 (``reduce_dtype``), and half again where the owners shard (``shard``): the gradients are
        reduce-scattered, half a ring all-reduce's bytes, and the updated weights all-gathered after the step,
        the other half (``planner.search.shard_gather_s``). A segment's own: ``wire_for``."""
        return self.wire_for(self.shard)

    def wire_for(self, shard: str) -> float:
        """``reduce_wire`` of a segment whose owners shard as ``shard`` says (``Segment.shard``): a plan that
        shards some segments and not others moves half the bytes for the first only."""
        return REDUCE_WIRE[self.reduce_dtype] * (0.5 if shard != SHARD_MODES[0] else 1.0)

    @property
    def reduce_copy(self) -> float:
        """Bytes of 16-bit gradient copies per byte of the gradients a rank all-reduces, alive from a bucket's
        post to its wait (0 in fp32: the all-reduce runs in the gradient buffer itself)."""
        return 0.0 if self.reduce_dtype == REDUCE_DTYPES[0] else REDUCE_WIRE[self.reduce_dtype]

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.option_names()}

    @staticmethod
    def from_mapping(data: Mapping[str, Any], where: str = "sync options") -> SyncOptions:
        """Options from a JSON object; unknown keys and wrong types are refused, naming ``where``."""
        if not isinstance(data, Mapping):
            raise SyncLayoutError(f"{where}: expected an object of options, got {type(data).__name__}")
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key not in _BOUNDS:
                raise SyncLayoutError(f"{where}: unknown option {key!r}; known: {', '.join(_BOUNDS)}")
            out[key] = _coerce(key, value, f"{where}.{key}")
        return SyncOptions(**out)

    @staticmethod
    def from_items(items: Iterable[str], base: SyncOptions | None = None) -> SyncOptions:
        """``["staleness=2", "placement=round-robin"]`` (``--sync-option``) over ``base`` (default: the defaults).

        Raises:
            SyncLayoutError: not KEY=VALUE, an unknown key, or a value out of bounds, naming the item.
        """
        out: dict[str, Any] = {}
        for item in items:
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key:
                raise SyncLayoutError(f"--sync-option {item!r}: expected KEY=VALUE, one of {SYNC_OPTION_HELP}")
            if key not in _BOUNDS:
                raise SyncLayoutError(f"--sync-option {item!r}: unknown key {key!r}; known: {SYNC_OPTION_HELP}")
            out[key] = _coerce(key, value, f"--sync-option {item!r}")
        base = base or SyncOptions()
        return replace(base, **out, given=base.given | out.keys())


def modes_for(options: SyncOptions) -> tuple[str, ...]:
    """The sync modes that can run with ``options``: every mode, or the synchronous one (``bsp``) alone where
    gradients are all-reduced in 16 bits (``reduce_dtype``) or the optimizer state is sharded (``shard``),
    which only its all-reduces and its one optimizer step over all replicas do."""
    if options.reduce_dtype == REDUCE_DTYPES[0] and options.shard == SHARD_MODES[0]:
        return SYNC_MODES
    return tuple(m.name for m in MODES if m.synchronous)


_INTERNAL = "sync options"  # check_mode_options's ``where`` when the planner checks, not the user's input


def check_mode_options(mode: str, options: SyncOptions, where: str = _INTERNAL) -> None:
    """Refuse options that ``mode`` cannot run, naming the option and its value; where ``where`` names the
    user's input (``--sync bsp with --sync-option``), also an option the user set (``options.given``) that
    ``mode`` does not read. Under ``auto`` an option counts if a mode it considers (``modes_for``) reads it.
    Without ``where`` (the planner's own checks, which try every mode with the user's options) only the first.

    Raises:
        SyncLayoutError: ``reduce_dtype`` other than fp32 under a mode other than ``bsp``; a given option
            that no mode in question reads (``staleness`` under ``bsp``).
    """
    _check_runnable(mode, options, where)
    if where == _INTERNAL:
        return
    modes = modes_for(options) if mode == "auto" else (mode,)
    for name in options.option_names():
        readers = _BOUNDS[name].modes
        if name in options.given and readers and not set(readers) & set(modes):
            raise SyncLayoutError(f"{where}: {name}={getattr(options, name)} is an option of sync mode "
                                  f"{' and '.join(readers)}; sync mode {' / '.join(modes)} does not use it "
                                  f"(drop it, or sync {readers[0]})")


def _check_runnable(mode: str, options: SyncOptions, where: str = "sync options") -> None:
    """Refuse options that ``mode`` cannot run: ``reduce_dtype`` bf16 under a mode other than ``bsp``."""
    if mode in SYNC_MODES and options.shard != SHARD_MODES[0] and not sync_mode(mode).synchronous:
        raise SyncLayoutError(f"{where}: shard={options.shard} shards the bsp mode's optimizer state; sync mode "
                              f"{mode} steps each replica's own optimizer (use shard=none, or sync bsp)")
    if mode in SYNC_MODES and mode not in modes_for(options):
        raise SyncLayoutError(f"{where}: reduce_dtype={options.reduce_dtype} applies to the bsp mode's gradient "
                              f"all-reduces; sync mode {mode} exchanges weights and updates in fp32 "
                              f"(use reduce_dtype=fp32, or sync bsp)")


def _coerce(key: str, value: Any, where: str) -> Any:
    """``value`` as option ``key``'s type (a string from the command line parses; a whole float is an
    integer), checked against its bounds."""
    bound = _BOUNDS[key]
    result: Any = None
    if bound.kind is str:
        result = value
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        try:
            number = float(value)
            if bound.kind is float or number.is_integer():
                result = bound.kind(value if isinstance(value, str) else number)
        except (ValueError, OverflowError):
            result = None
    if result is None:
        raise SyncLayoutError(f"{where}: {key} must be {'an integer' if bound.kind is int else 'a number'} "
                              f"in [{bound.least:g}, {bound.most:g}], got {value!r:.80}")
    _check(key, result, where)
    return result


def _check(key: str, value: Any, where: str) -> None:
    bound = _BOUNDS[key]
    if bound.choices:
        if value not in bound.choices:
            raise SyncLayoutError(f"{where}: {key} must be one of {', '.join(bound.choices)}, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not bound.least <= value <= bound.most:
        raise SyncLayoutError(f"{where}: {key} must be in [{bound.least:g}, {bound.most:g}], got {value!r}")


# ---------------------------------------------------------------------------
# the layout
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """Layers ``[first_layer, end_layer)`` of a segment whose gradients are all-reduced together (``bsp``).

    Under ``bucket_cut = "exact"`` a bucket may hold only a part of its first or last layer: ``span``
    gives its bounds in layers, a fraction being the share of that layer's parameter bytes, in the
    layer's parameter order, that lies before the bound::

        layers      3                 4        5
        params      [a  b  c  d | e]  [......] [..]      span (3.74, 6.0): e (the last 26% of layer 3's
        bucket 1    <---------->                         bytes), layers 4 and 5; bucket 1: span (0.0, 3.74)
        bucket 0                  <--------------->

    Attributes:
        segment: index of its segment.
        index: its place among the segment's buckets: 0 holds the segment's last layers.
        first_layer: the first layer it holds (a part of, where ``span`` starts inside it).
        end_layer: one past its last layer (of which it may hold a part).
        param_bytes: bytes of its gradients.
        algorithm: ``"ring"`` or ``"hierarchical"``.
        span: its bounds in layers where one falls inside a layer (``first_layer <= span[0]``,
            ``span[1] <= end_layer``); None: the whole layers ``[first_layer, end_layer)``.
    """

    segment: int
    index: int
    first_layer: int
    end_layer: int
    param_bytes: float
    algorithm: str = "ring"
    span: tuple[float, float] | None = None

    @property
    def bounds(self) -> tuple[float, float]:
        """Its bounds in layers: ``span``, else ``(first_layer, end_layer)``."""
        return self.span if self.span is not None else (float(self.first_layer), float(self.end_layer))


@dataclass(frozen=True)
class PsShard:
    """One shard of a segment's parameter server: the owner that keeps it and its share of the segment.

    A segment's shards cut its flat weight vector (its layers' parameters in order) into contiguous ranges,
    in the order of ``Segment.ps_shards``: shard k keeps elements ``[F_k, F_k+1)``, F the running sum of the
    fractions (``Segment.ps_bounds``).

    Attributes:
        host: the owner whose process keeps the shard: it reduces the owners' updates of its range and
            broadcasts the range's global weights back.
        fraction: its share of the segment's elements (the shards' fractions sum to 1).
    """

    host: str
    fraction: float

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "fraction": self.fraction}


def cut_bounds(fractions: Sequence[float], numel: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each share of a flat buffer of ``numel`` elements cut by ``fractions`` (in order, summing
    to 1), rounded to whole elements; the last ends at ``numel``.

    Example:
        >>> cut_bounds([0.5, 0.25, 0.25], 10)
        [(0, 5), (5, 8), (8, 10)]
    """
    edges = [0]
    acc = 0.0
    for f in fractions[:-1]:
        acc += f
        edges.append(min(numel, round(acc * numel)))
    edges.append(numel)
    return list(itertools.pairwise(edges))


@dataclass(frozen=True)
class Segment:
    """Consecutive layers with the same owners; synchronised among those owners.

    Attributes:
        first_layer: its first layer.
        end_layer: one past its last layer.
        owners: the devices that hold it, sorted by name.
        param_bytes: bytes of its parameters (and of its gradients).
        algorithm: of an all-reduce of the whole segment among its owners (``"none"`` with one owner).
        buckets: its gradient buckets under ``bsp``, last layers first.
        ps_shards: its parameter server's shards (``wsp``, ``hybrid-ps``): one per node that holds an owner
            under ``placement = "sharded"``, one on one owner otherwise (``place_ps_shards``).
        local_groups: its owners grouped by node, groups of two or more (``hybrid-ps``, ``daso``).
        shard: what its owners shard (``SyncOptions.shard``; ``"none"`` with one owner).
        shard_fractions: with ``shard``, the share of the segment's elements each owner keeps (in ``owners``'
            order, summing to 1): owner j steps elements ``[F_j, F_j+1)`` of each flat buffer, F the running
            sum (``shard_bounds``).
    """

    first_layer: int
    end_layer: int
    owners: tuple[str, ...]
    param_bytes: float = 0.0
    algorithm: str = "none"
    buckets: tuple[Bucket, ...] = ()
    ps_shards: tuple[PsShard, ...] = ()
    local_groups: tuple[tuple[str, ...], ...] = ()
    shard: str = SHARD_MODES[0]
    shard_fractions: tuple[float, ...] = ()

    @property
    def sharded(self) -> bool:
        """Whether its owners shard its optimizer state (and perhaps its gradients)."""
        return self.shard != SHARD_MODES[0]

    def owner_position(self, device: str) -> int | None:
        """``device``'s position in ``owners``, None where it is not one: a dict kept on the segment, since a
        4096-device plan's segments have an owner per VW and the planner asks of every stage (``Plan.shard_shares``)."""
        positions: dict[str, int] | None = self.__dict__.get("_owner_positions")
        if positions is None:
            positions = {d: q for q, d in enumerate(self.owners)}
            object.__setattr__(self, "_owner_positions", positions)
        return positions.get(device)

    def shard_of(self, device: str) -> float:
        """The share of the segment's optimizer state ``device`` keeps: its fraction where sharded, else 1."""
        if not self.sharded:
            return 1.0
        q = self.owner_position(device)
        if q is None:
            raise ValueError(f"{device} does not own segment [{self.first_layer}, {self.end_layer})")
        return self.shard_fractions[q]

    def shard_bounds(self, numel: int) -> list[tuple[int, int]]:
        """Per owner, the elements ``[lo, hi)`` of a flat buffer of ``numel`` elements it keeps."""
        return cut_bounds(self.shard_fractions, numel)

    @property
    def parameter_servers(self) -> bool:
        """Whether its owners push to and pull from parameter-server shards (``wsp``, ``hybrid-ps``)."""
        return bool(self.ps_shards)

    def ps_bounds(self, numel: int) -> list[tuple[int, int]]:
        """Per parameter-server shard, in ``ps_shards``' order, the elements ``[lo, hi)`` of the segment's flat
        weights (``numel`` elements) it keeps."""
        return cut_bounds([x.fraction for x in self.ps_shards], numel)

    @property
    def shared(self) -> bool:
        """Whether it has anything to synchronise: more than one owner."""
        return len(self.owners) > 1

    @property
    def lead(self) -> str:
        """The owner that speaks for the segment's replicas, which are equal after each sync: it writes the
        segment's layers to a checkpoint and counts their gradients once in a global norm."""
        return self.owners[0]


@dataclass(frozen=True)
class SyncLayout:
    """Every synchronisation decision of a plan: its mode, options and segments."""

    mode: str
    options: SyncOptions
    segments: tuple[Segment, ...]
    #: bytes a gradient all-reduce moves per byte of (fp32) gradient as the runtime keeps them: the profile's
    #: ``ModelProfile.gradient_wire`` (0.5 where the runtime keeps 16-bit gradients); derived, not written
    gradient_wire: float = 1.0

    def segments_over(self, first: int, end: int) -> tuple[Segment, ...]:
        """The segments that hold any layer of ``[first, end)``, in ``segments``' order, kept per range: a plan's
        shares are asked of every stage (``Plan.shard_shares``), thousands of stages of a few dozen ranges, for
        each shard mode the planner tries per segment, and a 200-layer plan has hundreds of segments."""
        found: dict[tuple[int, int], tuple[Segment, ...]] = self.__dict__.setdefault("_segments_over", {})
        key = (first, end)
        if key not in found:
            found[key] = tuple(s for s in self.segments if max(s.first_layer, first) < min(s.end_layer, end))
        return found[key]

    def wire_bytes(self, num_bytes: float, segment: Segment) -> float:
        """Bytes a reduction of ``num_bytes`` of ``segment``'s gradients moves: ``options.wire_for`` its shard mode
        (half in bf16, which only bsp's gradient all-reduces take: ``check_mode_options``; half again where its
        owners shard it), times ``gradient_wire``."""
        return num_bytes * self.options.wire_for(segment.shard) * self.gradient_wire

    @property
    def segment_shards(self) -> tuple[str, ...]:
        """Each segment's shard mode (``Segment.shard``), in order."""
        return tuple(seg.shard for seg in self.segments)

    @property
    def mixed_shards(self) -> bool:
        """Whether its shared segments differ in what their owners shard (``Plan.segment_shards``)."""
        return len({seg.shard for seg in self.segments if seg.shared}) > 1

    def owned_segments(self, device: str) -> list[int]:
        """The segments ``device`` synchronises: those it holds with at least one other device."""
        return [s for s, seg in enumerate(self.segments) if seg.shared and device in seg.owners]

    def local_segments(self, device: str) -> list[int]:
        """The segments ``device`` shares with an owner on its own node (LOCAL_ALLREDUCE)."""
        return [s for s, seg in enumerate(self.segments) if any(device in g for g in seg.local_groups)]

    def owned_segments_by_device(self) -> dict[str, list[int]]:
        """``owned_segments`` of every device that synchronises any, in one pass over the segments."""
        out: dict[str, list[int]] = {}
        for s, seg in enumerate(self.segments):
            if seg.shared:
                for dev in seg.owners:
                    out.setdefault(dev, []).append(s)
        return out

    def device_buckets(self, device: str) -> list[Bucket]:
        """The buckets ``device`` all-reduces, in the order it starts them: decreasing segment, then bucket."""
        return self._in_start_order(self.owned_segments(device))

    def buckets_by_device(self) -> dict[str, list[Bucket]]:
        """``device_buckets`` of every device that synchronises any, in one pass over the segments."""
        return {dev: self._in_start_order(segs) for dev, segs in self.owned_segments_by_device().items()}

    def _in_start_order(self, segments: Sequence[int]) -> list[Bucket]:
        return [b for s in sorted(segments, reverse=True) for b in self.segments[s].buckets]

    def to_dict(self) -> dict[str, Any]:
        """plan.json's ``"sync"`` section (docs/plan.md)."""
        segments = []
        for s, seg in enumerate(self.segments):
            row: dict[str, Any] = {"segment": s, "layers": [seg.first_layer, seg.end_layer],
                                   "owners": list(seg.owners), "param_bytes": seg.param_bytes,
                                   "algorithm": seg.algorithm}
            if seg.buckets:
                row["buckets"] = [{"layers": [b.first_layer, b.end_layer], "param_bytes": b.param_bytes,
                                   "algorithm": b.algorithm, **({} if b.span is None else {"span": list(b.span)})}
                                  for b in seg.buckets]
            if seg.ps_shards:
                row["ps_shards"] = [x.to_dict() for x in seg.ps_shards]
            if seg.local_groups:
                row["local_groups"] = [list(g) for g in seg.local_groups]
            if seg.sharded:
                row["shard"] = seg.shard
                row["shard_fractions"] = list(seg.shard_fractions)
            segments.append(row)
        return {"mode": self.mode, "options": self.options.to_dict(), "segments": segments}


def group_segments(num_layers: int,
                   layouts: Sequence[Sequence[tuple[T, int, int]]]) -> list[tuple[int, int, tuple[T, ...]]]:
    """(first, end, owners) for each run of layers with the same owners; ``layouts`` per VW, one
    ``(device, first layer, end layer)`` per stage; owners sorted.

    Example:
        >>> group_segments(4, [[("a", 0, 2), ("b", 2, 4)], [("c", 0, 4)]])
        [(0, 2, ('a', 'c')), (2, 4, ('b', 'c'))]
    """
    # the owners change only where some stage begins or ends: one owner list per run between two such bounds
    # (4096 VWs hold each of 200 layers: a list per run, not per layer), runs of the same owners then merged
    bounds = sorted({0, num_layers} | {k for layout in layouts for _, k, _ in layout}
                    | {l for layout in layouts for _, _, l in layout})
    if bounds[0] < 0 or bounds[-1] > num_layers:
        raise ValueError(f"a stage's layers fall outside [0, {num_layers}): bounds {bounds[0]} to {bounds[-1]}")
    run_of = {b: q for q, b in enumerate(bounds)}
    owners: list[list[T]] = [[] for _ in bounds[1:]]
    for layout in layouts:
        for d, k, l in layout:
            for q in range(run_of[k], run_of[l]):
                owners[q].append(d)
    out: list[tuple[int, int, tuple[T, ...]]] = []
    for q, o in enumerate(owners):
        key = tuple(sorted(o))  # type: ignore[type-var]
        if out and out[-1][2] == key:
            out[-1] = (out[-1][0], bounds[q + 1], key)
        else:
            out.append((bounds[q], bounds[q + 1], key))
    return out


def cut_buckets(param_bytes: Sequence[float], first: int, end: int, first_bucket_bytes: float,
                bucket_bytes: float) -> list[tuple[int, int, float]]:
    """(first, end, bytes) of the gradient buckets of layers ``[first, end)``, from the last layers to the first.

    Walking the layers backwards, a bucket closes once it holds at least ``first_bucket_bytes`` (the first
    bucket) or ``bucket_bytes`` (the others), as DistributedDataParallel buckets its gradients. A layer is
    never split, so a bucket can be larger; layers smaller than the first bucket are one bucket.

    Example:
        >>> cut_buckets([4.0, 4.0, 4.0], 0, 3, 3.0, 8.0)
        [(2, 3, 4.0), (0, 2, 8.0)]
    """
    out: list[tuple[int, int, float]] = []
    stop, held = end, 0.0
    for k in range(end - 1, first - 1, -1):
        held += param_bytes[k]
        if held >= (first_bucket_bytes if not out else bucket_bytes) or k == first:
            out.append((k, stop, held))
            stop, held = k, 0.0
    return out


def backward_after(g: Sequence[float] | npt.NDArray[np.float64], start: float, end: int) -> float:
    """Seconds of backward of layers ``[start, end)`` (``g`` per layer): the whole layers after ``start``, and
    where ``start`` falls inside a layer (``Bucket.span``), the share of that layer's backward its bytes
    after the bound stand for. What a bucket starting at ``start`` waits for, from the backward of layer
    ``end - 1`` on.

    Example:
        >>> backward_after([1.0, 2.0, 4.0], 1, 3), backward_after([1.0, 2.0, 4.0], 1.25, 3)
        (6.0, 5.5)
    """
    k = math.floor(start)
    whole = float(sum(g[k + 1:end]))
    return whole + (1.0 - (start - k)) * float(g[k]) if k < end else whole


def cut_buckets_exact(param_bytes: Sequence[float], first: int, end: int, first_bucket_bytes: float,
                      bucket_bytes: float) -> list[tuple[float, float, float]]:
    """(start, end, bytes) of the gradient buckets of layers ``[first, end)`` cut at exactly their size, from the
    last layers to the first; ``start`` and ``end`` in layers, a fraction being the share of that layer's bytes
    before the bound (``Bucket.span``).

    Walking the layers backwards, the first bucket closes at ``first_bucket_bytes``, each other at
    ``bucket_bytes``, wherever in a layer that falls; the last bucket holds what is left. A layer is split
    between buckets where a bound falls inside it (DistributedDataParallel's cut, to the byte rather than to
    the parameter), so no bucket is larger than its size.

    Example:
        >>> cut_buckets_exact([4.0, 4.0, 4.0], 0, 3, 3.0, 8.0)
        [(2.25, 3.0, 3.0), (0.25, 2.25, 8.0), (0.0, 0.25, 1.0)]
    """
    out: list[tuple[float, float, float]] = []
    stop, held = float(end), 0.0
    for k in range(end - 1, first - 1, -1):
        left = float(param_bytes[k])  # bytes of layer k not yet in a bucket: its first ones
        while left > 0:
            room = (first_bucket_bytes if not out else bucket_bytes) - held
            take = min(left, room)
            left -= take
            held += take
            if take >= room and (left > 0 or k > first):
                at = k + left / float(param_bytes[k])
                out.append((at, stop, held))
                stop, held = at, 0.0
    if held > 0 or not out:
        out.append((float(first), stop, held))
    return out


def place_ps_shard(owners: Sequence[T], nodes: Sequence[str], s: int, placement: str = "local") -> T:
    """The owner of segment ``s`` that hosts its parameter-server shard.

    ``owners`` in device order, ``nodes[q]`` the node of ``owners[q]``.

    - ``local``: on the node that hosts the most of the segment's stages, so that most
      pushes and pulls stay on the node's fast links and only the other nodes' owners
      cross the network (HetPipe places each layer's parameters with the stages that
      compute it, Park et al. ATC 2020, Sec. 5); ties between nodes and between the
      owners of the chosen node go round-robin by segment index, which spreads shards.
    - ``round-robin``: ``owners[s mod |owners|]``, whatever the nodes.

    Example:
        >>> place_ps_shard(["a:0", "b:0", "b:1"], ["a", "b", "b"], 0, "local")
        'b:0'
        >>> place_ps_shard(["a:0", "b:0", "b:1"], ["a", "b", "b"], 0, "round-robin")
        'a:0'
    """
    if not owners:
        raise SyncLayoutError(f"segment {s} has no owners to host its parameter-server shard")
    if placement == "round-robin":
        return owners[s % len(owners)]
    if placement == "local":
        counts = Counter(nodes)
        most = max(counts.values())
        tied = sorted(n for n, c in counts.items() if c == most)
        node = tied[s % len(tied)]
        members = [o for o, n in zip(owners, nodes, strict=True) if n == node]
        return members[s % len(members)]
    raise SyncLayoutError(f"sync option placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def place_ps_shards(owners: Sequence[T], nodes: Sequence[str], nic_bandwidth: Mapping[str, float], s: int,
                    placement: str = PLACEMENTS[0]) -> tuple[tuple[T, float], ...]:
    """(host, fraction) of each parameter-server shard of segment ``s``, in the order they cut its weights.

    ``owners`` in device order, ``nodes[q]`` the node of ``owners[q]``, ``nic_bandwidth`` per node its NIC's
    bytes/s.

    - ``sharded``: one shard per node that holds an owner, in the order the nodes first appear among the
      owners, each as large as the node's share of the owners' nodes' NIC bandwidth: a parameter server
      sharded over the servers (Li et al., OSDI 2014, Sec. 4), so that a wave's pushes and pulls cross every
      node's NIC, each NIC carrying in proportion to what it can move (HetPipe likewise runs one server per
      node, Park et al., ATC 2020, Sec. 5). Within a node, the owner ``s mod k`` of its k owners keeps the
      shard, which spreads segments over a node's devices. Owners all on one node: one shard.
    - ``local`` and ``round-robin``: one shard, the whole segment, on the owner ``place_ps_shard`` picks.

    Example:
        >>> place_ps_shards(["a:0", "a:1", "b:0"], ["a", "a", "b"], {"a": 3.0, "b": 1.0}, 1)
        (('a:1', 0.75), ('b:0', 0.25))
        >>> place_ps_shards(["a:0", "a:1", "b:0"], ["a", "a", "b"], {"a": 3.0, "b": 1.0}, 1, "local")
        (('a:1', 1.0),)
    """
    if placement != "sharded":
        return ((place_ps_shard(owners, nodes, s, placement), 1.0),)
    if not owners:
        raise SyncLayoutError(f"segment {s} has no owners to host its parameter-server shards")
    by_node: dict[str, list[T]] = {}
    for o, n in zip(owners, nodes, strict=True):
        by_node.setdefault(n, []).append(o)
    weights = [float(nic_bandwidth[n]) for n in by_node]
    total = sum(weights)
    shares = [round(w / total, 9) if total > 0 else round(1.0 / len(weights), 9) for w in weights]
    return tuple((members[s % len(members)], share) for members, share in zip(by_node.values(), shares, strict=True))


def build_sync_layout(cluster: Cluster, profile: ModelProfile, stages: Sequence[Sequence[tuple[str, int, int]]],
                      mode: str, options: SyncOptions, tp_degrees: Sequence[int] | None = None,
                      shard_weights: Mapping[str, float] | None = None,
                      segment_shards: Sequence[str] = ()) -> SyncLayout:
    """Every sync decision for VWs whose stages are ``stages`` (per VW, ``(device, first, end)`` per stage).

    ``shard_weights``: with ``options.shard``, device -> what sizes its shards (``shard_fractions``): each
    owner of a segment keeps the share ``w / sum(w)`` of its owners' weights (equal shares where none is given,
    or none is positive).

    ``segment_shards``: per segment, what its owners shard (``Plan.segment_shards``, checked by
    ``check_segment_shards``); empty: every shared segment shards as ``options.shard`` says.

    ``tp_degrees``: per layer, the TP degree it runs at (the same in every VW: ``plan.validate_plan``); a
    segment's owners are then the stages' first devices, and its bytes one TP rank's: rank j of each owner's
    group reduces its shard with rank j of the others (``cost.tp_rank_profile``). None: no TP.

    Raises:
        SyncLayoutError: an unknown mode; a sharded layout with TP stages (the runtime shards whole tensors).
    """
    if options.shard != SHARD_MODES[0] and tp_degrees is not None and max(tp_degrees, default=1) > 1:
        raise SyncLayoutError(f"sync options: shard={options.shard} with TP stages is not supported: a TP rank's "
                              f"gradients are DTensor shards already (use shard=none, or --max-tp 1)")
    try:
        rules = sync_mode(mode)
    except SyncModeError as e:
        raise SyncLayoutError(str(e)) from None
    _check_runnable(mode, options)  # not the options a user gave: the planner lays out every mode with them
    groups = group_segments(profile.num_layers, stages)
    if segment_shards:
        check_segment_shards(segment_shards, groups, options.shard)
    index = {d.name: d.index for d in cluster.devices}
    node_of = {d.name: d.node for d in cluster.devices}
    nic_of = {n.name: n.nic.bandwidth_bytes_per_s for n in cluster.nodes}
    layer_bytes = [float(x.param_bytes) for x in profile.layers]
    if tp_degrees is not None:
        layer_bytes = [float(tp_rank_profile(profile, k).layers[i].param_bytes) for i, k in enumerate(tp_degrees)]
    segments = []
    for s, (first, end, owners) in enumerate(groups):
        num_bytes = float(sum(layer_bytes[first:end]))
        seg = Segment(first, end, owners, num_bytes)
        shard = segment_shards[s] if segment_shards else options.shard
        wire = options.wire_for(shard if rules.synchronous else SHARD_MODES[0]) * profile.gradient_wire
        if seg.shared:
            shape = allreduce_shape(cluster, [index[o] for o in owners])

            def algorithm(size: float, shape: Any = shape, wire: float = wire) -> str:  # on the bytes that travel
                return estimate_allreduce(size * wire, shape, options.allreduce)[1]

            seg = replace(seg, algorithm=algorithm(num_bytes))
            if rules.synchronous and options.bucket_cut == "exact":
                exact = cut_buckets_exact(layer_bytes, first, end, options.first_bucket_bytes, options.bucket_bytes)
                seg = replace(seg, buckets=tuple(_exact_bucket(s, b, lo, hi, size, algorithm(size))
                                                 for b, (lo, hi, size) in enumerate(exact)))
            elif rules.synchronous:
                cuts = cut_buckets(layer_bytes, first, end, options.first_bucket_bytes, options.bucket_bytes)
                seg = replace(seg, buckets=tuple(Bucket(s, b, k, l, size, algorithm(size))
                                                 for b, (k, l, size) in enumerate(cuts)))
            if rules.parameter_servers:
                in_order = sorted(owners, key=index.__getitem__)
                shards = place_ps_shards(in_order, [node_of[o] for o in in_order], nic_of, s, options.placement)
                seg = replace(seg, ps_shards=tuple(PsShard(h, f) for h, f in shards))
            if rules.local_mean:
                by_node: dict[str, list[str]] = {}
                for o in owners:
                    by_node.setdefault(node_of[o], []).append(o)
                seg = replace(seg, local_groups=tuple(tuple(g) for n, g in sorted(by_node.items()) if len(g) > 1))
            if rules.synchronous and shard != SHARD_MODES[0]:
                seg = replace(seg, shard=shard, shard_fractions=shard_fractions(owners, shard_weights))
        segments.append(seg)
    return SyncLayout(mode, options, tuple(segments), profile.gradient_wire)


def check_segment_shards(modes: Sequence[str], groups: Sequence[tuple[int, int, tuple[T, ...]]], most: str) -> None:
    """Refuse per-segment shard modes (``Plan.segment_shards``) that do not fit the segments ``groups``
    (``group_segments``): one per segment, each a shard mode, ``none`` on a segment of one owner (nothing to
    shard), and the most of them ``most`` (the ``shard`` option: the most any segment shards).

    Raises:
        SyncLayoutError: naming the segment and the mode.
    """
    where = "sync.segment_shards"
    if len(modes) != len(groups):
        raise SyncLayoutError(f"{where}: {len(modes)} modes for the {len(groups)} segments the stages give; "
                              f"give one per segment")
    for s, (mode, (first, end, owners)) in enumerate(zip(modes, groups, strict=True)):
        if mode not in SHARD_MODES:
            raise SyncLayoutError(f"{where}[{s}]: {mode!r} is not a shard mode ({', '.join(SHARD_MODES)})")
        if mode != SHARD_MODES[0] and len(owners) < 2:
            raise SyncLayoutError(f"{where}[{s}]: {mode}, but segment {s} (layers [{first}, {end})) has one owner, "
                                  f"{owners[0]}: nothing to shard; use none")
    top = max(modes, key=SHARD_MODES.index)
    if top != most:
        raise SyncLayoutError(f"{where}: the most any segment shards is {top}, the sync option shard is {most}; "
                              f"they must agree (the option says the most any segment shards)")


def shard_fractions(owners: Sequence[str], weights: Mapping[str, float] | None) -> tuple[float, ...]:
    """Each owner's share of a sharded segment: its weight over the owners' sum (non-positive weights count as
    0), rounded to 1e-9; equal shares where no owner has a positive weight."""
    w = [max(0.0, float((weights or {}).get(o, 0.0))) for o in owners]
    total = sum(w)
    if total <= 0 or not math.isfinite(total):
        return tuple(round(1.0 / len(owners), 9) for _ in owners)
    return tuple(round(x / total, 9) for x in w)


def _exact_bucket(s: int, b: int, lo: float, hi: float, size: float, algorithm: str) -> Bucket:
    """The Bucket of an exact cut: whole layers where both bounds fall on layer boundaries, else with its span."""
    first, end = math.floor(lo), math.ceil(hi)
    whole = lo == first and hi == end
    return Bucket(s, b, first, end, size, algorithm, None if whole else (lo, hi))


def check_sync_section(raw: Any, expected: SyncLayout) -> None:
    """Refuse a plan.json ``"sync"`` section that differs from the layout its stages and options give.

    The section is written by the planner; a hand edit of segments, buckets, algorithms or hosts that
    does not follow from the stages would make the runtime and the prediction disagree.

    Raises:
        SyncLayoutError: naming the first segment (and field) that differs.
    """
    how = "the section is decided by the planner: re-plan with `hetrain plan --from PLAN -o NEW`"
    got = raw.get("segments") if isinstance(raw, Mapping) else None
    if not isinstance(got, list):
        raise SyncLayoutError(f"sync.segments: expected a list of segments, got {_show(got)}")
    want = expected.to_dict()["segments"]
    if len(got) != len(want):
        raise SyncLayoutError(f"sync.segments: sync has {len(got)} segments, the stages give {len(want)}; {how}")
    for s, (row, expect) in enumerate(zip(got, want, strict=True)):
        for key, value in expect.items():
            have = row.get(key) if isinstance(row, Mapping) else None
            if not _same(have, value):
                raise SyncLayoutError(f"sync.segments[{s}].{key}: {'missing' if have is None else _show(have)}, "
                                      f"the stages and options give {_show(value)}; {how}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, float) and isinstance(a, int | float) and not isinstance(a, bool):
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    if isinstance(b, list) and isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, dict) and isinstance(a, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    return type(a) is type(b) and bool(a == b)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

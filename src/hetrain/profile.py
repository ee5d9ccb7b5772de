"""What a model costs, layer by layer: ModelProfile, its JSON form, and scaling.

A profile holds, per layer, the figures the cost model needs: parameter bytes,
output activation bytes per sample (what crosses a stage boundary), bytes kept
for backward per sample, forward FLOPs per sample and, for device types where it
was measured, forward and backward seconds at one or more micro-batch sizes.
Per device type it may also hold the measured optimizer step, in seconds per
parameter byte, per optimizer (PipeDream's profiler times the weight update too).
docs/profile.md documents the JSON; the profiler writes it, people may edit it.

Example:
    >>> from hetrain.models.analytic import build_profile
    >>> p = build_profile("gpt2-small")                          # doctest: +SKIP
    >>> p.save("gpt2-small.json"); load_profile("gpt2-small.json")  # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from hetrain.catalog import RuntimeFootprint
from hetrain.errors import InputError
from hetrain.fields import (
    MAX_LAYERS,
    MAX_MICRO_BATCH,
    MAX_SEQ_LEN,
    load_json_object,
    optional_number,
    require_int,
    require_list,
    require_mapping,
    require_number,
    require_object,
    require_str,
    show,
)

PRECISIONS = ("fp32", "fp16", "bf16")
Precision = Literal["fp32", "fp16", "bf16"]
#: how the runtime that trains the model keeps its weights and gradients under 16-bit compute
#: (``ModelProfile.mixed_precision``); the first is hetrain's own
MIXED_PRECISIONS = ("autocast", "master-weights")
MixedPrecision = Literal["autocast", "master-weights"]
FORMAT_VERSION = 2
#: The optimizers: one vocabulary for the plan, the cost model (``cost.OPTIMIZER_STATE_PER_PARAM``), the
#: profiler and the runtime. ``adam`` is Adam with decoupled weight decay (``torch.optim.AdamW``, the same as
#: Adam without weight decay).
OPTIMIZER_NAMES = ("sgd", "momentum", "adam")
#: other names read at the edge (profile files, command lines) as one of ``OPTIMIZER_NAMES``
OPTIMIZER_ALIASES = {"adamw": "adam"}


def canonical_optimizer(name: str) -> str:
    """``name`` in the one vocabulary (``"adamw"`` -> ``"adam"``).

    Raises:
        ProfileError: a name that is none of ``OPTIMIZER_NAMES`` or their aliases.
    """
    key = OPTIMIZER_ALIASES.get(name, name)
    if key not in OPTIMIZER_NAMES:
        raise ProfileError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)} (or adamw)")
    return key


class ProfileError(InputError):
    """A profile that cannot be used; the message names the layer and the field."""


@dataclass(frozen=True)
class Measurement:
    """Timed forward and backward of one layer at one micro-batch size.

    ``source`` is ``"measured"`` (profiled on that device type) or ``"scaled"``
    (derived from another type's measurement by the roofline ratio).

    ``forward_spread_s`` / ``backward_spread_s``: how far one timed repeat strays from the
    median, as a standard deviation estimated from the repeats' interquartile range
    (``profiler.layers.estimate_spread``); None where unknown (one repeat, an older profile,
    a scaled figure). The planner scores its best plans under it (``planner.robust``).
    """

    micro_batch: int
    forward_s: float
    backward_s: float
    source: str = "measured"
    forward_spread_s: float | None = None
    backward_spread_s: float | None = None

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ProfileError(f"measurement micro_batch must be >= 1, got {self.micro_batch}")
        if not (self.forward_s >= 0 and self.backward_s >= 0):
            raise ProfileError(
                f"measured times must be >= 0, got forward {self.forward_s} s, backward {self.backward_s} s"
            )
        for key in ("forward_spread_s", "backward_spread_s"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"measurement at micro_batch {self.micro_batch}: {key} must be a finite "
                                   f"number of seconds >= 0, got {value}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_batch": self.micro_batch, "forward_s": self.forward_s,
                               "backward_s": self.backward_s}
        if self.source != "measured":
            out["source"] = self.source
        for key in ("forward_spread_s", "backward_spread_s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class TPSplit:
    """How a layer splits over a TP group of k devices (Megatron-style tensor parallelism: Shoeybi et al. 2019).

    The split parts are divided by k on every rank; the rest (norms, replicated biases, the layer's input and
    output, element-wise work on them) stays whole on every rank. A layer without a ``TPSplit`` is replicated:
    each rank of a TP group computes all of it.

    Attributes:
        split_param_bytes: parameter bytes divided among the ranks (the column- and row-parallel matrices).
        split_flops_per_sample: forward FLOPs divided among the ranks (their matrix multiplies, attention by heads).
        split_saved_bytes_per_sample: activation bytes kept for backward that are divided (those inside the
            column-parallel / row-parallel pair; Korthikanti et al. 2022, eq. 2).
        allreduce_bytes_per_sample: bytes each forward all-reduces over the group per sample (Megatron's g
            operator: a transformer block's attention and MLP outputs, two of s x h each); backward all-reduces as
            many (the f operator's conjugate, on the input gradients).
        allreduces: all-reduce calls per forward (and as many per backward): a transformer block's two.
        split_output_bytes_per_sample: output bytes per sample divided among the ranks and never gathered: a
            vocab-parallel head's logits (Megatron's parallel cross-entropy keeps each rank's k-th of the vocabulary;
            the loss term counts them, ``cost.loss_memory_per_sample``). 0: every rank holds the whole output.
    """

    split_param_bytes: float
    split_flops_per_sample: float
    split_saved_bytes_per_sample: float
    allreduce_bytes_per_sample: float
    allreduces: int = 2
    split_output_bytes_per_sample: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {"split_param_bytes": self.split_param_bytes, "split_flops_per_sample": self.split_flops_per_sample,
               "split_saved_bytes_per_sample": self.split_saved_bytes_per_sample,
               "allreduce_bytes_per_sample": self.allreduce_bytes_per_sample, "allreduces": self.allreduces}
        if self.split_output_bytes_per_sample:
            out["split_output_bytes_per_sample"] = self.split_output_bytes_per_sample
        return out


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer (one entry of the model's layer list).

    Attributes:
        name: a label, e.g. ``"block3"``.
        param_bytes: bytes of its parameters as training keeps them: fp32, whatever the precision of
            compute (the fp32 master weights of mixed precision, ``hetrain.amp``); also the bytes of
            their gradients, which are summed in fp32.
        output_bytes_per_sample: bytes of its output per sample as sent to the next stage (floating
            outputs in the precision of compute).
        saved_bytes_per_sample: activation bytes kept for backward per sample.
        forward_flops_per_sample: forward FLOPs per sample (backward is taken as 2x).
        measured: per device type, measurements at one or more micro-batch sizes (on one device).
        tp: how the layer splits under tensor parallelism; None: it has no TP rule, and a TP group
            replicates it.
        measured_tp: per device type and TP degree k >= 2, measurements of the layer on one rank of a TP group
            of k (its collectives in): ``hetrain profile`` under torchrun on a node with k devices. Where a
            type and degree have none, the cost model estimates them from ``tp`` (``cost.estimate_layer_time``).
    """

    name: str
    param_bytes: float
    output_bytes_per_sample: float
    saved_bytes_per_sample: float
    forward_flops_per_sample: float
    measured: tuple[tuple[str, tuple[Measurement, ...]], ...] = ()
    tp: TPSplit | None = None
    measured_tp: tuple[tuple[str, int, tuple[Measurement, ...]], ...] = ()

    def __post_init__(self) -> None:
        for key in ("param_bytes", "output_bytes_per_sample", "saved_bytes_per_sample",
                    "forward_flops_per_sample"):
            value = getattr(self, key)
            if not value >= 0:
                raise ProfileError(f"layer {self.name!r}: {key} must be >= 0, got {value}")
        if self.tp is not None:
            for key, whole in (("split_param_bytes", self.param_bytes),
                               ("split_flops_per_sample", self.forward_flops_per_sample),
                               ("split_saved_bytes_per_sample", self.saved_bytes_per_sample),
                               ("split_output_bytes_per_sample", self.output_bytes_per_sample)):
                part = getattr(self.tp, key)
                if not 0 <= part <= whole * (1 + 1e-9):
                    raise ProfileError(f"layer {self.name!r}: tp.{key} = {part} must be in [0, {whole}] "
                                       f"(the layer's own figure)")
            if not (self.tp.allreduce_bytes_per_sample >= 0 and self.tp.allreduces >= 0):
                raise ProfileError(f"layer {self.name!r}: tp.allreduce_bytes_per_sample and tp.allreduces "
                                   f"must be >= 0")
        for type_name, k, _ in self.measured_tp:
            if k < 2 or k & (k - 1):
                raise ProfileError(f"layer {self.name!r}: measured_tp[{type_name!r}] degree {k} must be a power "
                                   f"of two >= 2")

    def tp_measurements(self, type_name: str, k: int) -> tuple[Measurement, ...]:
        """Measurements on one rank of a TP group of ``k`` devices of ``type_name`` (empty where not measured)."""
        for t, degree, ms in self.measured_tp:
            if t == type_name and degree == k:
                return ms
        return ()

    def measurements(self, type_name: str) -> tuple[Measurement, ...]:
        for t, ms in self.measured:
            if t == type_name:
                return ms
        return ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "param_bytes": self.param_bytes,
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "saved_bytes_per_sample": self.saved_bytes_per_sample,
            "forward_flops_per_sample": self.forward_flops_per_sample,
        }
        if self.measured:
            out["measured"] = {t: [m.to_dict() for m in ms] for t, ms in self.measured}
        if self.tp is not None:
            out["tp"] = self.tp.to_dict()
        if self.measured_tp:
            by_type: dict[str, dict[str, Any]] = {}
            for t, k, ms in self.measured_tp:
                by_type.setdefault(t, {})[str(k)] = [m.to_dict() for m in ms]
            out["measured_tp"] = by_type
        return out


@dataclass(frozen=True)
class DeviceFigures:
    """Peak figures of a device type a profile was measured on (for roofline scaling)."""

    peak_flops: float
    memory_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class ModelProfile:
    """A model as the planner sees it: an ordered list of LayerProfiles.

    Attributes:
        name: model name, e.g. ``"gpt2-medium"``.
        layers: the layers, in order; the output of layer i feeds layer i + 1.
        input_bytes_per_sample: bytes of one sample of the model's input.
        precision: training precision of compute (``fp32``, ``fp16``, ``bf16``).
        compute_efficiency: fraction of the roofline peak that layers reach when
            their time is estimated rather than measured (0 < e <= 1).
        measured_on: peak figures of the device types with measurements, so
            other types can be scaled from them by the roofline ratio.
        optimizer_step_s_per_byte: per device type, per optimizer (``OPTIMIZER_NAMES``),
            the measured seconds of one optimizer step per parameter byte.
        action_overhead_s: per device type, the seconds each forward and each backward of a
            micro-batch costs on top of its layers' profiled times when the runtime runs it:
            its messages posted and completed, their copies, the executor's own work, the
            device getting going again after a wait. Layer times are measured back to back
            and contain none of it. It is calibrated from a real run (``hetrain calibrate``);
            a type without a figure costs 0.
        iteration_overhead_s: per device type, the seconds each iteration costs on top of its actions:
            the runtime's fixed work once per iteration (its step's bookkeeping, the data loader, the
            launch of the step's kernels). Paid with the optimizer step; a type without a figure costs 0.
        memory_footprint: per device type, ``(fixed_bytes, allocator_fraction)``: the memory a
            training process holds there beyond its tensors (``catalog.RuntimeFootprint``),
            measured by the profiler on the device; a type without one takes the catalog's.
        seq_len: tokens per sample the layers were measured at, for a token model (activation bytes
            and times scale with it); None where unknown (not a token model, or a profile that
            does not say). ``hetrain train`` runs at it.
        split_points: the module names a traced model was cut at (``hetrain profile --split-points``);
            empty for the default cut. ``hetrain train`` cuts the model at them again.
        common_spread: per device type, how far every measured time of that type moves together from
            one profiling to the next, as a fraction of the time (a relative standard deviation): a
            shift common to all the type's layers (its clock, the host's load, a quota's phase), which
            the per-layer spreads, each over its own repeats, do not hold
            (``profiler.layers.estimate_common_spread``). A type without a figure: none known. The
            planner draws it once per type and draw (``planner.robust``).
        action_overhead_spread_s: per device type, how far ``action_overhead_s`` moves from one step
            to the next, in seconds (a standard deviation): the calibration run's steps each imply their
            own overhead (``calibrate.fit_action_overhead``, from the steps' quartiles). The runtime's
            work per action is the host's, and it wanders with the host; a plan of many small
            micro-batches is exposed to it more than one of few large ones. The planner draws it
            once per draw, for every type alike (``planner.robust``). A type without a figure: none known.
        mixed_precision: how the runtime that trains the model keeps weights and gradients under 16-bit compute
            (``precision`` fp16 or bf16; under fp32 the two agree). ``autocast`` (hetrain's runtime, ``hetrain.amp``):
            fp32 parameters and gradients and a 16-bit copy of the weights, gradients all-reduced as fp32.
            ``master-weights`` (DeepSpeed's and Megatron-LM's fp16 / bf16 mixed precision, NVIDIA apex O2): 16-bit
            weights and gradients beside fp32 master weights and optimizer state, gradients all-reduced in 16 bits
            (Rajbhandari et al., ZeRO, 2020, sec. 3.1: 2 + 2 + 12 bytes per parameter under Adam). Describes runs of
            another runtime (``hetrain.imports``): hetrain's runtime refuses to run it (``runtime.command``).
        tp_efficiency: where a layer's time on a rank of a TP group is estimated (no ``measured_tp``), the
            fraction of the ideal 1/k speed-up its split part reaches: k-times narrower matrix multiplies run
            below the whole one's rate. 0.9 by default: Megatron-LM keeps 77% of one GPU's rate at TP 8 with
            its collectives in (Shoeybi et al. 2019, fig. 5), most of the loss being the all-reduces, which
            the cost model counts apart (``cost.estimate_tp_collective_time``).
    """

    name: str
    layers: tuple[LayerProfile, ...]
    input_bytes_per_sample: float
    precision: Precision = "fp32"
    compute_efficiency: float = 0.5
    measured_on: tuple[tuple[str, DeviceFigures], ...] = ()
    optimizer_step_s_per_byte: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    action_overhead_s: tuple[tuple[str, float], ...] = ()
    memory_footprint: tuple[tuple[str, float, float], ...] = ()
    iteration_overhead_s: tuple[tuple[str, float], ...] = ()
    seq_len: int | None = None
    common_spread: tuple[tuple[str, float], ...] = ()
    action_overhead_spread_s: tuple[tuple[str, float], ...] = ()
    split_points: tuple[str, ...] = ()
    tp_efficiency: float = 0.9
    mixed_precision: MixedPrecision = "autocast"
    #: 1 for a model's profile; k for what one rank of a TP group of k holds (``cost.tp_rank_profile``),
    #: which the planner and the simulator cost and never save
    tp_degree: int = field(default=1, compare=False)
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"profile {self.name!r} has no layers")
        if self.precision not in PRECISIONS:
            raise ProfileError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ProfileError(f"compute_efficiency must be in (0, 1], got {self.compute_efficiency}")
        for type_name, rates in self.optimizer_step_s_per_byte:
            for name, rate in rates:
                where = f"optimizer_step_s_per_byte[{type_name!r}][{name!r}]"
                if name not in OPTIMIZER_NAMES:
                    raise ProfileError(f"{where}: unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}")
                if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
                        math.isfinite(rate) and rate > 0):
                    raise ProfileError(f"{where} must be a positive finite number of seconds per parameter byte, "
                                       f"got {rate!r}")
        for type_name, fixed, fraction in self.memory_footprint:
            for name, value in (("fixed_bytes", fixed), ("allocator_fraction", fraction)):
                bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0)
                if bad:
                    raise ProfileError(f"memory_footprint[{type_name!r}].{name} must be a finite number >= 0, "
                                       f"got {value!r}")
        for key, figures in (("action_overhead_s", self.action_overhead_s),
                             ("iteration_overhead_s", self.iteration_overhead_s),
                             ("action_overhead_spread_s", self.action_overhead_spread_s)):
            for type_name, seconds in figures:
                if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                        math.isfinite(seconds) and seconds >= 0):
                    raise ProfileError(f"{key}[{type_name!r}] must be a finite number of seconds >= 0, "
                                       f"got {seconds!r}")
        for type_name, fraction in self.common_spread:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                    math.isfinite(fraction) and 0 <= fraction <= 1):
                raise ProfileError(f"common_spread[{type_name!r}] must be a fraction of the time in [0, 1], "
                                   f"got {fraction!r}")
        if not 0 < self.tp_efficiency <= 1:
            raise ProfileError(f"tp_efficiency must be in (0, 1], got {self.tp_efficiency}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ProfileError(f"mixed_precision must be one of {MIXED_PRECISIONS}, got {self.mixed_precision!r}")
        if self.seq_len is not None and not 1 <= self.seq_len <= MAX_SEQ_LEN:
            raise ProfileError(f"seq_len must be in [1, {MAX_SEQ_LEN}], got {self.seq_len}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_bytes(self) -> float:
        return float(sum(layer.param_bytes for layer in self.layers))

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one element of compute: 4 under fp32, 2 under bf16 / fp16 (parameters are fp32 always)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes_per_element(self) -> int:
        """Bytes of one gradient element as the runtime keeps and all-reduces it: 4 (fp32) under ``autocast``, the
        precision of compute's under ``master-weights`` (``mixed_precision``)."""
        return self.bytes_per_element if self.mixed_precision == "master-weights" else 4

    @property
    def gradient_wire(self) -> float:
        """Bytes a gradient all-reduce moves per byte of (fp32) ``param_bytes``: 1, or 0.5 where the runtime keeps
        16-bit gradients (``grad_bytes_per_element``)."""
        return self.grad_bytes_per_element / 4

    def figures_of(self, type_name: str) -> DeviceFigures | None:
        for t, f in self.measured_on:
            if t == type_name:
                return f
        return None

    def optimizer_s_per_byte(self, type_name: str, optimizer: str) -> float | None:
        """Measured seconds of one ``optimizer`` step per parameter byte on ``type_name``, or None.

        ``optimizer`` is a cost-model name (``"sgd"``, ``"momentum"``, ``"adam"``) or ``"adamw"``.
        """
        name = OPTIMIZER_ALIASES.get(optimizer, optimizer)
        for t, rates in self.optimizer_step_s_per_byte:
            if t == type_name:
                for n, rate in rates:
                    if n == name:
                        return rate
        return None

    def footprint_of(self, type_name: str) -> RuntimeFootprint | None:
        """The measured memory footprint on ``type_name`` (``memory_footprint``), else None."""
        for t, fixed, fraction in self.memory_footprint:
            if t == type_name:
                return RuntimeFootprint(float(fixed), float(fraction), f"measured on {t}")
        return None

    def action_overhead_of(self, type_name: str) -> float:
        """Seconds each forward and backward action costs on ``type_name`` beyond its layers (``action_overhead_s``),
        else 0."""
        for t, seconds in self.action_overhead_s:
            if t == type_name:
                return float(seconds)
        return 0.0

    def action_overhead_spread_of(self, type_name: str) -> float:
        """Seconds ``action_overhead_of(type_name)`` moves by from step to step (``action_overhead_spread_s``),
        else 0."""
        for t, seconds in self.action_overhead_spread_s:
            if t == type_name:
                return float(seconds)
        return 0.0

    def iteration_overhead_of(self, type_name: str) -> float:
        """Seconds each iteration costs on ``type_name`` beyond its actions (``iteration_overhead_s``), else 0."""
        for t, seconds in self.iteration_overhead_s:
            if t == type_name:
                return float(seconds)
        return 0.0

    def common_spread_of(self, type_name: str) -> float:
        """The relative spread of a shift common to all of ``type_name``'s times (``common_spread``), else 0."""
        for t, fraction in self.common_spread:
            if t == type_name:
                return float(fraction)
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        if self.tp_degree != 1:
            raise ValueError(f"profile {self.name!r} is one TP rank's view (degree {self.tp_degree}); save the "
                             f"model's profile")
        out: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "precision": self.precision,
            "compute_efficiency": self.compute_efficiency,
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.measured_on:
            out["measured_on"] = {
                t: {"peak_flops": f.peak_flops, "memory_bandwidth_bytes_per_s": f.memory_bandwidth_bytes_per_s}
                for t, f in self.measured_on
            }
        if self.optimizer_step_s_per_byte:
            out["optimizer_step_s_per_byte"] = {t: dict(rates) for t, rates in self.optimizer_step_s_per_byte}
        if self.action_overhead_s:
            out["action_overhead_s"] = dict(self.action_overhead_s)
        if self.iteration_overhead_s:
            out["iteration_overhead_s"] = dict(self.iteration_overhead_s)
        if self.memory_footprint:
            out["memory_footprint"] = {t: {"fixed_bytes": fixed, "allocator_fraction": fraction}
                                       for t, fixed, fraction in self.memory_footprint}
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        if self.split_points:
            out["split_points"] = list(self.split_points)
        if self.common_spread:
            out["common_spread"] = dict(self.common_spread)
        if self.action_overhead_spread_s:
            out["action_overhead_spread_s"] = dict(self.action_overhead_spread_s)
        if self.tp_efficiency != 0.9:
            out["tp_efficiency"] = self.tp_efficiency
        if self.mixed_precision != MIXED_PRECISIONS[0]:
            out["mixed_precision"] = self.mixed_precision
        return out

    def sent_bytes_per_sample(self, i: int) -> float:
        """Bytes per sample layer ``i``'s output puts on the link to the next stage from one device: all of it,
        or on a TP rank (``tp_degree`` k) a k-th: the output is the same on every rank of a group, and rank j
        sends its j-th part to rank j of the next group, which all-gathers them over its node's link (Megatron's
        scatter / gather between pipeline stages: Narayanan et al. 2021, sec. 4.1). Of an output split among
        the ranks (``TPSplit.split_output_bytes_per_sample``) each rank sends its own part."""
        layer = self.layers[i]
        own = layer.tp.split_output_bytes_per_sample if self.tp_degree > 1 and layer.tp is not None else 0.0
        return (layer.output_bytes_per_sample - own) / self.tp_degree + own

    @property
    def has_tp(self) -> bool:
        """Whether any layer has a TP rule (``LayerProfile.tp``): only then can a TP group split a stage."""
        return any(layer.tp is not None for layer in self.layers)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> ModelProfile:
        return parse_profile(data)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (atomically: write a temporary file, then rename)."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(p)


PROFILE_KEYS = frozenset({
    "format_version", "name", "precision", "compute_efficiency", "input_bytes_per_sample", "layers", "measured_on",
    "optimizer_step_s_per_byte", "action_overhead_s", "iteration_overhead_s", "memory_footprint", "seq_len",
    "common_spread", "action_overhead_spread_s", "split_points", "tp_efficiency", "mixed_precision"})
LAYER_KEYS = frozenset({"name", "param_bytes", "output_bytes_per_sample", "saved_bytes_per_sample",
                        "forward_flops_per_sample", "measured", "tp", "measured_tp"})
TP_KEYS = frozenset({"split_param_bytes", "split_flops_per_sample", "split_saved_bytes_per_sample",
                     "allreduce_bytes_per_sample", "allreduces", "split_output_bytes_per_sample"})
MEASUREMENT_KEYS = frozenset({"micro_batch", "forward_s", "backward_s", "source", "forward_spread_s",
                              "backward_spread_s"})


def _known_keys(raw: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    """Refuse a key the profile's reader does not take (a typo in a hand edit would be dropped without a word):
    one line naming the place, the key, its value and the nearest known key."""
    extra = [k for k in raw if k not in known]
    if extra:
        key = extra[0]
        near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ProfileError(f"{where or 'the top level'}: unknown key {key!r} (= {show(raw[key])}){hint} "
                           f"(it takes {', '.join(sorted(known))})")


def _number(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    """``raw[key]`` as a finite number >= 0 (``default`` where absent, if given)."""
    if key not in raw and default is not None:
        return default
    return require_number(raw, key, where, ProfileError, least=0)


def _measurement_from(raw: Any, where: str) -> Measurement:
    """One entry of a layer's ``measured[type]`` list."""
    raw = require_mapping(raw, where, ProfileError)
    _known_keys(raw, MEASUREMENT_KEYS, where)
    return Measurement(
        require_int(raw, "micro_batch", where, ProfileError, least=1, most=MAX_MICRO_BATCH,
                    limit_name="MAX_MICRO_BATCH"),
        require_number(raw, "forward_s", where, ProfileError, least=0),
        require_number(raw, "backward_s", where, ProfileError, least=0),
        require_str(raw, "source", where, ProfileError, "measured"),
        optional_number(raw, "forward_spread_s", where, ProfileError, least=0),
        optional_number(raw, "backward_spread_s", where, ProfileError, least=0),
    )


def _layer_from(raw: Any, i: int) -> LayerProfile:
    """Entry ``i`` of the profile's ``layers``."""
    where = f"layers[{i}]"
    raw = require_mapping(raw, where, ProfileError)
    _known_keys(raw, LAYER_KEYS, where)
    measured: list[tuple[str, tuple[Measurement, ...]]] = []
    for type_name, ms in require_object(raw, "measured", where, ProfileError, {}).items():
        at = f"{where}.measured[{type_name!r}]"
        if not isinstance(ms, list):
            raise ProfileError(f"{at}: expected a list of measurements, got {show(ms)}")
        items = tuple(_measurement_from(m, f"{at}[{k}]") for k, m in enumerate(ms))
        measured.append((str(type_name), tuple(sorted(items, key=lambda m: m.micro_batch))))
    tp = None
    if raw.get("tp") is not None:
        at = f"{where}.tp"
        t = require_mapping(raw["tp"], at, ProfileError)
        _known_keys(t, TP_KEYS, at)
        tp = TPSplit(_number(t, "split_param_bytes", at), _number(t, "split_flops_per_sample", at),
                     _number(t, "split_saved_bytes_per_sample", at), _number(t, "allreduce_bytes_per_sample", at),
                     require_int(t, "allreduces", at, ProfileError, 2, least=0, most=1000),
                     _number(t, "split_output_bytes_per_sample", at, 0.0))
    measured_tp: list[tuple[str, int, tuple[Measurement, ...]]] = []
    for type_name, by_k in require_object(raw, "measured_tp", where, ProfileError, {}).items():
        at = f"{where}.measured_tp[{type_name!r}]"
        by_k = require_mapping(by_k, at, ProfileError)
        for key, ms in by_k.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ProfileError(f"{at}: TP degree {key!r} is not a whole number")
            if not isinstance(ms, list):
                raise ProfileError(f"{at}[{key!r}]: expected a list of measurements, got {show(ms)}")
            items = tuple(_measurement_from(m, f"{at}[{key!r}][{k}]") for k, m in enumerate(ms))
            measured_tp.append((str(type_name), int(key), tuple(sorted(items, key=lambda m: m.micro_batch))))
    return LayerProfile(
        tp=tp, measured_tp=tuple(measured_tp),
        name=require_str(raw, "name", where, ProfileError, f"layer{i}"),
        param_bytes=_number(raw, "param_bytes", where),
        output_bytes_per_sample=_number(raw, "output_bytes_per_sample", where),
        saved_bytes_per_sample=_number(raw, "saved_bytes_per_sample", where),
        forward_flops_per_sample=_number(raw, "forward_flops_per_sample", where),
        measured=tuple(measured),
    )


def parse_profile(data: Mapping[str, Any]) -> ModelProfile:
    """Build a ModelProfile from its JSON dict; ProfileError names the field path (``layers[3].param_bytes``)
    and the value."""
    data = require_mapping(data, "profile", ProfileError)
    _known_keys(data, PROFILE_KEYS, "")
    version = require_int(data, "format_version", "", ProfileError, FORMAT_VERSION)
    if version not in (1, FORMAT_VERSION):
        raise ProfileError(f"profile format_version {version} is not supported (this hetrain reads 1 and "
                           f"{FORMAT_VERSION})")
    raw_layers = require_list(data, "layers", "", ProfileError, least=1, most=MAX_LAYERS, what="layers")
    layers = [_layer_from(raw, i) for i, raw in enumerate(raw_layers)]
    precision = require_str(data, "precision", "", ProfileError, "fp32", choices=PRECISIONS)
    # format 1 counted a 16-bit profile's parameters in 16 bits; training keeps them in fp32 (format 2)
    widen = 2.0 if version == 1 and precision != "fp32" else 1.0
    measured_on = tuple(
        (str(t), DeviceFigures(require_number(require_mapping(f, f"measured_on[{t!r}]", ProfileError), "peak_flops",
                                              f"measured_on[{t!r}]", ProfileError, positive=True),
                               require_number(f, "memory_bandwidth_bytes_per_s", f"measured_on[{t!r}]",
                                              ProfileError, positive=True)))
        for t, f in require_object(data, "measured_on", "", ProfileError, {}).items()
    )
    rates = _parse_optimizer_rates(data.get("optimizer_step_s_per_byte", {}))
    if widen != 1.0:
        layers = [replace(layer, param_bytes=layer.param_bytes * widen) for layer in layers]
        rates = tuple((t, tuple((n, r / widen) for n, r in rs)) for t, rs in rates)
    return ModelProfile(
        name=require_str(data, "name", "", ProfileError, "model"),
        layers=tuple(layers),
        input_bytes_per_sample=_number(data, "input_bytes_per_sample", ""),
        precision=precision,  # type: ignore[arg-type]
        compute_efficiency=require_number(data, "compute_efficiency", "", ProfileError, 0.5, positive=True, most=1),
        measured_on=measured_on,
        optimizer_step_s_per_byte=rates,
        action_overhead_s=_parse_overheads(data.get("action_overhead_s", {})),
        iteration_overhead_s=_parse_overheads(data.get("iteration_overhead_s", {}), "iteration_overhead_s"),
        memory_footprint=tuple(
            (str(t), require_number(require_mapping(f, f"memory_footprint[{t!r}]", ProfileError), "fixed_bytes",
                                    f"memory_footprint[{t!r}]", ProfileError, least=0),
             require_number(f, "allocator_fraction", f"memory_footprint[{t!r}]", ProfileError, least=0))
            for t, f in require_object(data, "memory_footprint", "", ProfileError, {}).items()),
        seq_len=None if data.get("seq_len") is None else require_int(
            data, "seq_len", "", ProfileError, least=1, most=MAX_SEQ_LEN, limit_name="MAX_SEQ_LEN"),
        common_spread=_parse_overheads(data.get("common_spread", {}), "common_spread", "fraction"),
        action_overhead_spread_s=_parse_overheads(data.get("action_overhead_spread_s", {}),
                                                  "action_overhead_spread_s"),
        split_points=_parse_split_points(data.get("split_points", [])),
        tp_efficiency=require_number(data, "tp_efficiency", "", ProfileError, 0.9, positive=True, most=1),
        mixed_precision=require_str(data, "mixed_precision", "", ProfileError,  # type: ignore[arg-type]
                                    MIXED_PRECISIONS[0], choices=MIXED_PRECISIONS),
    )


def _parse_split_points(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ProfileError(f"split_points must be a list of module names, got {value!r}")
    return tuple(value)


def _parse_overheads(raw: Any, key: str = "action_overhead_s", what: str = "seconds") -> tuple[tuple[str, float], ...]:
    """``{type: seconds}`` (or another ``what`` per type) -> the tuple form; the values are checked by
    ``ModelProfile``."""
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{key} must be an object {{device type: {what}}}, got {raw!r}")
    return tuple((str(t), v) for t, v in raw.items())


def _parse_optimizer_rates(raw: Any) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
    """``{type: {optimizer: seconds per byte}}`` -> the tuple form; ``"adamw"`` is read as ``"adam"``.

    Values are checked by ``ModelProfile``; here only the shape and the names."""
    key = "optimizer_step_s_per_byte"
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{key} must be an object {{device type: {{optimizer: seconds per byte}}}}, got {raw!r}")
    out = []
    for type_name, rates in raw.items():
        if not isinstance(rates, Mapping):
            raise ProfileError(f"{key}[{type_name!r}] must be an object {{optimizer: seconds per byte}}, "
                               f"got {rates!r}")
        by_name: dict[str, Any] = {}
        for name, rate in rates.items():
            canonical = OPTIMIZER_ALIASES.get(str(name), str(name))
            if canonical in by_name:
                raise ProfileError(f"{key}[{type_name!r}] gives {canonical!r} twice (as {name!r} too)")
            by_name[canonical] = rate
        out.append((str(type_name), tuple(by_name.items())))
    return tuple(out)


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile JSON file; ProfileError names the file, the field and the value."""
    p = Path(path)
    data = load_json_object(p, ProfileError, "profile")
    try:
        return parse_profile(data)
    except ProfileError as e:
        raise ProfileError(f"{p}: {e}") from None


def relabel_profile(profile: ModelProfile, type_name: str, figures: tuple[float, float] | None = None) -> ModelProfile:
    """The profile with every measurement (layers, optimizer step) filed under ``type_name`` (and its
    peak figures ``(peak_flops, memory_bandwidth_bytes_per_s)``, if given; else the first measured type's).

    A CPU process always profiles as type ``cpu``; an emulated device of type
    ``cpu-slow`` is a throttled CPU, so its measurements belong to ``cpu-slow``.

    Example:
        >>> from hetrain.models.analytic import build_profile                      # doctest: +SKIP
        >>> relabel_profile(build_profile("gpt-tiny"), "cpu-slow", (4.8e12, 4e9)).measured_on[0][0]  # doctest: +SKIP
        'cpu-slow'
    """
    data = profile.to_dict()
    for layer in data["layers"]:
        measured = layer.get("measured", {})
        layer["measured"] = {type_name: [m for ms in measured.values() for m in ms]}
        by_degree: dict[str, list[Any]] = {}
        for degrees in layer.get("measured_tp", {}).values():
            for k, ms in degrees.items():
                by_degree.setdefault(k, []).extend(ms)
        if by_degree:
            layer["measured_tp"] = {type_name: by_degree}
    rates = data.get("optimizer_step_s_per_byte", {})
    if rates:
        data["optimizer_step_s_per_byte"] = {type_name: {k: v for r in rates.values() for k, v in r.items()}}
    spreads = data.get("common_spread", {})
    if spreads:
        data["common_spread"] = {type_name: max(spreads.values())}
    if figures is not None:
        data["measured_on"] = {type_name: {"peak_flops": figures[0], "memory_bandwidth_bytes_per_s": figures[1]}}
    else:
        figs = list(data.get("measured_on", {}).values())
        data["measured_on"] = {type_name: figs[0]} if figs else {}
    return parse_profile(data)

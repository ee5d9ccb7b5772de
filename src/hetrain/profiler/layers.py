"""Measure layers with torch: time, parameter, output and saved-activation bytes.

``profile_layers`` runs each layer alone, as a pipeline stage would, and writes a
``ModelProfile`` (docs/profile.md). Per layer and micro-batch size ``b``:

    x_i ──detach, requires_grad──► layer_i ──► y_i ──► x_{i+1}
           forward timed: layer_i(x_i)
           backward timed: y_i.backward(random grad of y_i's shape)

- times: median of ``repeats`` runs after ``warmup`` runs; CUDA events on a GPU,
  ``time.perf_counter`` on the CPU; their spread over the repeats too (``estimate_spread``);
- ``param_bytes``: exact, the sum of parameter storage in the training precision;
- ``output_bytes_per_sample``: the layer's output (what crosses a stage boundary);
- ``saved_bytes_per_sample``: what autograd keeps for backward, caught with
  ``torch.autograd.graph.saved_tensors_hooks``, counted once per storage, parameters
  and buffers excluded. A layer counts what it saves even when that is its input
  (the previous layer's output): a stage boundary can fall anywhere, and the first
  layer of a stage does keep its input. Inside a stage this counts such a tensor
  twice (a ReLU's output that the next Linear also saves), an upper bound;
- ``forward_flops_per_sample``: from ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products, convolutions, attention; element-wise work is not counted);
- peak memory of forward + backward on CUDA (``LayerReport.peak_memory_bytes``);
- the optimizer step (``measure_optimizer_step``), per optimizer, in seconds per
  parameter byte: the weight update over all the layers' parameters, as PipeDream's
  profiler times it too.

Example:
    >>> import torch
    >>> from torch import nn
    >>> p = profile_layers([nn.Linear(8, 16), nn.ReLU()], torch.randn(1, 8), micro_batches=(1, 2))
    >>> p.layers[0].param_bytes
    576.0
"""

from __future__ import annotations

import functools
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hetrain import amp
from hetrain.amp import check_precision
from hetrain.catalog import RuntimeFootprint, lookup_device_type
from hetrain.errors import InputError
from hetrain.fit import estimate_common_spread
from hetrain.models.layers import param_bytes as layer_param_bytes
from hetrain.models.user import ModelSource, check_model_on_batch, describe_error, describe_shapes
from hetrain.profile import (
    OPTIMIZER_ALIASES,
    OPTIMIZER_NAMES,
    PRECISIONS,
    DeviceFigures,
    LayerProfile,
    Measurement,
    ModelProfile,
    Precision,
)
from hetrain.profiler.footprint import allocator_footprint, measure_fixed_footprint

SampleInput = Any  # a tensor, a tuple of tensors, or a callable b -> batch of size b
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------
# device types
# ---------------------------------------------------------------------------

# torch.cuda.get_device_name -> catalog name; first match wins. Names as drivers
# report them, e.g. "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 3090".
_GPU_NAMES: tuple[tuple[str, str | tuple[str, str, float]], ...] = (
    (r"\bH200\b", "H200"),
    (r"\bH100 PCIe\b", "H100-PCIe"),
    (r"\bH100 NVL\b", "H100-NVL"),
    (r"\bH100\b", "H100"),
    (r"\bA100\b", ("A100-40GB", "A100-80GB", 60e9)),  # (small, large, memory threshold)
    (r"\bV100-PCIE\b", ("V100-PCIe-16GB", "V100-PCIe-32GB", 24e9)),
    (r"\bV100\b", ("V100-16GB", "V100-32GB", 24e9)),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"),
    (r"\bRTX A6000$", "RTX-A6000"),
    (r"\bP40$", "P40"),
    (r"\bP100-PCIE-16GB$", "P100"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"\bRTX 2060$", "RTX2060"),
    (r"\bRTX 2080$", "RTX2080"),
    (r"\bRTX 3090$", "RTX3090"),
    (r"\bRTX 4090$", "RTX4090"),
    (r"\bTITAN V$", "TITAN-V"),
    (r"\bTITAN RTX$", "TITAN-RTX"),
    (r"\bP4000$", "P4000"),
)


def match_device_type(gpu_name: str, memory_bytes: float) -> str | None:
    """The catalog name for a GPU as ``torch.cuda.get_device_name`` reports it, or None.

    Memory tells variants apart (A100 40 GB / 80 GB). A model the catalog lacks
    (an "RTX 3090 Ti", a P100 SXM2) gives None rather than a near miss.

    Example:
        >>> match_device_type("NVIDIA A100-SXM4-80GB", 85e9)
        'A100-80GB'
        >>> match_device_type("NVIDIA GeForce RTX 3090 Ti", 25e9) is None
        True
    """
    name = re.sub(r"\b(NVIDIA|Tesla|GeForce|Quadro)\b", " ", gpu_name, flags=re.IGNORECASE)
    name = re.sub(r"\s+", " ", name).strip()
    for pattern, target in _GPU_NAMES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if isinstance(target, tuple):
                small, large, threshold = target
                return large if memory_bytes > threshold else small
            return target
    return None


def describe_device(device: torch.device) -> tuple[str, float]:
    """``(device type name, memory bytes)``: ``"cpu"`` on a CPU; a GPU's catalog name
    where it has one, else its name as the driver reports it without the vendor prefix."""
    if device.type != "cuda":
        return "cpu", float(lookup_device_type("cpu").memory_bytes)
    props = torch.cuda.get_device_properties(device)
    raw = torch.cuda.get_device_name(device)
    name = match_device_type(raw, props.total_memory)
    if name is None:
        name = re.sub(r"^NVIDIA\s+", "", raw).strip().replace(" ", "-")
    return name, float(props.total_memory)


def measure_device_figures(device: torch.device | str, precision: Precision = "fp32", matmul_size: int = 4096,
                           copy_bytes: int = 256 * 2**20, repeats: int = 5) -> DeviceFigures:
    """Attained FLOP/s of a square matmul and memory bandwidth of a copy on ``device``.

    For device types the catalog lacks, so the roofline has figures to scale by.
    A copy of ``n`` bytes moves ``2n`` (read + write); a matmul of size ``s`` does
    ``2 s^3`` FLOPs. Best of ``repeats`` after one warm-up.
    """
    dev = torch.device(device)
    dtype = DTYPES[precision]
    a = torch.randn(matmul_size, matmul_size, device=dev, dtype=dtype)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for k in range(repeats + 1):
            t = _Timer(dev)
            t.start()
            fn()
            t.stop()
            if k:
                times.append(t.seconds())
        return min(times)

    flops = 2 * matmul_size**3 / best(lambda: a @ a)
    bandwidth = 2 * copy_bytes / best(lambda: dst.copy_(src))
    return DeviceFigures(peak_flops=flops, memory_bandwidth_bytes_per_s=bandwidth)


def device_figures(type_name: str, device: torch.device, precision: Precision) -> DeviceFigures:
    """Catalog peak figures of ``type_name``, or measured ones for a type it lacks."""
    try:
        t = lookup_device_type(type_name)
    except KeyError:
        return measure_device_figures(device, precision)
    return DeviceFigures(t.peak_flops(precision), t.memory_bandwidth_bytes_per_s)


# ---------------------------------------------------------------------------
# helpers: timing and tensor trees
# ---------------------------------------------------------------------------


class _Timer:
    """Wall time of a region: CUDA events on a GPU (read after a synchronize), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.t0 = self.t1 = 0.0

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return float(self.begin.elapsed_time(self.end)) / 1e3
        return self.t1 - self.t0


def _map(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(_map(x, fn) for x in tree)
    if isinstance(tree, list):
        return [_map(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map(tree, out.append)
    return out


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    x = t.detach()
    return x.requires_grad_(requires_grad and (x.is_floating_point() or x.is_complex()))


def profile_inputs(source: ModelSource, data: str | None, seed: int = 0,
                   seq_len: int | None = None) -> Callable[[int], Any]:
    """``b -> inputs of b samples`` for profiling ``source``: the first samples of ``data``, or random ones.

    A token model or token data runs at ``seq_len`` tokens per sample (``hetrain.data.seq_len``: default
    the model's, or the user's data set's sample length).

    Raises:
        SpecError: a user's model without ``data`` (``MODULE:FUNCTION``), a data spec that cannot be loaded,
            or a ``seq_len`` that the model or data cannot take.
    """
    from hetrain.data.seq_len import check_sample_length, random_token_inputs, refuse_seq_len
    from hetrain.data.tables import is_table_spec
    from hetrain.data.tokens import is_token_spec
    from hetrain.models.registry import sample_batch
    from hetrain.models.spec import SpecError, is_user_spec

    refuse_seq_len(source, data, seq_len)
    if is_token_spec(data) or is_table_spec(data):  # windows of seq_len, or rows (a user's model: refused without)
        from hetrain.data.user import build_model_datasets

        tokens = build_model_datasets(source, data, seed, seq_len=seq_len)[1].train
        return lambda b: tokens.take(torch.arange(b) % len(tokens))[0]  # (b, T)
    if data is not None and is_user_spec(data):
        from hetrain.data.user import load_user_datasets

        train = load_user_datasets(data).train
        if source.preset is None:  # shapes hetrain cannot know: a mismatch named before anything is timed
            x, y = train.take(torch.arange(min(2, len(train))))  # (2, ...) each
            check_model_on_batch(source, x, y, data)
        check_sample_length(source, data, train, seq_len, from_profile=False)
        return lambda b: train.take(torch.arange(b) % len(train))[0]  # (b, ...): sample 0, 1, ... (again if short)
    if source.tokens is not None and (source.preset is None or seq_len is not None):  # hf:DIR, or a shorter gpt
        if data is not None:
            raise SpecError(f"--data {data}: profiling a token model takes tokens:FILE, text:FILE or MODULE:FUNCTION "
                            "(random token ids without it)")
        return random_token_inputs(source, seq_len, seed)
    if source.preset is None:
        raise SpecError(f"model {source.name} is your own: hetrain knows its input only from its data; give "
                        "--data MODULE:FUNCTION returning a torch Dataset of (input, target) pairs (docs/own-model.md)")
    if data is not None:
        raise SpecError(f"--data {data}: profiling takes MODULE:FUNCTION (a reference model's input is drawn "
                        "at random without it)")
    generator = torch.Generator().manual_seed(seed)
    preset, config = source.preset, source.config
    return lambda b: sample_batch(preset, b, generator, **config)[0]


def _replicate(sample: Any, b: int) -> Any:
    """A batch of ``b`` from one sample: tensors with leading size 1 are repeated ``b`` times."""
    def rep(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0 and t.shape[0] == 1:
            return t.repeat(b, *([1] * (t.dim() - 1)))
        return t
    return _map(sample, rep)


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    """What was measured for one layer.

    Attributes:
        times_s: ``(micro_batch, forward_s, backward_s)`` per measured size.
        spreads_s: ``(forward_spread_s, backward_spread_s)`` per entry of ``times_s``
            (``estimate_spread`` of the repeats; None for one repeat).
        peak_memory_bytes: CUDA only: peak memory of forward + backward at the
            largest micro-batch above what was allocated before (None on CPU).
    """

    name: str
    param_bytes: int
    output_bytes_per_sample: float
    saved_bytes_per_sample: float
    forward_flops_per_sample: float
    times_s: tuple[tuple[int, float, float], ...]
    peak_memory_bytes: int | None = None
    spreads_s: tuple[tuple[float | None, float | None], ...] = ()


@dataclass(frozen=True)
class LayersMeasurement:
    """``measure_layers``'s result: per-layer reports, the optimizer step, the device they ran on.

    ``optimizer_s_per_byte``: ``(optimizer, seconds per parameter byte)`` per measured optimizer.
    """

    layers: tuple[LayerReport, ...]
    input_bytes_per_sample: float
    type_name: str
    device: str
    precision: Precision
    figures: DeviceFigures
    optimizer_s_per_byte: tuple[tuple[str, float], ...] = ()
    footprint: RuntimeFootprint | None = None  # CUDA only (``profiler.footprint``)
    #: the whole model's forward + backward seconds at the smallest micro-batch, one per repeat (``_time_model``)
    model_times_s: tuple[float, ...] = ()

    def common_spread(self) -> float | None:
        """How far all the layers' times move together from repeat to repeat, as a fraction of the whole
        model's time: the repeats' whole-model spread beyond what the layers' own spreads at the smallest size
        (where the whole model was timed) add up
        to (``fit.estimate_common_spread``); None with fewer than 2 repeats or layers without a spread."""
        spread = estimate_spread(self.model_times_s)
        parts = [s for r in self.layers if r.spreads_s for s in r.spreads_s[0]]
        if spread is None or any(s is None for s in parts):
            return None
        return estimate_common_spread(spread, [s for s in parts if s is not None],
                                      statistics.median(self.model_times_s))

    def to_profile(self, model_name: str = "model") -> ModelProfile:
        """The ModelProfile of these measurements (``measured`` and the optimizer step under ``type_name``)."""
        layers = tuple(
            LayerProfile(
                name=r.name,
                param_bytes=float(r.param_bytes),
                output_bytes_per_sample=r.output_bytes_per_sample,
                saved_bytes_per_sample=r.saved_bytes_per_sample,
                forward_flops_per_sample=r.forward_flops_per_sample,
                measured=((self.type_name, tuple(
                    Measurement(b, f, g, "measured", *(r.spreads_s[k] if r.spreads_s else (None, None)))
                    for k, (b, f, g) in enumerate(r.times_s))),),
            )
            for r in self.layers
        )
        rates = ((self.type_name, self.optimizer_s_per_byte),) if self.optimizer_s_per_byte else ()
        footprint = (() if self.footprint is None else
                     ((self.type_name, self.footprint.fixed_bytes, self.footprint.allocator_fraction),))
        common = self.common_spread()
        return ModelProfile(name=model_name, layers=layers, input_bytes_per_sample=self.input_bytes_per_sample,
                            precision=self.precision, measured_on=((self.type_name, self.figures),),
                            optimizer_step_s_per_byte=rates, memory_footprint=footprint,
                            common_spread=() if common is None else ((self.type_name, common),))

    def table(self) -> str:
        """One line per layer: times at each size, bytes, FLOPs (and peak memory on CUDA)."""
        sizes = [b for b, _, _ in self.layers[0].times_s]
        head = f"{'layer':<16}" + "".join(f"{'fwd/bwd ms @' + str(b):>20}" for b in sizes)
        head += f"{'params MB':>11}{'out KB':>10}{'saved KB':>11}{'MFLOP':>10}"
        if any(r.peak_memory_bytes is not None for r in self.layers):
            head += f"{'peak MB':>9}"
        lines = [f"{self.type_name} ({self.device}, {self.precision}); per sample: out, saved, FLOPs", head]
        for r in self.layers:
            row = f"{r.name[:15]:<16}" + "".join(f"{f * 1e3:>11.3f}/{g * 1e3:<8.3f}" for _, f, g in r.times_s)
            row += (f"{r.param_bytes / 1e6:>11.2f}{r.output_bytes_per_sample / 1e3:>10.1f}"
                    f"{r.saved_bytes_per_sample / 1e3:>11.1f}{r.forward_flops_per_sample / 1e6:>10.1f}")
            if r.peak_memory_bytes is not None:
                row += f"{r.peak_memory_bytes / 1e6:>9.1f}"
            lines.append(row)
        common = self.common_spread()
        if common is not None:
            lines.append(f"whole model, forward + backward at {sizes[0]}, per repeat: "
                         + ", ".join(f"{t * 1e3:.3f}" for t in self.model_times_s)
                         + f" ms; common to all layers: {100 * common:.1f}%")
        if self.optimizer_s_per_byte:
            lines.append("optimizer step, ns per parameter byte: "
                         + ", ".join(f"{name} {rate * 1e9:.3f}" for name, rate in self.optimizer_s_per_byte))
        return "\n".join(lines)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse or otherwise storage-less tensors
        return None
    return (str(t.device), st.data_ptr())


def _measure_saved(layer: nn.Module, args: tuple[Any, ...]) -> tuple[int, float, Any]:
    """One forward under saved-tensor hooks and a FLOP counter: (saved bytes, FLOPs, output)."""
    own = {_storage_key(t) for t in [*layer.parameters(), *layer.buffers()]}
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in own and key[1] != 0:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    counter = FlopCounterMode(display=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        out = layer(*args)
    return sum(saved.values()), float(counter.get_total_flops()), out


def estimate_spread(values: Sequence[float]) -> float | None:
    """How far one of ``values`` strays from their median: the interquartile range / 1.349, the standard
    deviation of a normal law with that range, which one outlier cannot inflate as it does the sample
    standard deviation. None for fewer than 2 values (nothing to tell)."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 1.349


@dataclass(frozen=True)
class _Timed:
    """Medians of one layer's repeats at one micro-batch size, and their spreads (``estimate_spread``)."""

    forward_s: float
    backward_s: float
    forward_spread_s: float | None
    backward_spread_s: float | None

    @staticmethod
    def of(forward: Sequence[float], backward: Sequence[float]) -> _Timed:
        return _Timed(statistics.median(forward), statistics.median(backward),
                      estimate_spread(forward), estimate_spread(backward))


def _time_layer(layer: nn.Module, args: tuple[Any, ...], grad_inputs: bool, repeats: int, warmup: int,
                device: torch.device, min_time_s: float = 0.0) -> tuple[_Timed, Any]:
    """Median forward and backward seconds of ``layer(*args)`` with their spreads, and its (detached) output.

    With ``min_time_s > 0`` on a CPU, the times are medians over ``repeats`` blocks of back-to-back
    calls of at least that long (``_time_layer_blocks``), for a process under a CPU quota; single calls
    then run only as warm-up (and for the output)."""
    fwd: list[float] = []
    bwd: list[float] = []
    out: Any = None
    blocks = min_time_s > 0 and device.type == "cpu"
    calls = warmup + (0 if blocks else repeats)
    for k in range(max(calls, 1)):  # at least one: it gives the output
        inputs = _map(args, lambda t: _leaf(t, grad_inputs))
        layer.zero_grad(set_to_none=True)
        tf, tb = _Timer(device), _Timer(device)
        tf.start()
        out = layer(*inputs)
        tf.stop()
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads = [torch.randn_like(t) for t in outs]  # a random upstream gradient, outside the timed region
        tb.start()
        if outs:
            torch.autograd.backward(outs, grads)
        tb.stop()
        if k >= warmup:
            fwd.append(tf.seconds())
            bwd.append(tb.seconds() if outs else 0.0)
    layer.zero_grad(set_to_none=True)
    timed = _time_layer_blocks(layer, args, grad_inputs, min_time_s, repeats) if blocks else _Timed.of(fwd, bwd)
    return timed, _map(out, lambda t: t.detach())


def _time_layer_blocks(layer: nn.Module, args: tuple[Any, ...], grad_inputs: bool,
                       min_time_s: float, repeats: int = 1) -> _Timed:
    """Forward and backward seconds per call over blocks of back-to-back calls lasting ``min_time_s`` or more:
    the medians over ``repeats`` pairs of blocks (and their spreads).

    Under a CPU quota (a cgroup's ``quota`` per ``period``) a call shorter than the
    quota that is left runs at full speed and the process waits later, between calls;
    the median of single calls then gives the unthrottled time, which a training step of
    several layers does not see. Timing blocks of calls that span several periods
    takes the waits in: forward alone, then forward + backward, each repeated until
    ``min_time_s`` has passed; the backward time is the difference. One pair of blocks
    varies by 10-30% under a quota (identical layers measured that far apart); the
    median of several pairs, taken in turn, halves that.
    """
    grads: list[torch.Tensor] | None = None

    def call(backward: bool) -> None:
        nonlocal grads
        out = layer(*_map(args, lambda t: _leaf(t, grad_inputs)))
        outs = [t for t in _tensors(out) if t.requires_grad]
        if backward and outs:
            if grads is None:
                grads = [torch.randn_like(t) for t in outs]
            torch.autograd.backward(outs, grads)

    def block(backward: bool) -> float:
        """Seconds per call over at least 2 calls and ``min_time_s``."""
        n, start = 0, time.perf_counter()
        while True:
            call(backward)
            n += 1
            elapsed = time.perf_counter() - start
            if n >= 2 and elapsed >= min_time_s:
                return elapsed / n

    call(True)  # allocates the gradients and the upstream ones outside the timed blocks
    forward: list[float] = []
    backward: list[float] = []
    for _ in range(max(repeats, 1)):
        forward.append(block(False))
        backward.append(max(block(True) - forward[-1], 0.0))
    layer.zero_grad(set_to_none=True)
    return _Timed.of(forward, backward)


def _time_model(layers: Sequence[nn.Module], args: tuple[Any, ...], as_args: Callable[[Any], tuple[Any, ...]],
                repeats: int, warmup: int, device: torch.device, min_time_s: float = 0.0) -> list[float]:
    """The whole model's forward + backward seconds per call, one figure per repeat: the layers chained as
    in training (each output feeds the next), a random upstream gradient at the end. Single calls after
    ``warmup``, or, with ``min_time_s > 0`` on a CPU, blocks of calls lasting that long (as
    ``_time_layer_blocks``). Set against the layers' own spreads, these say how much of the noise is common
    to all layers (``LayersMeasurement.common_spread``)."""
    grads: list[torch.Tensor] | None = None

    def call() -> None:
        nonlocal grads
        out: Any = args
        for k, layer in enumerate(layers):
            out = layer(*(args if k == 0 else as_args(out)))
        outs = [t for t in _tensors(out) if t.requires_grad]
        if grads is None:
            grads = [torch.randn_like(t) for t in outs]
        if outs:
            torch.autograd.backward(outs, grads)

    def timed() -> float:
        n, start = 0, time.perf_counter()
        while True:
            call()
            n += 1
            if device.type != "cpu":
                _sync(device)
            elapsed = time.perf_counter() - start
            if blocks is False or (n >= 2 and elapsed >= min_time_s):
                return elapsed / n

    blocks = min_time_s > 0 and device.type == "cpu"
    for _ in range(max(warmup, 1)):  # allocates the gradients and the upstream ones outside the timed calls
        call()
    _sync(device)
    return [timed() for _ in range(repeats)]


def _time_model_if_it_fits(layers: Sequence[nn.Module], args: tuple[Any, ...],
                           as_args: Callable[[Any], tuple[Any, ...]], repeats: int, warmup: int,
                           device: torch.device, min_time_s: float, precision: Precision) -> list[float]:
    """``_time_model`` in training mode under ``precision``'s autocast, modes restored after; ``[]`` where the
    whole model does not fit on the device (a model profiled layer by layer to be split over several)."""
    modes = [m.training for m in layers]
    for m in layers:
        m.train()
    try:
        with amp.autocast(device, precision):
            return _time_model(layers, args, as_args, repeats, warmup, device, min_time_s)
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return []
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.train(mode)
        for m in layers:
            m.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer the runtime builds for a cost-model name (``runtime.trainer.build_optimizer_fn``)."""
    if name == "adam":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9 if name == "momentum" else 0.0)


def _time_steps(optimizer: torch.optim.Optimizer, device: torch.device, min_time_s: float) -> float:
    """Seconds per step over back-to-back steps lasting at least ``min_time_s`` (and 2 steps)."""
    n = 0
    _sync(device)
    start = time.perf_counter()
    while True:
        optimizer.step()
        n += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if n >= 2 and elapsed >= min_time_s:
            return elapsed / n


def measure_optimizer_step(layers: Sequence[nn.Module], device: str | torch.device = "cpu",
                           optimizers: Sequence[str] = OPTIMIZER_NAMES, min_time_s: float = 0.0,
                           repeats: int = 3) -> dict[str, float]:
    """Seconds of one optimizer step per parameter byte, per optimizer, over all of ``layers``' parameters.

    The step runs on copies of the parameters (same shapes, dtypes and device; the layers
    keep their weights) with random gradients (fixed seed): one untimed step allocates
    the optimizer state, then each of ``repeats`` times back-to-back steps for at least
    ``min_time_s`` (and at least 2 steps); the median time per step, divided by the
    parameter bytes, is the rate. Under a CPU quota give ``min_time_s`` several quota
    periods, as to ``measure_layers``: one step shorter than the quota left runs at full
    speed, and the waits come between steps (``_time_layer_blocks``).

    Args:
        layers: the layers whose parameters one optimizer updates (a shared parameter once).
        device: where the copies live (the layers' device, normally).
        optimizers: cost-model names ``"sgd"`` (SGD), ``"momentum"`` (SGD, momentum 0.9),
            ``"adam"`` (AdamW); ``"adamw"`` is taken as ``"adam"``.
        min_time_s: least duration of one repeat.
        repeats: timed repeats (median taken).

    Returns:
        ``{optimizer: seconds per parameter byte}`` under the cost-model names; empty when
        the layers have no parameters.

    Example:
        >>> rates = measure_optimizer_step([nn.Linear(64, 64)], optimizers=("sgd", "adamw"))
        >>> sorted(rates)
        ['adam', 'sgd']
    """
    names = [OPTIMIZER_ALIASES.get(o, o) for o in optimizers]
    unknown = [o for o, n in zip(optimizers, names, strict=True) if n not in OPTIMIZER_NAMES]
    if unknown:
        raise ValueError(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZER_NAMES)} (or adamw)")
    if repeats < 1 or min_time_s < 0:
        raise ValueError(f"repeats must be >= 1 and min_time_s >= 0, got repeats={repeats}, min_time_s={min_time_s}")
    dev = torch.device(device)
    unique = {id(p): p for layer in layers for p in layer.parameters()}
    total_bytes = sum(p.numel() * p.element_size() for p in unique.values())
    if total_bytes == 0:
        return {}
    generator = torch.Generator().manual_seed(0)
    rates: dict[str, float] = {}
    for name in dict.fromkeys(names):
        params = []
        for p in unique.values():
            copy = p.detach().to(dev).clone().requires_grad_(True)
            copy.grad = torch.randn(p.shape, generator=generator).to(dev, p.dtype)
            params.append(copy)
        optimizer = _build_optimizer(name, params)
        optimizer.step()  # allocates the state outside the timed blocks
        per_step = [_time_steps(optimizer, dev, min_time_s) for _ in range(repeats)]
        rates[name] = statistics.median(per_step) / total_bytes
        del optimizer, params
    return rates


class LayerError(InputError):
    """A layer that fails when run at one of the micro-batch sizes to measure (its own error chained).

    Attributes:
        layer / name: the layer's index and label.
        micro_batch: the size it failed at; ``micro_batches``: every size asked for, ascending.
        sample: ``(index in the micro-batch, its error)`` of a sample that fails alone while an earlier
            or later one runs alone (``find_failing_sample``): the data is at fault, not the size. None
            where the size is (every sample runs alone, or none does: a BatchNorm at 1).
    """

    def __init__(self, layer: int, name: str, micro_batch: int, micro_batches: Sequence[int], inputs: Any,
                 error: BaseException, sample: tuple[int, BaseException] | None = None) -> None:
        super().__init__(f"layer {layer} ({name}) fails at micro-batch {micro_batch} on input "
                         f"{describe_shapes(inputs)}: {describe_error(error)}")
        self.layer, self.name, self.micro_batch = layer, name, micro_batch
        self.micro_batches = tuple(micro_batches)
        self.error, self.sample = error, sample

    def sizes_to_try(self) -> list[int]:
        """Micro-batch sizes worth measuring instead: those that ran (every layer ran at every smaller
        size), else the larger ones asked for, else twice and four times the one that failed."""
        ran = [b for b in self.micro_batches if b < self.micro_batch]
        larger = [b for b in self.micro_batches if b > self.micro_batch]
        return ran or larger or [2 * self.micro_batch, 4 * self.micro_batch]


def _sample_of(t: torch.Tensor, k: int, b: int) -> torch.Tensor:
    """Sample ``k`` of a batch tensor of ``b`` samples, ``(1, ...)``; a tensor not of the batch, whole."""
    return t[k:k + 1] if t.dim() > 0 and t.shape[0] == b else t


def find_failing_sample(layer: nn.Module, x: Any, b: int, as_args: Callable[[Any], tuple[Any, ...]],
                        dev: torch.device, precision: Precision) -> tuple[int, BaseException] | None:
    """The first sample of ``x`` (a micro-batch of ``b`` that ``layer`` failed on) that fails alone, with its
    error, provided another sample runs alone; None otherwise (the size, not a sample, is at fault).

    Each sample runs forward only, without gradients, and the search stops as soon as it has both a
    failing and a running sample: the cost of a few forwards at micro-batch 1, on the error path only.
    Tensors whose leading dimension is not ``b`` (a mask shared by the batch) are passed whole.
    """
    failed: tuple[int, BaseException] | None = None
    ran = False
    for k in range(b):
        row = _map(x, functools.partial(_sample_of, k=k, b=b))  # (1, ...): sample k
        try:
            with torch.no_grad(), amp.autocast(dev, precision):
                layer(*as_args(row))
            ran = True
        except Exception as e:  # the model's own code on one sample
            failed = failed or (k, e)
        if failed is not None and ran:
            return failed
    return None


def _check_arguments(layers: Sequence[nn.Module], micro_batches: Sequence[int], repeats: int, warmup: int,
                     precision: str) -> list[int]:
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    sizes = sorted(set(micro_batches))
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"micro_batches must be positive integers, got {list(micro_batches)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return sizes


def _resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; a bare ``"cuda"`` becomes the current CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _layer_names(layers: Sequence[nn.Module], names: Sequence[str] | None) -> list[str]:
    """``names`` checked against the layers, or ``"<class><index>"`` per layer."""
    if names is not None and len(names) != len(layers):
        raise ValueError(f"{len(names)} names for {len(layers)} layers")
    return list(names) if names is not None else [f"{type(m).__name__.lower()}{i}" for i, m in enumerate(layers)]


def _check_sample_input(sample_input: SampleInput) -> None:
    """A sample input is a callable, or one sample: one of its tensors has a leading dimension of 1."""
    if not callable(sample_input) and not any(t.dim() > 0 and t.shape[0] == 1 for t in _tensors(sample_input)):
        shapes = [tuple(t.shape) for t in _tensors(sample_input)]
        raise ValueError(f"sample_input must be one sample with a leading batch dimension of 1 (got shapes {shapes}), "
                         "or a callable b -> batch of b samples")


@dataclass
class _LayerRecord:
    """One layer's measurements while they are gathered size by size (``_measure_every_size``).

    ``times_s`` and ``spreads_s`` gain one entry per size; the byte, FLOP and peak-memory counts
    are those of the whole largest micro-batch.
    """

    times_s: list[tuple[int, float, float]] = field(default_factory=list)
    spreads_s: list[tuple[float | None, float | None]] = field(default_factory=list)
    saved_bytes: int = 0
    forward_flops: float = 0.0
    output_bytes: float = 0.0
    peak_memory_bytes: int | None = None

    def report(self, name: str, layer: nn.Module, b_max: int) -> LayerReport:
        """The LayerReport of the record, its counts divided by the largest size ``b_max``."""
        return LayerReport(name=name, param_bytes=layer_param_bytes(layer),
                           output_bytes_per_sample=self.output_bytes / b_max,
                           saved_bytes_per_sample=self.saved_bytes / b_max,
                           forward_flops_per_sample=self.forward_flops / b_max, times_s=tuple(self.times_s),
                           peak_memory_bytes=self.peak_memory_bytes, spreads_s=tuple(self.spreads_s))


def _measure_layer_at(layer: nn.Module, args: tuple[Any, ...], b: int, grad_inputs: bool, counts: bool,
                      record: _LayerRecord, repeats: int, warmup: int, dev: torch.device, min_time_s: float,
                      precision: Precision) -> Any:
    """Time ``layer`` on ``args`` (micro-batch ``b``) into ``record``, with ``counts`` its bytes, FLOPs and
    peak memory too; returns its output, the next layer's input."""
    with amp.autocast(dev, precision):  # its cache: one 16-bit copy per weight, as an iteration
        timed, out = _time_layer(layer, args, grad_inputs, repeats, warmup, dev, min_time_s)
        record.times_s.append((b, timed.forward_s, timed.backward_s))
        record.spreads_s.append((timed.forward_spread_s, timed.backward_spread_s))
        if counts:
            leaves = _map(args, functools.partial(_leaf, requires_grad=grad_inputs))
            record.saved_bytes, record.forward_flops, y = _measure_saved(layer, leaves)
            record.output_bytes = sum(amp.to_wire(t, precision).element_size() * t.numel() for t in _tensors(y))
            record.peak_memory_bytes = _peak_memory(layer, args, grad_inputs, dev)
            del y
    return out


def _measure_every_size(layers: Sequence[nn.Module], names: Sequence[str], sizes: Sequence[int],
                        batch: Callable[[int], Any], as_args: Callable[[Any], tuple[Any, ...]], repeats: int,
                        warmup: int, dev: torch.device, min_time_s: float,
                        precision: Precision) -> tuple[list[_LayerRecord], float]:
    """Every layer at every size in ascending order, each fed the previous one's output; the records and the
    first layer's input bytes per sample (at the largest size).

    Raises:
        LayerError: a layer fails at a size, naming the sample that fails alone if one does.
    """
    records = [_LayerRecord() for _ in layers]
    b_max = sizes[-1]
    input_bytes = 0.0
    for b in sizes:
        x = batch(b)
        if b == b_max:
            input_bytes = _nbytes(x) / b
        for i, layer in enumerate(layers):
            args = as_args(x)
            try:
                x = _measure_layer_at(layer, args, b, i > 0, b == b_max, records[i], repeats, warmup, dev,
                                      min_time_s, precision)
            except Exception as e:  # the model's code at this size (BatchNorm at 1, out of memory) or on
                # one sample of the data (a token id beyond the vocabulary): one line, naming the sample
                sample = find_failing_sample(layer, x, b, as_args, dev, precision)
                raise LayerError(i, names[i], b, sizes, args[0] if len(args) == 1 else args, e, sample) from e
    return records, input_bytes


def measure_layers(layers: Sequence[nn.Module], sample_input: SampleInput,
                   micro_batches: Sequence[int] = (1, 2, 4, 8), device: str | torch.device = "cpu",
                   repeats: int = 5, warmup: int = 2, precision: Precision = "fp32",
                   names: Sequence[str] | None = None, unpack_tuples: bool = True,
                   min_time_s: float = 0.0, optimizers: Sequence[str] = OPTIMIZER_NAMES) -> LayersMeasurement:
    """Measure every layer at every micro-batch size; ``profile_layers`` without the conversion.

    Arguments as ``profile_layers``. Layers are moved to ``device`` in place and left in
    training mode as they were found. Under fp16 or bf16 they run as the runtime runs them
    (``hetrain.amp``): fp32 parameters, forward under autocast; a floating fp32 output counts
    at 2 bytes an element, as it is sent between stages.

    The optimizer step of each of ``optimizers`` (``measure_optimizer_step``, with
    ``min_time_s`` and ``repeats``) is measured too; ``optimizers=()`` skips it.

    ``min_time_s > 0`` (CPU only): each layer's times are means over back-to-back calls
    lasting at least that long instead of medians of single calls. Use it in a process
    held to a CPU quota (an emulated device): give it several quota periods (0.1 s for
    a 10 ms period), else calls shorter than the quota measure the unthrottled speed.

    Raises:
        LayerError: a layer fails at one of the sizes (a BatchNorm at 1 sample, out of memory), naming
            the layer, the size, its input and the error its code raised (chained).
    """
    sizes = _check_arguments(layers, micro_batches, repeats, warmup, precision)
    dev = _resolve_device(device)
    names = _layer_names(layers, names)
    _check_sample_input(sample_input)
    check_precision(precision, dev.type, "--precision")
    fixed_bytes = 0.0
    if dev.type == "cuda":  # before any layer is on the device: the context, the communicator's buffers
        fixed_bytes = measure_fixed_footprint(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    modes = [m.training for m in layers]
    for m in layers:
        m.to(device=dev).train()

    def batch(b: int) -> Any:
        x = sample_input(b) if callable(sample_input) else _replicate(sample_input, b)
        return _map(x, lambda t: t.to(dev))

    def as_args(x: Any) -> tuple[Any, ...]:
        return x if unpack_tuples and isinstance(x, tuple) else (x,)

    try:
        records, input_bytes = _measure_every_size(layers, names, sizes, batch, as_args, repeats, warmup, dev,
                                                   min_time_s, precision)
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.train(mode)
    type_name, _ = describe_device(dev)
    reports = tuple(r.report(name, layer, sizes[-1]) for r, name, layer in zip(records, names, layers, strict=True))
    footprint = allocator_footprint(fixed_bytes, dev, type_name) if dev.type == "cuda" else None
    model_s: list[float] = []
    if repeats >= 2:  # the whole model's repeats, for the noise common to all layers
        model_s = _time_model_if_it_fits(layers, as_args(batch(sizes[0])), as_args, repeats, warmup, dev,
                                         min_time_s, precision)
    rates = measure_optimizer_step(layers, dev, optimizers, min_time_s, repeats) if optimizers else {}
    return LayersMeasurement(reports, input_bytes, type_name, str(dev), precision,
                             device_figures(type_name, dev, precision), tuple(rates.items()), footprint,
                             tuple(model_s))


def _peak_memory(layer: nn.Module, args: tuple[Any, ...], grad_inputs: bool, dev: torch.device) -> int | None:
    """CUDA: peak bytes allocated by one forward + backward beyond what was allocated before."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    _time_layer(layer, args, grad_inputs, repeats=1, warmup=0, device=dev)
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - before)


def profile_layers(layers: Sequence[nn.Module], sample_input: SampleInput,
                   micro_batches: Sequence[int] = (1, 2, 4, 8), device: str | torch.device = "cpu",
                   repeats: int = 5, warmup: int = 2, model_name: str = "model", precision: Precision = "fp32",
                   names: Sequence[str] | None = None, unpack_tuples: bool = True) -> ModelProfile:
    """Profile a model given as a list of layers; each layer's output feeds the next.

    Args:
        layers: the layers in order (an ``nn.Sequential`` works too).
        sample_input: the first layer's input for micro-batch 1 (a tensor or tuple of
            tensors with leading dimension 1, repeated to make a batch of ``b``), or a
            callable ``b -> batch of b samples``.
        micro_batches: sizes to time at; saved, output and FLOP counts are taken at
            the largest and divided by it.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        repeats / warmup: timed runs (median taken) and untimed runs before them.
        model_name: the profile's name.
        precision: ``"fp32"``, or ``"fp16"`` / ``"bf16"`` (autocast over fp32 layers, as the runtime
            trains: ``hetrain.amp``; fp16 needs CUDA).
        names: one label per layer (default ``"<class><index>"``).
        unpack_tuples: a tuple output is passed to the next layer as ``*args``; with
            False it is passed as one argument (``hetrain.models``' convention).

    Returns:
        A ModelProfile with ``measured`` under the device type (``"cpu"``, or the
        GPU's catalog name), that type's figures under ``measured_on`` and its
        optimizer step (sgd, momentum, adam) under ``optimizer_step_s_per_byte``.

    Example:
        >>> p = profile_layers(nn.Sequential(nn.Linear(32, 64), nn.ReLU()), torch.randn(1, 32))
        >>> p.layers[1].measurements("cpu")[0].micro_batch
        1
    """
    m = measure_layers(layers, sample_input, micro_batches, device, repeats, warmup, precision, names, unpack_tuples)
    return m.to_profile(model_name)


def _layer_error_hint(e: LayerError, data: str | None) -> str:
    """What to do about a layer that failed: fix the sample that fails alone, or measure other sizes.

    Sample ``k`` of a micro-batch is sample ``k`` of the data (``profile_inputs`` takes the first ones).
    """
    if e.sample is None:
        return f"measure it at other sizes, e.g. --micro-batch {','.join(map(str, e.sizes_to_try()))}"
    k, error = e.sample
    where = f"the data set (--data {data})" if data is not None else "the profiling input"
    own = "" if describe_error(error) == describe_error(e.error) else f" ({describe_error(error)})"
    return (f"sample {k} of {where} fails alone{own} and other samples run: fix or drop that sample "
            "(any micro-batch size that holds it fails)")


def _with_tp_splits(profile: ModelProfile, source: ModelSource) -> tuple[ModelProfile, str]:
    """The measured profile with its layers' TP splits from the analytic profile of the same model, where there is
    one (a reference model, a transformers config) and its layers line up (``profile_combine.with_tp_splits``);
    and a line saying what was done."""
    from hetrain.models.analytic import build_profile
    from hetrain.models.hf_analytic import build_hf_profile, is_hf_spec
    from hetrain.profile_combine import with_tp_splits

    try:
        if is_hf_spec(source.name):
            twin = build_hf_profile(source.name, seq_len=profile.seq_len, precision=profile.precision)
        elif source.preset is not None:
            extra = {"seq_len": profile.seq_len} if profile.seq_len is not None else {}
            twin = build_profile(source.preset, **{**source.config, **extra, "precision": profile.precision})
        else:
            return profile, "no TP splits: a model of your own has no analytic profile; a TP group replicates it"
    except (KeyError, ValueError, TypeError) as e:
        return profile, f"no TP splits: the analytic profile of {source.name} could not be built ({e})"
    return with_tp_splits(profile, twin)


def run_profile_command(model: str | ModelSource, micro_batches: Sequence[int], output: str, device: str = "cpu",
                        repeats: int = 5, warmup: int = 2, precision: Precision = "fp32", seed: int = 0,
                        data: str | None = None, inputs: Callable[[int], Any] | None = None,
                        seq_len: int | None = None) -> int:
    """``hetrain profile``: profile a model, write the JSON; exit status.

    ``model`` is a reference model's name, ``MODULE:FUNCTION`` (``hetrain.models.user``), or
    the ``ModelSource`` resolved from either. Builds its layers under ``seed`` and feeds them
    ``sample_batch`` inputs (a reference model), or the first samples of ``data``
    (``MODULE:FUNCTION``, ``hetrain.data.user``; a user's model needs it: its input is known
    only from its data). Prints the per-layer table and the time model's error on held-out
    micro-batch sizes (with 3 or more sizes), and saves the profile. ``inputs`` (``b -> the
    first layer's input for b samples``, from ``profile_inputs``) replaces ``data`` (which still
    says what they are). A token model or token data runs at ``seq_len`` tokens per sample
    (``profile_inputs``); the profile records the length it was measured at. Returns 0; 2 for bad input
    (a model, data set, device or micro-batch size that cannot be used) or 1 for a failure while measuring,
    with the reason on stderr.
    """
    from hetrain.data.seq_len import measured_seq_len
    from hetrain.fit import TIME_MODELS, fit_error
    from hetrain.models.user import resolve_model

    try:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here; use --device cpu")
        source = resolve_model(model) if isinstance(model, str) else model
        sample = inputs if inputs is not None else profile_inputs(source, data, seed, seq_len)
        measured_at = measured_seq_len(source, data, sample)
        layers = source.build_layers(seed=seed)
        measured = measure_layers(layers, sample, micro_batches, dev, repeats, warmup, precision,
                                  source.layer_names, unpack_tuples=False)
        profile = replace(measured.to_profile(source.name), seq_len=measured_at, split_points=source.split_points)
        profile, tp_note = _with_tp_splits(profile, source)
        profile.save(output)
    except LayerError as e:  # the model, at a micro-batch size asked for: bad input
        print(f"hetrain profile: error: model {source.name}: {e}; {_layer_error_hint(e, data)}", file=sys.stderr)
        return 2
    except ValueError as e:  # InputError among them: a model, data set or device that cannot be used
        print(f"hetrain profile: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"hetrain profile: error: {e}", file=sys.stderr)
        return 1
    print(measured.table())
    print(tp_note)
    if len(set(micro_batches)) >= 3:
        for time_model in TIME_MODELS:
            print(fit_error(profile, measured.type_name, model=time_model).summary())  # type: ignore[arg-type]
    print(f"wrote {output}")
    return 0

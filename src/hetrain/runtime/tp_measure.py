"""Layers timed on one rank of a TP group (``LayerProfile.measured_tp``), the collectives in: the profiler's
measurement of what the runtime runs (it lives beside ``runtime.tp``, whose rules it applies; ``hetrain profile
--tp K`` and the demo's profile step call it).

Where a profile has no such times the cost model estimates them (``cost.tp_rank_profile``: the split share of the
one-device time divided by ``k * tp_efficiency``, plus the ring all-reduces on the node's link). That estimate
misses what a rank pays per TP layer beyond its share of the FLOPs and the bytes the collectives move: DTensor's
dispatch of every op, the collectives' fixed cost, smaller matrix multiplies. Measuring each layer parallelised
as the runtime parallelises it (``runtime.tp.RULES``, torch's ``parallelize_module``) on the group it would run
on puts all of it in the figure.

Every rank of the group runs the same calls in the same order (each forward and backward is collective inside
the layer): the number of back-to-back calls timed per block is agreed over the group (the largest any rank
needs to last ``min_time_s``) before each layer and size, so no rank waits for a call another never makes::

    for each layer with a TP rule, each micro-batch size:
        input = the whole layers before it on the same sample (every rank the same)
        n = max over the group of the calls lasting min_time_s        (one all-reduce)
        repeats x [n x (forward, backward)] ──► median per-call forward and backward seconds

Layers without a rule (embeddings, the head) run whole on every rank: their one-device times stand.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from hetrain import amp
from hetrain.profile import LayerProfile, Measurement, ModelProfile, Precision
from hetrain.runtime.tp import RULES, block_type

SampleInput = Callable[[int], Any]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _leaf(x: Any) -> Any:
    """``x`` with its floating tensors detached leaves that require grad (as a stage's received input)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    if isinstance(x, tuple):
        return tuple(_leaf(v) for v in x)
    if isinstance(x, list):
        return [_leaf(v) for v in x]
    return x


def _call_once(layer: nn.Module, x: Any, device: torch.device, precision: Precision) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``layer`` on ``x`` (its gradient: ones, the same on every rank)."""
    inputs = _leaf(x)
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with amp.autocast(device, precision):
        out = layer(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mid = time.perf_counter()
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return mid - start, time.perf_counter() - mid


def _agreed_calls(seconds: float, min_time_s: float, group: Any) -> int:
    """The calls a block needs to last ``min_time_s`` at ``seconds`` per call: the most any rank of ``group``
    needs, so that all make the same calls."""
    n = torch.tensor([max(1, math.ceil(min_time_s / max(seconds, 1e-9)))], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return int(n.item())


def time_tp_layer(layer: nn.Module, x: Any, mesh: DeviceMesh, repeats: int, warmup: int, min_time_s: float,
                  device: torch.device, precision: Precision) -> Measurement | None:
    """Median forward and backward seconds per call of ``layer`` parallelised on ``mesh`` by its rule, on ``x``
    (``b`` samples, whole on every rank); None for a layer without a rule. Collective over ``mesh``."""
    rule = RULES.get(block_type(layer))
    if rule is None:
        return None
    tp_layer = copy.deepcopy(layer).to(device).train()
    parallelize_module(tp_layer, mesh, rule(tp_layer, mesh.size()))
    first = 0.0
    for _ in range(max(1, warmup)):
        f, g = _call_once(tp_layer, x, device, precision)
        first = f + g
    calls = _agreed_calls(first, min_time_s, mesh.get_group())
    fwd, bwd = [], []
    for _ in range(repeats):
        pairs = [_call_once(tp_layer, x, device, precision) for _ in range(calls)]
        fwd.append(sum(f for f, _ in pairs) / calls)
        bwd.append(sum(g for _, g in pairs) / calls)
    b = _tensors(x)[0].shape[0]
    return Measurement(b, statistics.median(fwd), statistics.median(bwd), "measured")


def measure_layers_tp(layers: Sequence[nn.Module], sample_input: SampleInput, sizes: Sequence[int],
                      mesh: DeviceMesh, repeats: int = 3, warmup: int = 1, min_time_s: float = 0.0,
                      device: str | torch.device = "cpu",
                      precision: Precision = "fp32") -> dict[int, list[Measurement]]:
    """Per layer with a TP rule (by index), its measurements on one rank of ``mesh``'s group at each of ``sizes``.

    ``sample_input(b)`` must give every rank the same ``b`` samples (a generator seeded alike). Collective over
    the mesh: every rank calls it with the same arguments.
    """
    dev = torch.device(device)
    out: dict[int, list[Measurement]] = {}
    for b in sorted(set(sizes)):
        x: Any = _to(sample_input(b), dev)
        for i, layer in enumerate(layers):
            layer.to(dev)
            m = time_tp_layer(layer, x, mesh, repeats, warmup, min_time_s, dev, precision)
            if m is not None:
                out.setdefault(i, []).append(m)
            with torch.no_grad(), amp.autocast(dev, precision):
                x = layer(x)  # the next layer's input, whole
    return out


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    return x


def with_measured_tp(profile: ModelProfile, type_name: str, k: int,
                     measured: dict[int, list[Measurement]]) -> ModelProfile:
    """``profile`` with ``measured`` filed as its layers' ``measured_tp`` at degree ``k`` on ``type_name``."""
    layers: list[LayerProfile] = []
    for i, layer in enumerate(profile.layers):
        ms = measured.get(i)
        if not ms:
            layers.append(layer)
            continue
        kept = tuple(e for e in layer.measured_tp if not (e[0] == type_name and e[1] == k))
        ordered = tuple(sorted(ms, key=lambda m: m.micro_batch))
        layers.append(replace(layer, measured_tp=(*kept, (type_name, k, ordered))))
    return replace(profile, layers=tuple(layers))


def profile_with_tp(source: Any, args: Any, inputs: SampleInput) -> int:
    """``hetrain profile --tp K`` under torchrun with K ranks on one node: every rank measures the layers on its
    own device (``profiler.layers.run_profile_command``), then the K ranks time the layers with a TP rule as one
    TP group (``measure_layers_tp``), and rank 0 writes the profile with them (``measured_tp``). Exit status as
    ``run_profile_command``'s.

    Raises:
        InputError: not under torchrun with exactly K ranks.
    """
    import os
    from datetime import timedelta
    from pathlib import Path

    from hetrain.errors import InputError
    from hetrain.profile import load_profile
    from hetrain.profiler.layers import run_profile_command

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise InputError(f"--tp {args.tp}: time TP layers under `torchrun --nproc-per-node {args.tp} -m hetrain "
                         f"profile ... --tp {args.tp}` (WORLD_SIZE is {world}); without --tp the planner estimates "
                         f"them")
    rank = int(os.environ.get("RANK", "0"))
    own = Path(args.output) if rank == 0 else Path(f"{args.output}.rank{rank}")
    status = run_profile_command(source, args.micro_batch, str(own), device=args.device, repeats=args.repeats,
                                 precision=args.precision, data=args.data, inputs=inputs)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
    try:
        flags = torch.tensor([status], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank measured, or none goes on
        if int(flags.item()) != 0:
            return int(flags.item())
        mesh = DeviceMesh(device.type, list(range(world)))
        timed = measure_layers_tp(source.build_layers(seed=0), inputs, args.micro_batch, mesh,
                                  repeats=args.repeats, device=device, precision=args.precision)
        if rank == 0:
            profile = load_profile(own)
            with_measured_tp(profile, profile.measured_on[0][0], args.tp, timed).save(own)
            print(f"timed {len(timed)} layer(s) on a rank of a TP group of {args.tp}: measured_tp in {own}")
        else:
            own.unlink(missing_ok=True)
        return 0
    finally:
        dist.destroy_process_group()


#: how long the ranks of ``profile_with_tp`` wait for each other
TIMEOUT_S = 300.0

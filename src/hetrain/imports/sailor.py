"""Measured Megatron-DeepSpeed runs in the Sailor artifact's format, as hetrain plans (docs/measured-runs.md).

The Sailor project (github.com/eth-easl/sailor, SOSP 2025, MIT licence) published
measured training runs on real GPU clusters with the per-layer profiles and the
network fits that go with them. ``load_sailor_data`` reads a directory of

    measured_plans.json   the plans and what was measured (iteration time, per-GPU peak memory)
    profiles.json         per-layer forward/backward seconds per GPU type, micro-batch and TP degree;
                          per-layer parameter and activation element counts per TP degree
    network.json          fitted bandwidth curves between and inside nodes

and ``convert_plan`` turns one measured plan into a hetrain ``Plan`` by one rule,
the same for every plan, with no per-plan constant:

    Sailor                                   hetrain
    replica of a stage (a TP group of tp     a TP stage (``Stage.tp_group``) on a node of its own, or on the node its
      GPUs on one node)                        ``node`` id names, shared with the plan's replicas of that id
                                               (``_place``), with the GPUs the node had (``gpus_per_node``) of the
                                               GPU's catalog type, each with the memory the cluster had per GPU
    the run's precision (``precision``,      activations, transfers and TP all-reduces at 2 bytes an element in fp16
      ``fp16``: ``plan_precision``)            and bf16; DeepSpeed's mixed precision (``mixed_precision``
                                               "master-weights": 16 bytes per Adam parameter, 16-bit gradient
                                               all-reduce); fp32 by default
    a layer                                  the whole layer's (TP 1) parameter, output and activation bytes and a
                                               ``TPSplit`` solved from the data's per-rank counts at degree tp:
                                               split = (whole - rank) k / (k - 1) (``solve_split``), checked through
                                               ``cost.tp_rank_profile`` (``check_tp_split``); its seconds on one GPU
                                               as ``measured``, on one rank of a TP group as ``measured_tp``
                                               (collectives in); the head's logits split too (vocab-parallel); a
                                               missing backward 2 x the forward, flagged (``MeasuredPlan.extrapolated``)
    a node's GPUs among themselves           its intra link: the intra-node curve of one pair at the message that
                                               crosses it most often (``_intra_bandwidth``)
    replica r of every stage                 virtual worker r (a pipeline); mini-batch mbs x m
    activation / gradient between stages     a [[link]] between the two nodes: the fitted curve of the GPUs per node
                                               sending at once (aggregate; replicas on one node queue on its NIC),
                                               at the message each sends, mbs x the
                                               boundary's activation / tp; its k ranks share it, each sending a k-th
                                               (DeepSpeed partitions a TP group's activations and gradients over
                                               its ranks, the receiver gathers: ``cluster.tp_cluster``)
    the receiver's rebuild of each received  at TP > 1, on that [[link]]: half a rebuild per transfer (the whole tensor
      tensor (host zero-fill, pageable copy,   at rebuild_bytes_per_s), so each of the two stages is held one
      TP all-gather: reconstruct_tensor)       rebuild per tensor it receives (``stage_link_bandwidth``)
    gradient all-reduce among the replicas   a [[link]] between the replicas' nodes: the curve of the GPUs per node
      of a stage                               at once (the tp ranks' rings share it), at a ring step's message
                                               (a rank's gradients as the runtime keeps them / dp)
    DeepSpeed's PipelineEngine               1F1B; transfers that block (sync option transfers);
                                               one gradient bucket all-reduced after the last
                                               backward, a flat ring; AdamW in the run's precision
    DeepSpeed's memory beyond tensors        the profile's memory footprint of each GPU type: a fixed footprint
                                               per GPU and the allocator's share (``DeepSpeedRuntime``)
    DeepSpeed's fixed cost per iteration     the profile's iteration_overhead_s

Pure Python, no torch: the conversion is planning-side data.

Example:
    >>> data = load_sailor_data("sailor-dev")                         # doctest: +SKIP
    >>> run = convert_plan(data.plans[0], data)                       # doctest: +SKIP
    >>> run.plan.cluster.type_names, run.measured_iter_time_s         # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetrain.catalog import lookup_device_type
from hetrain.cluster import parse_cluster
from hetrain.cost import tp_rank_profile
from hetrain.errors import InputError
from hetrain.fields import show
from hetrain.plan import Plan, Prediction, Stage, VirtualWorker
from hetrain.profile import DeviceFigures, LayerProfile, Measurement, ModelProfile, TPSplit
from hetrain.sync_layout import SyncOptions

#: bytes per element of fp32 (the development set's runs: README of the data set; Sailor's simulator uses 4), and
#: of a parameter as hetrain's profile counts it (``LayerProfile.param_bytes``: the fp32 weights or master weights)
FP32_BYTES = 4
#: bytes per element of activations, activation gradients and the TP all-reduces, by a run's precision
#: (``plan_precision``): 16-bit compute moves and keeps 16-bit tensors
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: a layer's backward seconds per forward second where a profile has no backward (``bwd_s`` missing or null): a
#: linear layer's backward computes its input's and its weights' gradients, two matrix multiplies of the forward's
#: size (Kaplan et al. 2020, "Scaling laws", sec. 2.1: 2N FLOPs per token forward, 4N backward); not fitted
BACKWARD_PER_FORWARD = 2.0
#: a bucket larger than any model: DeepSpeed's PipelineEngine all-reduces the gradients once, after the
#: last backward of the iteration (``_exec_reduce_grads``), never during it
ONE_BUCKET_BYTES = float(2**40)
FILES = ("measured_plans.json", "profiles.json", "network.json")
#: bytes of a received tensor the measured runs' receiver rebuilds per second (``DeepSpeedRuntime``), fitted
#: once on the development set (benchmarks/real_cluster_accuracy.py --fit, docs/measured-runs.md)
REBUILD_BYTES_PER_S = 11e9


class MeasuredRunError(InputError):
    """A measured-run file or plan that cannot be converted; names the file or plan, the field and the value."""


@dataclass(frozen=True)
class DeepSpeedRuntime:
    """The properties of the runtime that made the measured runs (Megatron-DeepSpeed's PipelineEngine).

    Set as that runtime has them, not fitted per plan. Four numbers are physical constants of the
    runtime (``fixed_bytes_per_gpu``, ``allocator_fraction``, ``iteration_overhead_s``,
    ``rebuild_bytes_per_s``), fitted once on the development set (``benchmarks/real_cluster_accuracy.py
    --fit``, docs/measured-runs.md): the same for every plan, GPU type and cluster.

    Attributes:
        transfers: ``"blocking"``: its sends and receives are on the critical path of both stages.
        fixed_bytes_per_gpu: memory each GPU holds beyond its tensors: CUDA context, NCCL's
            communicators (a data-parallel, a pipeline, a tensor-parallel and DeepSpeed's own
            groups), DeepSpeed's and Megatron's buffers.
        allocator_fraction: what PyTorch's caching allocator holds beyond the tensor peak, as a share
            of it (fragmentation of a training step's many activation sizes).
        iteration_overhead_s: the runtime's fixed cost per iteration (its step's bookkeeping,
            the reduction of the tied embedding's gradients, logging).
        action_overhead_s: the runtime's fixed cost per forward and per backward of a micro-batch
            (the PipelineEngine interprets its instructions one by one, in Python).
        p2p_latency_s: the fixed cost of one stage-to-stage transfer beyond its bytes (DeepSpeed
            sends a tensor's shape before the tensor).
        partitioned_transfers: DeepSpeed's ``pipeline.pipe_partitioned`` and ``grad_partitioned``
            (default true where TP > 1): each TP rank sends 1/tp of an activation or gradient and the
            receiver gathers the parts; false: every TP rank sends the whole tensor to its peer.
        rebuild_bytes_per_s: how fast a receiving stage rebuilds a received activation or gradient into
            the whole tensor before it computes with it, in bytes of that whole tensor per second; 0: no
            rebuild. The measured runs' PipelineEngine (``reconstruct_tensor``, called at the start of every
            forward of a stage that is not the first and every backward of one that is not the last)
            allocates and zero-fills the whole tensor on the host, copies it to the GPU from pageable
            memory, all-gathers the parts within the TP group and copies the result, with the host
            waiting for the GPU in between: a cost proportional to the tensor, on the receiver's critical
            path (``rebuild_time_s``; ``stage_link_bandwidth``: how it enters the plan). DeepSpeed partitions
            and so rebuilds only where the model is tensor-parallel (``is_pipe_partitioned = is_model_parallel``):
            a plan at TP 1 pays none.
        mixed_precision: how the runtime keeps weights and gradients in a run at fp16 or bf16
            (``ModelProfile.mixed_precision``): DeepSpeed's FP16 optimizer keeps 16-bit weights and gradients and
            fp32 master weights and Adam state, 16 bytes per parameter (ZeRO's "2 + 2 + 12"), and all-reduces
            the 16-bit gradients. A run at fp32 keeps 4 + 4 + 8 under either name.
        rings_share_nic: the gradient all-reduces of a stage's TP ranks (one ring per rank, each over its own
            data-parallel group) run at once and share their node's NIC: the link is the curve of the node's
            sending GPUs at once, aggregate. False: each ring has that whole bandwidth to itself (a candidate the
            development set rejects, ``benchmarks/real_cluster_accuracy.py --baseline``).
    """

    transfers: str = "blocking"
    fixed_bytes_per_gpu: float = 4.41e9
    allocator_fraction: float = 0.104
    iteration_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    p2p_latency_s: float = 0.0
    partitioned_transfers: bool = True
    rebuild_bytes_per_s: float = REBUILD_BYTES_PER_S
    mixed_precision: str = "master-weights"
    rings_share_nic: bool = True

    def rebuild_time_s(self, tensor_bytes: float) -> float:
        """Seconds a receiving stage spends rebuilding one received tensor of ``tensor_bytes`` (whole).

        Example:
            >>> DeepSpeedRuntime(rebuild_bytes_per_s=10e9).rebuild_time_s(67108864)  # 8 x 2048 x 1024 fp32
            0.0067108864
        """
        return tensor_bytes / self.rebuild_bytes_per_s if self.rebuild_bytes_per_s > 0 else 0.0

    def sync_options(self) -> SyncOptions:
        """What the plan records of the runtime: blocking transfers, one bucket, a flat ring."""
        return SyncOptions(bucket_bytes=ONE_BUCKET_BYTES, first_bucket_bytes=ONE_BUCKET_BYTES, allreduce="ring",
                           transfers=self.transfers)


DEEPSPEED = DeepSpeedRuntime()


@dataclass(frozen=True)
class SailorData:
    """The three files of a measured-run directory, as read (``load_sailor_data``)."""

    directory: str
    plans: tuple[Mapping[str, Any], ...]
    profiles: Mapping[str, Any]
    network: Mapping[str, Any]


@dataclass(frozen=True)
class MeasuredPlan:
    """One measured run and its hetrain plan.

    Attributes:
        id: the run's id in measured_plans.json; ``group``: its group.
        plan: the hetrain plan (``convert_plan``).
        measured_iter_time_s / measured_max_mem_bytes: what was measured (peak memory per GPU).
        usable_for_time: the data's ``usable_for_time``.
        memory_reliable: whether its memory figure was measured on this configuration (False for the
            ``superseded_*`` groups, whose figures were carried over between runs).
        extrapolated: what of the profile the plan runs on was not measured but extrapolated, one line each
            (``BACKWARD_PER_FORWARD``; a micro-batch size outside or between the measured ones): a prediction
            of the plan rests on these rules. Empty: every time it uses was measured.
    """

    id: str
    group: str
    plan: Plan
    measured_iter_time_s: float
    measured_max_mem_bytes: float
    usable_for_time: bool
    memory_reliable: bool
    extrapolated: tuple[str, ...] = ()

    def per_gpu_bytes(self, device_peak_bytes: Mapping[str, float]) -> float:
        """The largest per-GPU memory of the plan: of each device's peak (a TP group's ranks hold alike)."""
        return max(device_peak_bytes.values())


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise MeasuredRunError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise MeasuredRunError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


def load_sailor_data(directory: str | Path) -> SailorData:
    """Read ``measured_plans.json``, ``profiles.json`` and ``network.json`` from ``directory``.

    Raises:
        MeasuredRunError: a file missing, not JSON, or without its top-level field.
    """
    d = Path(directory)
    plans_raw, profiles, network = (_load(d / name) for name in FILES)
    for name, raw, key in (("measured_plans.json", plans_raw, "plans"), ("profiles.json", profiles, "models"),
                           ("network.json", network, "inter_node")):
        if not isinstance(raw, Mapping) or key not in raw:
            raise MeasuredRunError(f"{d / name}: expected an object with {key!r}")
    plans = plans_raw["plans"]
    if not isinstance(plans, list):
        raise MeasuredRunError(f"{d / 'measured_plans.json'}: plans must be a list, got {type(plans).__name__}")
    return SailorData(str(d), tuple(plans), profiles, network)


# ---------------------------------------------------------------------------
# network: the fitted curves
# ---------------------------------------------------------------------------


def fitted_bandwidth(fit: Mapping[str, Any], size_bytes: float) -> float:
    """Bytes/s of a fitted curve at a message of ``size_bytes``.

    ``bw_GBps = c0 L^2 + c1 L + c2`` with ``L = log2(size / 1e6)`` (network.json's ``formula``),
    capped at the largest bandwidth measured (``max_bw_Bps``); where the quadratic is not positive
    (far below the fitted range) the largest measured bandwidth stands in, as the data's caveat says.

    Example:
        >>> fitted_bandwidth({"coeffs": [0.0, 0.0, 2.0], "max_bw_Bps": 3e9}, 8e6)
        2000000000.0
    """
    c0, c1, c2 = (float(c) for c in fit["coeffs"])
    level = math.log2(size_bytes / 1e6)
    gb_per_s = c0 * level * level + c1 * level + c2
    top = float(fit["max_bw_Bps"])
    return top if gb_per_s <= 0 else min(gb_per_s * 1e9, top)


def stage_link_bandwidth(network_bytes_per_s: float, runtime: DeepSpeedRuntime) -> float:
    """The bandwidth of a link between two stages: the network's, and the receiver's rebuild of each tensor.

    A blocking transfer holds its sender and its receiver for its duration (sync option ``transfers``).
    The runtime's receiver then rebuilds the tensor it received (``DeepSpeedRuntime.rebuild_time_s``), its
    sender does not. Between two stages the tensors go both ways, one per micro-batch each way: stage j
    sends micro-batch i's activation and receives its gradient, so each of the two stages rebuilds one
    tensor per micro-batch for each of the two transfers that hold it. Half a rebuild on each transfer
    holds each stage exactly its own rebuilds (and DeepSpeed's ``TrainSchedule`` runs the two stages'
    rebuilds in the same step, side by side)::

        one transfer of a tensor of S bytes (whole):  S / network + S / (2 x rebuild)
        a link's two transfers per micro-batch:       2 S / network + S / rebuild
        so stage j is held per micro-batch for t_j plus, on each of its links, both transfers and its one rebuild

    Example:
        >>> stage_link_bandwidth(60e9, DeepSpeedRuntime(rebuild_bytes_per_s=10e9))  # 1 / (1/60 + 1/20) GB/s
        15000000000.0
    """
    if runtime.rebuild_bytes_per_s <= 0:
        return network_bytes_per_s
    return 1.0 / (1.0 / network_bytes_per_s + 0.5 / runtime.rebuild_bytes_per_s)


def _intra_fit(network: Mapping[str, Any], gpu: str, plan_id: str) -> Mapping[str, Any]:
    """The intra-node curve of one pair of GPUs of type ``gpu`` sending at once (``intra_node[gpu]["2"]``)."""
    fit = network.get("intra_node", {}).get(gpu, {}).get("2")
    if fit is None:
        raise MeasuredRunError(f"plan {plan_id}: network.json has no intra_node[{gpu!r}]['2'] fit")
    return fit  # type: ignore[no-any-return]


def _inter_fit(network: Mapping[str, Any], sender: tuple[str, int], receiver: tuple[str, int],
               plan_id: str) -> Mapping[str, Any]:
    """The curve of ``count`` GPUs of one node sending at once to ``count`` of another, per (GPU type, count).

    Where the data has no curve for a node's count (a node whose replicas share it sends from more GPUs than the
    data measured at once), the largest count it has below: the replicas' transfers then queue on the node's NIC
    at that aggregate (``_links``)."""
    wanted = (sender[0], str(sender[1]), receiver[0], str(receiver[1]))
    node: Any = network["inter_node"]
    for level, k in enumerate(wanted):
        if isinstance(node, Mapping) and k not in node and level in (1, 3):
            below = [int(c) for c in node if str(c).isdigit() and int(c) <= int(k)]
            k = str(max(below)) if below else k
        if not isinstance(node, Mapping) or k not in node:
            raise MeasuredRunError(f"plan {plan_id}: network.json has no inter_node{list(wanted)} fit "
                                   f"(missing {k!r})")
        node = node[k]
    return node  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# the profile of one model: whole layers, their TP split, times per TP degree
# ---------------------------------------------------------------------------


#: GPU names of the data whose catalog type is not the one the name suggests, by what the data says of them:
#: its "RTX-2080" nodes have 11 GiB per GPU (network.json ``basic_cluster_config`` and ``gpu_memory_GB``),
#: which among Turing GeForce cards only the RTX 2080 Ti has (the RTX 2080 has 8 GB)
SAILOR_GPU_TYPES = {"RTX-2080": "RTX2080Ti"}
#: how far one rank's figures of the profile (``cost.tp_rank_profile``) may miss the data's per-rank element
#: counts at the TP degree the split was solved at: an embedding's rank holds 0.2% more saved activations than the
#: whole layer (OPT-350M: 4608 elements, the vocab-parallel embedding's own), which no split can express
TP_SPLIT_TOLERANCE = 0.01


def catalog_type(gpu: str) -> str:
    """The catalog type of one of the data's GPU names (``SAILOR_GPU_TYPES``, else the catalog's alias).

    Example:
        >>> catalog_type("RTX-2080"), catalog_type("GH-96")
        ('RTX2080Ti', 'GH200')
    """
    return lookup_device_type(SAILOR_GPU_TYPES.get(gpu, gpu)).name


def _model(data: SailorData, name: str, plan_id: str) -> Mapping[str, Any]:
    models = data.profiles["models"]
    if name not in models:
        raise MeasuredRunError(f"plan {plan_id}: profiles.json has no model {name!r}; it has {', '.join(models)}")
    return models[name]  # type: ignore[no-any-return]


def _gpu_memory_bytes(data: SailorData, gpu: str) -> float:
    """The memory of one GPU of type ``gpu`` as the data's cluster had it (``basic_cluster_config``), else the
    catalog's."""
    cfg = data.network.get("basic_cluster_config", {}).get(gpu, {})
    return float(cfg.get("mem_per_gpu") or lookup_device_type(catalog_type(gpu)).memory_bytes)


def solve_split(whole: float, rank: float, k: int) -> float:
    """The part of a layer's figure that a TP group of ``k`` splits, from the whole layer's and one rank's.

    A rank holds ``whole - split + split / k`` (``cost.tp_rank_profile``), so ``split = (whole - rank) k / (k - 1)``,
    kept within [0, whole] (a rank that holds more than the whole layer: nothing split).

    Example:
        >>> solve_split(12596224, 3153664, 4)   # an OPT-350M block's parameters (elements) at TP 4
        12590080.0
    """
    return min(whole, max(0.0, (whole - rank) * k / (k - 1)))


def _layer_bytes(sizes: Mapping[str, Any], i: int, n: int, e: int = FP32_BYTES) -> tuple[float, float, float]:
    """(parameter, output, saved) bytes per sample of layer ``i`` of ``n`` on one rank at one TP degree's
    ``layer_sizes_per_tp`` entry: parameters at 4 bytes (hetrain counts the fp32 weights, or master weights, and
    derives the rest from the profile's ``mixed_precision``), activations at ``e`` bytes (``PRECISION_BYTES``).
    The last layer's output is its logits, which hetrain's loss term keeps (one per micro-batch in flight): its
    saved bytes are its activation memory less that one output."""
    params = FP32_BYTES * float(sizes["params_floats"][i])
    out, saved = (e * float(sizes[key][i]) for key in ("act_output_floats", "act_mem_floats"))
    return params, out, max(0.0, saved - out) if i == n - 1 else saved


def _split_degree(sizes_per_tp: Mapping[str, Any], tp: int) -> int:
    """The TP degree the layers' split is solved at: the plan's, else the smallest the data has (1: none)."""
    if tp > 1:
        return tp
    return min((int(k) for k in sizes_per_tp if int(k) > 1), default=1)


def _layer(sizes_per_tp: Mapping[str, Any], i: int, n: int, k: int, seq: int, hidden: int,
           measured: Sequence[tuple[str, tuple[Measurement, ...]]],
           measured_tp: Sequence[tuple[str, int, tuple[Measurement, ...]]], e: int = FP32_BYTES) -> LayerProfile:
    """Layer ``i`` of ``n`` whole (TP 1) with its TP split solved at degree ``k`` (``solve_split``).

    Split: the parameters and saved activations by the data's per-rank counts; the forward FLOPs of the split
    parameters' matrix multiplies (2 per parameter and token) and, in a block, attention (by heads); all-reduced:
    a block's two of ``s h`` per forward (Megatron's attention and MLP outputs), the embedding's and the head's one
    (the vocab-parallel embedding's output; the head's input gradient). The output by the data's per-rank counts:
    whole on every rank but the head's logits (vocab-parallel, never gathered). Activations and all-reduces at ``e``
    bytes per element.
    """
    params, out, saved = _layer_bytes(sizes_per_tp["1"], i, n, e)
    block = 0 < i < n - 1
    attention = 4.0 * seq * seq * hidden if block else 0.0  # QK^T and AV, per sample
    flops = 2.0 * params / FP32_BYTES * seq + attention
    split = None
    if k > 1:
        rank_params, rank_out, rank_saved = _layer_bytes(sizes_per_tp[str(k)], i, n, e)
        split_params = solve_split(params, rank_params, k)
        split = TPSplit(split_param_bytes=split_params,
                        split_flops_per_sample=2.0 * split_params / FP32_BYTES * seq + attention,
                        split_saved_bytes_per_sample=solve_split(saved, rank_saved, k),
                        allreduce_bytes_per_sample=(2.0 if block else 1.0) * seq * hidden * e,
                        allreduces=2 if block else 1, split_output_bytes_per_sample=solve_split(out, rank_out, k))
    name = "embedding" if i == 0 else "head" if i == n - 1 else f"block{i}"
    return LayerProfile(name, params, out, saved, flops, tuple(measured), split, tuple(measured_tp))


def _rows(by_mbs: Mapping[str, Any], k: int, n: int, gpu: str, where: str
          ) -> tuple[list[list[Measurement]], bool]:
    """Per layer, the data's measurements of one GPU type at TP degree ``k``, by micro-batch size; and whether a
    backward was missing (``bwd_s`` absent or null, as a whole or for a layer): then ``BACKWARD_PER_FORWARD`` x the
    forward."""
    per_layer: list[list[Measurement]] = [[] for _ in range(n)]
    guessed = False
    for mbs, t in sorted((int(mbs), t[str(k)]) for mbs, t in by_mbs.items() if str(k) in t):
        fwd, bwd = t.get("fwd_s"), t.get("bwd_s")
        if not isinstance(fwd, list) or len(fwd) != n or (bwd is not None and not isinstance(bwd, list)) or (
                isinstance(bwd, list) and len(bwd) != n):
            raise MeasuredRunError(f"{where}: profiles.json timing[{gpu!r}][{str(mbs)!r}][{str(k)!r}]: fwd_s (and "
                                   f"bwd_s, where given) must be lists of {n} seconds, got fwd_s {show(fwd)}")
        for i in range(n):
            b = None if bwd is None else bwd[i]
            guessed = guessed or b is None
            f = float(fwd[i])
            per_layer[i].append(Measurement(mbs, f, BACKWARD_PER_FORWARD * f if b is None else float(b)))
    return per_layer, guessed


def _timings(model: Mapping[str, Any], gpus: Sequence[str], tp: int, n: int, where: str, mbs: int = 0,
             ) -> tuple[list[list[tuple[str, tuple[Measurement, ...]]]],
                        list[list[tuple[str, int, tuple[Measurement, ...]]]], tuple[str, ...]]:
    """Per layer, the data's seconds of each GPU type in ``gpus`` (by its catalog type): on one GPU (TP 1) as
    ``measured``, on one rank of a TP group of each degree k >= 2 as ``measured_tp`` (collectives in); and what the
    plan (at TP ``tp``, micro-batch ``mbs``; 0: none) takes of them by rule, not measurement (``MeasuredPlan``)."""
    measured: list[list[tuple[str, tuple[Measurement, ...]]]] = [[] for _ in range(n)]
    measured_tp: list[list[tuple[str, int, tuple[Measurement, ...]]]] = [[] for _ in range(n)]
    notes: list[str] = []
    for gpu in gpus:
        by_mbs = model["timing"].get(gpu)
        if by_mbs is None:
            raise MeasuredRunError(f"{where}: profiles.json has no timing for GPU type {gpu!r}")
        degrees = sorted({int(k) for t in by_mbs.values() for k in t})
        if tp not in degrees:
            raise MeasuredRunError(f"{where}: profiles.json has no timing of {gpu!r} at tp {tp}")
        for k in degrees:
            rows, guessed = _rows(by_mbs, k, n, gpu, where)
            if k == tp:
                notes.extend(_extrapolation_notes(gpu, k, [m.micro_batch for m in rows[0]], guessed, mbs))
            for i in range(n):
                if k == 1:
                    measured[i].append((catalog_type(gpu), tuple(rows[i])))
                else:
                    measured_tp[i].append((catalog_type(gpu), k, tuple(rows[i])))
    return measured, measured_tp, tuple(notes)


def _extrapolation_notes(gpu: str, k: int, sizes: Sequence[int], guessed: bool, mbs: int) -> list[str]:
    """What a plan at micro-batch ``mbs`` on ``gpu`` at TP ``k`` takes by rule: a backward from the forward, and a
    micro-batch size the profile does not have (``cost.interpolate_measurements``: proportional to the one measured
    size, else the nearest two sizes' line)."""
    notes = []
    if guessed:
        notes.append(f"{gpu} at TP {k}: backward = {BACKWARD_PER_FORWARD:g} x forward (no bwd_s in profiles.json)")
    if mbs and mbs not in sizes:
        rule = (f"{mbs / sizes[0]:g} x its time at micro-batch {sizes[0]}" if len(sizes) == 1 else
                f"the line through micro-batches {', '.join(map(str, sizes))}")
        notes.append(f"{gpu} at TP {k}: micro-batch {mbs} not measured; taken as {rule}")
    return notes


def check_tp_split(profile: ModelProfile, sizes: Mapping[str, Any], k: int, where: str) -> None:
    """Check that one rank's view of ``profile`` at TP degree ``k`` (``cost.tp_rank_profile``) holds the data's
    per-rank parameter and saved activation counts at that degree (``sizes``: its ``layer_sizes_per_tp`` entry),
    within ``TP_SPLIT_TOLERANCE``.

    Raises:
        MeasuredRunError: a layer whose split misses a count by more; names the layer, the degree and the figures.
    """
    n = profile.num_layers
    rank = tp_rank_profile(profile, k)
    e = profile.bytes_per_element
    for i in range(n):
        params, out, saved = _layer_bytes(sizes, i, n, e)
        for what, got, want in (("parameter", rank.layers[i].param_bytes, params),
                                ("output", rank.layers[i].output_bytes_per_sample, out),
                                ("saved activation", rank.layers[i].saved_bytes_per_sample, saved)):
            if abs(got - want) > TP_SPLIT_TOLERANCE * max(want, got):
                raise MeasuredRunError(f"{where}: layer {i} ({profile.layers[i].name}) at TP {k}: its split gives "
                                       f"a rank {got:.0f} {what} bytes, the data {want:.0f}")


def build_sailor_profile(data: SailorData, model_name: str, tp: int, gpus: Sequence[str],
                         runtime: DeepSpeedRuntime = DEEPSPEED, plan_id: str = "", precision: str = "fp32",
                         ) -> ModelProfile:
    """The hetrain profile of ``model_name`` for a run at TP degree ``tp`` on the catalog types of ``gpus``, in
    ``precision`` (``plan_precision``).

    Per layer (Sailor's ids: 0 embedding, 1..L blocks, L+1 final norm + head + loss) the whole layer's figures
    (``layer_sizes_per_tp["1"]``: parameters x 4 bytes, activations x ``PRECISION_BYTES``) and its TP split
    (``_layer``), solved at ``tp`` (a plan at TP 1: the smallest degree the data has) and checked there
    (``check_tp_split``); its times on one GPU (TP 1) as ``measured`` and on one rank of a TP group as
    ``measured_tp``, per measured micro-batch size (a missing backward: ``BACKWARD_PER_FORWARD`` x the forward). The
    runtime's memory footprint per GPU, and under 16-bit compute its ``mixed_precision``.
    """
    return _build_profile(data, model_name, tp, gpus, runtime, plan_id, precision, 0)[0]


def _build_profile(data: SailorData, model_name: str, tp: int, gpus: Sequence[str], runtime: DeepSpeedRuntime,
                   plan_id: str, precision: str, mbs: int) -> tuple[ModelProfile, tuple[str, ...]]:
    """``build_sailor_profile``, and what a plan at micro-batch ``mbs`` takes of it by rule (``_timings``)."""
    where = f"plan {plan_id}" if plan_id else f"model {model_name}"
    model = _model(data, model_name, plan_id)
    sizes_per_tp = model["layer_sizes_per_tp"]
    k = _split_degree(sizes_per_tp, tp)
    for degree in {"1", str(k)}:
        if degree not in sizes_per_tp:
            raise MeasuredRunError(f"{where}: profiles.json has no layer_sizes_per_tp[{degree!r}] for {model_name}")
    dims = model["dims"]
    seq, hidden = int(dims["sequence_length"]), int(dims["hidden_size"])
    n = len(sizes_per_tp["1"]["params_floats"])
    measured, measured_tp, notes = _timings(model, gpus, tp, n, where, mbs)
    e = PRECISION_BYTES[precision]
    layers = tuple(_layer(sizes_per_tp, i, n, k, seq, hidden, measured[i], measured_tp[i], e) for i in range(n))
    types = list(dict.fromkeys(catalog_type(g) for g in gpus))
    catalog = {t: lookup_device_type(t) for t in types}
    profile = ModelProfile(
        name=model_name, layers=layers,  # the input: token ids, 4 bytes each whatever the precision
        input_bytes_per_sample=FP32_BYTES * float(sizes_per_tp["1"]["act_input_floats"][0]),
        precision=precision,  # type: ignore[arg-type]
        measured_on=tuple((t, DeviceFigures(catalog[t].peak_flops(precision), catalog[t].memory_bandwidth_bytes_per_s))
                          for t in types),
        memory_footprint=tuple((t, runtime.fixed_bytes_per_gpu, runtime.allocator_fraction) for t in types),
        iteration_overhead_s=tuple((t, runtime.iteration_overhead_s) for t in types if runtime.iteration_overhead_s),
        action_overhead_s=tuple((t, runtime.action_overhead_s) for t in types if runtime.action_overhead_s),
        seq_len=seq,
        mixed_precision="autocast" if precision == "fp32" else runtime.mixed_precision,  # type: ignore[arg-type]
    )
    if k > 1:
        check_tp_split(profile, sizes_per_tp[str(k)], k, where)
    return profile, notes


# ---------------------------------------------------------------------------
# one plan
# ---------------------------------------------------------------------------


def _field(raw: Mapping[str, Any], key: str, plan_id: str) -> Any:
    if key not in raw:
        raise MeasuredRunError(f"plan {plan_id}: missing field {key!r}")
    return raw[key]


def _node_name(j: int, r: int) -> str:
    """The node of replica ``r`` of stage ``j`` where the run gives none (``node``): a node of its own."""
    return f"s{j}r{r}"


@dataclass(frozen=True)
class _Node:
    """A node of a measured plan: the replicas on it, ``(stage, replica)`` in the plan's order, each on ``tp``
    consecutive GPUs of the node's ``gpus`` of type ``gpu``."""

    name: str
    gpu: str
    gpus: int
    replicas: tuple[tuple[int, int], ...]
    tp: int

    @property
    def sending(self) -> int:
        """GPUs of the node that send at once: every replica's TP group (the curve ``inter_node`` keys by)."""
        return self.tp * len(self.replicas)

    def first_device(self, replica: tuple[int, int]) -> int:
        return self.tp * self.replicas.index(replica)


def _node_id(rep: Mapping[str, Any], j: int, r: int, where: str) -> str | None:
    """A replica's ``node`` (None where it has none), checked: a string or integer, no ':' or white space."""
    node = rep.get("node")
    if node is None:
        return None
    text = str(node)
    if isinstance(node, bool) or not isinstance(node, (str, int)) or not text or any(c in text for c in ": \t\n"):
        raise MeasuredRunError(f"{where}: stages[{j}].replicas[{r}].node = {show(node)}: a node id is a non-empty "
                               f"string or integer without ':' or white space")
    return text


def _place(stages: Sequence[Mapping[str, Any]], tp: int, where: str) -> dict[str, _Node]:
    """The plan's nodes: replicas with the same ``node`` id on one node, every other replica on a node of its own
    (``_node_name``), with the GPUs its node had (``gpus_per_node``, at least its replicas' TP groups).

    Raises:
        MeasuredRunError: replicas of one node with different GPU types or ``gpus_per_node``, more replicas than
            the node has GPUs, a node id that is a generated name; names the file, the field and the value.
    """
    members: dict[str, list[tuple[int, int]]] = {}
    given: set[str] = set()
    for j, s in enumerate(stages):
        for r, rep in enumerate(s["replicas"]):
            node = _node_id(rep, j, r, where)
            if node is not None:
                given.add(node)
            members.setdefault(_node_name(j, r) if node is None else node, []).append((j, r))
    nodes = {}
    for name, jrs in members.items():
        (j0, r0), first = jrs[0], stages[jrs[0][0]]["replicas"][jrs[0][1]]
        if name in given and any(_node_id(stages[j]["replicas"][r], j, r, where) is None for j, r in jrs):
            raise MeasuredRunError(f"{where}: a replica's node = {name!r}: the name of the node of its own of "
                                   f"stages[{j0}].replicas[{r0}]; choose another id")
        for j, r in jrs[1:]:
            rep = stages[j]["replicas"][r]
            for key in ("gpu_type", "gpus_per_node"):
                if rep.get(key) != first.get(key):
                    raise MeasuredRunError(
                        f"{where}: stages[{j}].replicas[{r}].node = {name!r} puts {key} {show(rep.get(key))} on the "
                        f"node of stages[{j0}].replicas[{r0}], whose {key} is {show(first.get(key))}: the replicas "
                        f"of a node share its GPUs")
        count = int(first.get("gpus_per_node") or tp * len(jrs))
        if count < tp * len(jrs):
            what = (f"stage {j0} replica {r0} has gpus_per_node {count}, fewer than its TP degree {tp}"
                    if len(jrs) == 1 else f"node {name!r} (stages[i].replicas[j].node) holds {len(jrs)} replicas "
                    f"of {tp} GPUs, gpus_per_node = {count}")
            raise MeasuredRunError(f"{where}: {what}")
        nodes[name] = _Node(name, str(first["gpu_type"]), count, tuple(jrs), tp)
    return nodes


def _p2p_bandwidth(aggregate_fit: Mapping[str, Any], size: float, k: int, runtime: DeepSpeedRuntime) -> float:
    """A ``[[link]]`` between two stages' nodes for a boundary of ``size`` bytes (whole) sent by a TP group of
    ``k``: the aggregate curve at the message each rank sends (a k-th under DeepSpeed's partitioning, the whole
    tensor otherwise, then k copies), with the receiver's rebuild where TP partitions it (``stage_link_bandwidth``)."""
    partitioned = runtime.partitioned_transfers and k > 1
    aggregate = fitted_bandwidth(aggregate_fit, size / k if runtime.partitioned_transfers else size)
    bw = aggregate if runtime.partitioned_transfers else aggregate / k  # k copies of the whole tensor
    return stage_link_bandwidth(bw, runtime) if partitioned else bw


def _ring_step_bytes(profile: ModelProfile, layers: Sequence[int], tp: int, dp: int) -> float:
    """A ring step's message of a stage's gradient all-reduce: a rank's gradients as the runtime keeps them
    (``ModelProfile.gradient_wire``) / dp."""
    rank = tp_rank_profile(profile, tp)
    return sum(rank.layers[i].param_bytes for i in layers) * profile.gradient_wire / dp


def _intra_bandwidth(node: _Node, stages: Sequence[Mapping[str, Any]], profile: ModelProfile, mbs: int,
                     data: SailorData, runtime: DeepSpeedRuntime, plan_id: str) -> float:
    """A node's intra link: the intra-node curve of one pair of GPUs at the message that crosses it most often.

    A pipeline boundary inside the node (replica r of stages j and j + 1 on it): a rank's part of the boundary's
    activation, each of the k ranks on its own pair, with the receiver's rebuild where TP partitions it (one transfer
    of ``S / k`` bytes takes ``S / (k bw) + S / (2 rebuild)``). Else a stage with several replicas on it: a ring
    step of their gradient all-reduce. Else (a node of one TP group) a ring step of a block's TP all-reduce
    (``mbs s h e / tp``), which the measured layer times hold already.
    """
    fit = _intra_fit(data.network, node.gpu, plan_id)
    dp, tp = len(stages[0]["replicas"]), node.tp
    here = set(node.replicas)
    boundary = [j for j, r in node.replicas if (j + 1, r % dp) in here]
    if boundary:
        size = mbs * profile.layers[stages[boundary[0]]["layers"][-1]].output_bytes_per_sample
        pair = fitted_bandwidth(fit, size / tp)
        rebuild = 0.5 * tp / runtime.rebuild_bytes_per_s if tp > 1 and runtime.rebuild_bytes_per_s > 0 else 0.0
        return 1.0 / (1.0 / pair + rebuild)
    shared = [j for j, _ in node.replicas if sum(1 for i, _ in node.replicas if i == j) > 1]
    if shared:
        return fitted_bandwidth(fit, _ring_step_bytes(profile, stages[shared[0]]["layers"], tp, dp))
    seq, hidden = profile.seq_len or 0, int(_model(data, profile.name, plan_id)["dims"]["hidden_size"])
    return fitted_bandwidth(fit, mbs * seq * hidden * profile.bytes_per_element / tp)


def _nodes(nodes: Mapping[str, _Node], stages: Sequence[Mapping[str, Any]], profile: ModelProfile, mbs: int,
           data: SailorData, runtime: DeepSpeedRuntime, plan_id: str) -> list[dict[str, Any]]:
    """The cluster file's nodes: each with its GPUs of the GPU's catalog type and the memory the cluster had per
    GPU; its NIC the largest aggregate bandwidth its sending GPUs reached towards a node like it; its intra link
    (``_intra_bandwidth``)."""
    out = []
    for node in nodes.values():
        own = _inter_fit(data.network, (node.gpu, node.sending), (node.gpu, node.sending), plan_id)
        intra = _intra_bandwidth(node, stages, profile, mbs, data, runtime, plan_id)
        out.append({"name": node.name, "intra_link": {"bandwidth_bytes_per_s": intra},
                    "nic": {"bandwidth_bytes_per_s": float(own["max_bw_Bps"])},
                    "devices": [{"type": catalog_type(node.gpu), "count": node.gpus,
                                 "memory_bytes": _gpu_memory_bytes(data, node.gpu)}]})
    return out


def _links(nodes: Mapping[str, _Node], place: Mapping[tuple[int, int], str], stages: Sequence[Mapping[str, Any]],
           profile: ModelProfile, mbs: int, data: SailorData, runtime: DeepSpeedRuntime,
           plan_id: str) -> list[dict[str, Any]]:
    """The ``[[link]]``s between nodes, each the aggregate bandwidth of the nodes' sending GPUs at once (the curve of
    ``_Node.sending`` GPUs per node) at the message each GPU sends: a TP group's k ranks share it, each sending a k-th
    of what the group moves (``cluster.tp_cluster``, ``ModelProfile.sent_bytes_per_sample``); replicas on one node
    queue on its NIC (the simulator's ``NIC out`` / ``NIC in``).

    Between stages: a rank's part of a boundary's activation (or gradient), ``mbs`` x the whole / tp
    (``_p2p_bandwidth``). Among a stage's replicas: a ring step of a rank's gradients (``_ring_step_bytes``); the
    slower of the two directions. One link per pair of nodes: the first asked, pipeline boundaries (stage order)
    before all-reduces; replicas on one node take its intra link (``_intra_bandwidth``)."""
    dp = len(stages[0]["replicas"])
    links: dict[tuple[str, ...], dict[str, Any]] = {}

    def add(a: str, b: str, bw: float, latency_s: float) -> None:
        if a != b and tuple(sorted((a, b))) not in links:
            links[tuple(sorted((a, b)))] = {"nodes": [a, b], "bandwidth_bytes_per_s": bw, "latency_s": latency_s}

    def fit(a: str, b: str) -> Mapping[str, Any]:
        na, nb = nodes[a], nodes[b]
        return _inter_fit(data.network, (na.gpu, na.sending), (nb.gpu, nb.sending), plan_id)

    for j, s in enumerate(stages[:-1]):
        size = mbs * profile.layers[s["layers"][-1]].output_bytes_per_sample
        for r in range(dp):
            a, b = place[(j, r)], place[(j + 1, r % dp)]
            if a != b:
                add(a, b, _p2p_bandwidth(fit(a, b), size, nodes[a].tp, runtime), runtime.p2p_latency_s)
    for j, s in enumerate(stages):  # the gradient all-reduce: the tp ranks' rings run at once
        if dp < 2:
            continue
        step = _ring_step_bytes(profile, s["layers"], nodes[place[(j, 0)]].tp, dp)
        for r in range(dp):
            for q in range(r + 1, dp):
                a, b = place[(j, r)], place[(j, q)]
                if a != b:
                    bw = min(fitted_bandwidth(fit(a, b), step), fitted_bandwidth(fit(b, a), step))
                    add(a, b, bw if runtime.rings_share_nic else bw * nodes[a].tp, 0.0)
    return list(links.values())


def _one_degree(stages: Sequence[Mapping[str, Any]], plan_id: str) -> tuple[int, int]:
    """(dp, tp) of the plan's stages; MeasuredRunError where stages differ in either."""
    dps = {len(s["replicas"]) for s in stages}
    if len(dps) != 1:
        raise MeasuredRunError(f"plan {plan_id}: stages with different data-parallel degrees "
                               f"{[len(s['replicas']) for s in stages]}: a replica would serve two pipelines, "
                               f"which hetrain's virtual workers cannot express")
    tps = {int(r["tp"]) for s in stages for r in s["replicas"]}
    if len(tps) != 1:
        raise MeasuredRunError(f"plan {plan_id}: replicas of TP degrees {sorted(tps)}; one TP degree per plan")
    return dps.pop(), tps.pop()


def plan_precision(raw: Mapping[str, Any], where: str) -> str:
    """The precision a measured plan ran in: its ``precision`` (``fp32``, ``fp16``, ``bf16``, in any case), else a
    flag ``"fp16": true`` or ``"bf16": true``, else fp32 (the development set's runs).

    Raises:
        MeasuredRunError: an unknown precision, a flag that is not true or false, two that disagree; names
            ``where`` (the file and the plan), the field and the value.

    Example:
        >>> plan_precision({"fp16": True}, "plan x"), plan_precision({"precision": "BF16"}, "plan x")
        ('fp16', 'bf16')
    """
    flags = []
    for key in ("fp16", "bf16"):
        if key in raw and not isinstance(raw[key], bool):
            raise MeasuredRunError(f"{where}: field {key!r} = {show(raw[key])}: true or false")
        if raw.get(key):
            flags.append(key)
    if len(flags) > 1:
        raise MeasuredRunError(f"{where}: fields 'fp16' and 'bf16' are both true: one precision per run")
    value = raw.get("precision")
    if value is None:
        return flags[0] if flags else "fp32"
    name = value.lower() if isinstance(value, str) else ""
    if name not in PRECISION_BYTES:
        raise MeasuredRunError(f"{where}: field 'precision' = {show(value)}: one of {', '.join(PRECISION_BYTES)}")
    if flags and flags[0] != name:
        raise MeasuredRunError(f"{where}: field 'precision' = {show(value)}, but field {flags[0]!r} is true")
    return name


def convert_plan(raw: Mapping[str, Any], data: SailorData, runtime: DeepSpeedRuntime = DEEPSPEED) -> MeasuredPlan:
    """The hetrain plan of one measured plan of ``data`` (module docstring: the rule).

    Raises:
        MeasuredRunError: a plan hetrain cannot represent (stages with different data-parallel degrees,
            replicas of different TP degrees, a node shared by replicas of different GPUs), or data it needs
            missing from the files.
    """
    plan_id = str(raw.get("id", "?"))
    where = f"{Path(data.directory) / FILES[0]}: plan {plan_id}"
    stages = _field(raw, "stages", plan_id)
    mbs, m = int(_field(raw, "mbs", plan_id)), int(_field(raw, "num_microbatches", plan_id))
    dp, tp = _one_degree(stages, plan_id)
    precision = plan_precision(raw, where)
    nodes = _place(stages, tp, where)
    place = {jr: n.name for n in nodes.values() for jr in n.replicas}
    gpus = list(dict.fromkeys(str(r["gpu_type"]) for s in stages for r in s["replicas"]))
    model_name = str(_field(raw, "model", plan_id))
    profile, notes = _build_profile(data, model_name, tp, gpus, runtime, plan_id, precision, mbs)
    if sum(len(s["layers"]) for s in stages) != profile.num_layers:
        raise MeasuredRunError(f"plan {plan_id}: its stages hold {sum(len(s['layers']) for s in stages)} layers, "
                               f"the profile of {model_name} has {profile.num_layers}")
    cluster = parse_cluster({"name": str(raw.get("cluster", "measured")),
                             "node": _nodes(nodes, stages, profile, mbs, data, runtime, plan_id),
                             "link": _links(nodes, place, stages, profile, mbs, data, runtime, plan_id)})

    def stage(j: int, r: int, s: Mapping[str, Any]) -> Stage:
        node = nodes[place[(j, r)]]
        first = node.first_device((j, r))
        group = tuple(f"{node.name}:{first + g}" for g in range(tp)) if tp > 1 else ()
        return Stage(f"{node.name}:{first}", s["layers"][0], s["layers"][-1] + 1, tp_group=group)

    vws = tuple(VirtualWorker(tuple(stage(j, r, s) for j, s in enumerate(stages)), mbs * m, m) for r in range(dp))
    strategy = "dp" if len(stages) == 1 else "pp" if dp == 1 else "hybrid"
    plan = Plan(model_name, dp * mbs * m, "1f1b", "bsp", "adam", vws, Prediction(0.0, 0.0, 0.0, 0.0, 0.0),
                strategy, "measured", cluster, profile, options={"measured_run": plan_id},
                sync_options=runtime.sync_options())
    measured = _field(raw, "measured", plan_id)
    group = str(raw.get("group", ""))
    return MeasuredPlan(
        id=plan_id, group=group, plan=plan,
        measured_iter_time_s=float(measured.get("iter_time_s") or 0.0),
        measured_max_mem_bytes=float(measured.get("max_mem_bytes") or 0.0),
        usable_for_time=bool(raw.get("usable_for_time", True)) and float(measured.get("iter_time_s") or 0) > 0,
        memory_reliable=not group.startswith("superseded") and float(measured.get("max_mem_bytes") or 0) > 0,
        extrapolated=notes,
    )

"""Sharded state on a plan: its shards sized, its memory counted, and the shard mode chosen segment by segment.

The search prices sharding with every shared segment at one mode and an even share per owner
(``search._shares``). Once a plan is chosen, this module works on the plan alone (pure, no
simulator):

- ``size_shards``: each owner's shard of each sharded segment, by the memory its stage leaves free
  (Cephalo's rule) or by speed, and every stage's memory counted at its own shares;
- ``lighten_segments``: each segment at the lightest mode under which every stage still fits,
  since sharding is not free: an all-gather of the segment's weights after the step, on the
  critical path, and under ZeRO-2 the gradients of every backward but the last held whole anyway;
- ``reprice``: the closed form's optimizer step and sync of a plan whose shards changed.

``planner.search.plan_shards`` calls the last two after a sharded planning, and keeps the plan they
give where it is not slower (by the simulator where the planner simulates)::

    segment   owners                 ZeRO-1 for all      per segment
    [0, 2)    a:0 b:0 (16 GB each)   optimizer           optimizer            needs optimizer sharding
    [2, 24)   a:1 b:1 (80 GB each)   optimizer           none                 fits unsharded
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hetrain.cost import (
    estimate_device_memory,
    estimate_iteration_overhead,
    estimate_optimizer_time,
    estimate_shard_gather_time,
    estimate_stage_memory,
    in_flight,
    tensor_budget,
)
from hetrain.plan import DeviceMemory, Plan, PlanError
from hetrain.planner.sync import estimate_mode_sync_time, plan_layouts, plan_traffic
from hetrain.sync_layout import SHARD_MODES, Segment

#: why a segment keeps its mode (``options["shard_choice"]["segments"]``)
FITS_UNSHARDED = "fits unsharded"
ONE_OWNER = "one owner: nothing to shard"


#: stage memory already counted, by everything it depends on (``stage_memory``): the VWs of a large cluster repeat
#: a few stage shapes, and ``lighten_segments`` counts every stage several times per segment
Memo = dict[tuple[Any, ...], float]


def stage_memory(plan: Plan, device: str, share: float | None = None, memo: Memo | None = None) -> float:
    """Peak tensor bytes of ``device``'s stage at its shares of the plan's sharded segments
    (``Plan.shard_shares``; ``share``: at that share of each of them instead), as the search counts a stage."""
    v, j = plan.stage_of(device)
    vw = plan.virtual_workers[v]
    s = vw.stages[j]
    state_share, grad_share = plan.shard_shares(device, share)
    copies = plan.sync_options.reduce_copy if len(plan.virtual_workers) > 1 else 0.0
    n = in_flight(plan.schedule, vw.micro_batches, len(vw.stages), j)
    key = (id(plan.profile), plan.optimizer, s.first_layer, s.end_layer, s.recompute, vw.micro_batch_size, n,
           vw.micro_batches, copies, state_share, grad_share)
    if memo is not None and key in memo:
        return memo[key]
    need = estimate_stage_memory(plan.profile, s.first_layer, s.end_layer, s.recompute, vw.micro_batch_size, n,
                                 plan.optimizer, reduce_copy=copies, state_share=state_share, grad_share=grad_share,
                                 micro_batches=vw.micro_batches)
    if memo is not None:
        memo[key] = need
    return need


def with_memory(plan: Plan, memo: Memo | None = None) -> Plan:
    """``plan`` with each stage's memory, and each device's, counted at its own shares.

    Raises:
        PlanError: a stage that does not fit its device (``plan.validate_plan``).
    """
    vws, memory = [], []
    devices = {d.name: d for d in plan.cluster.devices}
    for vw in plan.virtual_workers:
        stages = []
        for s in vw.stages:
            mem = stage_memory(plan, s.device, memo=memo)
            stages.append(replace(s, predicted_memory_bytes=mem))
            d = devices[s.device]
            memory.append(DeviceMemory(s.device, estimate_device_memory(plan.profile, d, mem), d.memory_bytes))
        vws.append(replace(vw, stages=tuple(stages)))
    return replace(plan, virtual_workers=tuple(vws), prediction=replace(plan.prediction, memory=tuple(memory)))


def shard_weights(plan: Plan, memo: Memo | None = None) -> dict[str, float]:
    """Device -> what sizes its shards (``Plan.shard_weights``). By memory (Cephalo's rule), the tensor budget its
    stage leaves free of everything but its sharded state, over what the whole sharded state of its stage would
    take: the largest share it could hold alone, so that shares in proportion to the weights fit wherever any
    split of a segment among its owners fits. By speed (``shard_by``), its peak FLOP/s. A device whose stage is in
    no sharded segment has none (``shard_fractions`` would read it as 0)."""
    weights: dict[str, float] = {}
    devices = {d.name: d for d in plan.cluster.devices}
    for vw in plan.virtual_workers:
        for s in vw.stages:
            d = devices[s.device]
            if plan.shard_shares(d.name, 0.0)[0] >= 1.0:
                continue  # nothing of its stage is sharded: its weight would size no shard
            if plan.sync_options.shard_by == "speed":
                weights[d.name] = d.peak_flops(plan.profile.precision)
                continue
            other, whole = stage_memory(plan, d.name, 0.0, memo), stage_memory(plan, d.name, 1.0, memo)
            weights[d.name] = max(0.0, tensor_budget(plan.profile, d) - other) / max(whole - other, 1.0)
    return weights


def size_shards(plan: Plan, memo: Memo | None = None) -> Plan | None:
    """``plan`` with its shards sized (``shard_weights``) and each stage's memory counted at its own shares;
    where the uneven shards do not fit (a stage in several segments of unlike owners), even shares, which the
    search priced; None where neither fits. Unsharded: its memory counted."""
    if plan.sync_options.shard == SHARD_MODES[0]:
        try:
            return with_memory(replace(plan, shard_weights={}), memo)
        except PlanError:
            return None
    for weights in (shard_weights(plan, memo), {}):
        try:
            return with_memory(replace(plan, shard_weights=weights), memo)
        except PlanError:
            continue
    return None


def with_segment_shards(plan: Plan, modes: tuple[str, ...]) -> Plan:
    """``plan`` with segment s sharded as ``modes[s]``: the ``shard`` option the most of them, the per-segment
    modes recorded where its shared segments differ (``Plan.segment_shards``); memory and shards not sized."""
    segments = plan.segments()
    shared = {m for m, seg in zip(modes, segments, strict=True) if seg.shared}
    most = max(shared, key=SHARD_MODES.index, default=SHARD_MODES[0])
    options = replace(plan.sync_options, shard=most)
    return replace(plan, sync_options=options, segment_shards=modes if len(shared) > 1 else (),
                   shard_weights=plan.shard_weights if most != SHARD_MODES[0] else {})


def lighten_segments(plan: Plan) -> tuple[Plan, list[dict[str, Any]]]:
    """``plan`` (sized, ``size_shards``) with each shared segment at the lightest mode, none before optimizer
    before optimizer+gradients, under which every stage still fits its tensor budget (``cost.tensor_budget``, the
    search's check; a stage over it already may not grow), its shards sized anew each time; and per segment, its
    mode and why. Segments are taken in order, each with the ones after it still at the plan's modes."""
    modes = list(plan.layout.segment_shards)
    budget = {d.name: tensor_budget(plan.profile, d) for d in plan.cluster.devices}
    memo: Memo = {}
    rows: list[dict[str, Any]] = []
    for s, seg in enumerate(plan.segments()):
        row = segment_row(s, seg)
        rows.append(row)
        if not seg.shared:
            continue
        for mode in SHARD_MODES[:SHARD_MODES.index(seg.shard)]:
            trial = size_shards(with_segment_shards(plan, (*modes[:s], mode, *modes[s + 1:])), memo)
            if trial is not None and _fits(trial, plan, budget):
                plan, modes[s] = trial, mode
                break
        row["shard"] = modes[s]
        row["why"] = FITS_UNSHARDED if modes[s] == SHARD_MODES[0] else f"needs {modes[s]} sharding"
    return plan, rows


def segment_row(number: int, seg: Segment, why: str | None = None) -> dict[str, Any]:
    """Segment ``number``'s row of ``options["shard_choice"]["segments"]``: its layers and mode, and why it keeps
    that mode (one owner: nothing to shard; else ``why``, where given)."""
    row: dict[str, Any] = {"segment": number, "layers": [seg.first_layer, seg.end_layer], "shard": seg.shard}
    if not seg.shared:
        row["why"] = ONE_OWNER
    elif why is not None:
        row["why"] = why
    return row


def _fits(trial: Plan, before: Plan, budget: dict[str, float]) -> bool:
    """Whether every stage of ``trial`` fits its tensor budget, or (one over it already) holds no more than
    in ``before``."""
    had = {s.device: s.predicted_memory_bytes for vw in before.virtual_workers for s in vw.stages}
    return all(s.predicted_memory_bytes <= max(budget[s.device], had[s.device])
               for vw in trial.virtual_workers for s in vw.stages)


def reprice(plan: Plan) -> Plan:
    """``plan``'s prediction with its optimizer step and sync priced anew at its shards (closed forms): each
    device steps its share of its stage's state and then all-gathers its sharded segments' weights
    (``cost.estimate_shard_gather_time``), and each segment's gradients travel at its own mode's wire bytes
    (a sharded one's reduce-scatter, half an all-reduce's). The pipeline is the plan's: its stages do not change.
    Its simulated time, which the shards change, is dropped."""
    cluster, profile = plan.cluster, plan.profile
    index = {d.name: d.index for d in cluster.devices}
    gather: dict[str, float] = {}
    for seg in plan.segments():
        if seg.sharded:
            t = estimate_shard_gather_time(cluster, [index[o] for o in seg.owners], seg.param_bytes)
            for o in seg.owners:
                gather[o] = gather.get(o, 0.0) + t
    optimizer_s = 0.0
    for vw in plan.virtual_workers:
        for s in vw.stages:
            d = cluster.devices[index[s.device]]
            param_bytes = sum(profile.layers[i].param_bytes for i in s.layers)
            optimizer_s = max(optimizer_s, estimate_optimizer_time(
                plan.shard_shares(s.device)[0] * param_bytes, profile.bytes_per_element, d, plan.optimizer, profile)
                + estimate_iteration_overhead(profile, d) + gather.get(s.device, 0.0))
    pr = plan.prediction
    compute_s = pr.pipeline_s + optimizer_s
    hide = {index[s.device]: s.predicted_backward_s for vw in plan.virtual_workers for s in vw.stages}
    sync_s = estimate_mode_sync_time(cluster, profile, plan_layouts(plan), plan.sync, plan.sync_options, compute_s,
                                     hide, plan_traffic(plan), plan.layout.segment_shards)
    iteration_s = compute_s + sync_s
    # time to accuracy: the samples it takes (the global batch's, unchanged) over the samples per second
    tta = None if pr.time_to_accuracy_s is None else pr.time_to_accuracy_s * iteration_s / pr.iteration_s
    prediction = replace(pr, iteration_s=iteration_s, samples_per_s=plan.global_batch / iteration_s, sync_s=sync_s,
                         optimizer_s=optimizer_s, simulated_iteration_s=None, time_to_accuracy_s=tta)
    options = dict(plan.options)
    predictions = options.get("sync_predictions")
    if isinstance(predictions, dict) and plan.sync in predictions:
        options["sync_predictions"] = {**predictions, plan.sync: {
            "sync_s": sync_s, "iteration_s": iteration_s, "samples_per_s": plan.global_batch / iteration_s}}
    return replace(plan, prediction=prediction, options=options)

"""Hand-built plans to compare hetrain's plan against: the even-split pipeline and even data parallelism.

A user without a planner splits things evenly: the layers over the devices of one pipeline,
or the global batch over data-parallel replicas. These plans model that, with the same cost
model as the planner's (stage times from ``cost``); a hand-built plan has no closed form, so its
predicted figures come from ``predict``, which the caller hands in (the simulator's
``with_simulated_prediction``: the planner imports no simulator)::

    even_split_plan   one VW over every device, layers [0, n) cut into p near-equal stages
    even_dp_plan      one VW per device, the global batch cut into near-equal mini-batches
                      (what torch's DistributedDataParallel does), one flat all-reduce ring

Both start from a plan the planner made (``strategy="pp"`` or ``"dp"``) and take its cluster,
profile, options, micro-batching and schedule (the even split a schedule torch has: ``torch_schedule``).
``torch_pipelining_micro_batches`` and ``torch_schedule`` say how many micro-batches and which schedule
torch.distributed.pipelining runs for an even-split plan.

Pure Python, no torch.

Example:
    >>> from hetrain.planner import plan                                        # doctest: +SKIP
    >>> even = even_split_plan(plan(cluster, profile, 32, strategy="pp"), with_simulated_prediction)  # doctest: +SKIP
    >>> [(s.first_layer, s.end_layer) for s in even.virtual_workers[0].stages]  # doctest: +SKIP
    [(0, 2), (2, 4), (4, 5), (5, 6)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hetrain.cost import estimate_action_overhead, estimate_layer_times
from hetrain.data.sharding import split_evenly
from hetrain.plan import Plan, Schedule, Stage, VirtualWorker

#: a plan with its predicted figures filled in (``simulator.with_simulated_prediction``)
Predict = Callable[[Plan], Plan]


def _stage(base: Plan, device_name: str, first: int, end: int, b: int) -> Stage:
    """Layers ``[first, end)`` on ``device_name`` at micro-batch ``b``, with the cost model's forward and
    backward times (the layers' and the overhead per action)."""
    device = base.cluster.device(device_name)
    fwd, bwd = estimate_layer_times(base.profile, device, b)
    o = estimate_action_overhead(base.profile, device)
    return Stage(device_name, first, end, predicted_forward_s=float(fwd[first:end].sum()) + o,
                 predicted_backward_s=float(bwd[first:end].sum()) + o)


def even_split_plan(base: Plan, predict: Predict, device_order: Sequence[str] | None = None) -> Plan:
    """One VW over all devices (cluster order), layers split as evenly as possible, earlier stages
    taking the extra layers; micro-batching and schedule from ``base`` (a ``strategy="pp"`` plan), the
    schedule one that torch.distributed.pipelining has (1F1B for ``base``'s 1F1B-eager): the pipeline a user
    would write by hand, and the one the torch baseline runs.

    With more devices than layers, the first ``n`` devices hold one layer each and the rest are unused.
    """
    devices = list(device_order or [d.name for d in base.cluster.devices])
    n, p = base.profile.num_layers, len(devices)
    p = min(p, n)
    q, r = divmod(n, p)
    m = max(vw.micro_batches for vw in base.virtual_workers)
    b = -(-base.global_batch // min(m, base.global_batch))  # the largest micro-batch
    stages, first = [], 0
    for j, dev in enumerate(devices[:p]):
        end = first + q + (1 if j < r else 0)
        stages.append(_stage(base, dev, first, end, b))
        first = end
    vw = VirtualWorker(tuple(stages), base.global_batch, min(m, base.global_batch))
    draft = replace(base, virtual_workers=(vw,), strategy="pp", formation="even-split",
                    schedule=torch_schedule(base.schedule), segment_shards=(),  # other stages, other segments
                    prediction=replace(base.prediction, memory=()))
    return predict(draft)


def even_dp_plan(base: Plan, predict: Predict) -> Plan:
    """DistributedDataParallel as hetrain models it: one replica per device of ``base`` (a ``strategy="dp"``
    plan), the global batch split evenly (a DDP user does not weigh the devices), all-reduce every step,
    over one flat ring of every device (sync option ``allreduce = "ring"``: DDP has no hierarchical scheme)."""
    devices = [d.name for d in base.cluster.devices]
    n = base.profile.num_layers
    vws = []
    for dev, share in zip(devices, split_evenly(base.global_batch, len(devices)), strict=True):
        vws.append(VirtualWorker((_stage(base, dev, 0, n, share),), share, 1))
    draft = replace(base, virtual_workers=tuple(vws), strategy="dp", formation="even-batch", segment_shards=(),
                    prediction=replace(base.prediction, memory=()),
                    sync_options=replace(base.sync_options, allreduce="ring"))  # DDP's flat ring, never hierarchical
    return predict(draft)


def torch_schedule(schedule: str) -> Schedule:
    """The torch.distributed.pipelining schedule closest to hetrain's ``schedule``: the same order, or 1F1B
    for 1F1B-eager (torch has no schedule with more warm-up forwards). ``hetrain.baselines``' names."""
    return "gpipe" if schedule == "gpipe" else "1f1b"


def torch_pipelining_micro_batches(plan: Plan) -> int:
    """The micro-batch count of ``plan``'s one VW, lowered to a divisor of the global batch
    (torch.distributed.pipelining cuts the batch into equal micro-batches)."""
    m = plan.virtual_workers[0].micro_batches
    while plan.global_batch % m:
        m -= 1
    return m

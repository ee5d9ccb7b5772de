"""Schedules as data: the Actions every device runs in one iteration.

A schedule is generated once from a Plan (DESIGN.md decision 2) and consumed,
unchanged, by the validator, the simulator and the runtime. Its language is
small: ``1F0`` is the forward of micro-batch 0 on stage 1, ``1B3`` a backward,
``SEND_F 1->2 mb0 to n0:2`` ships stage 1's activation of micro-batch 0 to the
device of stage 2, ``RECV_B 2->1 mb3 from n0:2`` waits for a gradient,
``ALLREDUCE_START seg2 bucket0`` posts the all-reduce of the gradients of the
first bucket (the last layers) of ``Plan.segments()[2]`` among the segment's
owners, ``ALLREDUCE_WAIT seg2 bucket0`` waits for it, ``STEP`` runs the
optimizer. Each form is one small class holding the fields its kinds need:
``Compute`` (F, B), ``Transfer`` (the sends and receives), ``SegmentSync`` (a
segment's ALLREDUCE, AVERAGE, PUSH...), ``BucketSync`` (ALLREDUCE_START,
ALLREDUCE_WAIT) and ``Step``; ``Action`` is their union, narrowed with
``match``. 1F1B with p = 2 stages and m = 3
micro-batches, as ``format_grid`` prints it::

    step | n0:0                      | n0:1
    -----+---------------------------+---------------------------
       0 | 0F0                       | RECV_F 0->1 mb0 from n0:0
       1 | SEND_F 0->1 mb0 to n0:1   | 1F0
       2 | 0F1                       | 1B0
       3 | SEND_F 0->1 mb1 to n0:1   | SEND_B 1->0 mb0 to n0:0
       4 | RECV_B 1->0 mb0 from n0:1 | RECV_F 0->1 mb1 from n0:0
       5 | 0B0                       | 1F1
       ...
      12 | STEP                      | STEP

Semantics (what the validator checks, the simulator times and the runtime must
do): a SEND is posted and does not hold the device (an ``isend`` whose handle
is waited on before the optimizer step); a RECV holds the device until the data
has arrived; an ALLREDUCE holds every owner of its segment until all of them
reach it and the collective completes.

Under ``bsp`` each segment is cut into gradient buckets (``SyncLayout``'s buckets: runs
of layers of about ``bucket_bytes``, the first one smaller, in reverse layer
order, as PyTorch's DistributedDataParallel buckets its gradients). The
``ALLREDUCE_START`` of every bucket follows the device's last backward: the
bucket's all-reduce starts *during* that backward, as soon as it has computed
the bucket's gradients (they are final then), and runs while the backward goes
on through the earlier layers; it does not hold the device. The
``ALLREDUCE_WAIT`` actions before STEP hold the device until their all-reduces
are done (one device of pure data parallelism, two buckets)::

    ... 0B2  ALLREDUCE_START seg0 bucket0  ALLREDUCE_START seg0 bucket1
        ALLREDUCE_WAIT seg0 bucket0  ALLREDUCE_WAIT seg0 bucket1  STEP

                     0B2, the last backward       WAITs       STEP
    device  |=========|=========|=========|...............|=====|
    link              |bucket0 all-reduce |bucket1 all-red|
                      ^ bucket 0's gradients are final here

Every device starts its buckets in decreasing segment order and, within a
segment, from the last layers to the first (the order their gradients become
final); the validator checks that the owners of each set of segments start
theirs in the same order, since collectives of one process group must be issued
in one order on all its members.

Example:
    >>> schedule = build_schedule(plan)            # doctest: +SKIP
    >>> validate(schedule, plan)                   # doctest: +SKIP
    >>> print(format_grid(schedule))               # doctest: +SKIP

The package, one job a module, each importing only the ones above it::

    actions.py    ActionKind, the Action classes, their text (parse_action), Schedule
    sync.py       SyncState and the sync actions that end an iteration, by mode
    templates.py  ScheduleTemplates: each distinct list of Actions once, peers filled in per device
    generate.py   gpipe, one_f_one_b, one_f_one_b_eager, add_p2p, build_schedule, build_schedule_templates
    roles.py      where each device sits in the plan (the validator's view)
    grid.py       format_grid, and the ScheduleError that shows it
    interpret.py  the validator's abstract execution: waits and deadlocks
    validator.py  validate: the static checks, then interpret
"""

from hetrain.schedule.actions import (
    BUCKET_KINDS,
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    COUNTERPART,
    P2P_KINDS,
    SEGMENT_KINDS,
    Action,
    ActionKind,
    BucketSync,
    Compute,
    Schedule,
    ScheduleError,
    SegmentSync,
    Step,
    Transfer,
    parse_action,
    parse_schedule,
    schedule_to_dict,
)
from hetrain.schedule.generate import (
    GENERATORS,
    add_p2p,
    build_schedule,
    build_schedule_templates,
    gpipe,
    one_f_one_b,
    one_f_one_b_eager,
)
from hetrain.schedule.grid import ERROR_MARK, format_grid
from hetrain.schedule.sync import (
    SyncState,
    add_bsp_sync,
    advance_sync_state,
    build_sync_actions,
    initial_sync_state,
    is_daso_blocking,
    is_global_sync,
    owned_segments,
    steady_sync_state,
)
from hetrain.schedule.templates import DeviceRole, ScheduleTemplates, fill_peers
from hetrain.schedule.validator import validate

__all__ = [
    "BUCKET_KINDS", "COLLECTIVE_KINDS", "COMPUTE_KINDS", "COUNTERPART", "ERROR_MARK", "GENERATORS", "P2P_KINDS",
    "SEGMENT_KINDS", "Action", "ActionKind", "BucketSync", "Compute", "DeviceRole", "Schedule", "ScheduleError",
    "ScheduleTemplates", "SegmentSync", "Step", "SyncState", "Transfer", "add_bsp_sync", "add_p2p",
    "advance_sync_state", "build_schedule", "build_schedule_templates", "build_sync_actions", "fill_peers",
    "format_grid", "gpipe", "initial_sync_state", "is_daso_blocking", "is_global_sync",
    "one_f_one_b", "one_f_one_b_eager", "owned_segments", "parse_action", "parse_schedule", "schedule_to_dict",
    "steady_sync_state", "validate",
]

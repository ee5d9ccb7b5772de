"""Discrete-event replay of a schedule, with durations from cost.py and link contention.

The simulator runs every device's Actions (``hetrain.schedule``) in global time
order. Durations come from the one cost model (DESIGN.md decision 4); what the
closed forms cannot see comes from the replay: the exact action order, transfers
queueing on shared links, all-reduces of different segments contending for NICs,
and sync of one segment overlapping the backward passes still running elsewhere.

What each action costs:

- ``jFi`` / ``jBi``: the stage's layer times at micro-batch i's size
  (``estimate_layer_times``) plus the device's overhead per action
  (``estimate_action_overhead``); a backward also re-runs the forward of the
  recompute set.
- ``SEND_F`` / ``SEND_B``: ``estimate_p2p_time`` of ``b_i x`` the output bytes per
  sample of the layer before the stage boundary (activation forward, its gradient
  of the same size backward). The sender does not wait (the runtime posts an
  ``isend``); the transfer starts when its link resources are free and the
  receiver's ``RECV`` holds it until the data has arrived. Under the sync option
  ``transfers=blocking`` (a runtime whose sends and receives are on the critical
  path, as DeepSpeed's PipelineEngine) the sender is held until its transfer
  ends, and the receiver for the transfer's duration from when it reaches its
  ``RECV`` (or from the transfer's start, if later):
  ``cost.estimate_blocking_pipeline_time`` is the closed form.
- ``ALLREDUCE segN``: when every owner of the segment has reached it,
  ``estimate_allreduce`` of the segment's gradient bytes, run as phases over the
  link resources it crosses: a flat ring as reduce-scatter then all-gather over
  its ring's links; the hierarchical scheme as intra-node reduce-scatter,
  inter-node all-reduce over the NICs, intra-node all-gather.
- ``ALLREDUCE_START segN bucketK`` (after a backward): the same, for the bucket's
  gradient bytes, started once every owner's backward has computed the bucket's
  gradients: on each owner, at the backward's start plus the backward time of the
  stage's layers from its last down to the bucket's first (with the recomputed
  forwards among them). The device does not wait: its backward goes on while the
  bucket's phases occupy the links. ``ALLREDUCE_WAIT segN bucketK`` holds the
  device until that all-reduce has ended; the time held counts as sync.
- ``STEP``: ``estimate_optimizer_time`` of the stage's parameters, plus the
  profile's fixed cost per iteration (``estimate_iteration_overhead``).

Link resources and contention::

    same node:    n0:0 ──(resource "n0:0->n0:1")──► n0:1        one per ordered pair
    across nodes: a:0 ──► ("a NIC out") ═══ network ═══ ("b NIC in") ──► b:1

A resource carries one transfer at a time, in the order transfers ask for it
(FIFO; each transfer gets the link's full bandwidth). We chose this over fair
bandwidth sharing because (1) it is what the runtime does: NCCL and Gloo run
the operations of one communicator in issue order, and a NIC's queue pairs
drain largely in order; (2) for the equal-sized, in-order messages of a
pipeline it finishes the last message at the same time as sharing would and
the first ones earlier, which is when their receivers need them; (3) a
transfer's end is known when it starts, so one event per transfer suffices,
where sharing would re-time every active transfer at each start and end. All
transfers leaving one node share its NIC out, all entering it share its NIC in
(full duplex).

Memory: weights, gradients and optimizer state from t = 0; a micro-batch's kept
activations are added when its forward ends and freed when its backward ends;
the largest recomputed layer's activations reappear during each backward, and
the optimizer step's transient lasts for the step. Figures come from
``estimate_stage_memory``, so the simulated peak equals the closed form with
``in_flight`` for the schedule.

The package, one job per module::

    compile.py   Actions -> timed operations (ops.py), link resources (links.py), collectives; from the
                 schedule's templates (``ScheduleTemplates``): a template's operations worked out once per
                 stage costs, each device's own (its transfers, its sync) filled in
    engine.py    the event queue: named event kinds, one handler per event kind and per operation
                 (the reference replay: ``simulate(plan, reference=True)``)
    fast_engine.py  the same replay, event for event, with forward, backward, send and receive
                 inlined in one loop: what ``simulate`` runs (tests/test_simulator_fast.py)
    result.py    SimResult, DeviceStats, the summary table
    replay.py    simulate(): schedule templates (build_schedule_templates_of) -> compile -> engine -> result;
                 with_simulated_prediction() for a hand-built plan

Example:
    >>> result = simulate(load_plan("plan.json"))        # doctest: +SKIP
    >>> print(result.summary())                          # doctest: +SKIP
"""

from hetrain.simulator.replay import (
    ASYNC_ITERATIONS,
    build_schedules,
    simulate,
    simulated_iterations,
    with_simulated_prediction,
)
from hetrain.simulator.result import DeviceStats, SimResult

__all__ = ["ASYNC_ITERATIONS", "DeviceStats", "SimResult", "build_schedules", "simulate", "simulated_iterations",
           "with_simulated_prediction"]

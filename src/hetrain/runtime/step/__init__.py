"""One step of training on one rank: its Actions, its micro-batches, and what runs before the optimizer step.

- ``executor``: one rank's Actions of an iteration (F/B, SEND/RECV, sync, STEP), as ``hetrain.schedule`` generates them.
- ``actions``: which Actions each iteration runs: the sync state, advanced as the simulator does (``StepActions``).
- ``p2p``: activations and gradients between neighbouring stages.
- ``batches``: global batches, the same on every rank, and this VW's micro-batches of them.
- ``losses``: the steps' losses summed over the used ranks, in batches, asynchronously.
- ``hooks``: the pre-step hooks, in one ordered list (``build_pre_step_hooks``): ``tied`` (tied gradients summed),
  ``loss_scale`` (fp16 unscaled, a step skipped on overflow), ``clip`` (global-norm clipping).
- ``record``: ``StepRecord``, what one step produced, and its metrics row.
- ``lr_schedule``: the learning rate of each step (pure Python).
- ``evaluate``: validation loss, forward only, through the first VW's pipeline.
"""

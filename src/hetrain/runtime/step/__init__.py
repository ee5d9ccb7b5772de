"""One step of training on one rank: its Actions, its micro-batches, and what runs before the optimizer step.

- ``executor``: one rank's Actions of an iteration (F/B, SEND/RECV, sync, STEP), as ``hetrain.schedule`` generates them.
- ``p2p``: activations and gradients between neighbouring stages.
- ``batches``: global batches, the same on every rank, and this VW's micro-batches of them.
- ``losses``: the steps' losses summed over the used ranks, in batches, asynchronously.
- ``tied``, ``loss_scale``, ``clip``: the pre-step hooks (tied gradients summed, fp16 unscaled, global-norm clipping).
- ``lr_schedule``: the learning rate of each step (pure Python).
- ``evaluate``: validation loss, forward only, through the first VW's pipeline.
"""

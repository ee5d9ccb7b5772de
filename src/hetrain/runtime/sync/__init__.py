"""Data-parallel synchronisation across VWs, as the plan's sync layout and mode decide it.

- ``allreduce``: each segment's gradients all-reduced among its owners (``bsp``, and every mode's node-local part).
- ``modes``: the relaxed modes: parameter-server PUSH / PULL, AVERAGE, LOCAL_ALLREDUCE.
- ``daso``: DASO's adaptive period k: the loss sent with its averages, k in the sync state and in checkpoints.
"""

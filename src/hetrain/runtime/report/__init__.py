"""What a run reports.

- ``metrics``: the measured Timeline, metrics as JSONL, TensorBoard scalars, the progress bar.
"""

"""Measured runs of other runtimes, turned into hetrain plans (docs/measured-runs.md).

``sailor``: the measured-plan, profile and network-fit files of the Sailor project's artifact
(Megatron-DeepSpeed runs on real GPU clusters), converted by one documented rule.
"""

"""The figures every analytic profile shares (``models.analytic``, ``models.hf_analytic``): bytes per element and
parameter, and the fraction of the roofline a transformer reaches. Pure Python, no torch."""

from __future__ import annotations

from hetrain.profile import PRECISIONS

INT64_BYTES = 8
MASK_BYTES = 1  # torch stores dropout masks as bool: 1 byte per element
PARAM_BYTES = 4  # bytes of one parameter (and of its gradient) as training keeps it: fp32

# Fraction of the roofline peak a layer reaches when its time is estimated.
# Transformers: large GEMMs; Megatron-LM reaches 44-52% of A100 peak end to end on
# GPT models of 1.7B-1T parameters (Narayanan et al. 2021, table 1), so 0.45.
TRANSFORMER_EFFICIENCY = 0.45


def _bytes_per_element(precision: str) -> int:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return 4 if precision == "fp32" else 2


def _check_efficiency(compute_efficiency: float) -> None:
    if not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency must be in (0, 1], got {compute_efficiency!r}")

"""Mixed precision as hetrain trains it: one rule for the profiler, the runtime and the memory model.

The plan's precision (``ModelProfile.precision``: ``fp32``, ``bf16`` or ``fp16``) is the precision
of compute. Whatever it is, the parameters, their gradients and the optimizer state stay in fp32:
the parameters *are* the fp32 master weights (Micikevicius et al., "Mixed precision training",
ICLR 2018). Under ``bf16`` or ``fp16``::

    forward     under torch.autocast(dtype): matmuls and convolutions in 16 bits, the
                numerically sensitive ops (softmax, norms, losses) in fp32, as torch's AMP lists say;
                each parameter is cast once per iteration (autocast's cache, kept for the
                iteration): the stage holds a 16-bit copy of its weights while activations live
    backward    autocast off (backward ops run in the dtype of their forward)
    between     floating fp32 activations and their gradients travel in the compute dtype
    stages      (half the bytes on a slow link) and are turned back into fp32 on arrival
    gradients   fp32, summed in fp32 across VWs
    step        fp32 optimizer on fp32 weights
    fp16 only   a dynamic loss scale (``LossScaler``): the backward starts from loss * S; before the
                step the gradients are divided by S and every rank agrees whether one is inf or
                NaN; if one is, the step is skipped and S halves; after ``growth_interval`` good
                steps S doubles

The memory model counts the same (``cost.estimate_weight_memory``): 4 bytes per parameter of
weights, 4 of gradients, the optimizer's fp32 state, and under 16-bit compute the 2-byte copy.

fp16 needs a GPU: the CPU has no fast fp16 kernels, and hetrain refuses it there. bf16 runs
everywhere (slowly on a CPU, and on GPUs before Ampere, which have no bf16 units).

Example:
    >>> import torch
    >>> with autocast(torch.device("cpu"), "bf16"):
    ...     y = torch.nn.Linear(4, 4)(torch.ones(2, 4))
    >>> y.dtype
    torch.bfloat16
    >>> to_wire(torch.ones(2), "bf16").dtype, from_wire(torch.ones(2, dtype=torch.bfloat16)).dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from hetrain.errors import InputError
from hetrain.profile import PRECISIONS, Precision

COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device_type: str, where: str = "the plan") -> None:
    """Refuse a precision that is not known, or fp16 on a CPU.

    Raises:
        InputError: naming ``where`` the precision came from.
    """
    if precision not in PRECISIONS:
        raise InputError(f"{where}: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device_type == "cpu":
        raise InputError(f"{where}: precision fp16 is not supported on a CPU (no fast fp16 kernels, and loss "
                         "scaling is only worth it on a GPU); use bf16 or fp32 there, or run on CUDA devices")


def is_mixed(precision: str) -> bool:
    """Whether compute runs in 16 bits (under autocast) rather than fp32."""
    return precision != "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's context: ``torch.autocast`` in the compute dtype, or nothing under fp32.

    Entered once around an iteration, its cache keeps one 16-bit copy of each weight for the
    whole iteration (``clear_cast_cache`` after anything that changes the weights).
    """
    if not is_mixed(precision):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def no_autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The backward's context: autocast off (its cache stays, the outer context still holds it)."""
    if not is_mixed(precision):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def clear_cast_cache(precision: str) -> None:
    """Drop autocast's 16-bit weight copies (the weights changed: an optimizer step, an average, a pull)."""
    if is_mixed(precision):
        torch.clear_autocast_cache()


def wire_dtype(precision: str) -> torch.dtype | None:
    """The dtype floating fp32 activations and gradients travel in between stages; None: as they are."""
    return COMPUTE_DTYPES[precision] if is_mixed(precision) else None


def to_wire(t: torch.Tensor, precision: str) -> torch.Tensor:
    """``t`` as it is sent between stages: an fp32 tensor in the compute dtype, any other as it is."""
    wire = wire_dtype(precision)
    if wire is None or t.dtype != torch.float32:
        return t
    return t.to(wire)


def from_wire(t: torch.Tensor) -> torch.Tensor:
    """A received 16-bit floating tensor back in fp32 (the stage computes on fp32 activations)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t


class LossScaler:
    """fp16's dynamic loss scale: the same on every rank, since every rank sees the same overflow verdict.

    Args:
        init_scale: the first scale (2^16, as torch's ``GradScaler``).
        growth_factor: the scale's factor after ``growth_interval`` steps without overflow.
        backoff_factor: its factor after a step with an overflow (that step is skipped).
        growth_interval: good steps in a row before the scale grows.

    Example:
        >>> s = LossScaler(init_scale=8.0, growth_interval=2)
        >>> s.update(found_inf=True), s.scale
        (False, 4.0)
        >>> s.update(found_inf=False), s.update(found_inf=False), s.scale
        (True, True, 8.0)
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"loss scaler: init_scale {init_scale} > 0, growth_factor {growth_factor} > 1, "
                             f"0 < backoff_factor {backoff_factor} < 1 and growth_interval {growth_interval} >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0  # steps skipped for an overflow, over the run

    def update(self, found_inf: bool) -> bool:
        """Move the scale after a step's verdict; return whether the step is taken."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))


__all__ = ["COMPUTE_DTYPES", "LossScaler", "Precision", "autocast", "check_precision", "clear_cast_cache",
           "from_wire", "is_mixed", "no_autocast", "to_wire", "wire_dtype"]

"""argparse types that refuse bad numbers with the value and the limit named (the ``hetrain`` commands').

Example:
    >>> int_between(1, 8, "MAX_X")("9")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 9 is more than the limit of 8 (MAX_X)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from hetrain.fields import MAX_MICRO_BATCH


def int_between(least: int, most: int, limit_name: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``[least, most]``; ``limit_name`` names ``most`` (``MAX_STEPS``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
        if value > most:
            raise argparse.ArgumentTypeError(
                f"{value} is more than the limit of {most}" + (f" ({limit_name})" if limit_name else ""))
        return value
    return parse


def number_at_least(least: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= least`` (``> least`` when not ``inclusive``)."""
    sign = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {sign} {least:g}, got {text!r}") from None
        if not math.isfinite(value) or value < least or (not inclusive and value == least):
            raise argparse.ArgumentTypeError(f"expected a finite number {sign} {least:g}, got {text!r}")
        return value
    return parse


def micro_batch_sizes(text: str) -> list[int]:
    """An argparse type: ``"1,2,4"`` -> ``[1, 2, 4]``, each at least 1 and at most ``MAX_MICRO_BATCH``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    big = [v for v in values if v > MAX_MICRO_BATCH]
    if big:
        raise argparse.ArgumentTypeError(f"{big[0]} is more than the limit of {MAX_MICRO_BATCH} (MAX_MICRO_BATCH)")
    return values


def module_names(text: str) -> tuple[str, ...]:
    """An argparse type: ``"model.layers.0,model.layers.4"`` -> its module names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no module; give NAME,... (e.g. model.layers.4)")
    return names

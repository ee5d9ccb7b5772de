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

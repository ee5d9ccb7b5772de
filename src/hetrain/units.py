"""Parse human units at the edge ("10Gbit/s", "24GB", "2us") into plain SI numbers.

Inside hetrain every quantity is a float in SI base units with the unit in the
name (DESIGN.md decision 5): ``memory_bytes``, ``bandwidth_bytes_per_s``,
``latency_s``, ``peak_flops`` (FLOP/s). This module is the only place that
reads unit suffixes.

Example:
    >>> parse_bandwidth("10Gbit/s")
    1250000000.0
    >>> parse_bytes("16GiB")
    17179869184.0
"""

from __future__ import annotations

import re
from decimal import Decimal

from hetrain.errors import InputError

_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*$")

_BYTE_UNITS: dict[str, float] = {
    "B": 1.0,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}

# Bandwidth: bytes per second or bits per second, decimal prefixes as vendors quote them.
_BANDWIDTH_UNITS: dict[str, float] = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
    "bit/s": 1 / 8, "Kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "bps": 1 / 8, "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8,
}

_TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_FLOPS_UNITS: dict[str, float] = {
    "FLOPS": 1.0, "GFLOPS": 1e9, "TFLOPS": 1e12, "PFLOPS": 1e15,
    "FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15,
}


class UnitError(InputError):
    """A quantity with a missing, unknown or out-of-range unit."""


def _parse(text: str | float | int, units: dict[str, float], what: str, field: str) -> float:
    if isinstance(text, bool):
        raise UnitError(f"{field}: expected a {what} such as {_example(units)}, got {text!r}")
    if isinstance(text, (int, float)):
        raise UnitError(
            f"{field}: {text!r} has no unit; write it with one, for example {_example(units)}"
        )
    match = _NUMBER.match(str(text))
    if match is None:
        raise UnitError(f"{field}: cannot read {text!r} as a {what}; write for example {_example(units)}")
    value_text, unit = match.groups()
    if unit == "":
        raise UnitError(
            f"{field}: {text!r} has no unit; write it with one, for example {_example(units)}"
        )
    scale = units.get(unit)
    if scale is None:
        known = ", ".join(units)
        raise UnitError(f"{field}: unknown unit {unit!r} in {text!r}; known units: {known}")
    value = float(value_text)
    if value < 0:
        raise UnitError(f"{field}: {text!r} is negative; a {what} must be >= 0")
    # Decimal arithmetic so that '50us' is exactly 5e-05, not 4.9999999999999996e-05.
    return float(Decimal(value_text) * Decimal(repr(scale)))


def _example(units: dict[str, float]) -> str:
    if "Gbit/s" in units:
        return "'10Gbit/s' or '300GB/s'"
    if "GiB" in units:
        return "'16GB' or '16GiB'"
    if "ms" in units:
        return "'10us' or '2ms'"
    return "'19.5TFLOPS'"


def parse_bytes(text: str | float | int, field: str = "size") -> float:
    """'24GB' -> 24e9, '16GiB' -> 17179869184.0."""
    return _parse(text, _BYTE_UNITS, "size in bytes", field)


def parse_bandwidth(text: str | float | int, field: str = "bandwidth") -> float:
    """'10Gbit/s' -> 1.25e9 bytes/s, '300GB/s' -> 3e11 bytes/s."""
    return _parse(text, _BANDWIDTH_UNITS, "bandwidth", field)


def parse_time(text: str | float | int, field: str = "time") -> float:
    """'2us' -> 2e-6 s, '1.5ms' -> 1.5e-3 s."""
    return _parse(text, _TIME_UNITS, "time", field)


def parse_flops(text: str | float | int, field: str = "rate") -> float:
    """'19.5TFLOPS' -> 1.95e13 FLOP/s."""
    return _parse(text, _FLOPS_UNITS, "compute rate", field)


def format_bytes(n: float) -> str:
    """Human form of a byte count in decimal units: 9.1e9 -> '9.1 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_bandwidth(bytes_per_s: float) -> str:
    """Human form of a bandwidth in bits per second: 1.25e9 -> '10 Gbit/s'."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("Kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def format_time(seconds: float) -> str:
    """Human form of a duration: 0.0123 -> '12.3 ms'."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"

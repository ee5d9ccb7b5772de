"""Unit parsing at the edge: human strings in, plain SI numbers out."""

from __future__ import annotations

import pytest

from hetrain.units import (
    UnitError,
    format_bandwidth,
    format_bytes,
    format_time,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    parse_time,
)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("10Gbit/s", 1.25e9),
        ("10 Gbit/s", 1.25e9),
        ("56Gbit/s", 7e9),
        ("100Mbit/s", 12.5e6),
        ("1Tbit/s", 125e9),
        ("10Gbps", 1.25e9),
        ("300GB/s", 3e11),
        ("15.75GB/s", 15.75e9),
        ("1GiB/s", 2.0**30),
        ("512MB/s", 512e6),
        ("8bit/s", 1.0),
        ("2.5e1Gbit/s", 25e9 / 8),
    ],
)
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("24GB", 24e9),
        ("16GiB", 16 * 2.0**30),
        ("1.5MiB", 1.5 * 2.0**20),
        ("512KB", 512e3),
        ("2TB", 2e12),
        ("1TiB", 2.0**40),
        ("100B", 100.0),
        (" 6 GB ", 6e9),
    ],
)
def test_parse_bytes(text: str, num_bytes: float) -> None:
    assert parse_bytes(text) == pytest.approx(num_bytes)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2us", 2e-6), ("2µs", 2e-6), ("1.5ms", 1.5e-3), ("3s", 3.0), ("500ns", 5e-7), ("0us", 0.0)],
)
def test_parse_time(text: str, seconds: float) -> None:
    assert parse_time(text) == pytest.approx(seconds)


def test_parse_flops() -> None:
    assert parse_flops("19.5TFLOPS") == pytest.approx(19.5e12)
    assert parse_flops("96GFLOP/s") == pytest.approx(96e9)
    assert parse_flops("1PFLOPS") == pytest.approx(1e15)


def test_bits_and_bytes_differ_by_eight() -> None:
    assert parse_bandwidth("80Gbit/s") == pytest.approx(parse_bandwidth("10GB/s"))


@pytest.mark.parametrize("value", ["10", 10, 10.0])
def test_missing_unit_names_value_and_example(value: object) -> None:
    with pytest.raises(UnitError, match=r"nic: '?10(\.0)?'? has no unit.*10Gbit/s"):
        parse_bandwidth(value, "nic")  # type: ignore[arg-type]


def test_missing_unit_for_memory_suggests_bytes() -> None:
    with pytest.raises(UnitError, match=r"memory: '24' has no unit.*'16GB'"):
        parse_bytes("24", "memory")


def test_unknown_unit_is_named_and_known_units_listed() -> None:
    with pytest.raises(UnitError, match=r"unknown unit 'Gb/s' in '10Gb/s'; known units: .*Gbit/s"):
        parse_bandwidth("10Gb/s")
    with pytest.raises(UnitError, match=r"unknown unit 'gigs' in '16gigs'.*GiB"):
        parse_bytes("16gigs")
    with pytest.raises(UnitError, match=r"unknown unit 'min'"):
        parse_time("2min")


def test_units_are_case_sensitive() -> None:
    # 'gb' could mean gigabits or gigabytes: refuse to guess.
    with pytest.raises(UnitError, match=r"unknown unit 'gb'"):
        parse_bytes("16gb")


def test_unreadable_number() -> None:
    with pytest.raises(UnitError, match=r"cannot read 'fast' as a bandwidth"):
        parse_bandwidth("fast")


def test_negative_is_refused_with_the_value() -> None:
    with pytest.raises(UnitError, match=r"memory: '-8GB' is negative"):
        parse_bytes("-8GB", "memory")
    with pytest.raises(UnitError, match=r"'-10Gbit/s' is negative"):
        parse_bandwidth("-10Gbit/s")


def test_bool_is_not_a_quantity() -> None:
    with pytest.raises(UnitError, match="got True"):
        parse_bytes(True)


def test_format_round_numbers() -> None:
    assert format_bytes(9.1e9) == "9.1 GB"
    assert format_bytes(512) == "512 B"
    assert format_bandwidth(1.25e9) == "10 Gbit/s"
    assert format_bandwidth(12.5e6) == "100 Mbit/s"
    assert format_time(0.0123) == "12.3 ms"
    assert format_time(2e-6) == "2 us"
    assert format_time(1.5) == "1.5 s"


def test_format_then_parse_round_trips() -> None:
    assert parse_bandwidth(format_bandwidth(7e9).replace(" ", "")) == pytest.approx(7e9)

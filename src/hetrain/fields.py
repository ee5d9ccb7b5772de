"""Typed reading of input files: each field checked, each error one line naming file, field and value.

The cluster, profile and plan parsers read their dicts through these helpers, so
a wrong type, a missing field or an absurd size is refused the same way::

    >>> from hetrain.errors import InputError
    >>> require_int({"mini_batch": "8"}, "mini_batch", "virtual_workers[0]", InputError)
    Traceback (most recent call last):
    ...
    hetrain.errors.InputError: virtual_workers[0].mini_batch: expected an integer, got '8'

``where`` is the path of the object being read (``virtual_workers[1].stages[0]``);
the helpers add the key. ``load_json_object`` and ``load_toml_object`` read a file
and turn every way it can be unreadable (missing, a directory, not UTF-8, binary,
empty, nested too deep, not an object at the top) into one line naming the file.

Sizes a real cluster never reaches are refused with the limit named, so that a
typing slip (``count = 100000000``) is an error in milliseconds, not an hour of
planning. The limits are written here once.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetrain.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

# --- limits: far beyond any real cluster or run, close enough to refuse a slip at once --------------
MAX_DEVICES = 8192
"""Devices in one cluster. A Cluster holds dense device-by-device link matrices (two of 8 bytes x N^2):
8192 devices take 1 GB and a few seconds to build; 65536 would take 68 GB. Raising it needs links
stored per node pair instead."""
MAX_NODES = MAX_DEVICES
"""Nodes in one cluster."""
MAX_LAYERS = 10_000
"""Layers of one model (the largest transformers have about 100 blocks; cut per sub-layer, under 1000)."""
MAX_GLOBAL_BATCH = 2**20
"""Samples per iteration over all virtual workers (about a million; the largest published data-parallel
batches are 64k to 128k samples; the planner's batch split takes time linear in it)."""
MAX_MICRO_BATCHES = 4096
"""Micro-batches per virtual worker per iteration (each is an action per stage in the schedule)."""
MAX_MICRO_BATCH = MAX_GLOBAL_BATCH
"""Samples in one micro-batch (profile measurements, ``--micro-batch``)."""
MAX_STEPS = 10**9
"""Training steps of one run."""
MAX_SEQ_LEN = 1 << 20
"""Tokens per sample of a token model (``--seq-len``; the longest-context models take about a million)."""
MAX_REPEATS = 10_000
"""Timed repetitions per measurement (``hetrain profile --repeats``)."""
MAX_FILE_BYTES = 1 << 30
"""Size of one input file (a plan of 65536 devices is a few tens of megabytes)."""

_MISSING: Any = object()

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlevel = 2
_short.maxlist = _short.maxtuple = _short.maxdict = 4


def show(value: Any) -> str:
    """A short, one-line repr of an offending value (long strings and deep lists are cut)."""
    return _short.repr(value)


def path_of(where: str, key: str | int) -> str:
    """``path_of("virtual_workers[1]", "stages")`` -> ``"virtual_workers[1].stages"``; ints index."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _get(data: Mapping[str, Any], key: str, where: str, error: type[InputError], default: Any) -> Any:
    if key in data:
        return data[key]
    if default is _MISSING:
        raise error(f"{path_of(where, key)}: missing")
    return default


def require_mapping(value: Any, where: str, error: type[InputError] = InputError) -> Mapping[str, Any]:
    """``value`` itself as an object (a JSON object, a TOML table)."""
    if not isinstance(value, Mapping):
        raise error(f"{where or 'the file'}: expected an object, got {show(value)}")
    return value


def require_object(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                   default: Any = _MISSING) -> Mapping[str, Any]:
    """``data[key]`` as an object (``{}`` where ``default`` is given and the key is absent)."""
    value = _get(data, key, where, error, default)
    if not isinstance(value, Mapping):
        raise error(f"{path_of(where, key)}: expected an object, got {show(value)}")
    return value


def require_list(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                 default: Any = _MISSING, least: int = 0, most: int | None = None, what: str = "entries") -> list[Any]:
    """``data[key]`` as a list of ``least`` to ``most`` entries."""
    value = _get(data, key, where, error, default)
    if not isinstance(value, list):
        raise error(f"{path_of(where, key)}: expected a list, got {show(value)}")
    if len(value) < least:
        raise error(f"{path_of(where, key)}: expected at least {least} {what}, got {len(value)}")
    if most is not None and len(value) > most:
        raise error(f"{path_of(where, key)}: {len(value)} {what} is more than the limit of {most}")
    return value


def require_str(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                default: Any = _MISSING, choices: tuple[str, ...] | None = None) -> str:
    """``data[key]`` as a non-empty string, one of ``choices`` where given."""
    value = _get(data, key, where, error, default)
    if not isinstance(value, str) or not value.strip():
        raise error(f"{path_of(where, key)}: expected a non-empty string, got {show(value)}")
    if choices is not None and value not in choices:
        raise error(f"{path_of(where, key)}: must be one of {', '.join(choices)}, got {show(value)}")
    return value


def check_int(value: Any, where: str, error: type[InputError] = InputError, least: int | None = None,
              most: int | None = None, limit_name: str | None = None) -> int:
    """``value`` as an integer in ``[least, most]``; ``limit_name`` names what ``most`` is (``MAX_DEVICES``)."""
    if isinstance(value, float) and value.is_integer():
        out = int(value)  # 8.0 in a JSON file written by another tool
    elif isinstance(value, int) and not isinstance(value, bool):
        out = value
    else:
        raise error(f"{where}: expected an integer, got {show(value)}")
    if least is not None and out < least:
        raise error(f"{where}: must be >= {least}, got {out}")
    if most is not None and out > most:
        named = f" ({limit_name})" if limit_name else ""
        raise error(f"{where}: {out} is more than the limit of {most}{named}")
    return out


def require_int(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                default: Any = _MISSING, least: int | None = None, most: int | None = None,
                limit_name: str | None = None) -> int:
    """``data[key]`` as an integer in ``[least, most]``."""
    value = _get(data, key, where, error, default)
    return check_int(value, path_of(where, key), error, least, most, limit_name)


def check_number(value: Any, where: str, error: type[InputError] = InputError, least: float | None = None,
                 positive: bool = False, most: float | None = None) -> float:
    """``value`` as a finite number, ``> 0`` if ``positive``, ``>= least`` and ``<= most`` where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: expected a number, got {show(value)}")
    out = float(value)
    if not math.isfinite(out):
        raise error(f"{where}: expected a finite number, got {show(value)}")
    if positive and not out > 0:
        raise error(f"{where}: must be > 0, got {show(value)}")
    if least is not None and out < least:
        raise error(f"{where}: must be >= {least:g}, got {show(value)}")
    if most is not None and out > most:
        raise error(f"{where}: must be <= {most:g}, got {show(value)}")
    return out


def require_number(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                   default: Any = _MISSING, least: float | None = None, positive: bool = False,
                   most: float | None = None) -> float:
    """``data[key]`` as a finite number (see ``check_number``)."""
    value = _get(data, key, where, error, default)
    return check_number(value, path_of(where, key), error, least, positive, most)


def optional_number(data: Mapping[str, Any], key: str, where: str, error: type[InputError] = InputError,
                    least: float | None = None) -> float | None:
    """``data[key]`` as a finite number, or None where absent or null."""
    value = data.get(key)
    if value is None:
        return None
    return check_number(value, path_of(where, key), error, least)


# --- files ---------------------------------------------------------------------------------------

def read_text(path: str | Path, error: type[InputError], what: str) -> str:
    """The text of an input file; one line naming the file when it is missing, a directory, too large,
    binary, not UTF-8 or empty."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise error(f"{p}: is a directory, not a {what}")
        if size > MAX_FILE_BYTES:
            raise error(f"{p}: {size} bytes is more than the limit of {MAX_FILE_BYTES} for a {what}")
        raw = p.read_bytes()
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror}") from None
    if b"\x00" in raw:
        raise error(f"{p}: a binary file, not a {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start}); a {what} is UTF-8") from None
    if not text.strip():
        raise error(f"{p}: the file is empty; expected a {what}")
    return text


def load_json_object(path: str | Path, error: type[InputError], what: str) -> dict[str, Any]:
    """A JSON file whose top level is an object."""
    p = Path(path)
    text = read_text(p, error, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a {what}") from None
    if not isinstance(data, dict):
        raise error(f"{p}: a {what} is a JSON object {{...}}, got {show(data)}")
    return data


def load_toml_object(path: str | Path, error: type[InputError], what: str) -> dict[str, Any]:
    """A TOML file (its top level is always a table)."""
    p = Path(path)
    text = read_text(p, error, what)
    try:
        data: dict[str, Any] = tomllib.loads(text)
        return data
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p}: not valid TOML: {e}") from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a {what}") from None


def check_output_path(path: str | Path, what: str, error: type[InputError] = InputError) -> Path:
    """Refuse, before any work, an output path that cannot be written: a directory, a missing or
    read-only directory, a path through a file."""
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise error(f"{what} {str(path)!r}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise error(f"{what} {p}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise error(f"{what} {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise error(f"{what} {p}: not writable (permission denied)")
    return p

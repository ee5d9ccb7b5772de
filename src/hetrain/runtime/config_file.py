"""``hetrain train --config train.toml``: command-line options kept in a TOML file.

Each key is an option's long name, with ``-`` or ``_`` (``checkpoint_every`` or
``checkpoint-every``); each value is what the option would take, as a TOML value. Options on the
command line override the file::

    plan = "plan.json"
    model = "gpt-tiny"
    data = "tokens:train.bin"
    steps = 2000
    lr = 3e-4
    lr_schedule = "cosine"
    progress = false          # the on/off flags take true or false
    set = ["n_blocks=2"]      # --set, given again and again: a list (or a table: set = {n_blocks = 2})

Every value runs through its option's own check (its argparse ``type`` and ``choices``), so a
value refused on the command line is refused in the file, and the error names the file, the key
and the value; a number is a TOML number (``steps = "4"`` is refused). A later check of two
values together names each where it was given (``named_value``): ``train.toml: min_lr = 1.0``,
or ``--min-lr 1.0``. The file is read in two passes of argparse: the first finds ``--config``, the
file's values become the parser's defaults, the second reads the command line over them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]


class ConfigFileError(InputError):
    """A train.toml that cannot be read, or a key or value in it that no option takes."""


def _long_name(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0][2:].replace("-", "_") if longs else None


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name (with ``_``) -> its action, for every option a file may set."""
    out = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        name = _long_name(action)
        if name is not None and name not in ("help", "config"):
            out[name] = action
    return out


def _value(path: str, key: str, value: Any, action: argparse.Action) -> Any:
    """``value`` checked as ``action`` would check it on the command line, converted the same way."""
    def refuse(why: str) -> ConfigFileError:
        return ConfigFileError(f"{path}: {key} = {json.dumps(value, default=str)}: {why}")

    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
        if not isinstance(value, bool):
            raise refuse("takes true or false")
        return action.const if value else not action.const
    if isinstance(action, argparse._AppendAction):  # --set KEY=VALUE, again and again
        if isinstance(value, dict):
            return [f"{k}={json.dumps(v)}" for k, v in value.items()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise refuse('takes a list of "KEY=VALUE" strings or a table')
        return list(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise refuse(f"takes a {'string' if action.type is None else 'number'}, not {_toml_type(value)}")
    if action.type is None and not isinstance(value, str):
        raise refuse(f"takes a string, not {_toml_type(value)}")
    converted: Any = value
    if action.type is not None:
        try:
            converted = action.type(str(value))  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise refuse(str(e) or "not a valid value") from None
        if isinstance(value, str) and isinstance(converted, int | float) and not isinstance(converted, bool):
            kind = "an integer" if isinstance(converted, int) else "a number"
            raise refuse(f"takes {kind}, not a string (write it without quotes: {key} = {value})")
    if action.choices is not None and converted not in action.choices:
        raise refuse(f"not one of {', '.join(map(str, action.choices))}")
    return converted


def _toml_type(value: Any) -> str:
    """A TOML value's type in TOML's words: ``a string``, ``an integer``, ``a float``, ``an array``, ..."""
    words = {bool: "a boolean", str: "a string", int: "an integer", float: "a float", list: "an array",
             dict: "a table"}
    return words.get(type(value), f"a {type(value).__name__}")


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The parser's defaults (dest -> value) that the TOML file ``path`` sets, each checked (module docstring).

    Raises:
        ConfigFileError: a file that cannot be read or is not TOML, an unknown key, or a value its option refuses.
    """
    return _load(path, parser)[0]


def _load(path: str, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, str]]:
    """``load_config_file``'s defaults, and by dest how an error names the value: ``train.toml: min_lr = 1.0``."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
        table = tomllib.loads(text)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigFileError(f"--config {path}: not a TOML file: {e}") from None
    options = _options(parser)
    defaults: dict[str, Any] = {}
    named: dict[str, str] = {}
    for key, value in table.items():
        action = options.get(key.replace("-", "_"))
        if action is None:
            raise ConfigFileError(f"{path}: unknown key {key!r} (= {json.dumps(value, default=str)}); keys are the "
                                  f"options of hetrain train: {', '.join(sorted(options))}")
        defaults[action.dest] = _value(path, key, value, action)
        named[action.dest] = f"{path}: {key} = {json.dumps(value, default=str)}"
    return defaults, named


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` over the defaults of ``--config FILE`` if given (module docstring).

    The namespace also records which values the file gave (``named_value`` reads it), so that a check
    of two options together can name the file and key, or the flag, of each.

    Raises:
        ConfigFileError: see ``load_config_file``. (argparse's own errors exit, as ``parse_args`` does.)
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=None)
    known, _ = first.parse_known_args(argv)
    if known.config is None:
        return parser.parse_args(argv)
    defaults, named = _load(known.config, parser)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False  # given by the file; the command line may still override it
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    # which of the file's values the command line left: parse it again over a marker per value
    # (argparse sets no default where the namespace has the attribute; a list, for --set's append)
    markers = {dest: _Unset() for dest in defaults}
    given = parser.parse_args(argv, namespace=argparse.Namespace(**markers))
    setattr(args, _FROM_FILE, {dest: named[dest] for dest, m in markers.items() if getattr(given, dest) is m})
    return args


_FROM_FILE = "config_file_values"  # the namespace's attribute: dest -> "train.toml: key = value"


class _Unset(list[Any]):
    """A value the command line did not give (``parse_with_config``); a list so that an append option can copy it."""


def named_value(args: argparse.Namespace, dest: str, flag: str) -> str:
    """How an error names an option's value: ``train.toml: min_lr = 1.0`` where the config file gave it,
    else ``--min-lr 1.0`` (``flag`` and the value).

    Example:
        >>> named_value(argparse.Namespace(min_lr=1.0), "min_lr", "--min-lr")
        '--min-lr 1.0'
    """
    from_file: dict[str, str] = getattr(args, _FROM_FILE, {})
    return from_file.get(dest) or f"{flag} {getattr(args, dest)}"

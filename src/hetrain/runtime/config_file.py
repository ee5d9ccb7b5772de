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
and the value. The file is read in two passes of argparse: the first finds ``--config``, the
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
        raise refuse(f"takes a {'string' if action.type is None else 'number or string'}, not a "
                     f"{type(value).__name__}")
    if action.type is None and not isinstance(value, str):
        raise refuse(f"takes a string, not a {type(value).__name__}")
    converted: Any = value
    if action.type is not None:
        try:
            converted = action.type(str(value))  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise refuse(str(e) or "not a valid value") from None
    if action.choices is not None and converted not in action.choices:
        raise refuse(f"not one of {', '.join(map(str, action.choices))}")
    return converted


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The parser's defaults (dest -> value) that the TOML file ``path`` sets, each checked (module docstring).

    Raises:
        ConfigFileError: a file that cannot be read or is not TOML, an unknown key, or a value its option refuses.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8")
        table = tomllib.loads(text)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigFileError(f"--config {path}: not a TOML file: {e}") from None
    options = _options(parser)
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        action = options.get(key.replace("-", "_"))
        if action is None:
            raise ConfigFileError(f"{path}: unknown key {key!r} (= {json.dumps(value, default=str)}); keys are the "
                                  f"options of hetrain train: {', '.join(sorted(options))}")
        defaults[action.dest] = _value(path, key, value, action)
    return defaults


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` over the defaults of ``--config FILE`` if given (module docstring).

    Raises:
        ConfigFileError: see ``load_config_file``. (argparse's own errors exit, as ``parse_args`` does.)
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=None)
    known, _ = first.parse_known_args(argv)
    if known.config is not None:
        defaults = load_config_file(known.config, parser)
        for action in parser._actions:
            if action.dest in defaults:
                action.required = False  # given by the file; the command line may still override it
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)

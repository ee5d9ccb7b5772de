"""A tree of frozen dataclasses as the single source of a command's options: its flags, its TOML keys, its checks.

One field, written once, with its docstring beneath it, gives:

- a command-line flag (``--lr``; the name with ``-``, or the field's ``flag``), whose help is the docstring;
- a key of a TOML file (``lr``, or ``lr-schedule`` / ``lr_schedule``: the flag's name);
- the check of its value (the field's ``type``: an argparse-style parser of the text, e.g. ``int_between``),
  run on the command line's text, on the file's value and on a value given in Python, with one message;
- where a value came from, for a check of two values together: ``t.toml: min_lr = 1.0`` or ``--min-lr 1.0``.

Sections are fields whose type is itself such a dataclass; flags and keys stay flat (one name space), so a
file written as a flat list of options loads as before. Anchor: torchtitan's ``JobConfig`` feeds both its CLI
and its TOML from one dataclass tree; this is the same idea without a third-party parser.

Example::

    @dataclass(frozen=True)
    class Optim:
        lr: float | None = option(None, type=number_at_least(0.0, inclusive=False))
        \"\"\"peak learning rate\"\"\"

    parser = argparse.ArgumentParser()
    add_options(parser, Optim)                     # --lr, with its help
    values = given_options(parser.parse_args(["--lr", "0.1"]), Optim)
    Optim(**values.values)                         # Optim(lr=0.1)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetrain.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

_META = "hetrain.option"


@dataclass(frozen=True)
class OptionSpec:
    """How a field is given: its flag, the parser of its text, its choices, and its kind.

    Attributes:
        flag: the long flag (``--lr``); None: ``--`` and the field's name with ``-``.
        type: parses and checks the command line's text (raises ``ArgumentTypeError`` / ``ValueError``).
        choices: the values allowed.
        metavar: the flag's value in help.
        repeat: a flag given again and again, collected as a tuple (``--set KEY=VALUE``); in a file, a list of
            strings or a table (``set = {n_blocks = 2}``).
        switch: an on/off flag with a ``--no-`` twin, default None (``--progress`` / ``--no-progress``); in a file,
            true or false.
    """

    flag: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    repeat: bool = False
    switch: bool = False


def option(default: Any = dataclasses.MISSING, *, flag: str | None = None, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, metavar: str | None = None, repeat: bool = False,
           switch: bool = False) -> Any:
    """A dataclass field that is an option (``OptionSpec``); its help is the docstring written beneath it."""
    spec = OptionSpec(flag, type, tuple(choices) if choices is not None else None, metavar, repeat, switch)
    return dataclasses.field(default=default, metadata={_META: spec})


@dataclass(frozen=True)
class Leaf:
    """One option of a config tree: where it sits (``path``), how it is named, how it is given."""

    path: tuple[str, ...]
    field: dataclasses.Field[Any]
    spec: OptionSpec
    help: str

    @property
    def name(self) -> str:
        """The field's name, its last path part (``min_lr``)."""
        return self.path[-1]

    @property
    def flag(self) -> str:
        """``--min-lr``."""
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The flag's name with ``_``: the file's key and the key of ``Given`` (``min_lr``; ``set`` for ``--set``)."""
        return self.flag[2:].replace("-", "_")

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING


def _is_section(f: dataclasses.Field[Any], owner: type) -> type | None:
    hints = _hints(owner)
    t = hints.get(f.name)
    return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string written beneath it in the class body, or in a base class's),
    whitespace collapsed."""
    out: dict[str, str] = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            out.update(_own_field_docs(c))
    return out


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): help without text
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out


def leaves(cls: Any, prefix: tuple[str, ...] = ()) -> tuple[Leaf, ...]:
    """Every option of the tree rooted at ``cls``, sections expanded after the options of their parent."""
    return _leaves(cls, prefix)


@functools.cache
def _leaves(cls: Any, prefix: tuple[str, ...]) -> tuple[Leaf, ...]:
    out: list[Leaf] = []
    docs = field_docs(cls)
    own = getattr(cls, "__annotations__", {})
    fields = dataclasses.fields(cls)
    # the class's own options, then its base classes', then its sections: ``--help`` lists --plan before --seed
    for f in [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]:
        if _META in f.metadata and _is_section(f, cls) is None:
            out.append(Leaf((*prefix, f.name), f, f.metadata[_META], docs.get(f.name, "")))
    for f in fields:
        section = _is_section(f, cls)
        if section is not None:
            out.extend(leaves(section, (*prefix, f.name)))
    keys = [leaf.key for leaf in out]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise TypeError(f"{cls.__name__}: options {dup} are named twice; flags and keys are one flat name space")
    return tuple(out)


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per option of ``cls``'s tree. A flag not given is absent from the namespace (``SUPPRESS``), so
    that ``given_options`` knows what the command line gave; defaults come from the dataclasses."""
    for leaf in leaves(cls):
        s = leaf.spec
        helptext = leaf.help.replace("%", "%%") or None
        if s.switch:
            parser.add_argument(leaf.flag, dest=leaf.key, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=helptext)
        elif s.repeat:
            parser.add_argument(leaf.flag, dest=leaf.key, action="append", default=argparse.SUPPRESS,
                                metavar=s.metavar, help=helptext)
        else:
            kwargs: dict[str, Any] = {"type": s.type} if s.type is not None else {}
            parser.add_argument(leaf.flag, dest=leaf.key, choices=s.choices, default=argparse.SUPPRESS,
                                metavar=s.metavar, help=helptext, **kwargs)


@dataclass(frozen=True)
class Given:
    """Option values by key, and how an error names each: ``--lr 0.1`` or ``t.toml: lr = 0.1``."""

    values: Mapping[str, Any]
    named: Mapping[str, str]

    def over(self, below: Given) -> Given:
        """These values over ``below``'s; a repeated option's items follow ``below``'s (``--set`` appends)."""
        values = dict(below.values)
        named = dict(below.named)
        for k, v in self.values.items():
            values[k] = (*below.values[k], *v) if isinstance(v, tuple) and isinstance(below.values.get(k), tuple) else v
            named[k] = self.named[k]
        return Given(values, named)


def given_options(args: argparse.Namespace, cls: type) -> Given:
    """The options of ``cls`` the command line gave (parsed by a parser ``add_options`` set up)."""
    values: dict[str, Any] = {}
    named: dict[str, str] = {}
    for leaf in leaves(cls):
        if hasattr(args, leaf.key):
            v = getattr(args, leaf.key)
            values[leaf.key] = tuple(v) if leaf.spec.repeat else v
            if leaf.spec.switch:
                named[leaf.key] = leaf.flag if v else "--no-" + leaf.flag[2:]
            else:
                named[leaf.key] = f"{leaf.flag} {' '.join(map(str, v)) if leaf.spec.repeat else v}"
    return Given(values, named)


class ConfigFileError(InputError):
    """A config file that cannot be read, or a key or value in it that no option takes."""


def _toml_type(value: Any) -> str:
    """A TOML value's type in TOML's words: ``a string``, ``an integer``, ``a float``, ``an array``, ..."""
    words = {bool: "a boolean", str: "a string", int: "an integer", float: "a float", list: "an array",
             dict: "a table"}
    return words.get(type(value), f"a {type(value).__name__}")


def _file_value(path: str, key: str, value: Any, leaf: Leaf) -> Any:
    """``value`` checked as the command line would check its flag, converted the same way."""
    def refuse(why: str) -> ConfigFileError:
        return ConfigFileError(f"{path}: {key} = {json.dumps(value, default=str)}: {why}")

    s = leaf.spec
    if s.switch:
        if not isinstance(value, bool):
            raise refuse("takes true or false")
        return value
    if s.repeat:
        if isinstance(value, dict):
            return tuple(f"{k}={json.dumps(v)}" for k, v in value.items())
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise refuse('takes a list of "KEY=VALUE" strings or a table')
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise refuse(f"takes a {'string' if s.type is None else 'number'}, not {_toml_type(value)}")
    if s.type is None and not isinstance(value, str):
        raise refuse(f"takes a string, not {_toml_type(value)}")
    converted: Any = value
    if s.type is not None:
        try:
            converted = s.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise refuse(str(e) or "not a valid value") from None
        if isinstance(value, str) and isinstance(converted, int | float) and not isinstance(converted, bool):
            kind = "an integer" if isinstance(converted, int) else "a number"
            raise refuse(f"takes {kind}, not a string (write it without quotes: {key} = {value})")
    if s.choices is not None and converted not in s.choices:
        raise refuse(f"not one of {', '.join(map(str, s.choices))}")
    return converted


def load_options_file(path: str, cls: type, command: str) -> Given:
    """The options of ``cls`` a TOML file gives; keys are the long flags' names, with ``-`` or ``_``.

    Raises:
        ConfigFileError: a file that cannot be read or is not TOML, an unknown key, or a value its option refuses;
            one line naming the file, the key and the value.
    """
    try:
        table = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigFileError(f"--config {path}: not a TOML file: {e}") from None
    by_key = {leaf.key: leaf for leaf in leaves(cls)}
    sections = {leaf.path[0] for leaf in by_key.values() if len(leaf.path) > 1}
    values: dict[str, Any] = {}
    named: dict[str, str] = {}
    for key, value, leaf in _file_items(path, table, by_key, sections):
        if leaf is None:
            raise ConfigFileError(f"{path}: unknown key {key!r} (= {json.dumps(value, default=str)}); keys are the "
                                  f"options of {command}: {', '.join(sorted(by_key))}")
        if leaf.key in values:
            raise ConfigFileError(f"{path}: {key} = {json.dumps(value, default=str)}: {leaf.key} is given twice "
                                  "(flat and in its section)")
        values[leaf.key] = _file_value(path, key, value, leaf)
        named[leaf.key] = f"{path}: {key} = {json.dumps(value, default=str)}"
    return Given(values, named)


def _file_items(path: str, table: Mapping[str, Any], by_key: Mapping[str, Leaf],
                sections: set[str]) -> Iterator[tuple[str, Any, Leaf | None]]:
    """``(key as written, value, its option or None)`` of a file's table: flat keys, and the keys of a section's
    table (``[optim]`` then ``lr = 3e-4``; its options only)."""
    for key, value in table.items():
        name = key.replace("-", "_")
        leaf = by_key.get(name)
        if name in sections and isinstance(value, dict) and not (leaf is not None and leaf.spec.repeat):
            for sub, v in value.items():
                inner = by_key.get(sub.replace("-", "_"))
                yield (f"{key}.{sub}", v, inner if inner is not None and inner.path[0] == name else None)
        else:
            yield key, value, leaf


def build_options(cls: type, given: Given) -> Any:
    """An instance of ``cls`` with ``given``'s values over the dataclasses' defaults, sections built alike."""
    def build(section: type, prefix: tuple[str, ...]) -> Any:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            sub = _is_section(f, section)
            if sub is not None:
                kwargs[f.name] = build(sub, (*prefix, f.name))
        for leaf in leaves(section):
            if len(leaf.path) == 1 and leaf.key in given.values:
                kwargs[leaf.name] = given.values[leaf.key]
        return section(**kwargs)

    return build(cls, ())


def check_value(owner: str, leaf: Leaf, value: Any) -> None:
    """``value``, given in Python, checked as its flag's text would be (``__post_init__`` of a config section).

    Raises:
        ValueError: ``TrainConfig: steps = -1: ...`` (the key, the value, why).
    """
    s = leaf.spec
    if value is None or s.switch:
        return
    if s.repeat:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{owner}: {leaf.key} = {value!r}: takes a tuple of strings")
        for item in value:
            try:
                if s.type is not None:
                    s.type(item)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                raise ValueError(f"{owner}: {leaf.key} = {value!r}: {e}") from None
        return
    if isinstance(value, bool) or (s.type is not None and not isinstance(value, str | int | float)):
        raise ValueError(f"{owner}: {leaf.key} = {value!r}: not a valid value")
    if s.type is not None:
        try:
            converted = s.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ValueError(f"{owner}: {leaf.key} = {value!r}: {e}") from None
        widened = isinstance(converted, float) and isinstance(value, int)  # lr=1 means 1.0
        if converted != value or (type(converted) is not type(value) and not widened):
            raise ValueError(f"{owner}: {leaf.key} = {value!r}: takes {type(converted).__name__}, "
                             f"not {type(value).__name__}")
    if s.choices is not None and value not in s.choices:
        raise ValueError(f"{owner}: {leaf.key} = {value!r}: not one of {', '.join(map(str, s.choices))}")


def check_section(section: Any) -> None:
    """Every option of one section (not its sub-sections) checked by ``check_value``."""
    cls = section.__class__
    owner = cls.__name__
    for leaf in leaves(cls):
        if len(leaf.path) == 1:
            check_value(owner, leaf, getattr(section, leaf.name))

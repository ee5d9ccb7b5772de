"""``MODULE:FUNCTION`` and ``path/to/file.py:FUNCTION``: naming a user's function on the command line.

One syntax for every command that takes a model or a data set of the user's own
(``hetrain profile --model``, ``hetrain train --model`` and ``--data``)::

    my_package.models:build         imported as a module (on sys.path, or the current directory)
    examples/own_model/model.py:build   loaded from the file (a path: it has a "/" or ends in ".py")

A file is imported as ``python path/to/file.py`` runs it: its directory first on ``sys.path``,
so it can import the modules beside it (``from helpers import build``). Every command loads
a spec here, and so does every rank of ``hetrain train`` under torchrun.

A reference model's name never holds a ``:``, so ``is_user_spec`` tells the two
apart without importing anything. This module imports no torch (``hetrain plan``
uses ``is_user_spec``); loading a spec imports the user's code, which may.

Example:
    >>> is_user_spec("gpt-tiny"), is_user_spec("examples/own_model/model.py:build")
    (False, True)
    >>> split_spec("pkg.mod:build")
    ('pkg.mod', 'build')
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from hetrain.errors import InputError


class SpecError(InputError):
    """A ``MODULE:FUNCTION`` spec that cannot be loaded, or whose function fails or returns the wrong thing."""


def is_user_spec(text: str) -> bool:
    """Whether ``text`` names a user's function (``MODULE:FUNCTION``) rather than a reference model or data set."""
    return ":" in text


def split_spec(spec: str) -> tuple[str, str]:
    """``"a/b.py:build"`` -> ``("a/b.py", "build")``; refuses a spec without both parts."""
    where, _, name = spec.rpartition(":")
    if not where or not name or not name.isidentifier():
        raise SpecError(f"{spec!r} is not MODULE:FUNCTION or path/to/file.py:FUNCTION "
                        f"(FUNCTION a Python name, e.g. my_models:build or model.py:build)")
    return where, name


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _load_file(path_text: str, spec: str) -> ModuleType:
    path = Path(path_text)
    if path.is_dir():
        raise SpecError(f"{spec}: {path_text} is a directory; give a Python file, e.g. {path_text}/model.py:FUNCTION")
    if not path.is_file():
        raise SpecError(f"{spec}: file {path_text} does not exist")
    resolved = path.resolve()
    digest = hashlib.blake2b(str(resolved).encode(), digest_size=4).hexdigest()
    name = f"_hetrain_user_{resolved.stem}_{digest}"  # one module per file, however its path is spelled
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, resolved)
    if found is None or found.loader is None:
        raise SpecError(f"{spec}: cannot load {path_text} as Python (give a .py file)")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    try:
        with _beside(resolved.parent):
            found.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs, named in one line
        del sys.modules[name]
        raise SpecError(f"{spec}: importing {path_text} raised {type(e).__name__}: {e}") from e
    return module


@contextlib.contextmanager
def _beside(directory: Path) -> Iterator[None]:
    """The file's directory first on ``sys.path`` while it is imported, as ``python file.py`` puts it.

    So ``from helpers import ...`` finds ``helpers.py`` next to the model file. Afterwards the
    directory stays on the path, but last: an import inside ``build()`` still finds its
    neighbours, and a neighbour can no longer shadow a package hetrain imports later.
    """
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)  # the first occurrence: the one inserted above
        if entry not in sys.path:
            sys.path.append(entry)


def _import_module(name: str, spec: str) -> ModuleType:
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: modules of the current directory import
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name) and (len(e.name) == len(name) or name[len(e.name)] == "."):
            raise SpecError(f"{spec}: no module named {e.name!r} (on the Python path or in the current "
                            f"directory); for a file, give its path: path/to/file.py:FUNCTION") from e
        raise SpecError(f"{spec}: importing module {name!r} raised ModuleNotFoundError: {e}") from e
    except Exception as e:  # the user's code: any error is theirs, named in one line
        raise SpecError(f"{spec}: importing module {name!r} raised {type(e).__name__}: {e}") from e


def load_function(spec: str) -> tuple[Callable[..., Any], ModuleType]:
    """The function ``spec`` names, and the module it lives in.

    Raises:
        SpecError: a malformed spec, a missing file, an unimportable module (its error named), no
            such name in the module, or a name that is not callable.
    """
    where, name = split_spec(spec)
    module = _load_file(where, spec) if _is_path(where) else _import_module(where, spec)
    if not hasattr(module, name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        known = f"; its functions: {', '.join(public)}" if public else ""
        raise SpecError(f"{spec}: {where} has no function {name!r}{known}")
    fn = getattr(module, name)
    if not callable(fn):
        raise SpecError(f"{spec}: {name} in {where} is a {type(fn).__name__}, not a function")
    return fn, module


def call_spec(spec: str, fn: Callable[..., Any], what: str) -> Any:
    """``fn()``, with any error it raises turned into one ``SpecError`` line naming ``spec`` (``what``: its role)."""
    try:
        return fn()
    except Exception as e:  # the user's code: any error is theirs, named in one line
        raise SpecError(f"{what} {spec} raised {type(e).__name__}: {e}") from e

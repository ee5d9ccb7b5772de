"""The shape of the code, counted from the source with ``ast``: the limits issue 33 set, kept.

- The sync mode's string is compared only where it is parsed (``hetrain.sync_mode``): at most 3 comparisons with
  a mode name in ``src/``; every other module asks the mode object.
- At most 2 ``ArgumentParser`` constructions (today 1: the command table's); every module run with ``python -m``
  hands its argv to the table, and every command adds its options to the table's parser.
- No private argparse API (``parser._actions``, ``argparse._StoreConstAction`` ...).
- No function over 80 lines, except the simulator's inlined event loop (checked event for event against the
  reference engine).
- At most 3 test files build a ``Prediction`` by hand (``tests/factories.py`` builds plans for the others).

Run as a script to print the counts and where each one is::

    python tests/test_code_shape.py
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = frozenset({"bsp", "wsp", "hybrid-ps", "daso", "local-sgd"})
#: argparse's private names that code outside argparse reads
PRIVATE_ARGPARSE = frozenset({"_actions", "_option_string_actions", "_subparsers", "_positionals", "_optionals",
                              "_defaults", "_registries", "_action_groups", "_name_parser_map", "_choices_actions",
                              "_get_formatter", "_print_message", "_get_values", "_mutually_exclusive_groups",
                              "_group_actions"})
#: functions allowed over the limit, with why
LONG_ALLOWED = {"simulator/fast_engine.py:run": "the inlined event loop, checked event for event"}
MAX_FUNCTION_LINES = 80


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts))
    return set()


def _trees(folder: str) -> Iterator[tuple[Path, ast.AST]]:
    for f in sorted((ROOT / folder).rglob("*.py")):
        yield f, ast.parse(f.read_text())


def mode_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a value with a sync mode's name (``==``, ``in``, ``match`` case)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and _strings(n.left).union(*(_strings(c) for c in n.comparators)) & MODES:
            out.append(n.lineno)
        elif isinstance(n, ast.MatchValue) and _strings(n.value) & MODES:
            out.append(n.value.lineno)
    return out


def parser_constructions(tree: ast.AST) -> list[int]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name == "ArgumentParser":
                out.append(n.lineno)
    return out


def private_argparse(tree: ast.AST) -> list[int]:
    out = []
    for n in ast.walk(tree):
        private = isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
        if private and ((isinstance(n.value, ast.Name) and n.value.id == "argparse") or n.attr in PRIVATE_ARGPARSE):
            out.append(n.lineno)
    return out


def long_functions(tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > limit]


def builds_prediction(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "Prediction"
               for n in ast.walk(tree))


def counts() -> dict[str, list[str]]:
    """Each count's places, ``path:line``."""
    out: dict[str, list[str]] = {"mode comparisons": [], "ArgumentParser constructions": [],
                                 "private argparse": [], "long functions": [], "tests building Prediction": []}
    for f, tree in _trees("src"):
        rel = f.relative_to(ROOT / "src" / "hetrain")
        out["mode comparisons"] += [f"{rel}:{k}" for k in mode_comparisons(tree)]
        out["ArgumentParser constructions"] += [f"{rel}:{k}" for k in parser_constructions(tree)]
        out["private argparse"] += [f"{rel}:{k}" for k in private_argparse(tree)]
        out["long functions"] += [f"{rel}:{name} ({n} lines)" for name, n in long_functions(tree)
                                  if f"{rel}:{name}" not in LONG_ALLOWED]
    out["tests building Prediction"] = [str(f.relative_to(ROOT)) for f, tree in _trees("tests")
                                        if builds_prediction(tree)]
    return out


LIMITS = {"mode comparisons": 3, "ArgumentParser constructions": 2, "private argparse": 0, "long functions": 0,
          "tests building Prediction": 3}


def test_the_code_keeps_its_shape() -> None:
    over = {k: v for k, v in counts().items() if len(v) > LIMITS[k]}
    assert over == {}, f"over the limits {LIMITS}: {over}"


def test_the_counters_can_fail() -> None:
    """Each counter on a hand-made source that breaks its rule, and on one that keeps it."""
    bad = ast.parse('if plan.sync == "daso" or mode in ("wsp", "bsp"):\n    p = argparse.ArgumentParser()\n'
                    'x = p._actions\ny = argparse._StoreConstAction\n'
                    'match m:\n    case "local-sgd":\n        pass\n')
    assert mode_comparisons(bad) == [1, 1, 6]
    assert parser_constructions(bad) == [2]
    assert private_argparse(bad) == [3, 4]
    good = ast.parse('if mode.steps_on_local_mean:\n    parser.add_argument("--sync", choices=names)\n')
    assert (mode_comparisons(good), parser_constructions(good), private_argparse(good)) == ([], [], [])
    body = "\n".join("    x = 1" for _ in range(MAX_FUNCTION_LINES))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(ast.parse("def f():\n    return 1\n")) == []
    assert builds_prediction(ast.parse("p = Prediction(0, 0, 0, 0, 0)\n"))
    assert not builds_prediction(ast.parse("p = make_plan()\n"))


def main() -> None:
    for name, places in counts().items():
        print(f"{name}: {len(places)} (limit {LIMITS[name]})")
        for where in places:
            print(f"    {where}")


if __name__ == "__main__":
    sys.exit(main())

"""The import arrow (DESIGN.md, "One arrow, one direction"), read from the source with ``ast``.

- No import cycle among the modules of ``src/hetrain`` outside ``emulate/``.
- Every module imports only from its own layer or the layers below it (``LAYERS``), so the
  planner never reaches the simulator, the profiler never the runtime, and nothing below the
  application layer reaches it.
- The planning side imports no torch (DESIGN.md decision 3).

Imports inside functions count: a deferred import is still an arrow. Run as a script to print
the graph, the module sizes and the longest functions::

    python tests/test_imports.py            # graph, then the sizes
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: the layers, lowest first; a module may import from its own layer and the ones before it
LAYERS: tuple[tuple[str, ...], ...] = (
    # hetrain.cli: the command table and its dispatcher, which names each command's module (a string, imported
    # when the command runs) and imports only errors, so that a command's own module may hand it its argv
    ("hetrain.errors", "hetrain.units", "hetrain.version", "hetrain.fields", "hetrain.arguments", "hetrain.options",
     "hetrain.sync_mode", "hetrain.cli"),
    ("hetrain.catalog",),
    ("hetrain.cluster", "hetrain.device_groups"),
    ("hetrain.profile",),
    ("hetrain.cost", "hetrain.time_model", "hetrain.fit", "hetrain.profile_combine"),
    ("hetrain.sync_layout",),
    ("hetrain.plan",),
    ("hetrain.planner", "hetrain.schedule", "hetrain.timeline", "hetrain.models.analytic", "hetrain.models.hf_analytic",
     "hetrain.models.analytic_figures", "hetrain.models.spec", "hetrain.data.sharding",
     "hetrain.imports"),
    ("hetrain.simulator",),
    ("hetrain.calibrate", "hetrain.planning", "hetrain.elastic", "hetrain.drift"),
    ("hetrain.models", "hetrain.data", "hetrain.amp"),
    ("hetrain.distributed",),
    ("hetrain.profiler",),
    ("hetrain.runtime",),
    ("hetrain.baselines", "hetrain.report", "hetrain.cluster_fixups", "hetrain.emulate", "hetrain.demo",
     "hetrain.commands", "hetrain.__main__", "hetrain"),
)
#: the planning side: pure Python (numpy allowed), no torch
PLANNING = LAYERS[:10]


def module_files() -> dict[str, Path]:
    out = {}
    for f in sorted((SRC / "hetrain").rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once for all the checks."""
    return ast.parse(path.read_text())


def imports_of(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(hetrain modules imported, top-level third-party packages imported) by the file, anywhere in it."""
    ours, theirs = set(), set()
    for node in ast.walk(_tree(path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        for name in names:
            if name == "hetrain" or name.startswith("hetrain."):
                ours.add(_resolve(name, modules))
            else:
                theirs.add(name.split(".")[0])
    return ours, theirs


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imports_of(f, modules)[0] - {m} for m, f in modules.items()}


def layer_of(module: str) -> int:
    best, where = -1, -1
    for k, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), k
    return where


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_outside_the_emulator() -> None:
    graph = {m: {t for t in ts if not t.startswith("hetrain.emulate")} for m, ts in import_graph().items()
             if not m.startswith("hetrain.emulate")}
    assert find_cycles(graph) == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in module_files() if layer_of(m) < 0] == []


def test_imports_go_down_the_layers_only() -> None:
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, targets in sorted(import_graph().items()) for t in sorted(targets)
              if layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_planning_side_imports_no_torch() -> None:
    modules = module_files()
    planning = {p for layer in PLANNING for p in layer}
    bad = [m for m, f in modules.items() if layer_of(m) < len(PLANNING) and "torch" in imports_of(f, modules)[1]]
    assert planning and bad == []


def test_the_checks_can_fail() -> None:
    """The cycle finder and the layer lookup on hand-made inputs."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("hetrain.planner.search") < layer_of("hetrain.simulator") \
        < layer_of("hetrain.runtime.sync.allreduce")
    assert layer_of("hetrain.profiler.network") < layer_of("hetrain.runtime.sync.allreduce")


def _longest_functions(path: Path, top: int) -> list[tuple[int, str]]:
    rows = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            rows.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(SRC)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    graph = import_graph()
    print("import graph (module -> hetrain modules it imports):")
    for m in sorted(graph):
        print(f"  [{layer_of(m):2}] {m} -> {', '.join(sorted(graph[m])) or '-'}")
    print("\ncycles outside emulate/:", find_cycles({m: {t for t in ts if not t.startswith("hetrain.emulate")}
                                                    for m, ts in graph.items()
                                                    if not m.startswith("hetrain.emulate")}) or "none")
    files = module_files()
    print("\nlargest modules (lines):")
    for n, m in sorted(((len(f.read_text().splitlines()), m) for m, f in files.items()), reverse=True)[:15]:
        print(f"  {n:5} {m}")
    print("\nlongest functions (lines):")
    for n, where in sorted((r for f in files.values() for r in _longest_functions(f, 3)), reverse=True)[:15]:
        print(f"  {n:5} {where}")


if __name__ == "__main__":
    sys.exit(main())

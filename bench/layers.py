"""fedsim's import graph, read from the source (no import runs): cycles, layers, what the ClientApp pulls in,
and the longest functions.

    python bench/layers.py            # the figures
    python bench/layers.py --edges    # and every import inside a cycle

Every ``import`` of a fedsim module counts, at module level or inside a function (a lazy import is still a
dependency); ``if TYPE_CHECKING:`` blocks do not. A graph without cycles has layers (a module's layer is one
above the highest module it imports), so no import runs upward. ``tests/test_layers.py`` holds the targets.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (("fedsim", "fedsim"), ("strategies", "fedsim.strategies"))  # source folder -> installed name
# Modules whose code runs only on the server (or the simulation's driver): the ClientApp must import none.
SERVER_SIDE = (
    "fedsim.server",
    "fedsim.async_server",
    "fedsim.server_app",
    "fedsim.run",
    "fedsim.cli",
    "fedsim.experiment",
    "fedsim.engines",
    "fedsim.attacks",
    "fedsim.compression",
    "fedsim.selection",
    "fedsim.sweep",
    "fedsim.callbacks",
    "fedsim.checkpoint",
    "fedsim.recorder",
    "fedsim.strategies.base",
    "fedsim.strategies.composition",
    "fedsim.strategies.wrapper",
    "fedsim.strategies.clip_wrapper",
)
CLIENT_APP = "fedsim.client_app"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every fedsim module (installed name) and its file; the config package is data, left out."""
    out = {}
    for folder, package in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            if "conf" in rel.parts:
                continue
            parts = [package, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool]]:
    """Each import statement and whether it runs at module level (not inside a function)."""

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            yield from walk(child, inner)

    return walk(tree, True)


def graph(root: Path = ROOT) -> dict[str, dict[str, bool]]:
    """module -> {imported fedsim module: True when some import of it runs at module level}."""
    known = modules(root)
    edges: dict[str, dict[str, bool]] = {m: {} for m in known}
    for mod, path in known.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node, top in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for name in names:
                target = _resolve(name, known)
                if target and target != mod:
                    edges[mod][target] = edges[mod].get(target, False) or top
    return edges


def cycles(edges: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def layers(edges: dict[str, dict[str, bool]]) -> dict[str, int]:
    """Each module's layer (0: imports no fedsim module); the graph must have no cycles."""
    depth: dict[str, int] = {}

    def layer(v: str) -> int:
        if v not in depth:
            depth[v] = 1 + max((layer(w) for w in edges.get(v, {})), default=-1)
        return depth[v]

    for v in edges:
        layer(v)
    return depth


def closure(edges: dict[str, dict[str, bool]], start: str, module_level: bool) -> set[str]:
    """What importing ``start`` imports (at module level only, or with every lazy import too)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w, top in edges.get(todo.pop(), {}).items():
            if (top or not module_level) and w not in seen:
                seen.add(w)
                todo.append(w)
    seen.discard(start)
    return seen


def is_server_side(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in SERVER_SIDE)


def longest_functions(root: Path = ROOT, n: int = 15) -> list[tuple[int, str]]:
    """The ``n`` longest functions (lines, ``module:qualified name``)."""
    out = []
    for mod, path in modules(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def walk(node: ast.AST, prefix: str, mod: str = mod) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((child.end_lineno - child.lineno + 1, f"{mod}:{prefix}{child.name}"))
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

        walk(tree, "")
    return sorted(out, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--edges", action="store_true", help="list every import inside a cycle")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    a = p.parse_args(argv)
    edges = graph(a.root)
    found = cycles(edges)
    inside = [(u, v) for comp in found for u in comp for v in edges[u] if v in comp]
    print(f"modules {len(edges)}, imports {sum(len(v) for v in edges.values())}")
    print(f"import cycles {len(found)}, imports inside a cycle (running upward) {len(inside)}")
    for comp in found:
        print("  cycle:", ", ".join(comp))
    if a.edges:
        for u, v in inside:
            print(f"    {u} -> {v} ({'module level' if edges[u][v] else 'lazy'})")
    if not found:
        print(f"layers {max(layers(edges).values()) + 1}")
    direct = sorted(edges[CLIENT_APP])
    top = closure(edges, CLIENT_APP, module_level=True)
    print(f"{CLIENT_APP} imports {len(direct)} fedsim modules: {', '.join(direct)}")
    print(
        f"  with theirs, at module level: {len(top)}; server-side among them: {sorted(filter(is_server_side, top))}"
    )
    print("longest functions:")
    for lines, name in longest_functions(a.root):
        print(f"  {lines:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fedsim's import graph, read from the source (no import runs): cycles, the declared layers, what the ClientApp
pulls in, and the longest functions.

    python bench/layers.py            # the figures
    python bench/layers.py --edges    # and every import inside a cycle

Every ``import`` of a fedsim module counts, at module level or inside a function (a lazy import is still a
dependency); ``if TYPE_CHECKING:`` blocks do not. ``tests/test_layers.py`` holds the targets.

Units and layers. A unit is a sub-folder of the package (``algorithms/``, ``data/``, ``deploy/``, ``engines/``,
``features/`` and ``strategies/``, installed as ``fedsim.strategies``), counted whole, or one top-level module
of ``fedsim/``. ``LAYERS`` puts every unit in one named layer, lowest first; a unit imports only units of its
own layer or of a layer below, and units import one another in no circle. The order, and why:

core
    The vocabulary both sides share and no feature owns: errors, keys, seeds, range checks, config
    composition, the run's knobs, tasks and models, local-training settings, plain data.
data
    Data sets, partitioners and their cache, a SuperNode's data folder: the model's inputs, nothing of a
    round.
wire
    What crosses the grid and how it is read: Flower records to numpy and back, the aggregation math on
    them, the train message and the Cohort, byte counting and codecs, the one reply screen, grid helpers.
    Client and server halves both speak it, so it sits below both.
client
    The client side's framework: the client algorithm's contract and the client halves' (``algorithms/``:
    base, halves with the ClientChain, state), the training loop. It names no feature: the run spec names the
    halves (class paths ``fedsim.build`` writes from the classes the server halves import), and the chain
    builds them the way a ``_target_`` is built.
server
    The server side's framework: the strategies that stand alone and the wrappers' base (``strategies/``),
    the node binding's gate.
features
    One folder per feature holding both its halves (``features/<feature>/``: ``client.py``, ``server.py``):
    attacks, compression, selection, clipping and DP, faults, SCAFFOLD, FedDyn, Ditto and FedPer; and
    simulated time. A feature needs the client framework and the server framework, so it sits above both, and
    keeping its halves together puts one feature in one place instead of one half in each framework. The
    server half imports its client half (``client_half = FlipLabels``), never the other way round; no
    ``__init__`` in ``features/`` imports anything, so a ClientApp that builds a client half loads no server
    code (``SERVER_SIDE`` and :func:`is_server_side` name the server halves).
aliases
    The old import paths of moved features (``fedsim.attacks``, ``compression``, ``selection``, ``faults``):
    names re-exported from ``features/``, above it, for users' configs and code; no fedsim module imports
    them.
outputs
    What a run writes and reads back: metrics files, figures, callbacks, checkpoints, the run folder.
assembly
    A config turned into objects: the client task and spec (build), the strategy with its wrappers and the
    client algorithm bound to it (build_server), a SuperNode's task from its own data (node_data).
loops
    The synchronous and asynchronous server loops.
apps
    The Flower apps' own layer of a deployed run: run_config, run_spec, admission and the ClientApp (a node
    derives the server's client spec to check a message against it, so it sits above assembly).
engines
    Backends that run ClientApps in a simulation (``engines/``).
run
    One experiment composed, checked and run; the ServerApp that runs one on a deployed grid.
entry
    Command lines: ``fedsim`` (cli, ``python -m fedsim``), sweeps, ``python -m fedsim.deploy`` (``deploy/``).
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
    "fedsim.node_binding",
    "fedsim.strategies.base",
    "fedsim.strategies.composition",
    "fedsim.strategies.wrapper",
    "fedsim.features.clipping.wrapper",
    "fedsim.features.clipping.rows",
    "fedsim.features.clipping.accounting",
    "fedsim.features.clipping.privacy_table",
)
CLIENT_APP = "fedsim.client_app"

# The layers, lowest first (see the module docstring): every unit in exactly one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "__init__",
            "errors",
            "keys",
            "schema",
            "seeds",
            "checks",
            "procs",
            "progress",
            "override_check",
            "config",
            "groups",
            "validate",
            "state",
            "tasks",
            "models",
            "local",
            "safe_pickle",
            "checkpoint_fields",
        ),
    ),
    ("data", ("data/", "partition_cache")),
    ("wire", ("records", "aggregate", "comm", "codecs", "messages", "screen", "grid_utils")),
    ("client", ("algorithms/", "training")),
    ("server", ("strategies/", "node_binding")),
    ("features", ("features/", "clock")),
    ("aliases", ("attacks", "compression", "selection", "faults")),
    ("outputs", ("figures", "recorder", "callbacks", "checkpoint", "run_folder")),
    ("assembly", ("build", "build_server", "node_data")),
    ("loops", ("server", "async_server")),
    ("apps", ("run_config", "run_spec", "admission", "client_app")),
    ("engines", ("engines/",)),
    ("run", ("experiment", "run", "server_app")),
    ("entry", ("cli", "__main__", "sweep", "deploy/")),
)


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


def unit(path: Path, root: Path = ROOT) -> str:
    """A file's unit: ``name/`` for a file anywhere in a sub-folder (``strategies/`` is one), else the module's
    name (``__init__`` and ``__main__`` of ``fedsim/`` are units of their own)."""
    rel = path.relative_to(root)
    if rel.parts[0] != "fedsim":
        return f"{rel.parts[0]}/"
    return f"{rel.parts[1]}/" if len(rel.parts) > 2 else path.stem


def unit_graph(root: Path = ROOT) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """unit -> {imported unit: the module imports behind it}; imports inside a unit are left out."""
    known = modules(root)
    units = {mod: unit(path, root) for mod, path in known.items()}
    out: dict[str, dict[str, list[tuple[str, str]]]] = {u: {} for u in units.values()}
    for mod, targets in graph(root).items():
        for target in targets:
            if units[mod] != units[target]:
                out[units[mod]].setdefault(units[target], []).append((mod, target))
    return out


def layer_of(declared: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> dict[str, tuple[int, str]]:
    """unit -> (the layer's rank, its name)."""
    return {u: (rank, name) for rank, (name, units) in enumerate(declared) for u in units}


def layer_violations(
    root: Path = ROOT, declared: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[str]:
    """One line for each unit in no layer (or in two), each unit declared that does not exist, each circle of
    units, and each import from a unit into a higher layer than its own."""
    units = unit_graph(root)
    where = layer_of(declared)
    names = [u for _, us in declared for u in us]
    out = [f"unit {u} is in more than one layer" for u in sorted({u for u in names if names.count(u) > 1})]
    out += [f"unit {u} is in no layer of LAYERS" for u in sorted(set(units) - set(where))]
    out += [f"unit {u} is declared in LAYERS but does not exist" for u in sorted(set(where) - set(units))]
    out += [f"units in a circle: {', '.join(c)}" for c in cycles(units)]
    for u, targets in sorted(units.items()):
        for v, imports in sorted(targets.items()):
            if u in where and v in where and where[v][0] > where[u][0]:
                mod, target = imports[0]
                more = f" (and {len(imports) - 1} more)" if len(imports) > 1 else ""
                out.append(
                    f"{mod} ({u}, layer {where[u][1]}) imports {target} ({v}, layer {where[v][1]}): upward{more}"
                )
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
    """In ``SERVER_SIDE``, or a feature's server half (``fedsim.features.<feature>.server``)."""
    feature_server = module.startswith("fedsim.features.") and module.endswith(".server")
    return feature_server or any(module == s or module.startswith(s + ".") for s in SERVER_SIDE)


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
        print(f"module layers {max(layers(edges).values()) + 1} (derived from the graph)")
    units = unit_graph(a.root)
    print(f"units {len(units)} (each sub-folder counted whole), declared layers {len(LAYERS)}, lowest first:")
    for name, members in LAYERS:
        print(f"  {name:9s} {' '.join(members)}")
    wrong = layer_violations(a.root)
    print(f"unit circles and imports against the declared order: {len(wrong)}")
    for line in wrong:
        print("  ", line)
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

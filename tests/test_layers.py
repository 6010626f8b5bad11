"""The import graph (bench/layers.py reads it from the source, lazy imports counted): no module cycles; the units
(each sub-folder counted whole, each top-level module) in the declared layers, with no circle between units and
no import against the declared order; a ClientApp that imports a handful of modules, none of them server-side."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fedsim_layers", ROOT / "bench" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def test_the_import_graph_has_no_cycles():
    edges = layers.graph()
    assert len(edges) > 90 and "fedsim.strategies.fedavg" in edges and "fedsim.client_app" in edges
    assert layers.cycles(edges) == []
    depth = layers.layers(edges)
    assert all(depth[u] > depth[v] for u in edges for v in edges[u])  # every import runs downward


def test_the_client_app_imports_six_modules_and_nothing_server_side():
    edges = layers.graph()
    assert len(edges[layers.CLIENT_APP]) <= 6, sorted(edges[layers.CLIENT_APP])
    top = layers.closure(edges, layers.CLIENT_APP, module_level=True)
    assert "fedsim.training" in top and "fedsim.algorithms.halves" in top
    assert not sorted(filter(layers.is_server_side, top))


def test_the_scanner_sees_lazy_and_relative_imports_and_finds_a_cycle(tmp_path):
    pkg = tmp_path / "fedsim"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "strategies").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fedsim import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(
        "import fedsim.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fedsim.b\n"
    )
    edges = layers.graph(tmp_path)
    assert edges["fedsim.a"] == {"fedsim.b": True} and edges["fedsim.b"] == {"fedsim.sub.c": False}
    assert edges["fedsim.sub.c"] == {"fedsim.a": True}  # the TYPE_CHECKING import is not a dependency
    assert layers.cycles(edges) == [["fedsim.a", "fedsim.b", "fedsim.sub.c"]]
    assert layers.closure(edges, "fedsim.a", module_level=True) == {"fedsim.b"}


def test_the_units_keep_the_declared_layer_order_with_no_circle_between_folders():
    units = layers.unit_graph()
    assert {"algorithms/", "data/", "deploy/", "engines/", "strategies/", "messages", "client_app"} <= set(
        units
    )
    assert "fedsim.strategies.fedavg" not in units and not any("." in u for u in units)  # folders count whole
    # a lazy import counts: run_spec builds the server's strategy inside a function
    assert ("fedsim.run_spec", "fedsim.build_server") in units["run_spec"]["build_server"]
    wrong = layers.layer_violations()
    assert wrong == [], "\n".join(wrong)


def test_the_layer_check_names_an_upward_import_a_circle_of_folders_and_an_undeclared_unit(tmp_path):
    pkg = tmp_path / "fedsim"
    for folder in (pkg / "low", pkg / "high", tmp_path / "strategies"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from fedsim.high import b\n")  # lazy, and upward
    (pkg / "high" / "b.py").write_text("X = 1\n")
    (pkg / "high" / "c.py").write_text("from ..low import d\n")  # no module cycle, but low/ <-> high/
    (pkg / "low" / "d.py").write_text("")
    (pkg / "util.py").write_text("import fedsim.low.a\n")
    (tmp_path / "strategies" / "s.py").write_text("from fedsim import util\n")
    assert layers.cycles(layers.graph(tmp_path)) == []
    declared = (("bottom", ("__init__", "low/")), ("top", ("high/", "strategies/", "ghost")))
    assert layers.layer_violations(tmp_path, declared) == [
        "unit util is in no layer of LAYERS",
        "unit ghost is declared in LAYERS but does not exist",
        "units in a circle: high/, low/",
        "fedsim.low.a (low/, layer bottom) imports fedsim.high.b (high/, layer top): upward",
    ]
    both = (("bottom", ("__init__", "low/", "util")), ("top", ("high/", "low/", "strategies/")))
    assert layers.layer_violations(tmp_path, both)[0] == "unit low/ is in more than one layer"
    fine = (("bottom", ("__init__", "low/", "high/")), ("top", ("util", "strategies/")))
    assert layers.layer_violations(tmp_path, fine) == ["units in a circle: high/, low/"]


# The code a round runs (the server loops, the engines, the strategies and wrappers, the screen, the client's
# training and its halves): no function of it over FUNCTION_LIMIT lines. Constructors (``__init__``) run once,
# when the run is built, and so does node discovery; they are not on it.
ROUND_PATH = (
    "fedsim.server",
    "fedsim.async_server",
    "fedsim.engines",
    "fedsim.strategies",
    "fedsim.screen",
    "fedsim.grid_utils",
    "fedsim.client_app",
    "fedsim.messages",
    "fedsim.training",
    "fedsim.local",
    "fedsim.algorithms",
    "fedsim.attacks",
    "fedsim.faults",
    "fedsim.compression",
    "fedsim.selection",
    "fedsim.comm",
    "fedsim.codecs",
    "fedsim.records",
    "fedsim.aggregate",
)
START_UP = frozenset({"fedsim.grid_utils:discover"})
FILE_LIMIT, FUNCTION_LIMIT = 600, 60


def _on_round_path(name: str) -> bool:
    module, _, qualified = name.partition(":")
    on = any(module == m or module.startswith(m + ".") for m in ROUND_PATH)
    return on and qualified.rpartition(".")[2] != "__init__" and name not in START_UP


def long_files(root: Path = ROOT) -> dict[str, int]:
    """The files of fedsim/ and strategies/ over FILE_LIMIT lines, with their lengths."""
    out = {}
    for path in layers.modules(root).values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > FILE_LIMIT:
            out[str(path.relative_to(root))] = n
    return out


def long_round_functions(root: Path = ROOT) -> list[tuple[int, str]]:
    """The functions on the round path over FUNCTION_LIMIT lines (lines, ``module:qualified name``)."""
    every = layers.longest_functions(root, n=10**6)
    return [(n, name) for n, name in every if n > FUNCTION_LIMIT and _on_round_path(name)]


def test_no_file_of_fedsim_or_strategies_is_over_600_lines():
    assert long_files() == {}, f"over {FILE_LIMIT} lines: {long_files()}"


def test_no_function_on_the_round_path_is_over_60_lines():
    assert long_round_functions() == [], f"over {FUNCTION_LIMIT} lines: {long_round_functions()}"


def test_the_size_checks_name_a_long_file_and_a_long_round_function(tmp_path):
    pkg = tmp_path / "fedsim"
    (pkg / "engines").mkdir(parents=True)
    (tmp_path / "strategies").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engines" / "__init__.py").write_text("")
    body = "    x = 1\n" * 60  # 61 lines with the def
    (pkg / "engines" / "fast.py").write_text(
        f"class G:\n    def step(self):\n    {body.replace(chr(10), chr(10) + '    ')}"
    )
    (pkg / "server.py").write_text(f"def __init__():\n{body}\ndef short():\n    pass\n")
    (pkg / "cli.py").write_text(f"def main():\n{body}" + "# filler\n" * 540)
    assert long_files(tmp_path) == {"fedsim/cli.py": 601}
    assert long_round_functions(tmp_path) == [
        (61, "fedsim.engines.fast:G.step")
    ]  # cli and __init__: not on it

"""The import graph (bench/layers.py reads it from the source): no cycles, so no import runs upward, and a
ClientApp that imports a handful of modules, none of them server-side."""

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

"""Each feature's two halves in one folder (``fedsim.features``): the client halves import nothing server-side, the
client layer names no feature, the run spec names the halves the server halves import, old import paths and
checkpoints written before the move still work."""

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim import checkpoint

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fedsim_layers", ROOT / "bench" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def test_every_client_half_of_a_feature_imports_nothing_server_side():
    edges = layers.graph()
    clients = [m for m in edges if m.startswith("fedsim.features.") and m.endswith(".client")]
    assert len(clients) >= 5
    for mod in clients:
        every = layers.closure(edges, mod, module_level=False)  # lazy imports too
        assert "fedsim.algorithms.halves" in every or "fedsim.algorithms.base" in every, mod
        assert not sorted(filter(layers.is_server_side, every)), mod
        assert not any(m.startswith("fedsim.strategies") for m in every), mod


def test_the_client_layer_names_no_feature():
    """The chain finds the halves in the spec, which the server halves' imports name: no class path of a
    feature is written in the client layer's code (its strings, docstrings aside)."""
    for path in (ROOT / "fedsim" / "algorithms").glob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n) is not None
        }
        strings = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
        ]
        assert not [s for s in strings if "features" in s], path.name


def test_the_spec_names_the_halves_the_server_halves_import():
    from fedsim.algorithms.halves import chain
    from fedsim.build import client_spec
    from fedsim.features.attacks.client import FlipLabels
    from fedsim.features.attacks.server import LabelFlip
    from fedsim.features.clipping.client import ClientClipping
    from fedsim.features.compression.client import Compress
    from fedsim.features.compression.server import TopK
    from fedsim.features.faults.client import InjectedFaults

    assert LabelFlip.client_half is FlipLabels and TopK.client_half is Compress
    spec = client_spec(compose_cfg(*TINY, "attack=label_flip", "compression=topk"), "cpu")
    named = json.loads(spec)["halves"]
    assert named == [
        "fedsim.features.clipping.client.ClientClipping",
        "fedsim.features.faults.client.InjectedFaults",
        "fedsim.features.compression.client.Compress",
        "fedsim.features.attacks.client.FlipLabels",
    ]
    assert [type(h) for h in chain(spec)] == [ClientClipping, InjectedFaults, Compress, FlipLabels]
    plain = client_spec(compose_cfg(*TINY), "cpu")
    assert [type(h) for h in chain(plain)] == [ClientClipping, InjectedFaults]


def test_the_old_import_paths_name_the_same_classes():
    import fedsim.attacks
    import fedsim.compression
    import fedsim.faults
    import fedsim.selection
    from fedsim.features.attacks import server as attacks
    from fedsim.features.compression import server as compression
    from fedsim.features.faults import client as faults
    from fedsim.features.selection import server as selection

    assert fedsim.attacks.SignFlip is attacks.SignFlip and fedsim.attacks.LabelFlip is attacks.LabelFlip
    assert fedsim.compression.TopK is compression.TopK and fedsim.compression.QSGD is compression.QSGD
    assert fedsim.selection.PowerOfChoice is selection.PowerOfChoice
    assert fedsim.faults.FaultRates is faults.FaultRates


def _as_before_the_move(node):
    """A checkpoint's data with every moved class named as fedsim named it before the move."""
    from fedsim.strategies.base import MOVED_MODULES

    if isinstance(node, dict):
        return {k: _as_before_the_move(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_before_the_move(v) for v in node]
    if isinstance(node, str):
        for old, new in MOVED_MODULES.items():
            if node.startswith(new + "."):
                return old + node[len(new) :]
    return node


@pytest.mark.slow
@pytest.mark.parametrize(
    "feature, old",
    [
        (["attack=sign_flip", "attack.fraction=0.3"], "fedsim.attacks.SignFlip"),
        (["strategy=scaffold"], "fedsim.strategies.scaffold.Scaffold"),
        (["clipping=fixed", "clipping.clip_norm=0.5"], "fedsim.strategies.clipping.FixedClipping"),
    ],
)
def test_a_checkpoint_written_before_the_move_resumes_bit_identical(tmp_path, feature, old):
    """A run folder whose checkpoint names a moved class by its old path (``fedsim.attacks.SignFlip`` or
    ``fedsim.strategies.scaffold.Scaffold``: its config's ``_target_`` and the stored strategy state) resumes,
    and the resumed run equals the run made in one go (SCAFFOLD's clients keep their control variates)."""
    over = [*feature, "checkpoint_every=1"]
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    run_tiny(full, *over, "num_rounds=3")
    run_tiny(part, *over, "num_rounds=2")
    path = part / "checkpoint.pt"
    ckpt = checkpoint._torch_load(path)  # the file as written, plain data
    before = {
        k: (_as_before_the_move(v) if k in ("config", "strategy_attrs") else v) for k, v in ckpt.items()
    }
    targets = [section.get("_target_") for section in before["config"].values() if isinstance(section, dict)]
    assert old in targets and old in json.dumps(before["strategy_attrs"])
    torch.save(before, path)
    summary = run_tiny(resumed, *over, "num_rounds=3", f"resume={path}")
    assert summary["rounds_done"] == 3
    assert without_wall_time(read_metrics(resumed)) == without_wall_time(read_metrics(full))
    a, b = torch.load(resumed / "model.pt"), torch.load(full / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_feature_folder_is_a_package_the_wheel_ships():
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = [p.parent for p in (ROOT / "fedsim" / "features").rglob("__init__.py")]
    assert len(folders) >= 9
    for folder in folders:
        assert ".".join(folder.relative_to(ROOT).parts) in packages, folder.name


def test_nothing_of_fedsim_imports_the_old_paths():
    """``fedsim.attacks`` and friends are aliases for users: fedsim's own modules import the features."""
    aliases = {"fedsim.attacks", "fedsim.compression", "fedsim.selection", "fedsim.faults"}
    edges = layers.graph()
    assert aliases <= set(edges)
    assert not sorted((m, t) for m, targets in edges.items() for t in targets if t in aliases)


def test_building_every_shipped_client_half_loads_no_server_code():
    """At run time too: a process that builds the chain of a spec naming every shipped client half imports no
    server half and no strategy module (Flower's own package imports its server side whatever fedsim does)."""
    import subprocess
    import sys

    from fedsim.build import client_spec

    cfg = compose_cfg(*TINY, "attack=label_flip", "compression=topk", "selection=power_of_choice")
    spec = client_spec(cfg, "cpu")
    assert len(json.loads(spec)["halves"]) == 5
    code = (
        "import json, sys\n"
        "from fedsim.algorithms.halves import chain\n"
        "print(json.dumps([len(chain(sys.stdin.read())), sorted(sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=spec, capture_output=True, text=True, check=True)
    built, loaded = json.loads(out.stdout)
    assert built == 5 and "fedsim.features.attacks.client" in loaded
    mine = [m for m in loaded if m.startswith("fedsim")]
    server = [m for m in mine if layers.is_server_side(m) or m.startswith("fedsim.strategies.")]
    assert server == [], server

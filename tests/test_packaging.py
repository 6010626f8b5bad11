"""The package as users install it: one top-level package, and no clash with a user's own ``strategies/``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fedsim.config import FLOWER_ENV

ROOT = Path(__file__).resolve().parent.parent


def tracked_sources(checkout: Path) -> list[str]:
    """The files git tracks in the checkout's three source folders (fedsim/, strategies/, conf/)."""
    return subprocess.run(
        ["git", "ls-files", "fedsim", "strategies", "conf"],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


@pytest.mark.slow  # a fedsim subprocess
def test_fedsim_runs_from_a_folder_holding_its_own_strategies_package(tmp_path):
    # a research project with its own `strategies` package (and a PyPI package of that name could exist too)
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "__init__.py").write_text("raise ImportError('not fedsim')\n")
    (tmp_path / "strategies" / "fedavg.py").write_text("FedAvg = None\n")
    env = {**os.environ, **FLOWER_ENV, "PYTHONPATH": str(tmp_path)}
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "num_rounds=1",
            "num_clients=4",
            "clients_per_round=2",
            "quiet=true",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["config"]["strategy"]["_target_"] == "fedsim.strategies.fedavg.FedAvg"


@pytest.mark.slow
def test_wheel_from_a_clean_clone_installs_only_fedsim(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",  # the build backend's warnings
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(clone),
        ],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    # every folder of the tree that ships is a package setuptools was told of (it warns of one it was not)
    assert "is absent from the `packages` configuration" not in built.stdout + built.stderr
    [wheel] = tmp_path.glob("fedsim_flower-*.whl")  # the distribution name; the import name is fedsim
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"fedsim", wheel.name.split("-py")[0] + ".dist-info"}, top
    assert "fedsim/strategies/base.py" in names and "fedsim/conf/config.yaml" in names
    # every file git tracks in the three source folders is in the wheel (a subpackage missing from
    # pyproject's `packages` installs a fedsim that cannot import itself)
    where = {"fedsim": "fedsim", "strategies": "fedsim/strategies", "conf": "fedsim/conf"}
    wanted = {
        where[t.split("/")[0]] + t[len(t.split("/")[0]) :]
        for t in tracked_sources(clone)
        if t.endswith((".py", ".yaml"))
    }
    assert wanted and not wanted - set(names), sorted(wanted - set(names))[:5]


def test_the_app_bundle_holds_every_file_the_apps_run_and_nothing_else():
    """``flwr run`` packs ``fab-include`` (pyproject.toml): all of fedsim/, strategies/ and conf/ that git
    tracks, and no docs, tests or benchmarks, which every SuperNode would unpack for every message."""
    import io

    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("needs the git checkout")
    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(root))).namelist())
    tracked = tracked_sources(root)
    assert tracked and set(tracked) <= names, sorted(set(tracked) - names)[:5]
    assert not {n for n in names if n.split("/")[0] in ("tests", "docs", "bench", "notebooks")}
    assert "LICENSE" in names


def test_the_layout_page_names_every_module_script_and_notebook():
    """docs/layout.md names every module of fedsim/ and strategies/ (subpackages as ``name/``), every bench
    script and every notebook, so a module added without a word in the docs fails here."""
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "layout.md").read_text()
    block = text[text.index("```\n") :]
    block = block[: block.index("```\n", 4)]
    words = set(re.findall(r"[A-Za-z0-9_]+(?:\.py)?/?", block))
    missing = []
    for folder in ("fedsim", "strategies"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder)
            if path.name != "__init__.py" and path.stem not in words and path.stem != "__main__":
                missing.append(str(path.relative_to(root)))
            if len(rel.parts) > 1 and f"{rel.parts[0]}/" not in words:
                missing.append(f"{folder}/{rel.parts[0]}/")
    missing += [f"bench/{p.name}" for p in sorted((root / "bench").glob("*.py")) if p.name not in words]
    missing += [
        f"notebooks/{p.stem}" for p in sorted((root / "notebooks").glob("*.ipynb")) if p.stem not in words
    ]
    assert not sorted(set(missing)), f"docs/layout.md does not name: {sorted(set(missing))}"

"""The README is a front page and docs/ is a site: every page in mkdocs.yml's nav, the Quick start commands the
ones .ci/run runs, the README's links pointing at files that exist, and (where MkDocs is installed) a strict
build of the whole site, API reference included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


class _NavLoader(yaml.SafeLoader):
    """mkdocs.yml with its ``!!python/...`` tags (the toc's slugify) read as None: only the nav matters here."""


_NavLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def mkdocs_config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_NavLoader)


def nav_pages(nav) -> list[str]:
    """Every page file a MkDocs nav names, in order (nested sections included)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


def test_the_readme_is_a_front_page_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert "## Quick start" in headings


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = nav_pages(mkdocs_config()["nav"])
    docs = ROOT / "docs"
    on_disk = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert not on_disk - set(pages), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - set(pages))}"
    assert not set(pages) - on_disk, f"nav entries with no file: {sorted(set(pages) - on_disk)}"
    assert len(pages) == len(set(pages)), "a page is in the nav twice"


def _ci_readme_block(n: int) -> str:
    """The README's Quick start block ``n``, extracted by .ci/run's own ``readme_block`` function (the oracle)."""
    ci = (ROOT / ".ci" / "run").read_text()
    func = ci[ci.index("readme_block() {") :]
    func = func[: func.index("\n}\n") + 3]
    return subprocess.run(
        ["bash", "-c", f"{func}readme_block {n}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.rstrip("\n")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("awk") is None, reason="needs bash and awk")
def test_the_quick_start_blocks_are_the_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    expected = re.search(r"\[ \"\$\(readme_block 2\)\" = '([^']*)' \]", ci)
    assert expected, ".ci/run no longer checks the README's second command"
    assert _ci_readme_block(2) == expected.group(1)
    first = _ci_readme_block(1)
    assert first == "pip install -e . && fedsim", first  # one line: CI runs it on a pseudo-terminal


def test_the_readmes_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://|#", t)]
    assert local, "the README links to no page"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing
    anchors = [t[1:] for t in targets if t.startswith("#")]
    slugs = {
        re.sub(r"[^\w\- ]", "", h[3:].strip().lower()).replace(" ", "-")
        for h in text.splitlines()
        if h.startswith("## ")
    }
    assert set(anchors) <= slugs, set(anchors) - slugs


def test_the_docs_extra_holds_the_site_builders():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0]: req for req in extras["docs"]}
    assert set(names) == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert names["mkdocstrings"].startswith("mkdocstrings[python]")
    assert all(">=" in req for req in names.values()), names


def test_the_site_builds_strictly_with_its_api_reference(tmp_path):
    """``mkdocs build --strict``: any broken link, anchor, nav entry or API reference is an error."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "strategies" / "index.html").read_text()
    assert 'id="fedsim.strategies.krum.Krum"' in reference  # the strategies/ folder under its import name
    errors = (tmp_path / "site" / "reference" / "errors" / "index.html").read_text()
    assert 'id="fedsim.errors.ConfigError"' in errors

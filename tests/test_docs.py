"""The README is a front page and docs/ is a site: every page in mkdocs.yml's nav, the Quick start commands the
ones .ci/run runs, the README's links pointing at files that exist, and (where MkDocs is installed) a strict
build of the whole site, API reference included."""

from __future__ import annotations

import importlib.util
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


# ---------------------------------------------------------------- tables of figures written from recorded output
def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_bench_table_in_the_docs_is_the_one_its_recorded_output_gives(capsys):
    """``python bench/tables.py --check`` from the checkout: the recorded outputs are committed, nothing runs."""
    tables = _bench_module("tables")
    assert tables.write_or_check(sorted((ROOT / "docs").rglob("*.md")), check=True) == 0, capsys.readouterr()
    held = [name for page in (ROOT / "docs").rglob("*.md") for name in tables.blocks(page.read_text())]
    assert sorted(held) == sorted(tables.TABLES)  # each table on one page, every generator used
    assert {"default-idle", "default-busy"} <= set(
        tables.blocks((ROOT / "docs" / "performance.md").read_text())
    )


def test_the_parser_reads_back_every_number_bench_prints():
    """bench.py's ``format_rows`` is the oracle: what it prints, parsed, gives its numbers at its precision."""
    bench, tables = _bench_module("bench"), _bench_module("tables")
    summary = {"wall": 12.345, "startup": 3.21, "round1": 1.5, "per_round": 0.0123, "peak_mb": 366.4}
    rows = [
        ("default", "auto", {**summary, "accuracy": 0.91357}),
        ("default", "torch", {**summary, "per_round": 0.0246, "wall": 6.0, "accuracy": 0.9}),
        ("default", "flower", {**summary, "per_round": None, "wall": 24.69, "accuracy": 0.9}),
    ]
    text = "\nheading line\n" + "\n".join(bench.format_rows(rows)) + "\n(default) plain torch / auto: 2.00\n"
    run = tables.parse_bench(text)
    assert run.heading == "heading line" and run.goals == ["(default) plain torch / auto: 2.00"]
    assert [(sc, v) for sc, v, _ in run.rows] == [(sc, v) for sc, v, _ in rows]
    auto, _, flower = (nums for _, _, nums in run.rows)
    assert auto == [
        12.35,
        3.21,
        1.5,
        0.012,
        366.0,
        0.9136,
        2.0,
        0.49,
        2.0,
    ]  # torch/this, flower/this by bench
    assert flower[3] is None and flower[6] is None and flower[8] == 1.0


def test_write_replaces_only_between_markers_and_check_reports_a_difference(tmp_path, monkeypatch, capsys):
    tables = _bench_module("tables")
    monkeypatch.setattr(tables, "TABLES", {"t": lambda: "| a |\n|---|\n| 2 |"})
    doc = tmp_path / "page.md"
    doc.write_text("intro\n\n<!-- bench-table:t -->\n| a |\n|---|\n| 1 |\n<!-- /bench-table:t -->\n\nafter\n")
    assert tables.write_or_check([doc], check=True) == 1
    assert "-| 1 |" in capsys.readouterr().out
    assert tables.write_or_check([doc], check=False) == 0
    assert (
        doc.read_text()
        == "intro\n\n<!-- bench-table:t -->\n| a |\n|---|\n| 2 |\n<!-- /bench-table:t -->\n\nafter\n"
    )
    assert tables.write_or_check([doc], check=True) == 0
    doc.write_text("<!-- bench-table:unknown -->\n<!-- /bench-table:unknown -->\n")
    assert (
        tables.write_or_check([doc], check=True) == 1
    )  # a marker without a generator, a table without a page


def test_save_records_what_the_benchmark_prints(tmp_path):
    out = tmp_path / "run.txt"
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import tables; tables.save({str(out)!r}); print('row 1')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout == "row 1\n" and out.read_text() == "row 1\n"


def test_the_async_table_is_what_async_vs_sync_reports(tmp_path, monkeypatch, capsys):
    """async_vs_sync.py's own report (the oracle) for made-up runs, parsed back into the table."""
    avs, tables = _bench_module("async_vs_sync"), _bench_module("tables")

    def run(seed, t, rounds):
        recs = [{"round": 1, "sim_time": 1.0, "eval_accuracy": 0.5}]
        return ({"target_sim_time": t, "config": {"seed": seed}, "rounds_done": rounds}, recs)

    runs = {"fedavg": [run(0, 8.0, 60), run(1, 4.0, 60)], "fedbuff": [run(0, 2.0, 300), run(1, 4.0, 280)]}
    avs.report(runs, tmp_path / "plot.png")
    (tmp_path / "async.txt").write_text("# made-up runs\n" + capsys.readouterr().out)
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    assert tables.async_table("async.txt").splitlines()[2:] == [
        "| strategy | seed 0 | seed 1 | mean simulated s to target | vs FedAvg |",
        "|---|---|---|---|---|",
        "| FedAvg (sync) | 8.00 | 4.00 | 6.00 | 1.00× |",
        "| FedBuff | 2.00 | 4.00 | 3.00 | 2.00× sooner |",
    ]

"""The result tables of docs/reproductions.md (and docs/privacy.md's copy of the DP table) are bench/reproduce.py's:
every table it generates has its markers in the documents, --write and --check replace and compare exactly
what is between them, and (slow) fresh runs of the two smallest reproductions give the committed tables."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("fedavg_digits", "client_drift")  # the reproductions the slow test reruns (about 70 s of CPU)


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "bench" / "reproduce.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("reproduce", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_generated_table_has_markers_and_every_marker_a_generator():
    r = _reproduce()
    reps = r._reproductions()
    want = {("reproduce", t) for rep in reps.values() for t in rep.tables}
    want |= {("reproduce-time", n) for n in reps}
    have: set = set()
    for doc in r.DOCS:
        text = doc.read_text()
        found = r.blocks(text)
        opened = r.re.findall(r"^<!-- reproduce(?:-time)?:[\w-]+ -->$", text, r.re.M)
        closed = r.re.findall(r"^<!-- /reproduce(?:-time)?:[\w-]+ -->$", text, r.re.M)
        assert len(opened) == len(closed) == len(found), f"{doc.name}: an unpaired or repeated marker"
        assert not have & set(found), f"{doc.name}: a block that another document holds too"
        have |= set(found)
    assert have == want
    assert set(SMALL) <= set(reps)


def test_write_replaces_between_the_markers_and_check_reports_a_difference(tmp_path, capsys):
    r = _reproduce()
    doc = tmp_path / "doc.md"
    doc.write_text(
        "intro\n<!-- reproduce-time:x -->\nold time\n<!-- /reproduce-time:x -->\n\n"
        "<!-- reproduce:t -->\n| a |\n|---|\n| 1 |\n<!-- /reproduce:t -->\nprose 1\n"
    )
    new = {("reproduce", "t"): "| a |\n|---|\n| 2 |", ("reproduce-time", "x"): "new time"}
    assert r.write_or_check(new, [doc], check=True) == 1
    assert "-| 1 |" in capsys.readouterr().out
    assert r.write_or_check(new, [doc], check=False) == 0
    assert doc.read_text() == (
        "intro\n<!-- reproduce-time:x -->\nnew time\n<!-- /reproduce-time:x -->\n\n"
        "<!-- reproduce:t -->\n| a |\n|---|\n| 2 |\n<!-- /reproduce:t -->\nprose 1\n"
    )
    # the time line is not checked; a table without markers is an error
    assert r.write_or_check({**new, ("reproduce-time", "x"): "other"}, [doc], check=True) == 0
    assert r.write_or_check({("reproduce", "missing"): "| b |"}, [doc], check=True) == 1


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reproduce.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_check_without_runs_is_one_line_naming_what_it_needs(tmp_path):
    """``--no-run --check`` reads sweeps an earlier ``--out DIR`` left: without --out, or with a folder that holds
    none, it stops with one line (exit 2) that says what to give, and no traceback."""
    proc = _script("--no-run", "--check")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "--out DIR" in line and "reproduce.py --only fedavg_digits --check" in line, (
        line
    )
    proc = _script("--out", str(tmp_path), "--no-run", "--check", "--only", "fedavg_digits")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()  # the first sweep of fedavg_digits, named with its folder
    assert "\n" not in line and line.startswith(f"reproduce: no finished runs in {tmp_path}/"), line
    assert line.endswith("(run the sweep, or drop --no-run)"), line


@pytest.mark.slow  # reruns the sweeps of the two smallest reproductions (about 70 s of CPU)
def test_small_reproductions_give_the_committed_tables():
    """The documented check from a clean checkout: no --out, the sweeps run in a temporary folder."""
    only = [arg for name in SMALL for arg in ("--only", name)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reproduce.py"), "--check", *only],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

"""The benchmark scripts run end to end on a minimal setting and print their tables (no timing asserts)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] in ("a", "b", "c", "default") and parts[2][0] in "0123456789f":
            rows[(parts[0], parts[1])] = parts[2:]  # a measured row, or "failed: ..."
    return rows


@pytest.mark.slow  # runs a benchmark script in fresh processes
def test_scale_bench_prints_its_table():
    out = _run(
        str(BENCH / "scale.py"),
        "--scenarios",
        "a,c",
        "--variants",
        "auto,inprocess,torch",
        "--rounds",
        "2",
        "--small",
    )
    rows = _rows(out)
    assert set(rows) == {(sc, v) for sc in "ac" for v in ("auto", "inprocess", "torch")}
    assert not any("failed:" in " ".join(r) for r in rows.values())
    assert rows[("a", "inprocess")][5] == rows[("a", "torch")][5]  # same SGD steps, same accuracy
    assert (
        "(a) plain torch / auto (default engine), time per round" in out and "(c) fedsim peak memory" in out
    )


@pytest.mark.slow  # runs a benchmark script in fresh processes
def test_default_bench_prints_its_table():
    out = _run(str(BENCH / "bench.py"), "--rounds", "2", "--variants", "auto,torch")
    rows = _rows(out)
    assert set(rows) == {("default", "auto"), ("default", "torch")}
    assert rows[("default", "auto")][5] == rows[("default", "torch")][5]
    assert "(default) plain torch / auto (default engine), time per round" in out


@pytest.mark.slow  # runs a benchmark script in fresh processes
def test_async_vs_sync_bench_runs_the_sweep_and_prints_its_table(tmp_path):
    out = _run(
        str(BENCH / "async_vs_sync.py"),
        "--sweep-dir",
        str(tmp_path / "sweep"),
        "--seeds",
        "0",
        "--out",
        str(tmp_path / "plot.png"),
        "num_rounds=2",
        "num_clients=12",
        "clients_per_round=4",
    )
    lines = [ln.split() for ln in out.splitlines()]
    strategies = [p[0] for p in lines if len(p) == 4 and p[1] == "0"]
    assert strategies == ["fedavg", "fedasync", "fedbuff"]
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.slow  # runs a benchmark script in fresh processes
def test_host_work_bench_times_its_pieces_and_the_per_client_slope(tmp_path):
    import json

    child = _run(str(BENCH / "host_work.py"), "--child", "--rounds", "4")
    pieces = json.loads(child.strip().splitlines()[-1])
    # every timer found its function: the steps, the evaluation and the host work are all measured
    assert pieces["steps"] > 0 and pieces["evaluation"] > 0 and pieces["host"] > 0 and pieces["clients"] == 10
    assert pieces["round"] > max(pieces["steps"], pieces["evaluation"], pieces["host"])  # medians, not a sum
    out = _run(
        str(BENCH / "host_work.py"),
        "--pythons",
        f"a={sys.executable},b={sys.executable}",
        "--rounds",
        "4",
        "--repeat",
        "1",
        "--load",
        "idle",
        "--cohorts",
        "2,4",
    )
    assert "host, 2 clients" in out and "host, 4 clients" in out
    assert "(idle) host work per added client, a / b:" in out


def _gpu_check():
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCH))


def _judged(lines: list[str]) -> list[str]:
    return [ln for ln in lines if "goal <=" in ln]


def test_gpu_targets_are_not_measured_without_a_gpu():
    g = _gpu_check()
    fast = {"rounds": [1.0, 0.1, 0.1], "busy_rounds": 0.95}  # fedsim as fast as its limits: every target met
    results = {name: dict(fast) for _, ours, limit, _, _ in g.TARGETS for name in (ours, limit)}
    on_gpu, missed_gpu = g.targets(results, on_gpu=True)
    assert len(_judged(on_gpu)) == 5 and all(ln.endswith(": met)") for ln in _judged(on_gpu))
    assert missed_gpu == 0
    dry, missed = g.targets(results, on_gpu=False)
    assert len(_judged(dry)) == 5 and missed == 5
    assert all("not measured: no GPU" in ln and "met)" not in ln for ln in _judged(dry))
    # on a GPU: a target without its timing or without a GPU busy figure is not measured either
    no_busy = {**results, "time-vectorized": {"rounds": [1.0, 0.1, 0.1]}}
    del no_busy["real-limit-graph"]
    lines = _judged(g.targets(no_busy, on_gpu=True)[0])
    assert sum("not measured: no GPU busy figure" in ln for ln in lines) == 1
    assert sum("not measured: no timing" in ln for ln in lines) == 2
    assert sum(ln.endswith(": met)") for ln in lines) == 2


@pytest.mark.slow  # runs two dry-run timings of the GPU check in a fresh process (about 5 s)
def test_gpu_check_dry_run_judges_no_gpu_target():
    out = _run(str(BENCH / "gpu_check.py"), "--dry-run", "--only", "time-vectorized,time-limit-eager")
    section = out.split("4. speed targets")[1]
    judged = _judged(section.splitlines())
    assert len(judged) == 5
    assert all("not measured: no GPU (CPU dry run)" in ln for ln in judged)
    assert " met" not in section and "NOT met" not in section

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


def _bench():
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("bench")
    finally:
        sys.path.remove(str(BENCH))


def test_tight_limit_trains_what_per_client_sgd_trains():
    """The tight limit's written-out batched steps give plain per-client torch SGD's model (autograd, one client
    at a time: an independent oracle), partial batches, clients of different step counts and FedAvg included."""
    import numpy as np

    from fedsim.data.digits import load_digits
    from fedsim.data.partition import dirichlet
    from fedsim.models import mlp

    b = _bench()
    ds = load_digits(seed=0)
    parts = dirichlet(ds.y_train, 12, np.random.default_rng([0, 7]), alpha=0.5)
    assert len({len(p) for p in parts}) > 3  # clients of different sizes, so of different step counts
    keep = {}
    result = b._result
    b._result = lambda t, a, g, s: (keep.update(glob=g), result(t, a, g, s))[1]
    try:
        args = dict(seed=0, per_round=6, rounds=2, epochs=2, batch_size=16, lr=0.1)
        b.plain_fedavg(ds, parts, mlp, **args)
        tight = b.tight_fedavg(ds, parts, mlp, **args)
    finally:
        b._result = result
    plain = keep["glob"]
    assert set(tight["model"]) == set(plain)
    assert max(float((tight["model"][k] - plain[k]).abs().max()) for k in plain) < 1e-6
    assert len(tight["rounds_wall"]) == len(tight["rounds_cpu"]) == 2


@pytest.mark.slow  # runs fedsim and the tight limit in fresh processes
def test_default_bench_prints_the_tight_ratio():
    out = _run(
        str(BENCH / "bench.py"), "--rounds", "4", "--repeat", "1", "--scenarios", "default", "--load", "idle"
    )
    assert "default   idle" in out
    assert "(default, idle) tight limit / fedsim per round, wall clock: min" in out
    agree = out.split("largest difference fedsim vs tight (allowed 1e-06): default ")[1]
    assert float(agree.split(";")[0]) <= 1e-6


def test_step_bench_times_fedsims_step_and_the_limits_on_the_same_weights():
    out = _run(
        str(BENCH / "step_compare.py"), "--clients", "3", "--steps", "3", "--repeat", "2", "--inner", "2"
    )
    assert "3 clients x 16 examples of 1x8x8, 3 steps; thread CPU per step: fedsim" in out
    assert float(out.split("weights after the steps differ by ")[1].split()[0]) <= 1e-6


@pytest.mark.slow  # runs fedsim quiet and beside a busy neighbour in fresh processes
def test_busy_bench_prints_each_settings_ratio():
    out = _run(str(BENCH / "busy.py"), "--settings", "auto,vectorized-null", "--rounds", "3", "--repeat", "1")
    for setting in ("auto", "vectorized-null"):
        assert f"({setting}) busy / quiet, wall clock, median of the pairs:" in out
    assert "failed:" not in out

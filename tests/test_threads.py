"""``engine.threads=null`` takes the cores other processes leave free (``fedsim.groups.free_cores``)."""

import os
import subprocess
import sys
import time

import pytest

from fedsim import groups
from fedsim.engines import local_grid


def _fake(monkeypatch, cores: int, busy: float | None, load: float, total: int | None = None) -> None:
    monkeypatch.setattr(groups, "usable_cores", lambda: list(range(cores)))
    monkeypatch.setattr(groups, "_busy_now", lambda c, w: busy)
    monkeypatch.setattr(groups.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(groups.os, "cpu_count", lambda: total or cores)


@pytest.mark.parametrize(
    ("cores", "busy", "load", "total", "want"),
    [
        (2, 0.0, 0.0, None, 2),  # idle: every core
        (2, 2.0, 0.0, None, 1),  # a neighbour just started on both cores (the load average has not risen yet)
        (2, 0.0, 6.0, None, 1),  # a loaded machine, never fewer than one thread
        (8, 0.3, 2.6, None, 5),  # the larger of the two measures, a core busy when more than half of it is
        (8, 2.0, 1.0, None, 6),
        (4, None, 32.0, 64, 2),  # no /proc/stat; the load average of 64 cores, scaled to the 4 usable ones
        (16, 0.0, 0.0, None, 16),
    ],
)
def test_free_cores_leaves_other_processes_their_cores(monkeypatch, cores, busy, load, total, want):
    _fake(monkeypatch, cores, busy, load, total)
    assert groups.free_cores() == want
    assert groups.resolve_threads(None) == want
    assert groups.resolve_threads(3) == 3  # a number is taken as set


def test_the_engine_gets_the_free_cores_for_null(monkeypatch):
    _fake(monkeypatch, 4, 3.0, 0.0)
    grid = local_grid(groups.EngineSettings(name="vectorized", threads=None), 2)
    try:
        assert grid._threads == 1
    finally:
        grid.close()
    _fake(monkeypatch, 4, 0.0, 0.0)
    grid = local_grid(groups.EngineSettings(name="auto", threads=None), 2)
    try:
        assert grid._threads == 4
    finally:
        grid.close()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_busy_now_sees_a_process_spinning_on_a_core():
    core = groups.usable_cores()[-1]
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        assert groups._busy_now([core], 0.3) > 0.8  # the spinner holds the whole core
    finally:
        proc.kill()
        proc.wait()

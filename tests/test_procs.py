"""fedsim.procs: a process's descendants at any depth, from /proc and from ps (the reader elsewhere than Linux)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsim import procs

GRANDCHILD = "import time; time.sleep(60)"
CHILD = (
    "import subprocess, sys, time; "
    f"p = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}]); print(p.pid, flush=True); time.sleep(60)"
)


@pytest.mark.parametrize("reader", ["proc", "ps"])
def test_descendants_at_any_depth(monkeypatch, reader):
    if reader == "ps":
        monkeypatch.setattr(procs, "PROC", Path("/no/such/proc"))  # what macOS has
    elif not procs.PROC.is_dir():
        pytest.skip("no /proc here")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        found: list[int] = []
        for _ in range(50):  # the grandchild is listed once it has started
            found = procs.descendants(child.pid)
            if grandchild in found:
                break
            time.sleep(0.1)
        assert found == [grandchild]  # the child's own children only, each after its parent
        mine = procs.descendants(os.getpid())
        assert child.pid in mine and grandchild in mine
        assert mine.index(child.pid) < mine.index(grandchild)
    finally:
        for pid in procs.descendants(child.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        child.kill()
        child.wait()

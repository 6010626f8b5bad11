"""Start-up of the ``fedsim`` command: CPU and wall seconds of a fresh process until its first round ends.

    python bench/startup.py                                  # this checkout's python, 5 runs
    python bench/startup.py --pythons before=A/bin/python,after=B/bin/python --repeat 7

Each run is a fresh ``python -m fedsim`` (the default experiment, ``num_rounds=2``) in a fresh folder. When the
process prints its ``[round 1/`` progress line, the bench reads the process's CPU time (user + system, all its
threads, from ``/proc/<pid>/stat``) and the wall time since it was started, then lets it finish. With several
pythons the runs are interleaved (a, b, a, b, ...), so a neighbour's load falls on both; min and median are
printed per python, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (every thread), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(python: str) -> tuple[float, float]:
    """(CPU s, wall s) of one fresh ``fedsim`` process at its first round's progress line."""
    with tempfile.TemporaryDirectory(prefix="fsstart") as folder:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [python, "-m", "fedsim", "num_rounds=2"],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **FLOWER_ENV},
        )
        got = None
        for line in proc.stdout:
            if got is None and line.startswith("[round 1/"):
                got = (_cpu_seconds(proc.pid), time.perf_counter() - start)
        if proc.wait() != 0 or got is None:
            raise SystemExit(f"{python}: the run failed (exit {proc.returncode}) or printed no round line")
        return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pythons", default=f"this={sys.executable}", help="name=python,... (interleaved)")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    pythons = dict(item.split("=", 1) for item in a.pythons.split(","))
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in pythons}
    for _ in range(a.repeat):
        for name, python in pythons.items():
            got[name].append(one_run(python))
    load = os.getloadavg()[0]
    print(f"first round of `python -m fedsim`, {a.repeat} fresh processes each, load average {load:.1f}")
    print(f"{'python':<10}{'CPU s min':>10}{'median':>8}{'wall s min':>12}{'median':>8}")
    for name, runs in got.items():
        cpu, wall = [r[0] for r in runs], [r[1] for r in runs]
        print(
            f"{name:<10}{min(cpu):>10.2f}{statistics.median(cpu):>8.2f}{min(wall):>12.2f}{statistics.median(wall):>8.2f}"
        )
    if len(got) == 2:
        (n1, r1), (n2, r2) = got.items()
        ratio = statistics.median(r[0] for r in r2) / statistics.median(r[0] for r in r1)
        print(f"CPU {n2} / {n1} (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

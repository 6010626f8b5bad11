"""Ends the processes a run left behind when it was killed without a chance to stop them (SIGKILL, OOM killer).

Ray's raylet and GCS notice a dead driver and exit, but its dashboard and runtime-env agents, by then children of
``init``, keep trying to reach the dead GCS for about two minutes. A run on the Ray engine therefore starts a
small watcher process (this file run as a script with the driver's pid) in its own session: while the driver
lives it notes the driver's descendants (pid and start time) every half second; once the driver is gone it
kills those that still run. A process is matched by pid *and* start time, so a reused pid is never touched. A
run that ends normally stops the watcher first (:meth:`Reaper.stop`). Linux only (it reads ``/proc``);
elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")
INTERVAL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a live process, or None."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            start[int(entry.name)] = st[1]
    found: dict[int, int] = {}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child != os.getpid():
                found[child] = start[child]
                stack.append(child)
    return found


def watch(driver: int, interval: float = INTERVAL_S) -> int:
    """Note ``driver``'s descendants while it lives; then kill those still running. Returns how many."""
    seen: dict[int, int] = {}
    while os.getppid() == driver:  # the driver started this process: once it dies, the parent changes
        seen.update(descendants(driver))
        time.sleep(interval)
    killed = 0
    for pid, started in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == started:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


class Reaper:
    """The watcher process of one run (see the module docstring); a no-op where ``/proc`` is missing."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        if sys.platform.startswith("linux") and PROC.is_dir():
            self.proc = subprocess.Popen(
                [sys.executable, "-S", __file__, str(os.getpid())],  # this file alone: stdlib imports only
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C or SIGTERM to the run's process group does not reach it
            )

    def stop(self) -> None:
        """The run ended normally: the watcher goes without killing anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]))

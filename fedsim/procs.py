"""The processes a process started, at any depth: what a sweep's second Ctrl-C kills and what a deployment's
``stop`` terminates. Linux reads ``/proc``; elsewhere (macOS, the BSDs) ``ps -A -o pid=,ppid=``.
(``fedsim.engines.reaper`` keeps its own ``/proc`` reader: it runs as a stdlib-only script.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

PROC = Path("/proc")


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, by parent pid."""
    pairs: list[tuple[int, int]] = []
    if PROC.is_dir():
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended while being read
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # past "(comm)": the state, then the ppid
            pairs.append((int(entry.name), ppid))
    else:
        try:
            out = subprocess.run(
                ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
                pairs.append((int(fields[0]), int(fields[1])))
    children: dict[int, list[int]] = {}
    for pid, ppid in pairs:
        children.setdefault(ppid, []).append(pid)
    return children


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, at any depth, each after its parent."""
    children = children_by_parent()
    found, todo, seen = [], [pid], {pid}
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(child)
                todo.append(child)
    return found


def start_time(pid: int) -> str | None:
    """An identity of the live process ``pid`` beyond its number: its start time (clock ticks since boot, field 22
    of ``/proc/<pid>/stat``; ``ps -o lstart=`` elsewhere), or None when no such process runs.

    A number the system gives to another process after ``pid`` ended comes with another start time, so a file
    naming ``pid`` and this value names one process only.
    """
    if pid <= 0:
        return None
    if PROC.is_dir():
        try:
            stat = (PROC / str(pid) / "stat").read_text()
        except OSError:
            return None
        return stat.rsplit(")", 1)[1].split()[19]  # past "(comm)": field 3 onwards, so field 22 is index 19
    try:
        out = subprocess.run(
            ["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return " ".join(out.split()) or None


def is_own(pid: int, started: str | None, parent: int, family: set[int] | None = None) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` and a descendant of ``parent``: the
    check before ``parent`` signals a process some file named (never a non-positive number, ``parent`` itself,
    a number reused by another process, or a process ``parent`` did not start). ``family``: ``parent``'s
    descendants when the caller has read them already."""
    if pid <= 1 or pid == parent or not started:
        return False
    family = set(descendants(parent)) if family is None else family
    return pid in family and start_time(pid) == started

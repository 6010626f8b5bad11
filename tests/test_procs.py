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


def _sleep_outside() -> int:
    """A live ``sleep`` this process did not start (its shell parent has exited: it is no descendant of ours)."""
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    return int(out.stdout)


def _started(pid: int) -> str:
    """Field 22 of /proc/PID/stat, read here (the oracle for ``procs.start_time``)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("reader", ["proc", "ps"])
def test_a_process_start_time_tells_it_from_a_later_one_with_its_number(monkeypatch, reader):
    if reader == "ps":
        monkeypatch.setattr(procs, "PROC", Path("/no/such/proc"))
    child = subprocess.Popen(["sleep", "60"])
    try:
        started = procs.start_time(child.pid)
        assert started and procs.start_time(child.pid) == started
        if reader == "proc":
            assert started == _started(child.pid)
        assert procs.is_own(child.pid, started, os.getpid())
        assert not procs.is_own(child.pid, started + "1", os.getpid())  # the number, another process
        assert not procs.is_own(child.pid, started, child.pid)  # not a descendant of the one asking
    finally:
        child.kill()
        child.wait()
    assert procs.start_time(child.pid) is None
    assert procs.start_time(0) is None and procs.start_time(-1) is None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc here")
def test_a_stale_entry_naming_a_live_unrelated_process_survives_the_sweeps_sigterm(tmp_path):
    """A job killed by SIGKILL leaves its entry; the number is given to another process. The sweep's SIGTERM
    reaches its own running job only: not a process an old entry names, nor one it did not start."""
    import signal

    from fedsim import sweep

    jobs = tmp_path / sweep.JOBS_FOLDER
    jobs.mkdir()
    job = subprocess.Popen(["sleep", "60"])  # this sweep's own job, listed as job_slot lists it
    (jobs / str(job.pid)).write_text(_started(job.pid) + "\n")
    reused = subprocess.Popen(["sleep", "60"])  # a number an ended job had: the entry holds that job's start
    (jobs / str(reused.pid)).write_text(str(int(_started(reused.pid)) - 100) + "\n")
    unlisted = subprocess.Popen(["sleep", "60"])  # an entry written before entries held a start time
    (jobs / str(unlisted.pid)).write_text("")
    stranger = _sleep_outside()  # right start time, but not a process this one started
    (jobs / str(stranger)).write_text(_started(stranger) + "\n")
    try:
        stop = sweep.SweepStop()
        stop.sweep_dir = tmp_path
        stop._handle(signal.SIGTERM, None)
        assert job.wait(timeout=10) == -signal.SIGTERM
        time.sleep(0.2)
        assert reused.poll() is None and unlisted.poll() is None and _alive(stranger)
        assert not (jobs / str(reused.pid)).exists() and not (jobs / str(unlisted.pid)).exists()  # cleaned
        assert (jobs / str(stranger)).exists()  # a live process: left as it is, never signalled
    finally:
        for p in (job, reused, unlisted):
            p.kill()
            p.wait()
        os.kill(stranger, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc here")
def test_an_entry_named_minus_one_or_zero_is_never_signalled(tmp_path, monkeypatch):
    import signal

    from fedsim import sweep

    jobs = tmp_path / sweep.JOBS_FOLDER
    jobs.mkdir()
    for name in ("-1", "0", "1", str(os.getpid())):  # every process, the group, init, the sweep itself
        (jobs / name).write_text(_started(max(1, abs(int(name)))) + "\n")
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(pid))
    stop = sweep.SweepStop()
    stop.sweep_dir = tmp_path
    stop._handle(signal.SIGTERM, None)
    assert sent == []


def test_a_job_lists_itself_with_its_start_time_and_a_killed_jobs_entry_is_cleaned(tmp_path):
    from fedsim import sweep

    with sweep.job_slot(tmp_path) as why:
        assert why is None
        (entry,) = sweep.job_entries(tmp_path)
        assert entry[1:] == (os.getpid(), procs.start_time(os.getpid()))
    assert sweep.job_entries(tmp_path) == []  # removed when the job ends
    gone = subprocess.Popen(["sleep", "60"])
    started = procs.start_time(gone.pid)
    (tmp_path / sweep.JOBS_FOLDER / str(gone.pid)).write_text(started + "\n")
    gone.kill()  # SIGKILL: its own removal never runs
    gone.wait()
    sweep.clean_jobs(tmp_path)
    assert sweep.job_entries(tmp_path) == []

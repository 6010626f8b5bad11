"""``engine=ray engine.address=HOST:PORT`` joins an existing Ray cluster: a local head node started here.

The head node runs as ``ray start --head --block`` in its own process group, so it is stopped by its pid (and
the pids it spawned), never with ``ray stop``, which would stop every Ray process of this user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers import read_metrics, run_tiny, without_wall_time

from fedsim.config import FLOWER_ENV
from fedsim.deploy.launch import descendants, free_port, running, terminate
from fedsim.errors import ConfigError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not installed"),
]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_head():
    """A one-machine Ray cluster (2 CPUs) on a free port; yields ``(address, temp_dir)``."""
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="fsray"))  # short: Ray's socket paths must stay under 108 bytes
    env = {**os.environ, **FLOWER_ENV}
    cmd = [
        "ray",
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        "--block",
    ]
    log = open(temp / "head.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    seen: set[int] = {proc.pid}
    try:
        end = time.monotonic() + 180
        while not _answers(port):
            assert proc.poll() is None, (temp / "head.log").read_text()[-2000:]
            assert time.monotonic() < end, "the Ray head node did not open its port within 180 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", temp
    finally:
        seen.update(descendants(proc.pid))
        os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops what it started on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        left = terminate(sorted(p for p in seen if running(p)), timeout=20)
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


def test_simulation_joins_the_ray_cluster(tmp_path, ray_head):
    address, temp = ray_head
    over = ["seed=1", "num_rounds=2", "placement.num_cpus_per_client=1"]
    summary = run_tiny(tmp_path / "cluster", "engine=ray", f"engine.address={address}", *over)
    assert summary["status"] == "completed" and summary["engine"] == "ray" and summary["rounds_done"] == 2
    # the driver ran on the cluster started above (its log is in that cluster's session folder) ...
    assert list((temp / "session_latest" / "logs").glob("python-core-driver-*"))
    # ... and the result is the one the default engine computes
    run_tiny(tmp_path / "inproc", *over)
    a, b = read_metrics(tmp_path / "inproc"), read_metrics(tmp_path / "cluster")
    for ra, rb in zip(without_wall_time(a), without_wall_time(b), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["round"], k)


def test_address_that_does_not_answer_is_a_config_error(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"engine.address='127.0.0.1:\d+' is not allowed: .*ray start --head"
    ):
        run_tiny(tmp_path, "engine=ray", f"engine.address=127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 30

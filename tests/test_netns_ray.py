"""``engine=ray`` on a Ray cluster of two hosts: the head node on the server host, a worker on a client host.

The hosts are network namespaces (``tests/netns.py``): the head (``ray start --head``) listens on the server
host's ``10.213.0.1``, the worker (``ray start --address=10.213.0.1:PORT``) runs on client host
``10.213.0.10``, one CPU each, so Flower's two ClientApp actors land one on each node. The fedsim command runs
on the server host with ``engine.address=10.213.0.1:PORT``, as on a cluster's head machine. One cluster (a
module fixture) serves both tests: a run whose clients train on both nodes and whose result is the single-host
run's, then a run whose worker node is killed (SIGKILL to its process group), which stops with one line.

Where each ClientApp task ran is read from Ray's own logs: the nodes run with ``RAY_BACKEND_LOG_LEVEL=debug``,
whose core workers log every task they execute in their node's session folder. The nodes are started with the
Python running the tests (``python -m ray.scripts.scripts``, what the ``ray`` command runs): Ray's workers
import fedsim with their node's interpreter. Skipped where ``ip netns`` cannot be used or Ray is missing.
About 40 s on 2 cores (70 s on a loaded machine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import netns
import pytest
import torch
from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from helpers import compose_cfg, read_metrics, without_wall_time
from strategy_helpers import server_identity

from fedsim.config import FLOWER_ENV
from fedsim.deploy import free_port
from fedsim.deploy.launch import running, terminate
from fedsim.errors import RunError
from fedsim.procs import descendants

WHY_NOT = netns.unavailable() or (None if importlib.util.find_spec("ray") else "Ray is not installed")
needs_cluster = pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")
TINY = ["num_clients=4", "clients_per_round=4", "seed=1", "quiet=true", "checkpoint_every=0"]
ONE_CPU = "placement.num_cpus_per_client=1"
RAN = "task_name=ClientAppActor.run"  # in a core worker's "Executing task" debug line
TASK_ID = re.compile(r"task_id=(\w+)")


class Node:
    """``ray start ... --block`` in namespace ``ns`` (its own process group), with its own temp folder."""

    def __init__(self, ns: str, ip: str, temp: Path, *args: str) -> None:
        self.ns, self.ip, self.temp = ns, ip, temp
        temp.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            f"--node-ip-address={ip}",
            "--num-cpus=1",
        ]
        cmd += ["--disable-usage-stats", "--object-store-memory=80000000", f"--temp-dir={temp}", "--block"]
        env = {**os.environ, **FLOWER_ENV, "RAY_BACKEND_LOG_LEVEL": "debug"}
        self.log = temp / "node.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*netns.exec_prefix(ns), *cmd, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.seen: dict[int, str] = {}  # pid -> its start time: a pid reused later is never signalled
        self.note()

    def logs(self, pattern: str) -> list[Path]:
        return sorted((self.temp / "session_latest" / "logs").glob(pattern))

    def ran(self) -> set[str]:
        """The ids of the ClientApp tasks this node's workers have executed so far."""
        found = set()
        for path in self.logs("python-core-worker-*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if "Executing task" in line and RAN in line:
                    found.add(TASK_ID.search(line).group(1))
        return found

    def note(self) -> None:
        """Remember every process this node runs now (its descendants and whatever runs in its namespace)."""
        pids = {self.proc.pid, *netns.pids_in(self.ns)}
        if running(self.proc.pid):
            pids.update(descendants(self.proc.pid))
        self.seen.update({p: t for p in pids if (t := _started(p)) is not None})

    def left(self) -> list[int]:
        """The processes noted that still run (same pid, same start time)."""
        return [p for p, t in self.seen.items() if running(p) and _started(p) == t]


def _started(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _wait(what: str, ok, node: Node, timeout: float = 120) -> float:
    t0 = time.monotonic()
    while not ok():
        assert node.proc.poll() is None, f"{what}: ray start exited\n{node.log.read_text()[-2000:]}"
        assert time.monotonic() - t0 < timeout, f"{what} within {timeout:g} s\n{node.log.read_text()[-2000:]}"
        time.sleep(0.2)
    return time.monotonic() - t0


def _registered(head: Node) -> int:
    return sum(p.read_text().count("Registering new node") for p in head.logs("gcs_server.out"))


@pytest.fixture(scope="module")
def cluster():
    """A head node on the server host and a worker node on client host 0; yields ``(hosts, address, head,
    worker, start seconds)``; stops both (SIGTERM to each process group, SIGKILL after 5 s, then every process
    noted is checked gone) and removes the namespaces, also when a test fails."""
    netns.sweep()
    hosts = netns.Hosts(1)
    temp = Path(tempfile.mkdtemp(prefix="fsr"))  # short: Ray's socket paths must stay under 108 bytes
    nodes: list[Node] = []
    try:
        with netns.inside(hosts.hub):
            port = free_port(netns.HUB_IP)
        address = f"{netns.HUB_IP}:{port}"
        t0 = time.monotonic()
        head = Node(
            hosts.hub, netns.HUB_IP, temp / "h", "--head", f"--port={port}", "--include-dashboard=false"
        )
        nodes.append(head)
        _wait("the head's GCS registers it", lambda: _registered(head) >= 1, head)
        worker = Node(hosts.clients[0], hosts.ips[hosts.clients[0]], temp / "w", f"--address={address}")
        nodes.append(worker)
        _wait("the head's GCS registers the worker", lambda: _registered(head) >= 2, worker)
        yield hosts, address, head, worker, time.monotonic() - t0
    finally:
        for node in reversed(nodes):  # the worker first, while the head it reports to still runs
            node.note()
            # SIGTERM to the process group: `ray start --block` and what it started stop; a worker's `ray
            # start` then lingers for about 30 s (its children gone), so it gets SIGKILL after 5 s
            terminate([node.proc.pid], timeout=5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        left = terminate(sorted(p for node in nodes for p in node.left()), timeout=20)
        hosts.close()
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"
        assert not [ns for ns in hosts.names() if (netns.NETNS_DIR / ns).exists()]


def _fedsim(hosts, address: str, out: Path, *overrides: str, background: bool = False):
    """The fedsim command on the server host, joining the cluster at ``address``; its outputs in ``out``."""
    args = ["-m", "fedsim", "engine=ray", f"engine.address={address}", ONE_CPU, f"hydra.run.dir={out}"]
    cmd = [*netns.exec_prefix(hosts.hub), sys.executable, *args, *TINY, *overrides]
    kw = {"cwd": out.parent, "env": {**os.environ, **FLOWER_ENV}, "text": True}
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    return subprocess.run(cmd, capture_output=True, timeout=300, **kw)


def _same_model(a: Path, b: Path) -> None:
    sa, sb = (torch.load(p / "model.pt", map_location="cpu") for p in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-6, atol=1e-7), k


@pytest.mark.slow
@needs_cluster
def test_clients_train_on_both_hosts_and_the_result_is_the_single_host_runs(tmp_path, cluster):
    hosts, address, head, worker, _start = cluster
    t0 = time.monotonic()
    done = _fedsim(hosts, address, tmp_path / "cluster", "num_rounds=2")
    wall = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"] == "ray" and summary["rounds_done"] == 2
    records = read_metrics(tmp_path / "cluster")
    # every ClientApp task ran on one of the two nodes, each node ran some: 4 discovery queries (one per
    # client: its partition and size) and 2 rounds x 4 train messages
    on_head, on_worker = head.ran(), worker.ran()
    asked = 4 + sum(r["num_clients"] + r["failures"] for r in records[1:])
    assert asked == 12 and on_head and on_worker and not on_head & on_worker, (on_head, on_worker)
    assert len(on_head) + len(on_worker) == asked, (on_head, on_worker)
    # the driver saw its two actors alive at the two hosts' addresses (the head's session folder)
    driver = "".join(p.read_text() for p in head.logs("python-core-driver-*.log"))
    for ip in (netns.HUB_IP, worker.ip):
        assert f"state: ALIVE, ip address: {ip}," in driver, ip
    # the result is the one a single host computes without Ray (same seed)
    from fedsim.run import run_experiment

    run_experiment(compose_cfg(*TINY, ONE_CPU, "num_rounds=2", "engine=inprocess"), tmp_path / "one")
    one = read_metrics(tmp_path / "one")
    for ra, rb in zip(without_wall_time(one), without_wall_time(records), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["round"], k)
    _same_model(tmp_path / "one", tmp_path / "cluster")
    times = [round(r["round_time"], 2) for r in records[1:]]
    print(f"\ncluster start {_start:.1f} s, two-host run {wall:.1f} s (rounds {times} s), ", end="")
    print(f"tasks on head/worker {len(on_head)}/{len(on_worker)}")


@pytest.mark.slow
@needs_cluster
def test_a_worker_killed_mid_run_stops_the_run_in_one_line(tmp_path, cluster):
    """SIGKILL to the worker node's process group (raylet, agents, its ClientApp actor) after round 1: the
    run ends within a bound with exit status 1 and one line naming the lost actor; it never hangs."""
    hosts, address, head, worker, _ = cluster
    out = tmp_path / "killed"
    proc = _fedsim(hosts, address, out, "num_rounds=30", "client.local_epochs=10", background=True)
    try:
        t0, metrics = time.monotonic(), out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # round 0 and round 1
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() - t0 < 180, "round 1 not recorded within 180 s"
            time.sleep(0.1)
        worker.note()
        os.killpg(worker.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the run still runs 120 s after its worker node was killed")
        stopped = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("fedsim")]  # Flower logs its own before
    assert len(ours) == 1, ours
    last = ours[0]
    lost = "fedsim: run failed: Ray lost a ClientApp actor, its process or its node died (Actor"
    assert last.startswith(lost), last
    assert "resume=RUN_FOLDER" in last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("Ray lost a ClientApp actor")
    assert 1 <= summary["rounds_done"] < 30
    assert stopped < 60, stopped
    done = summary["rounds_done"]
    print(f"\nworker killed after round {done}: the run stopped {stopped:.1f} s later with {last[:120]}")


# ------------------------------------------------------- without a cluster: the engine's lost-actor rule
def _reply(code: int, reason: str) -> Message:
    with server_identity():
        ask = Message(RecordDict(), dst_node_id=7, message_type="train")
    ask.metadata.__dict__["_message_id"] = "m1"
    return Message(Error(code=code, reason=reason), reply_to=ask)


LOST = (
    "<class 'ray.exceptions.ActorUnavailableError'>:<'The actor 8b48 is unavailable: The actor is "
    "temporarily unavailable: RpcError: failed to connect to all addresses; ipv4:10.213.0.10:10002: "
    "Connection refused'>"
)
CLIENT = (
    "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException occurred: boom'>"
)


def test_a_lost_actor_reply_stops_the_ray_engine_in_one_line(monkeypatch):
    """Flower's reply for an actor Ray lost ends the run with one RunError; a client's own error does not."""
    import flwr.simulation

    from fedsim.engines import ray as ray_engine

    assert ray_engine.lost_actor(_reply(ErrorCode.UNKNOWN, LOST)).startswith(
        "ActorUnavailableError: The actor"
    )
    died = LOST.replace("ActorUnavailableError", "ActorDiedError")
    assert ray_engine.lost_actor(_reply(ErrorCode.UNKNOWN, died)).startswith("ActorDiedError")
    assert ray_engine.lost_actor(_reply(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, CLIENT)) is None
    assert ray_engine.lost_actor(_reply(ErrorCode.UNKNOWN, "ActorDiedError in a message")) is None

    got = {}

    def fake_run_simulation(server_app, client_app, num_supernodes, backend_config):
        class Grid:
            def push_messages(self, messages):
                return ["m1"]

            def pull_messages(self, ids):
                return [
                    _reply(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, CLIENT),
                    _reply(ErrorCode.UNKNOWN, LOST),
                ]

        def serve():  # what Flower's ServerApp thread does, re-raised as Flower does
            server_app._main(Grid(), None)

        t = threading.Thread(target=lambda: got.setdefault("e", _raises(serve)))
        t.start()
        t.join(timeout=10)
        raise got["e"]  # Flower re-raises the ServerApp thread's exception itself

    monkeypatch.setattr(flwr.simulation, "run_simulation", fake_run_simulation)
    backend = ray_engine.backend_config(1, 0, num_cpus=1)
    with server_identity(), pytest.raises(RunError) as e:
        ray_engine.run(2, lambda grid: grid.send_and_receive([Message(RecordDict(), 7, "train")]), backend)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "Ray lost a ClientApp actor, its process or its node died (ActorUnavail"
    )
    assert "10.213.0.10" in msg and "resume=RUN_FOLDER" in msg


def _raises(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 (handed to the caller, as Flower does)
        return e
    return None

"""fedsim's deployment across hosts: the server and each SuperNode in network namespaces of their own.

The server host (a namespace holding the SuperLink on its 127.0.0.1, the SuperExec, the public front on
10.213.0.1 and one link proxy per node) and three client hosts (10.213.0.10-12, one SuperNode each, joined by
veth pairs to the server's bridge) stand for machines on a LAN; TLS and node authentication as in production,
the server's certificate naming 10.213.0.1. Each node reaches the server host's address only through its own
link (``netns_proxy.Link``): first without faults, then 50-200 ms round trips with jitter, one node capped in
bandwidth and stalled, one cut for 30 s. Skipped where ``ip netns`` cannot be used (not root, no iproute2).
About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import threading
import time
from pathlib import Path

import netns
import pytest
from helpers import read_metrics
from netns_proxy import Faults, Link

from fedsim.deploy import Federation, Security, free_port, make_certs
from fedsim.deploy.launch import running, supernode_command, terminate, warm_command
from fedsim.procs import descendants

APP = Path(__file__).resolve().parents[1]
N = 3
TINY = ["dataset=digits", f"num_clients={N}", "quiet=true", "checkpoint_every=0", "seed=3"]

WHY_NOT = netns.unavailable()  # None where namespaces work (a probe: one namespace added and deleted)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")]


class NetFederation(Federation):
    """A ``Federation`` on the server host whose SuperNodes run on client hosts, each through its own link."""

    def __init__(self, *args, hosts: netns.Hosts, **kw) -> None:
        super().__init__(*args, **kw)
        self.hosts = hosts
        self.links: dict[int, Link] = {}
        self.where: dict[str, str] = {}  # process name -> its namespace

    def spawn(self, name, cmd, cwd=None):
        ns = self.where.get(name.removesuffix("-warm"))
        return super().spawn(name, [*netns.exec_prefix(ns), *cmd] if ns else cmd, cwd)

    def link(self, i: int, faults: Faults) -> Link:
        """Node ``i``'s proxy on the server host (10.213.0.1, a port of its own), forwarding to the front."""
        link = Link((netns.HUB_IP, free_port(netns.HUB_IP)), (self.host, self.port), faults).start()
        self.links[i] = link
        return link

    def start_node(self, i: int) -> None:
        """SuperNode ``i`` (warm, 0.25 s poll, partition cache) on client host ``i``, connecting to its link's
        address."""
        name = f"supernode{i}"
        self.where[name] = self.hosts.clients[i]
        port = free_port("127.0.0.1")
        secret = self._secret(self.workdir / f"{name}.secret")
        listen = "{}:{}".format(*self.links[i].listen)
        cache = str(self.workdir / "partition-cache")
        n = len(self.hosts.clients)
        cmd = supernode_command(listen, port, i, n, self.sec, warm_secret=secret, poll=0.25, cache_dir=cache)
        proc = self.spawn(name, cmd, cwd=self.cwd)
        self.spawn(f"{name}-warm", warm_command(port, secret, parent_pid=proc.pid), cwd=self.cwd)

    def stop_node(self, i: int) -> None:
        """Stop SuperNode ``i`` and its warm SuperExec (SIGTERM: the node leaves as Flower's does on Ctrl-C)."""
        for name in (f"supernode{i}", f"supernode{i}-warm"):
            proc = self.procs.pop(name)
            pids = [proc.pid, *descendants(proc.pid)]  # with the ClientApps a warm SuperExec forked
            self.stopped += pids
            terminate(pids, timeout=15)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def hosts():
    netns.sweep()
    h = netns.Hosts(N)
    try:
        yield h
    finally:
        h.close()
        assert not [ns for ns in h.names() if (netns.NETNS_DIR / ns).exists()]


def node_faults(i: int) -> Faults:
    """Node i's link: round trips from 50 ms (node 0) to 200 ms (the last node), +-20 ms jitter; node 1 capped
    at 1 MB/s (a run's first message brings the app bundle, about 1 MB; a model is about 20 KB each way)."""
    return Faults(rtt=0.05 + 0.15 * i / (N - 1), jitter=0.02, rate=1e6 if i == 1 else 0.0, seed=i)


@pytest.fixture(scope="module")
def fed(hosts, tmp_path_factory):
    root = tmp_path_factory.mktemp("netns")
    with contextlib.ExitStack() as stack:
        stack.enter_context(netns.inside(hosts.hub))  # this thread is the operator on the server host
        certs = make_certs(root / "certs", nodes=N, hosts=(netns.HUB_IP,))
        sec = Security(tls=True, auth=True, certs=certs)
        f = NetFederation(root / "work", sec, host=netns.HUB_IP, cwd=root, echo=lambda _: None, hosts=hosts)
        f.root = root
        try:
            f.start_superlink(timeout=120)
            for i in range(N):
                f.register(i)
                f.link(i, Faults(seed=i))  # no faults until test_faulty_links_...
                f.start_node(i)
            f.wait_nodes_online(N, timeout=240)
            yield f
        finally:
            f.stop()
            for link in f.links.values():
                link.close()
            left = [p for p in f.stopped if running(p)]
            assert not left, f"processes left running: {left}"


class RoundWatch(threading.Thread):
    """Notes when each round's record appears in ``metrics.jsonl`` (polled every 0.1 s); ``wait`` gives up early
    when ``failed()`` says the run is over."""

    def __init__(self, out: Path) -> None:
        super().__init__(daemon=True)
        self.out, self.seen, self.done = out / "metrics.jsonl", {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.out.exists():
                for line in self.out.read_text().splitlines():
                    if line.strip() and (r := json.loads(line)["round"]) not in self.seen:
                        self.seen[r] = time.monotonic()
            time.sleep(0.1)

    def wait(self, rnd: int, timeout: float) -> float:
        end = time.monotonic() + timeout
        while rnd not in self.seen:
            assert time.monotonic() < end, f"round {rnd} not recorded within {timeout:g} s"
            time.sleep(0.1)
        return self.seen[rnd]


def _run(fed: NetFederation, name: str, overrides: list[str]) -> tuple[int, Path, RoundWatch]:
    out = fed.root / name
    run_id = fed.submit(APP, {"overrides": shlex.join(overrides), "out-dir": str(out)})
    watch = RoundWatch(out)
    watch.start()
    return run_id, out, watch


def _finish(fed: NetFederation, run_id: int, out: Path, watch: RoundWatch, timeout: float) -> list[dict]:
    status = fed.wait_run(run_id, timeout, poll=1.0, done=(out / "summary.json").exists)
    time.sleep(0.3)
    watch.done.set()
    if status["status"] != "finished:completed":
        pytest.fail(f"run {run_id}: {status}\n{fed.run_log(run_id)[-3000:]}")
    return read_metrics(out)


def replies_by_round(out: Path, records: list[dict]) -> dict[int, list[dict]]:
    """The train replies of each round, from replies.jsonl, checked against the round records.

    A synchronous round pulls its own replies before the next round sends anything, and a message left
    without a reply gets its ``timeout:`` line when the round gives up on it, so replies.jsonl holds each
    round's lines together: ``num_clients`` aggregated replies plus one line per failure. Every line must
    fall to exactly one round (none lost, none twice), and each round's timeout lines match its record.
    """
    lines = [json.loads(x) for x in (out / "replies.jsonl").read_text().splitlines() if x]
    train = [r for r in lines if r["type"] == "train"]
    rounds, at = {}, 0
    for rec in records[1:]:
        n = rec["num_clients"] + rec["failures"]
        chunk = train[at : at + n]
        at += n
        ok = [r for r in chunk if not r["error"]]
        assert len(ok) == rec["num_clients"], (rec["round"], chunk, rec)
        assert len({r["partition_id"] for r in ok}) == len(ok), ("an update counted twice", rec["round"], ok)
        late = [r for r in chunk if (r["error"] or "").startswith("timeout:")]
        assert len(late) == (rec.get("failure_kinds") or {}).get("timeout", 0), (rec, chunk)
        rounds[rec["round"]] = chunk
    assert at == len(train), f"{len(train) - at} train replies beyond the records: {train[at:]}"
    return rounds


def test_a_deployment_across_hosts(fed, hosts):
    """Three SuperNodes, each on its own host, reach the server host's address through their links (no
    faults yet); TLS and node authentication; two rounds in which every node trains its own partition."""
    run_id, out, watch = _run(fed, "plain", [*TINY, f"clients_per_round={N}", "num_rounds=2"])
    records = _finish(fed, run_id, out, watch, timeout=240)
    assert [r["round"] for r in records] == [0, 1, 2] and all(r["failures"] == 0 for r in records[1:])
    for chunk in replies_by_round(out, records).values():
        # each update came from the node registered for its partition (the binding's keys)
        assert sorted((r["partition_id"], r["node_id"]) for r in chunk) == sorted(fed.node_ids.items())
    for i in range(N):
        pid = fed.procs[f"supernode{i}"].pid
        where = netns._ip("netns", "identify", str(pid)).stdout.strip()
        assert where == hosts.clients[i], (i, where)  # the node runs on its own host...
        link = fed.links[i]
        assert link.listen[0] == netns.HUB_IP and link.connections >= 1  # ...and came by the hub's address
        assert link.seen["up"] > 0 and link.seen["down"] > 0


def test_faulty_links_and_a_30_s_cut(fed):
    """Three nodes over 50-200 ms links with jitter (node 1 capped at 1 MB/s and stalled for 3 s twice), node 2
    cut for 30 s after round 2, then restored; every client every round, 12 s round timeout.

    While the link is cut the SuperLink still lists node 2 as connected (Flower drops a node after about 60 s
    without heartbeats), so its rounds are recorded as ``timeout`` (no reply in time) and replies.jsonl names
    the node in a ``timeout:`` line. Flower's SuperNode retries a refused connection with a growing backoff, which
    fedsim.deploy.node caps at 4 s (Flower's own: 20 s, often two rounds here); the tasks queued for it during the cut expire (fedsim's ServerApp gives them
    a TTL of round_timeout + 5 s), so once back it takes the current round's task.
    """
    cut_node, rounds = 2, 7
    for i, link in fed.links.items():
        link.faults = node_faults(i)
    over = [*TINY, f"clients_per_round={N}", f"num_rounds={rounds}", "round_timeout=12", "node_timeout=120"]
    run_id, out, watch = _run(fed, "faults", over)
    watch.wait(1, 240)
    fed.links[1].stall(3.0)
    watch.wait(2, 120)
    link = fed.links[cut_node]
    before = link.connections
    link.cut()
    cut_at = time.monotonic()
    fed.links[1].stall(3.0)
    time.sleep(30)
    link.restore()
    back_at = time.monotonic()
    records = _finish(fed, run_id, out, watch, timeout=400)
    print("round times (s):", [round(r["round_time"], 2) for r in records[1:]])
    assert [r["round"] for r in records] == list(range(rounds + 1))
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == rounds
    by_round = replies_by_round(out, records)
    ok = {r: {x["partition_id"] for x in by_round[r] if not x["error"]} for r in by_round}
    # a round is inside the cut if it started after the cut (the previous record was seen after it, less
    # the watcher's 0.1 s poll) and ended before the link came back
    inside = [r for r in by_round if watch.seen[r - 1] - 0.2 > cut_at and watch.seen[r] < back_at]
    assert len(inside) >= 1, (inside, watch.seen, cut_at, back_at)
    cut_id = fed.node_ids[cut_node]
    for r in inside:
        assert ok[r] == set(range(N)) - {cut_node}, (r, ok[r])
        assert records[r]["failure_kinds"] == {"timeout": 1}, records[r]
        (line,) = [x for x in by_round[r] if x["error"]]
        assert line["node_id"] == cut_id and line["error"].startswith("timeout: no reply within 12 s"), line
    # every other node trained in every round (latency, jitter, the cap and the stalls cost time, no update)
    for r in by_round:
        assert ok[r] >= set(range(N)) - {cut_node}, (r, sorted(ok[r]))
    # back within 2 rounds of the link's return: in the first or second round that started after it
    after = [r for r in by_round if watch.seen[r - 1] > back_at]
    assert any(cut_node in ok[r] for r in after[:2]), (after, {r: (by_round[r], records[r]) for r in after})
    assert link.connections > before and fed.links[1].seen["down"] > 0

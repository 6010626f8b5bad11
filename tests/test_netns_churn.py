"""Churn across hosts: ten SuperNodes, each on its own network namespace, leaving and joining at random.

The namespace harness of tests/test_netns.py with ten client hosts. During a 20-round run in which every node
is asked every round, nodes leave and join at round boundaries on a seeded schedule, in three ways:

* ``stop``: the SuperNode process gets SIGTERM (it leaves as Flower's does on Ctrl-C, telling the SuperLink)
  and a fresh SuperNode process joins later with the same key. The client host's warm SuperExec is started
  apart from its SuperNode here (bound to this test process) and outlives it, so a join costs one cold
  Python start, not two; it reconnects to the new SuperNode on the same Runtime API port.
* ``restart``: the SuperNode and its warm SuperExec are both stopped and both started again (a cold host).
* ``cut``: the node's link is cut (its network goes away; the SuperNode keeps running and retrying) and
  restored. The SuperLink still lists a cut node, so each round inside a cut waits ``round_timeout``: the
  schedule cuts two nodes for one round, at once.

Every round's record must agree with who was connected: its replies name the ten nodes, each trained or
failed, never both; a node gone for the whole round has no update and a failure naming it (``unavailable``
once it left, ``timeout`` while cut); a node back trains again within ``BACK_WITHIN`` rounds; replies.jsonl
holds each update once; a node connected for a whole round, past those rounds, trained in it. The whole file
took 167-171 s on 2 cores beside a busy process (three runs, `round_timeout=10`, 30 rounds), 294 s alone on a
slower 2-core machine (`round_timeout=20`, 30 rounds), 155 s alone with the 20 rounds it has now on a faster
one; figures in docs/deploy.md, "Across machines".
Needs root and iproute2 (skipped with the reason otherwise).
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import netns
import pytest
from netns_proxy import Faults
from test_netns import APP, WHY_NOT, NetFederation, RoundWatch, _finish, replies_by_round

from fedsim.deploy import Security, free_port, make_certs
from fedsim.deploy.launch import running, supernode_command, terminate, warm_command
from fedsim.procs import descendants

NODES, ROUNDS, SEED = 10, 20, 42
ROUND_TIMEOUT = 20  # seconds: a round inside a cut waits this long for the cut nodes (10 timed out healthy
# nodes in CI once: with a cold restart beside another test, rounds took 10-13 s on 2 cores)
POLL = 0.5  # a SuperNode's idle poll (s): half the idle requests of the 0.25 s the other namespace tests use
TASK_POLL = 0.25  # a SuperExec's task poll (s; fedsim's warm one: 0.05, ten of them idle: 0.4 of a core)
RETRY = 1.0  # longest wait (s) between a SuperNode's (or a SuperExec's) reconnection attempts
STAY = 3  # rounds a node stays after its join before it may leave again
BACK_WITHIN = {"stop": 2, "cut": 2, "restart": 3}  # rounds that start after a join, by kind of leave
OVERRIDES = [
    "dataset=digits",
    f"num_clients={NODES}",
    f"clients_per_round={NODES}",
    f"num_rounds={ROUNDS}",
    f"round_timeout={ROUND_TIMEOUT}",
    "node_timeout=240",  # the run is submitted while the SuperNodes start; it waits for all ten
    "min_replies=1",
    "eval_every=10",
    "quiet=true",
    "checkpoint_every=0",
    "seed=3",
]
# the warm SuperExec with its reconnection backoff capped as fedsim.deploy.node caps the SuperNode's
WARM = (
    "import sys; from fedsim.deploy.node import cap_retry_delay; cap_retry_delay({retry}); "
    "from fedsim.deploy.warm import main; main(sys.argv[1:])"
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")]


def schedule(seed: int = SEED) -> dict[int, list[tuple[str, str, int]]]:
    """Round -> the events after its record: ``(action, kind, node)``, action ``leave`` or ``join``.

    At most 3 nodes stopped at a time, each away 1-3 rounds and then back for at least ``STAY`` rounds; two nodes cut for one round at one boundary; two
    of the stops are cold restarts; nothing after round ``ROUNDS - 4`` (all back for the
    last rounds).
    """
    rng = random.Random(seed)
    last = ROUNDS - 4
    cut_at = rng.randint(4, last - 2)
    spans: list[list] = []  # [node, kind, left after round, joins after round]
    for r in range(1, last):
        gone = [s[0] for s in spans if s[2] <= r <= s[3]]
        # a node back stays STAY rounds: one stopped while it is still connecting is not known to have left
        free = [
            n for n in range(NODES) if n not in gone and all(r - s[3] >= STAY for s in spans if s[0] == n)
        ]
        if r == cut_at:
            spans += [[n, "cut", r, r + 1] for n in rng.sample(free, 2)]
        elif len(gone) < 3 and rng.random() < 0.7:
            spans.append([rng.choice(free), "stop", r, min(r + rng.randint(1, 3), last)])
    for span in rng.sample([s for s in spans if s[1] == "stop"], 2):
        span[1] = "restart"
    plan: dict[int, list[tuple[str, str, int]]] = {}
    for node, kind, _, back in spans:  # at a boundary, joins first
        plan.setdefault(back, []).append(("join", kind, node))
    for node, kind, left, _ in spans:
        plan.setdefault(left, []).append(("leave", kind, node))
    return {r: plan[r] for r in sorted(plan)}


class ChurnFederation(NetFederation):
    """``NetFederation`` whose SuperNodes can leave alone: each host's warm SuperExec is started apart from its
    SuperNode (bound to this test process) on a Runtime API port kept for the host."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.ports: dict[int, int] = {}
        self.secret: dict[int, Path] = {}
        self.node: dict[int, str] = {}  # node -> the name of its SuperNode process now
        self.warm: dict[int, str] = {}
        self.starts: Counter = Counter()

    def _name(self, base: str, i: int) -> str:
        self.starts[base, i] += 1
        name = f"{base}{i}" + (f".{self.starts[base, i] - 1}" if self.starts[base, i] > 1 else "")
        self.where[name] = self.hosts.clients[i]
        return name

    def start_warm(self, i: int) -> None:
        self.ports[i] = free_port("127.0.0.1")  # on the client host's loopback: no other process there
        self.secret[i] = self._secret(self.workdir / f"supernode{i}.secret")
        cmd = warm_command(self.ports[i], self.secret[i], parent_pid=os.getpid())
        cmd[1:3] = ["-c", WARM.format(retry=RETRY)]
        self.warm[i] = self._name("superexec-", i)
        self.spawn(self.warm[i], cmd, cwd=self.cwd)

    def start_node(self, i: int) -> None:
        """SuperNode ``i`` on client host ``i``, through its link, served by the host's warm SuperExec."""
        listen = "{}:{}".format(*self.links[i].listen)
        cache = str(self.workdir / "partition-cache")
        cmd = supernode_command(
            listen, self.ports[i], i, NODES, self.sec, warm_secret=self.secret[i], poll=POLL, cache_dir=cache
        )
        cmd[3:3] = ["--retry-max-delay", f"{RETRY:g}"]  # after `python -m fedsim.deploy.node`
        self.node[i] = self._name("supernode", i)
        self.spawn(self.node[i], cmd, cwd=self.cwd)

    def end(self, name: str) -> None:
        """SIGTERM process ``name`` and what it forked (a warm SuperExec's ClientApps); wait for it."""
        proc = self.procs.pop(name)
        pids = [proc.pid, *descendants(proc.pid)]
        self.stopped.extend(pids)
        terminate(pids, timeout=15)
        proc.wait(timeout=10)

    def leave(self, kind: str, i: int) -> None:
        if kind == "cut":
            self.links[i].cut()
            return
        self.end(self.node[i])
        if kind == "restart":
            self.end(self.warm[i])

    def join(self, kind: str, i: int) -> str:
        """Bring node ``i`` back; return what happened (a cut node whose SuperNode gave up is started again,
        as the service manager docs/deploy.md asks for would)."""
        if kind == "cut":
            self.links[i].restore()
            proc = self.procs[self.node[i]]
            if proc.poll() is None:
                return "restored"
            self.procs.pop(self.node[i])
            self.start_node(i)
            return f"restored; its SuperNode had exited ({proc.returncode}) and was started again"
        if kind == "restart":
            self.start_warm(i)
        self.start_node(i)
        return kind

    def stop_nodes(self) -> None:
        """Stop every client host's processes at once (then ``stop`` stops the server host's)."""
        names = [n for n in self.procs if n.startswith(("supernode", "superexec-"))]
        with ThreadPoolExecutor(len(names) or 1) as pool:
            list(pool.map(self.end, names))


@pytest.fixture(scope="module")
def fed10(tmp_path_factory):
    """The server host and ten client hosts; the SuperNodes are started, not waited for (the run waits)."""
    netns.sweep()
    hosts = netns.Hosts(NODES)
    root = tmp_path_factory.mktemp("churn")

    def register(i: int) -> int:
        with netns.inside(hosts.hub):  # a thread of the pool: the flwr CLI must start on the server host
            return f.register(i)

    try:
        with netns.inside(hosts.hub):
            certs = make_certs(root / "certs", nodes=NODES, hosts=(netns.HUB_IP,))
            sec = Security(tls=True, auth=True, certs=certs)
            f = ChurnFederation(
                root / "work", sec, host=netns.HUB_IP, cwd=root, echo=lambda _: None, hosts=hosts
            )
            f.root = root
            f.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = f"{TASK_POLL:g}"
            try:
                for i in range(NODES):  # their imports overlap the SuperLink's start; they wait for a node
                    f.start_warm(i)
                f.start_superlink(timeout=120)
                with ThreadPoolExecutor(NODES) as pool:
                    list(pool.map(register, range(NODES)))
                for i in range(NODES):
                    f.link(i, Faults(rtt=0.01, jitter=0.005, seed=i))
                    f.start_node(i)
                yield f
            finally:
                f.stop_nodes()
                f.stop()
                for link in f.links.values():
                    with contextlib.suppress(Exception):
                        link.close()
                left = [p for p in f.stopped if running(p)]
                assert not left, f"processes left running: {left}"
    finally:
        hosts.close()
        assert not [ns for ns in hosts.names() if (netns.NETNS_DIR / ns).exists()]


def churn(fed: ChurnFederation, plan: dict, watch: RoundWatch) -> dict[int, list[list]]:
    """Play the schedule at round boundaries; return node -> its absences ``[kind, began, left, joined]``
    (monotonic seconds: ``began`` when its leave started, so it may be gone from then on; ``left`` once it was
    gone: stopping a node and its SuperExec takes seconds, while the next round goes on; ``joined`` before it
    was brought back)."""
    away: dict[int, list[list]] = {n: [] for n in range(NODES)}
    for r in sorted(plan):
        watch.wait(r, 300)
        for action, kind, node in plan[r]:
            if action == "leave":
                began = time.monotonic()
                fed.leave(kind, node)
                away[node].append([kind, began, time.monotonic(), float("inf")])
            else:
                away[node][-1][3] = time.monotonic()
                print(f"after round {r}: node {node} back ({fed.join(kind, node)})")
    return away


def test_ten_nodes_leaving_and_joining(fed10):
    plan = schedule()
    kinds = Counter(kind for ev in plan.values() for action, kind, _ in ev if action == "leave")
    assert kinds["cut"] == 2 and kinds["restart"] == 2 and kinds["stop"] >= 6, kinds  # the seed gives churn
    out = fed10.root / "run"
    t0 = time.monotonic()
    run_id = fed10.submit(APP, {"overrides": shlex.join(OVERRIDES), "out-dir": str(out)})
    watch = RoundWatch(out)
    watch.start()
    away = churn(fed10, plan, watch)
    records = _finish(fed10, run_id, out, watch, timeout=600)
    print(
        f"run: {time.monotonic() - t0:.1f} s from submission, round 1 at {watch.seen[1] - t0:.1f} s; round times:"
    )
    print([round(r["round_time"], 1) for r in records[1:]])
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    by_round = replies_by_round(out, records)  # every update once, every failure a line
    ids = {n: p for p, n in fed10.node_ids.items()}
    trained = {r: {x["partition_id"] for x in lines if not x["error"]} for r, lines in by_round.items()}
    failed = {
        r: {ids[x["node_id"]]: x["error"] for x in lines if x["error"]} for r, lines in by_round.items()
    }
    print({r: sorted(failed[r]) for r in failed if failed[r]})
    for r, lines in by_round.items():
        # each update came from the node registered for its partition; each node trained or failed, once
        assert all(ids[x["node_id"]] == x["partition_id"] for x in lines if not x["error"]), lines
        assert trained[r] | set(failed[r]) == set(range(NODES)) and not trained[r] & set(failed[r]), r
        start, end = watch.seen[r - 1], watch.seen[r]
        for n, spans in away.items():
            for kind, _, left, joined in spans:
                if left < start and joined > end:  # gone for the whole round: a failure naming it
                    err = failed[r].get(n, "")
                    ok = err.startswith("timeout:") if kind == "cut" else "Unavailable" in err
                    assert ok, (r, n, kind, err)
    check_back(away, by_round, trained, watch)
    check_present(away, by_round, trained, watch)


def check_back(away: dict, by_round: dict, trained: dict, watch: RoundWatch) -> None:
    """A node back trains again within ``BACK_WITHIN[kind]`` of the rounds that start after its join."""
    took = []
    for n, spans in away.items():
        for kind, _, _, joined in spans:
            later = [r for r in by_round if watch.seen[r - 1] > joined]
            first = next((k for k, r in enumerate(later, 1) if n in trained[r]), None)
            took.append((n, kind, first))
            assert first is not None and first <= BACK_WITHIN[kind], (n, kind, joined, later[:4], first)
    print("rounds until trained again (node, kind, n-th round after the join):", took)


def check_present(away: dict, by_round: dict, trained: dict, watch: RoundWatch) -> None:
    """A node connected for the whole round, and past its ``BACK_WITHIN`` rounds after a join, trained in it."""
    for r in by_round:
        for n, spans in away.items():
            busy = [
                (kind, began, joined)
                for kind, began, _, joined in spans
                if began
                < watch.seen[r]  # its leave began before the round's record (else it was there all round)
                and r <= max(k for k in by_round if watch.seen[k - 1] <= joined) + BACK_WITHIN[kind]
            ]
            assert busy or n in trained[r], (r, n, spans)

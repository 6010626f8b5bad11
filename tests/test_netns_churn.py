"""Churn across hosts: ten SuperNodes, each on its own network namespace, leaving and joining at random.

The namespace harness of tests/test_netns.py with ten client hosts. During a short run in which every node
is asked every round, SuperNodes are stopped (SIGTERM, with their warm SuperExec) and started again at round
boundaries, on a seeded schedule; every round's record must agree with who was connected: a node that was
gone for the whole round has no update in it and a failure line naming it, a node that came back trains
again, and replies.jsonl holds each update once. Ten warm SuperNodes take minutes to start and run on two
cores, more than CI's budget for these tests: opt in with ``FEDSIM_NETNS_CHURN=1``. Also needs root and
iproute2 (skipped with the reason otherwise).
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import time

import netns
import pytest
from netns_proxy import Faults
from test_netns import APP, WHY_NOT, NetFederation, RoundWatch, _finish, replies_by_round

from fedsim.deploy import Security, make_certs
from fedsim.deploy.launch import running

NODES, ROUNDS, SEED = 10, 12, 42
OVERRIDES = [
    "dataset=digits",
    f"num_clients={NODES}",
    f"clients_per_round={NODES}",
    f"num_rounds={ROUNDS}",
    "round_timeout=15",
    "min_replies=1",
    "quiet=true",
    "checkpoint_every=0",
    "seed=3",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}"),
    pytest.mark.skipif(
        os.environ.get("FEDSIM_NETNS_CHURN") != "1",
        reason="ten SuperNodes take longer than CI's budget for the namespace tests: FEDSIM_NETNS_CHURN=1 runs it",
    ),
]


def schedule(seed: int = SEED) -> dict[int, list[tuple[str, int]]]:
    """Round -> the events after its record: ``("leave", node)`` or ``("join", node)``; at most 3 nodes away,
    each away for 1-3 rounds; nothing after round ``ROUNDS - 3`` (every node is back for the last rounds)."""
    rng = random.Random(seed)
    plan: dict[int, list[tuple[str, int]]] = {}
    back: dict[int, int] = {}  # node away -> the round after which it joins again
    for r in range(1, ROUNDS - 2):
        for node, when in sorted(back.items()):
            if when == r:
                plan.setdefault(r, []).append(("join", node))
                del back[node]
        if r < ROUNDS - 3 and len(back) < 3 and rng.random() < 0.7:
            node = rng.choice([n for n in range(NODES) if n not in back])
            plan.setdefault(r, []).append(("leave", node))
            back[node] = min(r + rng.randint(1, 3), ROUNDS - 3)
    return plan


@pytest.fixture(scope="module")
def fed10(tmp_path_factory):
    netns.sweep()
    hosts = netns.Hosts(NODES)
    root = tmp_path_factory.mktemp("churn")
    try:
        with netns.inside(hosts.hub):
            certs = make_certs(root / "certs", nodes=NODES, hosts=(netns.HUB_IP,))
            sec = Security(tls=True, auth=True, certs=certs)
            f = NetFederation(
                root / "work", sec, host=netns.HUB_IP, cwd=root, echo=lambda _: None, hosts=hosts
            )
            f.root = root
            try:
                f.start_superlink(timeout=120)
                for i in range(NODES):
                    f.register(i)
                    f.link(i, Faults(rtt=0.02, jitter=0.01, seed=i))
                    f.start_node(i)
                f.wait_nodes_online(NODES, timeout=400)
                yield f
            finally:
                f.stop()
                for link in f.links.values():
                    with contextlib.suppress(Exception):
                        link.close()
                left = [p for p in f.stopped if running(p)]
                assert not left, f"processes left running: {left}"
    finally:
        hosts.close()
        assert not [ns for ns in hosts.names() if (netns.NETNS_DIR / ns).exists()]


def test_ten_nodes_leaving_and_joining(fed10):
    plan = schedule()
    assert sum(a == "leave" for ev in plan.values() for a, _ in ev) >= 3  # the seed gives real churn
    out = fed10.root / "run"
    run_id = fed10.submit(APP, {"overrides": shlex.join(OVERRIDES), "out-dir": str(out)})
    watch = RoundWatch(out)
    watch.start()
    away: dict[int, list[list[float]]] = {n: [] for n in range(NODES)}  # node -> [[left, joined], ...]
    for r in sorted(plan):
        watch.wait(r, 300)
        for action, node in plan[r]:
            if action == "leave":
                fed10.stop_node(node)
                away[node].append([time.monotonic(), float("inf")])
            else:
                fed10.start_node(node)
                away[node][-1][1] = time.monotonic()
    records = _finish(fed10, run_id, out, watch, timeout=600)
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    by_round = replies_by_round(out, records)  # every update once, every failure a line
    ids = {n: p for p, n in fed10.node_ids.items()}
    print({r: sorted(ids[x["node_id"]] for x in by_round[r] if x["error"]) for r in by_round})
    for r, lines in by_round.items():
        start, end = watch.seen[r - 1], watch.seen[r]
        trained = {x["partition_id"] for x in lines if not x["error"]}
        failed = {ids[x["node_id"]] for x in lines if x["error"]}
        assert trained | failed == set(range(NODES)) and not trained & failed, (r, trained, failed)
        for n, spans in away.items():
            if any(left < start and joined > end for left, joined in spans):  # gone the whole round
                assert n in failed, (r, n, spans, start, end)
    # a node back from churn trains again within 3 rounds of its return (a cold start: imports, reconnect)
    for n, spans in away.items():
        for _, joined in spans:
            later = [r for r in by_round if watch.seen[r - 1] > joined][:3]
            assert any(n in {x["partition_id"] for x in by_round[r] if not x["error"]} for r in later), (
                n,
                joined,
                later,
            )

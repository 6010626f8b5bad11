"""Fast checks behind the namespace tests: what a deployed run records for a node that does not reply in
time (a fake grid, no services), the tests' skip reasons, and the link proxy on loopback.

The namespace tests (tests/test_netns.py) cut a node's link mid-run; these check the record they rely on:
replies.jsonl gets one ``timeout:`` line per message of a synchronous round left without a reply, naming the
node it was sent to and whether the SuperLink still listed that node as connected.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest
from flwr.app import MetricRecord, RecordDict
from test_deploy import message

from fedsim import keys
from fedsim.deploy import free_port
from fedsim.server_app import ReplyLog


class SilentGrid:
    """A grid where only the nodes in ``answering`` reply; ``online`` are the nodes the SuperLink lists."""

    def __init__(self, answering: set[int], online: set[int]) -> None:
        self.answering, self.online, self.sent = answering, online, {}

    def push_messages(self, messages):
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent[m.metadata.message_id] = m
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids):
        out = []
        for i in ids:
            dst = int(self.sent[i].metadata.dst_node_id)
            if dst in self.answering:
                content = RecordDict(
                    {keys.METRICS: MetricRecord({keys.PARTITION_ID: dst, keys.NUM_EXAMPLES: 5})}
                )
                out.append(message(dst, 0, i, content=content))
                self.answering = self.answering - {dst}  # one reply per message
        return out

    def get_node_ids(self):
        return sorted(self.online)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_message_without_reply_gets_a_timeout_line_naming_its_node(tmp_path):
    path = tmp_path / "replies.jsonl"
    grid = SilentGrid(answering={1, 3}, online={1, 2, 3})  # node 2 is silent but listed, node 4 gone
    log = ReplyLog(grid, path)
    replies = log.send_and_receive([message(0, n, content=RecordDict()) for n in (1, 2, 3, 4)], timeout=0.3)
    log.close()
    assert sorted(int(r.metadata.src_node_id) for r in replies) == [1, 3]
    lines = _lines(path)
    assert sorted((x["node_id"], x["partition_id"]) for x in lines if not x["error"]) == [(1, 1), (3, 3)]
    silent = {x["node_id"]: x["error"] for x in lines if x["error"]}
    assert silent == {
        2: "timeout: no reply within 0.3 s (the SuperLink lists the node as connected)",
        4: "timeout: no reply within 0.3 s (the SuperLink lists the node as offline)",
    }


def test_every_reply_in_time_leaves_no_timeout_line(tmp_path):
    path = tmp_path / "replies.jsonl"
    log = ReplyLog(SilentGrid(answering={1, 2}, online={1, 2}), path)
    log.send_and_receive([message(0, n, content=RecordDict()) for n in (1, 2)], timeout=5)
    log.close()
    assert [x["error"] for x in _lines(path)] == [None, None]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_the_namespace_tests_say_why_they_are_skipped(monkeypatch):
    import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root (ip netns add)"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert netns.unavailable() == "iproute2's ip command is not installed"


@pytest.fixture
def echo_server():
    """A TCP echo server on 127.0.0.1 (a thread per connection); yields its address."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def _round_trip(address, payload: bytes = b"x" * 100) -> float:
    t0 = time.monotonic()
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(65536)
    assert got == payload
    return time.monotonic() - t0


def test_the_link_proxy_delays_caps_stalls_cuts_and_restores(echo_server):
    from netns_proxy import Faults, Link

    link = Link(("127.0.0.1", free_port("127.0.0.1")), echo_server, Faults(rtt=0.2, jitter=0.02)).start()
    try:
        assert 0.2 <= _round_trip(link.listen) < 1.0  # each way half the RTT, +-10 ms: 0.19 s at least
        link.faults = Faults(rate=100_000)  # 20 KB up and back at 100 KB/s: 0.4 s
        assert 0.35 <= _round_trip(link.listen, b"y" * 20_000) < 2.0
        link.faults = Faults()
        link.stall(0.5)
        assert 0.45 <= _round_trip(link.listen) < 2.0
        link.cut()
        with pytest.raises(OSError):
            _round_trip(link.listen)
        link.restore()
        assert _round_trip(link.listen) < 0.5
        assert link.seen["up"] == link.seen["down"] == 3 * 100 + 20_000 and link.connections == 4
    finally:
        link.close()

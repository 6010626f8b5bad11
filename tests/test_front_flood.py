"""Fronts that hold a flood: 1,000 idle connections from one address leave the honest nodes served.

A stranger with no key opens 1,000 TCP connections to a front from one loopback address (127.0.0.2), sends
nothing, and re-opens each one the front cuts (the loop is bounded in connections and seconds, and stops by
itself). Meanwhile an honest client on another address (127.0.0.1) makes TLS requests on the Fleet API, each
on a fresh connection, as a SuperNode does when its keep-alive connection has been closed. Both fronts cap
connections per address when they are accepted and cut a connection that sends no complete header within
``Limits.header_timeout``, so at least 95 % of the honest requests are answered by the upstream (a stand-in
for the SuperLink behind the front: it answers 200 to every request it is forwarded). Before the cap, the
Python front's 576 threads were all held by the stranger and 12-16 of 20 honest requests failed.
"""

from __future__ import annotations

import http.server
import selectors
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedsim.deploy import free_port, make_certs, wait_for_superlink
from fedsim.deploy.front import Limits, nginx_binary, nginx_conf, nginx_stream_module
from fedsim.deploy.launch import loopback_name

FLOOD, HONEST = 1000, 40  # idle connections from the stranger; honest requests during the flood
STRANGER = "127.0.0.2"  # the flood's source address (all of 127.0.0.0/8 is loopback on Linux)


class _Upstream(http.server.ThreadingHTTPServer):
    daemon_threads = True


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _ok(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(size)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = _ok

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def upstream(tmp_path):
    """A TLS stand-in for the SuperLink on 127.0.0.1 (the fronts check its certificate against ``ca.crt``)."""
    certs = make_certs(tmp_path / "certs", nodes=0)
    server = _Upstream(("127.0.0.1", 0), _Answer)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certs / "server.pem"), str(certs / "server.key"))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield certs, server.server_address[1]
    server.shutdown()


def _flood(address: str, stop: threading.Event, stats: dict, seconds: float = 90, most: int = 60_000) -> None:
    """Hold ``FLOOD`` idle connections from ``STRANGER``, re-opening each one the front closes, until ``stop``,
    ``seconds`` or ``most`` connections in all (whichever comes first)."""
    host, port = address.rsplit(":", 1)
    sel = selectors.DefaultSelector()
    end, opened = time.monotonic() + seconds, 0

    def open_one() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.bind((STRANGER, 0))
        s.connect_ex((host, int(port)))
        sel.register(s, selectors.EVENT_READ)
        opened += 1

    try:
        while not stop.is_set() and time.monotonic() < end and opened < most:
            while len(sel.get_map()) < FLOOD and opened < most:
                open_one()
            stats["held"] = len(sel.get_map())
            for key, _ in sel.select(timeout=0.05):  # readable: the front closed it (or refused it)
                sel.unregister(key.fileobj)
                key.fileobj.close()
    finally:
        stats["opened"] = opened
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()


def _honest(address: str, ca: Path) -> list[int | None]:
    """``HONEST`` POSTs to a Fleet route, each on a fresh TLS connection from 127.0.0.1: their statuses
    (None: the connection failed or no answer came within 10 s)."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    out = []
    for _ in range(HONEST):
        try:
            raw = socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.1", 0))
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(
                    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
                )
                parts = s.makefile("rb").readline().split()
                out.append(int(parts[1]) if len(parts) > 1 else None)
        except OSError:
            out.append(None)
        time.sleep(0.25)
    return out


def _under_flood(address: str, ca: Path) -> tuple[list, dict]:
    stop, stats = threading.Event(), {"held": 0}
    flood = threading.Thread(target=_flood, args=(address, stop, stats))
    flood.start()
    try:
        t0 = time.monotonic()
        while stats.get("held", 0) < FLOOD and time.monotonic() - t0 < 30:  # the flood is up
            time.sleep(0.1)
        statuses = _honest(address, ca)
    finally:
        stop.set()
        flood.join(timeout=60)
    stats["stopped"] = not flood.is_alive()
    return statuses, stats


def _check(name: str, statuses: list, stats: dict, capped: bool = True) -> None:
    served = statuses.count(200)
    print(
        f"{name} front: {served} of {len(statuses)} honest requests served under a flood of {FLOOD} idle "
        f"connections from one address ({stats['opened']} opened in all)"
    )
    assert stats["stopped"], "the flood loop did not stop by itself"
    assert served >= 0.95 * len(statuses), statuses
    if capped:  # the front closed the stranger's connections beyond its cap as they came, not after a timeout
        assert stats["opened"] > 2 * FLOOD, stats


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow  # about 20 s: a flood and 40 requests spaced 0.25 s
def test_python_front_serves_honest_nodes_under_an_idle_flood_from_one_address(upstream, tmp_path):
    certs, port = upstream
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "fedsim.deploy.pyfront", "--listen", address, "--upstream-port", str(port)]
    cmd += [
        "--cert",
        str(certs / "server.pem"),
        "--key",
        str(certs / "server.key"),
        "--ca",
        str(certs / "ca.crt"),
    ]
    front = _start(cmd, tmp_path / "front.log")
    try:
        wait_for_superlink(address, 60, certs / "ca.crt")
        statuses, stats = _under_flood(address, certs / "ca.crt")
    finally:
        front.terminate()
        front.wait(timeout=30)
    _check("Python", statuses, stats)


@pytest.mark.slow  # about 20 s: a flood and 40 requests spaced 0.25 s
@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (.ci/run installs it)")
def test_nginx_front_serves_honest_nodes_under_an_idle_flood_from_one_address(upstream, tmp_path):
    certs, port = upstream
    listen = free_port()
    prefix = tmp_path / "front"
    prefix.mkdir()
    tls = (certs / "server.pem", certs / "server.key", certs / "ca.crt", loopback_name(certs / "server.pem"))
    conf = prefix / "nginx.conf"
    stream = nginx_stream_module()  # what fedsim.deploy writes: the stream server when nginx has the module
    conf.write_text(nginx_conf("127.0.0.1", listen, port, prefix, tmp_path, tls, Limits(), stream))
    cmd = [nginx_binary(), "-c", str(conf), "-p", str(prefix), "-e", str(tmp_path / "front-error.log")]
    front = _start(cmd, tmp_path / "front.log")
    address = f"127.0.0.1:{listen}"
    try:
        wait_for_superlink(address, 60, certs / "ca.crt")
        statuses, stats = _under_flood(address, certs / "ca.crt")
    finally:
        front.terminate()
        front.wait(timeout=30)
    name = "nginx" + (" (stream server)" if stream is not None else " (no stream module)")
    _check(name, statuses, stats, capped=stream is not None)

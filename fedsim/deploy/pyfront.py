"""fedsim's Python front: the fallback for machines without nginx (``python -m fedsim.deploy.pyfront``).

The rules and limits are ``fedsim.deploy.front``'s (``allowed``, ``Limits``): a thread per connection, at
most ``Limits.max_conn + 64`` of them and ``Limits.conn_per_address`` per client address, counted when a
connection is accepted (beyond, it is closed at once); per client address a token bucket and a cap on requests in progress
(503 beyond, which Flower's SuperNode retries), and at most ``upstream_conns`` requests at the SuperLink; the
request line and headers within ``header_timeout``; a body that stalls for ``body_timeout``, or then averages
under ``min_rate``, is dropped; bodies over ``max_body`` get 413 before a byte of them is read. A body is
copied in pieces into a spooled temporary file (on disk above 1 MB) and forwarded only once complete; the
SuperLink's answer is streamed back.

``count_file`` (``--count-file``, for measurements such as ``bench/deploy.py``'s): one JSON line per forwarded
request, ``{"route", "up", "down", "up_body", "down_body"}``: the bytes the node sent (request line, headers
and body, as HTTP/1.1 carries them before TLS) and the bytes it was sent back (status line, headers, body),
and the bodies alone (the Fleet API's protobuf messages).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedsim.deploy.front import HOP_BY_HOP, MB, Limits, _listen, allowed


class _Gate:
    """Admission for the Python front: requests in progress (per address and in all) and a token bucket per
    address (``Limits.rate`` a second, ``Limits.burst`` at once)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
        self._total = 0
        self._tokens: dict[str, tuple[float, float]] = {}  # address -> (tokens, time)

    def enter(self, addr: str) -> int | None:
        """Admit a request from ``addr`` (None) or say why not (an HTTP status: 503, which Flower's SuperNode
        retries with backoff)."""
        lim = self.limits
        with self._lock:
            now = time.monotonic()
            tokens, then = self._tokens.get(addr, (float(lim.burst + 1), now))
            tokens = min(float(lim.burst + 1), tokens + (now - then) * lim.rate)
            if tokens < 1.0:
                self._tokens[addr] = (tokens, now)
                return 503
            if self._active.get(addr, 0) >= lim.conn_per_address or self._total >= lim.max_conn:
                return 503
            self._tokens[addr] = (tokens - 1.0, now)
            if len(self._tokens) > 100_000:  # forget idle addresses (a full bucket is the default)
                self._tokens = {a: v for a, v in self._tokens.items() if v[0] < lim.burst}
            self._active[addr] = self._active.get(addr, 0) + 1
            self._total += 1
            return None

    def leave(self, addr: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._active.get(addr, 1) - 1
            if left:
                self._active[addr] = left
            else:
                self._active.pop(addr, None)


class _Counter:
    """Appends one JSON line per forwarded request to a file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # kept open for the life of the process

    def add(self, route: str, up: int, down: int, up_body: int, down_body: int) -> None:
        line = json.dumps(
            {"route": route, "up": up, "down": down, "up_body": up_body, "down_body": down_body}
        )
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


def request_head_bytes(request_line: bytes, headers) -> int:
    """Bytes of a request's line and headers as HTTP/1.1 carries them (``Name: value`` CRLF each, a blank line)."""
    return len(request_line) + sum(len(f"{k}: {v}\r\n".encode()) for k, v in headers.items()) + 2


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fedsim-front"
    sys_version = ""
    upstream: tuple[str, int] = ("127.0.0.1", 0)
    upstream_ctx: ssl.SSLContext | None = None
    limits: Limits = Limits()
    gate: _Gate | None = None
    upstream_slots: threading.Semaphore | None = None
    counter: _Counter | None = None
    _sent_head = 0  # bytes of the status line and headers sent back (counted when a counter is set)

    def flush_headers(self) -> None:
        if self.counter is not None and getattr(self, "_headers_buffer", None):
            self._sent_head = sum(len(b) for b in self._headers_buffer)
        super().flush_headers()

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(
            self.limits.body_timeout
        )  # any read that stalls this long ends the request

    def handle_one_request(self) -> None:
        # the request line and headers must arrive within header_timeout, however slowly each byte comes
        self._timer = threading.Timer(self.limits.header_timeout, self._cut)
        self._timer.start()
        try:
            super().handle_one_request()
        except (TimeoutError, OSError):
            self.close_connection = True
        finally:
            self._timer.cancel()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, format, *args):
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _deny(self, code: int = 403) -> None:
        body = {413: b"request body too large\n", 503: b"too many requests, retry later\n"}.get(
            code, b"forbidden by the fedsim front\n"
        )
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        if code in (408, 411, 413, 503):
            self.send_header("Connection", "close")  # the rest of the request is not read
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _read_body(self, length: int, spool) -> bool:
        """Copy the body into ``spool`` in pieces; False when it stalls (``body_timeout`` without a byte) or,
        after ``body_timeout`` seconds, has arrived slower than ``min_rate`` bytes a second."""
        lim = self.limits
        t0, got = time.monotonic(), 0
        while got < length:
            piece = self.rfile.read1(min(length - got, 64 * 1024))
            if not piece:
                return False
            spool.write(piece)
            got += len(piece)
            late = time.monotonic() - t0 - lim.body_timeout
            if late > 0 and got < length and got < late * lim.min_rate:
                return False
        spool.seek(0)
        return True

    def _forward(self) -> None:
        self._timer.cancel()  # the headers are in (the timer's thread ends)
        addr = self.client_address[0]
        refused = self.gate.enter(addr) if self.gate is not None else None  # refusals count too
        if refused:
            self._deny(refused)
            return
        try:
            if allowed(self.command, self.path):
                self._admitted()
            else:
                self._deny()
        finally:
            if self.gate is not None:
                self.gate.leave(addr)

    def _admitted(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._deny(411)  # Flower's clients send a Content-Length
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._deny(400)
            return
        if length > self.limits.max_body:
            self._deny(413)
            return
        with tempfile.SpooledTemporaryFile(max_size=1024 * 1024) as spool:
            if length and not self._read_body(length, spool):
                self.close_connection = True  # a stalled or too slow sender: drop it, forward nothing
                return
            self._relay(spool if length else None, length)

    def _relay(self, body, length: int) -> None:
        if self.upstream_slots is not None and not self.upstream_slots.acquire(timeout=30):
            self._deny(503)  # the SuperLink has upstream_conns requests in progress for 30 s
            return
        try:
            self._relay_now(body, length)
        finally:
            if self.upstream_slots is not None:
                self.upstream_slots.release()

    def _relay_now(self, body, length: int) -> None:
        host, port = self.upstream
        conn = (
            http.client.HTTPSConnection(host, port, context=self.upstream_ctx, timeout=600)
            if self.upstream_ctx
            else http.client.HTTPConnection(host, port, timeout=600)
        )
        try:
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in HOP_BY_HOP | {"host", "content-length"}
            }
            headers["Content-Length"] = str(length)
            conn.request(self.command, self.path, body=body, headers=headers)  # a file: sent in blocks
            res = conn.getresponse()
            size = res.getheader("Content-Length")
            data = None if size is not None else res.read()  # the SuperLink's own answer (bounded by it)
        except (OSError, http.client.HTTPException) as e:
            self.log_message("upstream error: %s", e)
            conn.close()
            self._deny(502)
            return
        sent = 0
        try:
            self.send_response(res.status, res.reason)
            for k, v in res.getheaders():
                if k.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)) if data is not None else size)
            self.end_headers()
            if self.command == "HEAD":
                return
            if data is not None:
                self.wfile.write(data)
                sent = len(data)
                return
            while piece := res.read(64 * 1024):  # streamed back, not held whole
                self.wfile.write(piece)
                sent += len(piece)
        finally:
            conn.close()
            if self.counter is not None:
                head = request_head_bytes(self.raw_requestline, self.headers)
                self.counter.add(self.path, head + length, self._sent_head + sent, length, sent)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _forward


class _Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most ``Limits.max_conn + 64`` of them, and at most ``per_address`` per
    client address, counted as each connection is accepted: beyond either, a new connection is closed at once
    (no thread, no TLS handshake), so one address cannot hold the slots by opening connections and sending
    nothing (those that do are cut after ``Limits.header_timeout``)."""

    daemon_threads = True
    request_queue_size = 128
    max_threads = 576
    per_address = 64

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_threads)
        self._open: dict[str, int] = {}  # client address -> connections held (only the accept loop adds)
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        addr = client_address[0]
        with self._open_lock:
            if self._open.get(addr, 0) >= self.per_address:
                addr = None
            else:
                self._open[addr] = self._open.get(addr, 0) + 1
        if addr is None or not self._slots.acquire(blocking=False):
            if addr is not None:
                self._forget(addr)
            self.shutdown_request(request)  # refuse the connection, start no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            self._forget(addr)
            raise

    def _forget(self, addr: str) -> None:
        with self._open_lock:
            left = self._open.get(addr, 1) - 1
            if left:
                self._open[addr] = left
            else:
                self._open.pop(addr, None)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self._forget(client_address[0])


def serve(
    listen_host: str,
    listen_port: int,
    upstream_port: int,
    cert: Path | None = None,
    key: Path | None = None,
    ca: Path | None = None,
    limits: Limits | None = None,
    count_file: Path | None = None,
) -> None:
    """Run the Python front until killed (TLS on both sides when ``cert``, ``key`` and ``ca`` are given);
    with ``count_file``, count each forwarded request's bytes there (see the module docstring)."""
    limits = limits or Limits()
    handler = type(
        "Handler",
        (_Handler,),
        {
            "upstream": ("127.0.0.1", upstream_port),
            "upstream_ctx": ssl.create_default_context(cafile=str(ca)) if ca else None,
            "limits": limits,
            "gate": _Gate(limits),
            "upstream_slots": threading.BoundedSemaphore(limits.upstream_conns),
            "counter": _Counter(count_file) if count_file else None,
        },
    )
    server_cls = type(
        "Server",
        (_Server,),
        {
            "address_family": socket.AF_INET6 if ":" in listen_host else socket.AF_INET,
            "max_threads": limits.max_conn + 64,  # the gate answers 503 to the excess while a thread is free
            "per_address": limits.conn_per_address,
        },
    )
    server = server_cls((listen_host, listen_port), handler)
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(cert), str(key))
        # the handshake happens in the connection's own thread (a stalled one does not block accept)
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    print(
        f"fedsim front (Python fallback) on {_listen(listen_host, listen_port)} -> 127.0.0.1:{upstream_port}, "
        f"bodies up to {limits.max_body / MB:.1f} MB",
        flush=True,
    )
    server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedsim.deploy.pyfront", description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="public HOST:PORT")
    p.add_argument("--upstream-port", type=int, required=True, help="the SuperLink's port on 127.0.0.1")
    p.add_argument("--cert", type=Path, help="TLS certificate served on the public side")
    p.add_argument("--key", type=Path, help="its private key")
    p.add_argument("--ca", type=Path, help="CA certificate to check the SuperLink's certificate with")
    p.add_argument(
        "--max-body", type=int, default=None, help="largest request body in bytes (default: body_limit())"
    )
    p.add_argument("--limits", default="{}", help="other Limits fields as JSON, e.g. '{\"rate\": 50}'")
    p.add_argument(
        "--count-file", type=Path, help="append each forwarded request's bytes here, one JSON line each"
    )
    a = p.parse_args(argv)
    host, _, port = a.listen.rpartition(":")
    if bool(a.cert) != bool(a.key) or bool(a.cert) != bool(a.ca):
        p.error("give --cert, --key and --ca together (TLS), or none of them")
    try:
        given = json.loads(a.limits)
        if a.max_body is not None:
            given["max_body"] = a.max_body
        limits = Limits(**given)
    except (ValueError, TypeError) as e:
        p.error(f"--limits: {e}")
    serve(host.strip("[]"), int(port), a.upstream_port, a.cert, a.key, a.ca, limits, a.count_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

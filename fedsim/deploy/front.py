"""The SuperLink's public front: a reverse proxy that forwards only the SuperNodes' Fleet API and ``/health``.

Flower 1.42's SuperLink serves its Fleet API (SuperNodes), Control API (``flwr run/ls/stop/log``,
``flwr supernode register``) and Runtime API (the ServerApp and SuperExec) on one HTTP(S) port, and the
open-source SuperLink has no login for the Control API. So ``fedsim.deploy`` binds the SuperLink to 127.0.0.1
and puts this front on the public address: ``POST /v1/fleet/<route>`` and ``GET /health`` are forwarded (over
TLS, checking the SuperLink's certificate, when the federation uses TLS); every other path gets 403. The
operator uses the Control API on the server host itself (or over SSH).

Two implementations, the same rules:

* nginx (``nginx_conf``), the default whenever ``nginx`` is installed: started in the foreground
  (``daemon off``) by ``fedsim.deploy``, stopped by its pid.
* ``python -m fedsim.deploy.pyfront``: a small threaded proxy in the standard library
  (``fedsim.deploy.pyfront``), a fallback for machines without nginx (trials, CI); fedsim says so when it
  uses it. Prefer nginx (or your own proxy with the same
  rules) for a long-lived server.

SuperNode authentication is unchanged behind the front: a node signs a timestamp with its private key in
request headers (Flower 1.42 signs no body or route), which the front passes through.

Both fronts shed abuse before the SuperLink sees it (``Limits``): Flower's SuperLink reads and parses a whole
body before it checks node authentication, so a stranger's large or slow bodies would cost its memory and the
round time. A body larger than ``Limits.max_body`` gets 413 (from its ``Content-Length``, or as soon as a body
without one passes the limit), a body must arrive whole before anything is forwarded (nginx spools it to its
temporary folder, the Python front to a spooled temporary file: neither holds it all in memory), a sender
that stalls is cut off, and each client address gets at most ``Limits.rate`` requests a second (plus a
``burst``), ``Limits.conn_per_address`` requests at a time and as many connections, counted when a connection
is accepted (nginx in a ``stream`` server where it has the module, the Python front in its accept loop), a
connection that sends no complete header within ``Limits.header_timeout`` is cut, and the SuperLink at most
``Limits.upstream_conns`` at a time (503 or 502 beyond: Flower's SuperNode retries those, not a 429).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# Fleet routes are one lower-case path segment (register-node, pull-messages, ...); the raw request target
# must match too (no dot segments, no %-escapes, no query), so what is checked is exactly what is forwarded.
FLEET_PATH = re.compile(r"^/v1/fleet/[a-z][a-z-]*$")
HEALTH_PATH = "/health"
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}
MB = 1024 * 1024
BODY_FACTOR, BODY_SLACK = 2, 1 * MB  # the body limit: twice the largest expected Fleet body, plus 1 MB


def largest_object(model_bytes: int | None = None) -> int:
    """The largest body an honest Fleet call carries: one object of the message (bytes).

    Flower 1.42 pushes and pulls a message's content as separate objects (``push-object``/``pull-object``),
    and an array as chunks of at most ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE`` bytes (5 MB): so the largest body
    is one chunk, or the whole model when it is smaller (``model_bytes``; None: unknown, one chunk).
    """
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE as chunk

    return int(chunk) if model_bytes is None else int(min(int(model_bytes), int(chunk)))


def body_limit(model_bytes: int | None = None) -> int:
    """The front's body limit: ``BODY_FACTOR`` times the largest expected body, plus ``BODY_SLACK`` (bytes)."""
    return BODY_FACTOR * largest_object(model_bytes) + BODY_SLACK


@dataclass(frozen=True)
class Limits:
    """What the front lets a client address do (the same in nginx and in the Python fallback).

    The defaults hold a federation of a few hundred SuperNodes with Flower's 3 s poll, or a handful behind
    one address (NAT, or one machine) polling every 0.25 s; each node makes a burst of ``pull-object`` calls,
    one per object, when a message arrives.
    """

    max_body: int = field(default_factory=body_limit)  # bytes; larger bodies get 413
    rate: int = 100  # requests per second and client address, sustained
    burst: int = 400  # requests above the rate a client address may make at once
    conn_per_address: int = 64  # connections per client address (capped at accept), and requests in progress
    max_conn: int = 512  # requests in progress in all (the Python front's threads)
    # requests in progress at the SuperLink: what unauthenticated bodies can cost it is ~3 x this x max_body
    upstream_conns: int = 32
    header_timeout: float = 5.0  # seconds to send the TLS handshake, request line and headers (idle: cut)
    body_timeout: float = 15.0  # seconds the body may stall between two reads
    min_rate: int = 8 * 1024  # bytes/s: the Python front's floor for a body's average (after body_timeout)

    def __post_init__(self) -> None:
        ints = ("max_body", "rate", "burst", "conn_per_address", "max_conn", "upstream_conns", "min_rate")
        for name in ints:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: expected an integer >= 1")


def allowed(method: str, target: str) -> bool:
    """Whether the front forwards a request (``target``: the raw request target, path and query)."""
    if FLEET_PATH.match(target):
        return method == "POST"
    return target == HEALTH_PATH and method in ("GET", "HEAD")


def nginx_binary() -> str | None:
    """The ``nginx`` executable (also looked for in the sbin folders, which a user's PATH may lack)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")


def nginx_stream_module(binary: str | None = None) -> str | None:
    """How this nginx gets its ``stream`` module: ``""`` built in, the path of ``ngx_stream_module.so`` to
    load (Debian's ``libnginx-mod-stream``), or None when it has none (then connections are capped per
    address only once their headers are in)."""
    import subprocess

    binary = binary or nginx_binary()
    if binary is None:
        return None
    try:
        flags = subprocess.run([binary, "-V"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    if re.search(r"--with-stream(\s|$)", flags):
        return ""
    found = re.search(r"--modules-path=(\S+)", flags)
    folders = [found.group(1)] if found else []
    folders += ["/usr/lib/nginx/modules", "/usr/share/nginx/modules", "/usr/lib64/nginx/modules"]
    if "--with-stream=dynamic" in flags:
        for folder in folders:
            if (Path(folder) / "ngx_stream_module.so").is_file():
                return str(Path(folder) / "ngx_stream_module.so")
    return None


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def nginx_conf(
    listen_host: str,
    listen_port: int,
    upstream_port: int,
    prefix: Path,
    logs: Path,
    tls: tuple[Path, Path, Path, str] | None,
    limits: Limits | None = None,
    stream: str | None = None,
) -> str:
    """nginx's configuration for the front.

    ``tls`` is ``(server certificate, server key, CA certificate, name to check in the SuperLink's
    certificate)``, or None for a federation without TLS. ``prefix`` holds nginx's pid and temporary files
    (bodies larger than 1 MB are spooled there before they are forwarded). ``limits``: ``Limits()``.

    ``stream`` (:func:`nginx_stream_module`: ``""`` built in, a module path to load, None: none): with it, the
    public port is a ``stream`` server that caps connections per client address **when they are accepted**
    (``Limits.conn_per_address``; beyond, closed at once) and passes each on, with the client's address in
    a PROXY protocol header, to the HTTP server on a Unix socket in ``prefix`` (where the rules and the
    other limits apply to that address). Without it, nginx's ``limit_conn`` counts a connection only once
    its headers are in.
    """
    lim = limits or Limits()
    sock = prefix / "front.sock"
    if stream is not None and len(str(sock)) > 100:  # a Unix socket's path holds at most 107 bytes
        stream = None
    upstream = f"{'https' if tls else 'http'}://fedsim_superlink"
    proxy = [
        f"proxy_pass {upstream};",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_request_buffering on;  # the whole body arrives before the SuperLink sees a byte of it",
        "proxy_buffering off;",
        "proxy_read_timeout 600s;",
        "proxy_send_timeout 600s;",
    ]
    listen = f"listen {_listen(listen_host, listen_port)}"
    if stream is not None:
        listen = f'listen "unix:{sock}"'
    server_tls = []
    if tls:
        cert, key, ca, name = tls
        listen += " ssl"
        server_tls = [
            f'ssl_certificate "{cert}";',
            f'ssl_certificate_key "{key}";',
            "ssl_protocols TLSv1.2 TLSv1.3;",
        ]
        proxy += [
            f'proxy_ssl_trusted_certificate "{ca}";',
            "proxy_ssl_verify on;",
            f"proxy_ssl_name {name};",
            "proxy_ssl_server_name on;",
            "proxy_ssl_session_reuse on;",
        ]

    def block(lines: list[str], indent: str) -> str:
        return "\n".join(indent + ln for ln in lines)

    temp = "\n".join(
        f'    {kind}_temp_path "{prefix / (kind + "_temp")}";'
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # started as root, nginx runs its workers as "nobody", who cannot write the spooled bodies into the
    # private (0700) folder: keep them as this user (better: start fedsim as an unprivileged user)
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    load, accept, real_ip = "", "", ""
    if stream is not None:
        listen += " proxy_protocol"
        load = f'load_module "{stream}";\n' if stream else ""
        accept = _stream_block(listen_host, listen_port, sock, lim)
        real_ip = "    set_real_ip_from unix:;  # the stream server's PROXY header names the client\n"
        real_ip += "    real_ip_header proxy_protocol;\n"
    # a connection costs nginx 2 (client, SuperLink), or 4 through the stream server (its two, the Unix side)
    connections = max(2048, 4 * lim.max_conn + 128)
    return f"""# fedsim.deploy: the SuperLink's public front (fedsim/deploy/front.py). Generated; do not edit.
{load}daemon off;
{user}worker_processes 1;
worker_rlimit_nofile {2 * connections};
pid "{prefix / "nginx.pid"}";
error_log "{logs / "front-error.log"}" warn;
events {{
    worker_connections {connections};
}}
{accept}http {{
{real_ip}    access_log "{logs / "front-access.log"}";
    server_tokens off;
    # abuse is shed here, before the SuperLink (which parses a whole body before checking node authentication)
    client_max_body_size {-(-lim.max_body // 1024)}k;
    client_body_buffer_size 1m;
    client_header_timeout {lim.header_timeout:g}s;
    client_body_timeout {lim.body_timeout:g}s;
    send_timeout 60s;
    keepalive_timeout 30s;
    limit_req_zone $binary_remote_addr zone=fedsim_rate:10m rate={lim.rate}r/s;
    limit_conn_zone $binary_remote_addr zone=fedsim_conn:10m;
    limit_conn_zone $server_name zone=fedsim_all:1m;
    limit_req_status 503;  # Flower's SuperNode retries 502/503 with backoff, and gives up on 429
    limit_conn_status 503;
    limit_req zone=fedsim_rate burst={lim.burst} nodelay;
    limit_conn fedsim_conn {lim.conn_per_address};
    limit_conn fedsim_all {lim.max_conn};
{temp}
    upstream fedsim_superlink {{
        server 127.0.0.1:{upstream_port} max_conns={lim.upstream_conns};  # beyond: 502 (retried)
        keepalive 16;
    }}
    server {{
        {listen};
{block(server_tls, "        ")}
        # the SuperNodes' Fleet API, POST only, exact route names (the raw request target is checked too)
        location ~ ^/v1/fleet/[a-z][a-z-]*$ {{
            if ($request_uri !~ "^/v1/fleet/[a-z][a-z-]*$") {{
                return 403;
            }}
            limit_except POST {{
                deny all;
            }}
{block(proxy, "            ")}
        }}
        location = /health {{
            if ($request_uri != "/health") {{
                return 403;
            }}
            limit_except GET {{
                deny all;
            }}
{block(proxy, "            ")}
        }}
        # everything else (Control API: flwr run/ls/stop/log, node registration; Runtime API; docs): refused
        location / {{
            return 403;
        }}
    }}
}}
"""


def _stream_block(host: str, port: int, sock: Path, lim: Limits) -> str:
    """The ``stream`` server on the public port: connections per client address capped as they are
    accepted, each passed on to the HTTP server's Unix socket with a PROXY protocol header."""
    return f"""stream {{
    limit_conn_zone $binary_remote_addr zone=fedsim_accept:10m;
    server {{
        listen {_listen(host, port)};
        limit_conn fedsim_accept {lim.conn_per_address};  # checked at accept: beyond, closed at once
        proxy_pass "unix:{sock}";
        proxy_protocol on;
        proxy_connect_timeout 5s;
        proxy_timeout 660s;  # idle both ways: a request may wait 600 s for the SuperLink
    }}
}}
"""

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
* ``python -m fedsim.deploy.front``: a small threaded proxy in the standard library, a fallback for machines
  without nginx (trials, CI); fedsim says so when it uses it. Prefer nginx (or your own proxy with the same
  rules) for a long-lived server.

SuperNode authentication is unchanged behind the front: a node signs each Fleet request with its private key
in request headers, which the front passes through.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import re
import shutil
import socket
import ssl
import sys
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
MAX_BODY = 512 * 1024 * 1024  # bytes; Flower sends arrays in 5 MB chunks, so requests stay far below this


def allowed(method: str, target: str) -> bool:
    """Whether the front forwards a request (``target``: the raw request target, path and query)."""
    if FLEET_PATH.match(target):
        return method == "POST"
    return target == HEALTH_PATH and method in ("GET", "HEAD")


def nginx_binary() -> str | None:
    """The ``nginx`` executable (also looked for in the sbin folders, which a user's PATH may lack)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def nginx_conf(
    listen_host: str,
    listen_port: int,
    upstream_port: int,
    prefix: Path,
    logs: Path,
    tls: tuple[Path, Path, Path, str] | None,
) -> str:
    """nginx's configuration for the front.

    ``tls`` is ``(server certificate, server key, CA certificate, name to check in the SuperLink's
    certificate)``, or None for a federation without TLS. ``prefix`` holds nginx's pid and temporary files.
    """
    upstream = f"{'https' if tls else 'http'}://fedsim_superlink"
    proxy = [
        f"proxy_pass {upstream};",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_request_buffering off;",
        "proxy_buffering off;",
        "proxy_read_timeout 600s;",
        "proxy_send_timeout 600s;",
    ]
    listen = f"listen {_listen(listen_host, listen_port)}"
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
    return f"""# fedsim.deploy: the SuperLink's public front (fedsim/deploy/front.py). Generated; do not edit.
daemon off;
worker_processes 1;
pid "{prefix / "nginx.pid"}";
error_log "{logs / "front-error.log"}" warn;
events {{
    worker_connections 1024;
}}
http {{
    access_log "{logs / "front-access.log"}";
    server_tokens off;
    client_max_body_size {MAX_BODY // (1024 * 1024)}m;
{temp}
    upstream fedsim_superlink {{
        server 127.0.0.1:{upstream_port};
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


# ---- the Python fallback --------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fedsim-front"
    sys_version = ""
    upstream: tuple[str, int] = ("127.0.0.1", 0)
    upstream_ctx: ssl.SSLContext | None = None

    def log_message(self, format, *args):
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _deny(self, code: int = 403) -> None:
        body = b"forbidden by the fedsim front\n"
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self) -> None:
        if not allowed(self.command, self.path):
            self._deny()
            return
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._deny(411)  # Flower's clients send a Content-Length
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._deny(413)
            return
        body = self.rfile.read(length) if length else None
        host, port = self.upstream
        conn = (
            http.client.HTTPSConnection(host, port, context=self.upstream_ctx, timeout=600)
            if self.upstream_ctx
            else http.client.HTTPConnection(host, port, timeout=600)
        )
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
            conn.request(self.command, self.path, body=body, headers=headers)
            res = conn.getresponse()
            data = res.read()
        except (OSError, http.client.HTTPException) as e:
            self.log_message("upstream error: %s", e)
            self._deny(502)
            return
        finally:
            conn.close()
        self.send_response(res.status, res.reason)
        for k, v in res.getheaders():
            if k.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _forward


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def serve(
    listen_host: str,
    listen_port: int,
    upstream_port: int,
    cert: Path | None = None,
    key: Path | None = None,
    ca: Path | None = None,
) -> None:
    """Run the Python front until killed (TLS on both sides when ``cert``, ``key`` and ``ca`` are given)."""
    handler = type(
        "Handler",
        (_Handler,),
        {
            "upstream": ("127.0.0.1", upstream_port),
            "upstream_ctx": ssl.create_default_context(cafile=str(ca)) if ca else None,
        },
    )
    _Server.address_family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
    server = _Server((listen_host, listen_port), handler)
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(cert), str(key))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(
        f"fedsim front (Python fallback) on {_listen(listen_host, listen_port)} -> 127.0.0.1:{upstream_port}",
        flush=True,
    )
    server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedsim.deploy.front", description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="public HOST:PORT")
    p.add_argument("--upstream-port", type=int, required=True, help="the SuperLink's port on 127.0.0.1")
    p.add_argument("--cert", type=Path, help="TLS certificate served on the public side")
    p.add_argument("--key", type=Path, help="its private key")
    p.add_argument("--ca", type=Path, help="CA certificate to check the SuperLink's certificate with")
    a = p.parse_args(argv)
    host, _, port = a.listen.rpartition(":")
    if bool(a.cert) != bool(a.key) or bool(a.cert) != bool(a.ca):
        p.error("give --cert, --key and --ca together (TLS), or none of them")
    serve(host.strip("[]"), int(port), a.upstream_port, a.cert, a.key, a.ca)
    return 0


if __name__ == "__main__":
    sys.exit(main())

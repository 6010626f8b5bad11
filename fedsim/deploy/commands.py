"""The commands and checks of a federation's processes: SuperLink, SuperExec, SuperNodes (through
``fedsim.deploy.node``), the warm SuperExec, secrets, the ``flwr`` connection, readiness and process ends.

``fedsim.deploy.launch.Federation`` runs them; ``python -m fedsim.deploy`` prints them for the same steps
across machines (docs/deploy.md).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsim.config import FLOWER_ENV
from fedsim.deploy.certs import CA_CERT, SERVER_CERT, SERVER_KEY, node_key_name, write_private

FLWR_ENV = FLOWER_ENV  # every Flower process the helper starts gets these (see fedsim.config)
CONNECTION = "fedsim"  # name of the SuperLink connection written to $FLWR_HOME/config.toml
FINISHED = "finished"
FRONTS = ("auto", "nginx", "python", "none")  # what stands on the public address (see fedsim.deploy.front)
SECRET_FILE = "superexec.secret"  # in the workdir: the SuperLink's and SuperExec's shared secret
BINDING_FILE = "nodes.yaml"  # in the workdir: partition ids bound to the registered node keys
SERVER_SIDE = ("front", "superexec", "superlink")  # stopped last, in this order


class DeployError(RuntimeError):
    """A deployment step failed; the message says which and what to check."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_exposed(host: str, echo: Callable[[str], None] | None = None) -> str | None:
    """The warning for a SuperLink bound to a non-loopback ``host`` (None when it is loopback)."""
    if is_loopback(host):
        return None
    msg = (
        f"fedsim.deploy: warning: the SuperLink listens on {host}: its one port also serves the Control API "
        "(anyone who reaches it can list, submit and stop runs and register nodes: Flower's open-source "
        "SuperLink has no login for it) and the Runtime API. Keep it on 127.0.0.1 behind the front "
        "(--front auto, the default); see docs/deploy.md, 'Security'."
    )
    print(msg, file=sys.stderr, flush=True)
    if echo is not None and echo is not print:
        echo(msg)
    return msg


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Security:
    """TLS and SuperNode authentication settings, with the certificate folder (``python -m fedsim.deploy certs``)."""

    tls: bool = True
    auth: bool = True
    certs: Path | None = None

    def __post_init__(self) -> None:
        if self.auth and not self.tls:
            raise DeployError(
                "SuperNode authentication needs TLS: use --tls with --auth (Flower refuses "
                "--enable-supernode-auth together with --insecure)"
            )
        if self.tls and self.certs is None:
            raise DeployError(
                "TLS needs a certificate folder (make one with `python -m fedsim.deploy certs DIR`)"
            )

    @property
    def ca(self) -> Path:
        return Path(self.certs) / CA_CERT

    def node_key(self, i: int) -> Path:
        """SuperNode ``i``'s private key (its public key is the same path plus ``.pub``)."""
        return Path(self.certs) / node_key_name(i)

    def required_files(self, nodes: int) -> list[Path]:
        """Files this setting needs for a federation of ``nodes`` SuperNodes."""
        if not self.tls:
            return []
        files = [self.ca, Path(self.certs) / SERVER_CERT, Path(self.certs) / SERVER_KEY]
        if self.auth:
            for i in range(nodes):
                files += [self.node_key(i), self.node_key(i).with_name(self.node_key(i).name + ".pub")]
        return files

    def check(self, nodes: int) -> None:
        """Raise ``DeployError`` naming the first missing certificate or key file."""
        for f in self.required_files(nodes):
            if not f.is_file():
                raise DeployError(
                    f"missing certificate/key file: {f} (make test ones with "
                    f"`python -m fedsim.deploy certs {f.parent} --nodes {nodes}`)"
                )


def superlink_command(host: str, port: int, sec: Security, secret: Path | None = None) -> list[str]:
    """``flower-superlink`` for one port (Fleet, Control and Runtime APIs share it in Flower 1.42).

    With ``secret`` (a file), ServerApps are left to a separately started ``flower-superexec`` that proves
    the same secret (``--isolation process``): nobody else can take the SuperLink's tasks.
    """
    cmd = ["flower-superlink"]
    if sec.tls:
        c = Path(sec.certs)
        cmd += [
            "--ssl-ca-certfile",
            str(c / CA_CERT),
            "--ssl-certfile",
            str(c / SERVER_CERT),
            "--ssl-keyfile",
            str(c / SERVER_KEY),
        ]
    else:
        cmd += ["--insecure"]
    if sec.auth:
        cmd += ["--enable-supernode-auth"]
    if secret is not None:
        cmd += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    return cmd + ["--disable-runtime-dependency-installation", "--host", host, "--port", str(port)]


def superexec_command(
    runtime_address: str, sec: Security, secret: Path, parent_pid: int | None = None
) -> list[str]:
    """``flower-superexec``: launches the ServerApp of each run, authenticated to the SuperLink by ``secret``."""
    cmd = ["flower-superexec", "--runtime-api-address", runtime_address]
    cmd += ["--root-certificates", str(sec.ca)] if sec.tls else ["--insecure"]
    cmd += ["--superexec-auth-secret-file", str(secret)]
    return cmd + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def warm_command(port: int, secret: Path, parent_pid: int | None = None) -> list[str]:
    """fedsim's warm SuperExec (:mod:`fedsim.deploy.warm`) for the SuperNode whose Runtime API is on ``port``."""
    cmd = [sys.executable, "-m", "fedsim.deploy.warm", "--runtime-api-address", f"127.0.0.1:{port}"]
    cmd += ["--insecure", "--superexec-auth-secret-file", str(secret)]  # loopback only
    return cmd + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def write_secret(path: Path) -> Path:
    """A fresh random SuperExec secret in ``path``, readable by its owner only."""
    write_private(path, secrets.token_hex(32).encode())
    return path


def loopback_name(cert: Path) -> str:
    """The name a front checks in the SuperLink's certificate on 127.0.0.1; raise if it does not cover 127.0.0.1.

    Flower's CLI, the SuperExec and the ServerApp reach the SuperLink at 127.0.0.1 and check that the
    certificate names it; nginx checks a DNS name in it (``localhost`` if present).
    """
    from cryptography import x509

    crt = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    try:
        san = crt.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    ips = {str(a) for a in san.get_values_for_type(x509.IPAddress)} if san else set()
    dns = san.get_values_for_type(x509.DNSName) if san else []
    if "127.0.0.1" not in ips or not dns:
        raise DeployError(
            f"{cert}: the SuperLink's certificate must name 127.0.0.1 (IP) and a DNS name in its SAN: the "
            "SuperLink listens on 127.0.0.1 behind the front and is checked there (fedsim.deploy certs adds "
            "localhost, 127.0.0.1 and ::1)"
        )
    return "localhost" if "localhost" in dns else dns[0]


def node_config(
    partition_id: int, num_partitions: int, data_dir: str | None = None, cache_dir: str | None = None
) -> str:
    """The ``--node-config`` string of a SuperNode (paths quoted as TOML requires).

    ``cache-dir``: where the node keeps its partition between messages (``fedsim.partition_cache``).
    """
    text = f"partition-id={partition_id} num-partitions={num_partitions}"
    if data_dir:
        text += f" data-dir={json.dumps(str(data_dir))}"
    if cache_dir:
        text += f" cache-dir={json.dumps(str(cache_dir))}"
    return text


def supernode_command(
    superlink: str,
    port: int,
    partition_id: int,
    num_partitions: int,
    sec: Security,
    key: Path | None = None,
    data_dir: str | None = None,
    max_wait_time: float | None = None,
    ca: Path | None = None,
    cache_dir: str | None = None,
    warm_secret: Path | None = None,
    poll: float | None = None,
) -> list[str]:
    """Flower's SuperNode command for one node, run through :mod:`fedsim.deploy.node` (which ends the process
    when its connection to the SuperLink ends); ``port`` is its own Runtime API port (unique per host).

    ``ca`` overrides ``sec.ca`` (the CA certificate that signed the SuperLink's certificate). ``warm_secret``:
    the node runs with ``--isolation process`` and leaves its ClientApps to ``warm_command``'s process,
    which proves this shared secret. ``poll``: the node's idle poll in seconds, through
    :mod:`fedsim.deploy.node` (``None`` or Flower's own 3 s: Flower's own loop, unscaled).
    """
    from fedsim.deploy.node import FLOWER_IDLE_POLL

    # always through fedsim.deploy.node: a SuperNode whose connection ends exits (Flower's stays alive, silent)
    cmd = [sys.executable, "-m", "fedsim.deploy.node"]
    if poll is not None and poll != FLOWER_IDLE_POLL:
        cmd += ["--poll", f"{poll:g}"]
    cmd += ["--", "--superlink", superlink]
    if warm_secret is not None:
        cmd += ["--isolation", "process", "--superexec-auth-secret-file", str(warm_secret)]
    cmd += ["--root-certificates", str(ca or sec.ca)] if sec.tls else ["--insecure"]
    if sec.auth:
        cmd += ["--auth-supernode-private-key", str(key if key is not None else sec.node_key(partition_id))]
    if max_wait_time:
        cmd += ["--max-wait-time", f"{max_wait_time:g}"]
    config = node_config(partition_id, num_partitions, data_dir, cache_dir)
    return cmd + ["--port", str(port), "--node-config", config]


def check_node(
    superlink: str,
    partition_id: int,
    num_partitions: int,
    ca: Path | None,
    key: Path | None,
    data_dir: str | None,
    wait: float,
) -> None:
    """Check a SuperNode's settings before it starts; raise ``DeployError`` naming the first problem.

    Checks, cheapest first: ``0 <= partition_id < num_partitions``; the CA certificate and private key files
    exist; ``data_dir`` is a folder holding ``train.npz``; the SuperLink at ``superlink`` answers within
    ``wait`` seconds (over TLS with ``ca`` when given, which also proves the certificate is trusted).
    """
    if num_partitions < 1 or not 0 <= partition_id < num_partitions:
        raise DeployError(
            f"partition-id={partition_id} is not allowed: expected an integer in "
            f"[0, num-partitions={num_partitions})"
        )
    for what, f in (("CA certificate", ca), ("SuperNode private key", key)):
        if f is not None and not Path(f).is_file():
            raise DeployError(f"missing {what} file: {f}")
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DeployError(
                f"data-dir={data_dir!r}: no such folder (expected one holding train.npz with "
                "arrays x and y; see docs/deploy.md)"
            )
        if not (folder / "train.npz").is_file():
            raise DeployError(f"data-dir={data_dir!r}: {folder / 'train.npz'} does not exist")
    wait_for_superlink(superlink, wait, ca)


def connection_toml(address: str, sec: Security, name: str = CONNECTION) -> str:
    """The ``$FLWR_HOME/config.toml`` entry that points the ``flwr`` CLI at a SuperLink."""
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{address}"']
    if sec.tls:  # root-certificates must be an absolute path
        lines.append(f"root-certificates = {json.dumps(str(sec.ca.resolve()))}")
    else:
        lines.append("insecure = true")
    return "\n".join(lines) + "\n"


def wait_for_superlink(
    address: str, timeout: float, ca: Path | None = None, alive: Callable[[], bool] = lambda: True
) -> float:
    """Poll the SuperLink's ``/health`` route until it answers; return the seconds waited.

    Raises
    ------
    DeployError
        When it does not answer within ``timeout`` seconds, or ``alive()`` turns false (the process exited).
    """
    url = f"{'https' if ca else 'http'}://{address}/health"
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    t0 = time.monotonic()
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=min(2.0, max(0.1, timeout))) as r:
                if r.status == 200:
                    return time.monotonic() - t0
                last = f"HTTP {r.status}"
        except (urllib.error.URLError, OSError, ssl.SSLError) as e:
            last = str(getattr(e, "reason", e))
        if not alive():
            raise DeployError(f"the SuperLink process exited before {address} answered ({last})")
        if time.monotonic() - t0 > timeout:
            raise DeployError(
                f"the SuperLink at {address} did not answer within {timeout:g} s ({last}); "
                "check the address, the port and that flower-superlink is running"
            )
        time.sleep(0.2)


# ---- processes ------------------------------------------------------------------------------------------


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def terminate(pids: Sequence[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM each pid (and its process group when it leads one), wait, SIGKILL survivors; return those."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if running(pid):
                try:
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, sig)
                    else:
                        os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        end = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < end and any(running(p) for p in pids):
            time.sleep(0.1)
        if not any(running(p) for p in pids):
            return []
    return [p for p in pids if running(p)]

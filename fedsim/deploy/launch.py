"""Start, watch and stop a Flower federation (SuperLink, SuperNodes, ``flwr`` CLI) as local processes.

``Federation`` prints every command it runs (copy them to run the same federation across machines), waits
for readiness by polling (the SuperLink's ``/health`` route, ``flwr supernode list``, ``flwr ls``), never by
fixed sleeps, and stops every process it started by its pid: SuperNodes first, then the SuperLink, each with
its process group and the helper processes Flower spawns (``flower-superexec``, ``flwr-serverapp``,
``flwr-clientapp``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsim.config import FLOWER_ENV
from fedsim.deploy.certs import CA_CERT, SERVER_CERT, SERVER_KEY, node_key_name

FLWR_ENV = FLOWER_ENV  # every Flower process the helper starts gets these (see fedsim.config)
CONNECTION = "fedsim"  # name of the SuperLink connection written to $FLWR_HOME/config.toml
FINISHED = "finished"


class DeployError(RuntimeError):
    """A deployment step failed; the message says which and what to check."""


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


def superlink_command(host: str, port: int, sec: Security) -> list[str]:
    """``flower-superlink`` for one port (Fleet, Control and Runtime APIs share it in Flower 1.42)."""
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
    return cmd + ["--disable-runtime-dependency-installation", "--host", host, "--port", str(port)]


def node_config(partition_id: int, num_partitions: int, data_dir: str | None = None) -> str:
    """The ``--node-config`` string of a SuperNode (``data-dir`` quoted as TOML requires)."""
    text = f"partition-id={partition_id} num-partitions={num_partitions}"
    if data_dir:
        text += f" data-dir={json.dumps(str(data_dir))}"
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
) -> list[str]:
    """``flower-supernode`` for one node; ``port`` is its own Runtime API port (unique per host).

    ``ca`` overrides ``sec.ca`` (the CA certificate that signed the SuperLink's certificate).
    """
    cmd = ["flower-supernode", "--superlink", superlink]
    cmd += ["--root-certificates", str(ca or sec.ca)] if sec.tls else ["--insecure"]
    if sec.auth:
        cmd += ["--auth-supernode-private-key", str(key if key is not None else sec.node_key(partition_id))]
    if max_wait_time:
        cmd += ["--max-wait-time", f"{max_wait_time:g}"]
    return cmd + ["--port", str(port), "--node-config", node_config(partition_id, num_partitions, data_dir)]


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


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; elsewhere ``pgrep -P``)."""
    if Path("/proc").is_dir():
        kids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
        return kids
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid``, children first."""
    found, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in found:
                found.append(c)
                todo.append(c)
    return found


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


class Federation:
    """A SuperLink and its SuperNodes as local processes, plus the ``flwr`` CLI pointed at them.

    Parameters
    ----------
    workdir : Path
        Holds ``flwr-home/`` (a private ``FLWR_HOME`` with the connection), ``logs/`` and ``pids.json``.
    sec : Security
        TLS and node-authentication settings.
    host, port : str, int
        Where the SuperLink listens (one port for all its APIs); ``port=None`` picks a free one.
    cwd : Path, optional
        Working directory of the SuperLink, hence of the ServerApp (relative ``out-dir`` values start there).
    echo : callable
        Receives each command line before it runs (``print`` by default).
    """

    def __init__(
        self,
        workdir: str | Path,
        sec: Security,
        host: str = "127.0.0.1",
        port: int | None = None,
        cwd: str | Path | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.sec, self.host, self.port = sec, host, port or free_port(host)
        self.cwd = Path(cwd).resolve() if cwd else None
        self.echo = echo
        self.flwr_home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **FLWR_ENV, "FLWR_HOME": str(self.flwr_home)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.node_ids: dict[int, int] = {}  # partition id -> node id from `flwr supernode register`
        self.stopped: list[int] = []  # every pid ``stop``/``kill`` signalled (to check none is left)
        self._echoed: set[str] = set()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _echo(self, cmd: Sequence[str], env: bool = False) -> None:
        line = ("$ " + (f"FLWR_HOME={shlex.quote(str(self.flwr_home))} " if env else "")) + shlex.join(cmd)
        if line not in self._echoed:  # polls repeat the same command: show it once
            self._echoed.add(line)
            self.echo(line)

    def spawn(self, name: str, cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
        """Start ``cmd`` in its own process group, output to ``logs/<name>.log``; remember its pid."""
        self._echo(cmd)
        log = open(self.logs / f"{name}.log", "wb")
        try:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=cwd, start_new_session=True
            )
        finally:
            log.close()
        self.procs[name] = proc
        self._write_pids()
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a process's log, without colour codes."""
        import re

        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()[-lines:])

    def _write_pids(self) -> None:
        pids = {n: p.pid for n, p in self.procs.items()}
        (self.workdir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    # -- SuperLink and the CLI --------------------------------------------------------------------------
    def start_superlink(self, timeout: float = 60.0) -> float:
        """Start the SuperLink, write the CLI connection, wait until ``/health`` answers; return the wait."""
        self.sec.check(0)
        proc = self.spawn("superlink", superlink_command(self.host, self.port, self.sec), cwd=self.cwd)
        (self.flwr_home / "config.toml").write_text(connection_toml(self.address, self.sec))
        self.echo(f"# {self.flwr_home / 'config.toml'}:\n" + connection_toml(self.address, self.sec))
        try:
            return wait_for_superlink(
                self.address,
                timeout,
                self.sec.ca if self.sec.tls else None,
                alive=lambda: proc.poll() is None,
            )
        except DeployError as e:
            raise DeployError(f"{e}\n{self.log_tail('superlink')}") from None

    def flwr(self, *args: str, timeout: float = 60.0) -> dict:
        """Run ``flwr ARGS --format json`` against the connection; return its JSON (raise on failure)."""
        cmd = ["flwr", *args, "--format", "json"]
        self._echo(cmd, env=True)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DeployError(f"`{shlex.join(cmd)}` did not finish within {timeout:g} s") from None
        try:
            out = json.loads(res.stdout[res.stdout.find("{") :])
        except ValueError:
            raise DeployError(
                f"`{shlex.join(cmd)}` failed (exit {res.returncode}): "
                f"{(res.stdout + res.stderr).strip()[-500:]}"
            ) from None
        if not out.get("success", False):
            msg = " ".join(str(out.get("error-message", out)).split())
            raise DeployError(f"`{shlex.join(cmd)}` failed: {msg}")
        return out

    def register(self, partition_id: int, public_key: Path | None = None) -> int:
        """Register a SuperNode's public key with the SuperLink (before the node connects); return its node id."""
        key = public_key or self.sec.node_key(partition_id).with_name(
            self.sec.node_key(partition_id).name + ".pub"
        )
        out = self.flwr("supernode", "register", str(key), CONNECTION, "--name", f"node{partition_id}")
        self.node_ids[partition_id] = int(out["node-id"])
        return self.node_ids[partition_id]

    def nodes(self) -> list[dict]:
        """``flwr supernode list``: one dict per node (``node-id``, ``status``, ...)."""
        return list(self.flwr("supernode", "list", CONNECTION)["nodes"])

    # -- SuperNodes ---------------------------------------------------------------------------------------
    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        data_dir: str | None = None,
        key: Path | None = None,
        name: str | None = None,
        max_wait_time: float | None = None,
    ) -> subprocess.Popen:
        """Start one SuperNode for ``partition_id`` (its own Runtime API port is picked free)."""
        cmd = supernode_command(
            self.address,
            free_port(self.host),
            partition_id,
            num_partitions,
            self.sec,
            key=key,
            data_dir=data_dir,
            max_wait_time=max_wait_time,
        )
        return self.spawn(name or f"supernode{partition_id}", cmd, cwd=self.cwd)

    def wait_nodes_online(self, count: int, timeout: float = 120.0) -> float:
        """Poll ``flwr supernode list`` until ``count`` nodes are online; return the seconds waited."""
        t0 = time.monotonic()
        while True:
            online = [n for n in self.nodes() if n.get("status") == "online"]
            if len(online) >= count:
                return time.monotonic() - t0
            dead = [n for n, p in self.procs.items() if n.startswith("supernode") and p.poll() is not None]
            if dead:
                raise DeployError(
                    f"SuperNode {dead[0]} exited (code {self.procs[dead[0]].returncode}):\n"
                    f"{self.log_tail(dead[0])}"
                )
            if time.monotonic() - t0 > timeout:
                raise DeployError(
                    f"only {len(online)} of {count} SuperNodes came online within {timeout:g} s"
                )
            time.sleep(0.5)

    # -- runs ---------------------------------------------------------------------------------------------
    def submit(self, app_dir: str | Path, run_config: dict[str, str]) -> int:
        """``flwr run APP`` with ``--run-config`` string values; return the run id."""
        rc = " ".join(f"{k}={json.dumps(str(v))}" for k, v in run_config.items())
        args = ["run", str(app_dir), CONNECTION] + (["--run-config", rc] if rc else [])
        return int(self.flwr(*args)["run-id"])

    def run_status(self, run_id: int) -> dict:
        """``flwr ls --run-id``: the run's dict (``status``, ``status-details``, ...)."""
        return self.flwr("ls", CONNECTION, "--run-id", str(run_id))["runs"][0]

    def wait_run(
        self,
        run_id: int,
        timeout: float,
        stream: bool = False,
        poll: float = 2.0,
        done: Callable[[], bool] | None = None,
    ) -> dict:
        """Poll the run until it is finished (``finished:completed|failed|stopped``); return its status dict.

        ``stream=True`` also streams the run's logs (``flwr log RUN --stream``) to this process's stdout.
        ``done``, a cheap local check (e.g. "summary.json exists"), makes the ``flwr ls`` calls (a CLI process
        each) rarer: at most one per 10 ``poll`` intervals until ``done()`` is true.
        """
        streamer = None
        if stream:
            cmd = ["flwr", "log", str(run_id), CONNECTION, "--stream"]
            self._echo(cmd, env=True)
            streamer = subprocess.Popen(cmd, env=self.env, start_new_session=True)
        t0 = time.monotonic()
        try:
            while True:
                status = self.run_status(run_id)
                if str(status.get("status", "")).startswith(FINISHED):
                    return status
                if time.monotonic() - t0 > timeout:
                    raise DeployError(
                        f"run {run_id} did not finish within {timeout:g} s (status {status.get('status')})"
                    )
                if done is None or done():
                    time.sleep(poll)
                    continue
                next_ls = min(time.monotonic() + 10 * poll, t0 + timeout)
                while not done() and time.monotonic() < next_ls:
                    time.sleep(0.25)
        finally:
            if streamer is not None:
                try:
                    streamer.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    terminate([streamer.pid], timeout=5)
                    streamer.wait()

    def run_log(self, run_id: int, timeout: float = 60.0) -> str:
        """The run's log so far (``flwr log RUN --show``)."""
        cmd = ["flwr", "log", str(run_id), CONNECTION, "--show"]
        res = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        return res.stdout + res.stderr

    def wait_exit(self, name: str, timeout: float) -> int:
        """Wait until process ``name`` exits; return its exit code (``DeployError`` after ``timeout`` s)."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DeployError(f"{name} still running after {timeout:g} s:\n{self.log_tail(name)}") from None

    # -- shutdown -----------------------------------------------------------------------------------------
    def kill(self, name: str) -> list[int]:
        """SIGKILL process ``name`` with everything it spawned, as if its machine vanished; return the pids."""
        proc = self.procs.pop(name)
        pids = [proc.pid, *descendants(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        self.stopped += pids
        self._write_pids()
        return pids

    def detach(self) -> None:
        """Forget the processes without stopping them (``pids.json`` keeps them for ``stop_from_pidfile``)."""
        self.procs.clear()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop SuperNodes, then the SuperLink, with everything they spawned; reap our children."""
        if not self.procs:
            return
        order = [n for n in self.procs if n != "superlink"] + [n for n in self.procs if n == "superlink"]
        for name in order:
            proc = self.procs[name]
            pids = [proc.pid, *descendants(proc.pid)]
            self.stopped += pids
            left = terminate(pids, timeout)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                left.append(proc.pid)
            if left:
                print(f"fedsim.deploy: could not stop {name} processes {left}", file=sys.stderr)
        self.procs.clear()
        pidfile = self.workdir / "pids.json"
        if pidfile.exists():
            pidfile.unlink()

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_from_pidfile(workdir: str | Path, timeout: float = 15.0) -> list[int]:
    """Stop the processes a ``Federation`` recorded in ``workdir/pids.json``; return the pids stopped.

    Only pids whose command line still names a Flower program are touched (pids are reused by the OS).
    """
    pidfile = Path(workdir) / "pids.json"
    if not pidfile.exists():
        raise DeployError(f"no pid file at {pidfile} (nothing started there, or already stopped)")
    pids = json.loads(pidfile.read_text())
    order = [n for n in pids if n != "superlink"] + [n for n in pids if n == "superlink"]
    stopped = []
    for name in order:
        pid = int(pids[name])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = "flower" if running(pid) else ""
        if not running(pid) or "flower" not in cmdline:
            continue
        terminate([pid, *descendants(pid)], timeout)
        stopped.append(pid)
    pidfile.unlink()
    return stopped

"""Start, watch and stop a Flower federation (SuperLink, SuperNodes, ``flwr`` CLI) as local processes.

``Federation`` prints every command it runs (copy them to run the same federation across machines), waits
for readiness by polling (the SuperLink's ``/health`` route, ``flwr supernode list``, ``flwr ls``), never by
fixed sleeps, and stops every process it started by its pid: SuperNodes first, then the front, the SuperExec
and the SuperLink, each with its process group and the helper processes Flower spawns (``flwr-serverapp``,
``flwr-clientapp``).

The server side is hardened by default (docs/deploy.md, "Security"): the SuperLink listens on 127.0.0.1 only,
a front (nginx, else fedsim's Python fallback, ``fedsim.deploy.front``) forwards the SuperNodes' Fleet API from
the public address and refuses everything else, and ServerApps are launched by a separately started
``flower-superexec`` that proves a shared secret (``--isolation process``), so nobody else can take the
SuperLink's tasks from its Runtime API. The ``flwr`` CLI (runs, node registration) talks to the loopback port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fedsim.deploy import front as front_mod
from fedsim.deploy.certs import CA_CERT, SERVER_CERT, SERVER_KEY
from fedsim.deploy.commands import (  # noqa: F401  (re-exported: callers take them from here)
    BINDING_FILE,
    CONNECTION,
    FINISHED,
    FLWR_ENV,
    FRONTS,
    SECRET_FILE,
    SERVER_SIDE,
    DeployError,
    Security,
    check_node,
    connection_toml,
    free_port,
    is_loopback,
    loopback_name,
    node_config,
    running,
    superexec_command,
    superlink_command,
    supernode_command,
    terminate,
    wait_for_superlink,
    warm_command,
    warn_exposed,
    write_secret,
)
from fedsim.procs import descendants


class Federation:
    """A SuperLink and its SuperNodes as local processes, plus the ``flwr`` CLI pointed at them.

    Parameters
    ----------
    workdir : Path
        Holds ``flwr-home/`` (a private ``FLWR_HOME`` with the connection), ``logs/``, ``pids.json``, the
        SuperExec secret, the front's configuration and ``nodes.yaml`` (the node binding). Mode 0700.
    sec : Security
        TLS and node-authentication settings.
    host, port : str, int
        The public address SuperNodes connect to; ``port=None`` picks a free one. With a front, the front
        listens there and the SuperLink on a free port of 127.0.0.1; with ``front="none"`` the SuperLink itself.
    cwd : Path, optional
        Working directory of the SuperLink and SuperExec, hence of the ServerApp (relative ``out-dir`` values
        start there).
    echo : callable
        Receives each command line before it runs (``print`` by default).
    front : str
        ``"auto"`` (nginx if installed, else the Python fallback), ``"nginx"``, ``"python"`` or ``"none"``
        (the SuperLink itself on ``host``: every API public; warned about unless ``host`` is loopback).
    isolation : bool
        Start ServerApps through a separately started ``flower-superexec`` that proves a shared secret.
    limits : front.Limits, optional
        The front's body limit, rates and timeouts (default ``Limits()``: bodies up to ``body_limit()``).
    """

    def __init__(
        self,
        workdir: str | Path,
        sec: Security,
        host: str = "127.0.0.1",
        port: int | None = None,
        cwd: str | Path | None = None,
        echo: Callable[[str], None] = print,
        front: str = "auto",
        isolation: bool = True,
        limits: front_mod.Limits | None = None,
    ) -> None:
        from fedsim.deploy.certs import private_folder

        if front not in FRONTS:
            raise DeployError(f"front={front!r} is not allowed: expected one of {', '.join(FRONTS)}")
        self.workdir = private_folder(Path(workdir).resolve())
        self.sec, self.host, self.port = sec, host, port or free_port(host)
        self.cwd = Path(cwd).resolve() if cwd else None
        self.echo = echo
        if front == "auto":
            front = "nginx" if front_mod.nginx_binary() else "python"
            if front == "python":
                echo("# no nginx found: the public front is fedsim's Python fallback (fedsim.deploy.pyfront)")
        self.front = front
        self.isolation = isolation
        self.limits = limits or front_mod.Limits()
        self.internal_port = free_port("127.0.0.1") if front != "none" else self.port
        self.flwr_home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **FLWR_ENV, "FLWR_HOME": str(self.flwr_home)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.node_ids: dict[int, int] = {}  # partition id -> node id from `flwr supernode register`
        self.bound_keys: dict[int, list[Path]] = {}  # partition id -> public keys registered for it
        self.stopped: list[int] = []  # every pid ``stop``/``kill`` signalled (to check none is left)
        self.secrets: list[Path] = []  # the shared-secret files written, removed by ``stop``
        self._echoed: set[str] = set()
        if front == "none":
            warn_exposed(host, echo)

    @property
    def address(self) -> str:
        """The public address: what SuperNodes use in ``--superlink``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def control_address(self) -> str:
        """Where the SuperLink itself listens: the ``flwr`` CLI's address (127.0.0.1 behind a front)."""
        return self.address if self.front == "none" else f"127.0.0.1:{self.internal_port}"

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
        """Start the SuperLink (with its SuperExec and front), write the CLI connection, wait; return the wait.

        Order: the SuperLink on its own port (127.0.0.1 behind a front), until ``/health`` answers there; the
        SuperExec (``isolation``); the front on the public address, until ``/health`` answers through it.
        """
        self.sec.check(0)
        tls_name = (
            loopback_name(Path(self.sec.certs) / SERVER_CERT) if self.sec.tls and self.front != "none" else ""
        )
        ca = self.sec.ca if self.sec.tls else None
        t0 = time.monotonic()
        secret = self._secret(self.workdir / SECRET_FILE) if self.isolation else None
        bind = self.host if self.front == "none" else "127.0.0.1"
        proc = self.spawn(
            "superlink", superlink_command(bind, self.internal_port, self.sec, secret), cwd=self.cwd
        )
        (self.flwr_home / "config.toml").write_text(connection_toml(self.control_address, self.sec))
        self.echo(f"# {self.flwr_home / 'config.toml'}:\n" + connection_toml(self.control_address, self.sec))
        self._wait_up("superlink", self.control_address, timeout - (time.monotonic() - t0), ca, proc)
        if secret is not None:
            self.spawn(
                "superexec", superexec_command(self.control_address, self.sec, secret, proc.pid), cwd=self.cwd
            )
        if self.front != "none":
            front = self.spawn("front", self.front_command(tls_name))
            self._wait_up("front", self.address, timeout - (time.monotonic() - t0), ca, front)
        return time.monotonic() - t0

    def _secret(self, path: Path) -> Path:
        self.secrets.append(write_secret(path))
        return path

    def _wait_up(self, name: str, address: str, timeout: float, ca: Path | None, proc) -> None:
        try:
            wait_for_superlink(address, max(1.0, timeout), ca, alive=lambda: proc.poll() is None)
        except DeployError as e:
            raise DeployError(f"{name}: {e}\n{self.log_tail(name)}") from None

    def front_command(self, tls_name: str = "") -> list[str]:
        """The command of the public front (nginx with a generated configuration, or the Python fallback)."""
        c = Path(self.sec.certs) if self.sec.tls else None
        if self.front == "python":
            cmd = [sys.executable, "-m", "fedsim.deploy.pyfront", "--listen", self.address]
            cmd += ["--upstream-port", str(self.internal_port), "--max-body", str(self.limits.max_body)]
            if self.limits != front_mod.Limits(max_body=self.limits.max_body):
                cmd += ["--limits", json.dumps(dataclasses.asdict(self.limits))]
            if c is not None:
                cmd += [
                    "--cert",
                    str(c / SERVER_CERT),
                    "--key",
                    str(c / SERVER_KEY),
                    "--ca",
                    str(c / CA_CERT),
                ]
            return cmd
        nginx = front_mod.nginx_binary()
        if nginx is None:
            raise DeployError("front='nginx' but no nginx executable is installed (apt-get install nginx)")
        prefix = self.workdir / "front"
        prefix.mkdir(exist_ok=True)
        tls = (c / SERVER_CERT, c / SERVER_KEY, c / CA_CERT, tls_name) if c is not None else None
        conf = prefix / "nginx.conf"
        stream = front_mod.nginx_stream_module(nginx)
        if stream is None:
            self.echo(
                "# nginx has no stream module (Debian: apt-get install libnginx-mod-stream): connections are "
                "capped per address only once their headers are in"
            )
        (prefix / "front.sock").unlink(missing_ok=True)  # left by an nginx that was killed
        conf.write_text(
            front_mod.nginx_conf(
                self.host, self.port, self.internal_port, prefix, self.logs, tls, self.limits, stream
            )
        )
        cmd = [nginx, "-c", str(conf), "-p", str(prefix), "-e", str(self.logs / "front-error.log")]
        check = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True)
        if check.returncode != 0:
            raise DeployError(
                f"nginx refused the front's configuration {conf}: {check.stderr.strip()[-500:]}"
            )
        self.echo(
            f"# {conf}: forwards only POST /v1/fleet/* and GET /health to {self.control_address}, bodies up "
            f"to {self.limits.max_body / front_mod.MB:.1f} MB, {self.limits.rate} requests/s per address"
        )
        return cmd

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

    def register(
        self, partition_id: int | None, public_key: Path | None = None, name: str | None = None
    ) -> int:
        """Register a SuperNode's public key with the SuperLink (before the node connects); return its node id.

        The key is bound to ``partition_id`` in ``nodes.yaml`` (``binding_file``); ``None`` registers it
        without binding it (such a node may join but gets no work in a run that uses the binding).
        """
        if public_key is None:
            if partition_id is None:
                raise DeployError("register(None) needs the public key to register")
            public_key = self.sec.node_key(partition_id).with_name(
                self.sec.node_key(partition_id).name + ".pub"
            )
        name = name or f"node{partition_id}"
        node_id = int(
            self.flwr("supernode", "register", str(public_key), CONNECTION, "--name", name)["node-id"]
        )
        if partition_id is not None:
            self.node_ids.setdefault(partition_id, node_id)
            self.bound_keys.setdefault(partition_id, []).append(Path(public_key))
        return node_id

    def binding_file(self) -> Path | None:
        """Write ``nodes.yaml``: each partition bound to the keys registered for it; None when none was."""
        from fedsim.node_binding import binding_yaml

        if not self.bound_keys:
            return None
        path = self.workdir / BINDING_FILE
        path.write_text(binding_yaml(self.bound_keys))
        return path

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
        cache_dir: str | None = None,
        warm: bool = False,
        poll: float | None = None,
    ) -> subprocess.Popen:
        """Start one SuperNode for ``partition_id`` (its own Runtime API port is picked free).

        ``warm``: its ClientApps are forked from a warm process (:mod:`fedsim.deploy.warm`), started beside it.
        ``poll``: its idle poll in seconds (:mod:`fedsim.deploy.node`; ``None``: Flower's 3 s).
        """
        name = name or f"supernode{partition_id}"
        port = free_port("127.0.0.1")
        secret = self._secret(self.workdir / f"{name}.secret") if warm else None
        cmd = supernode_command(
            self.address,
            port,
            partition_id,
            num_partitions,
            self.sec,
            key=key,
            data_dir=data_dir,
            max_wait_time=max_wait_time,
            cache_dir=cache_dir,
            warm_secret=secret,
            poll=poll,
        )
        proc = self.spawn(name, cmd, cwd=self.cwd)
        if secret is not None:
            self.spawn(f"{name}-warm", warm_command(port, secret, parent_pid=proc.pid), cwd=self.cwd)
        return proc

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
        """``flwr run APP`` with ``--run-config`` string values; return the run id.

        Unless ``run_config`` names ``nodes``, a run gets the binding of the keys registered so far.
        """
        if "nodes" not in run_config and (binding := self.binding_file()) is not None:
            run_config = {**run_config, "nodes": str(binding)}
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
        """Forget the processes without stopping them (``pids.json`` keeps them for ``stop_from_pidfile``, which
        also removes the secrets)."""
        self.procs.clear()
        self.secrets.clear()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop SuperNodes, then the SuperLink, with everything they spawned; reap our children; remove the
        shared secrets."""
        if not self.procs:
            remove_secrets(self.secrets)
            return
        order = [n for n in self.procs if n not in SERVER_SIDE] + [n for n in SERVER_SIDE if n in self.procs]
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
        remove_secrets(self.secrets)
        pidfile = self.workdir / "pids.json"
        if pidfile.exists():
            pidfile.unlink()

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_from_pidfile(workdir: str | Path, timeout: float = 15.0) -> list[int]:
    """Stop the processes a ``Federation`` recorded in ``workdir/pids.json``; return the pids stopped.

    Only pids whose command line still names a Flower program, nginx or fedsim's front are touched (pids are
    reused by the OS).
    """
    pidfile = Path(workdir) / "pids.json"
    if not pidfile.exists():
        raise DeployError(f"no pid file at {pidfile} (nothing started there, or already stopped)")
    pids = json.loads(pidfile.read_text())
    order = [n for n in pids if n not in SERVER_SIDE] + [n for n in SERVER_SIDE if n in pids]
    stopped = []
    for name in order:
        pid = int(pids[name])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = "flower" if running(pid) else ""
        if not running(pid) or not any(
            w in cmdline
            for w in ("flower", "nginx", "fedsim.deploy.pyfront", "fedsim.deploy.warm", "fedsim.deploy.node")
        ):
            continue
        terminate([pid, *descendants(pid)], timeout)
        stopped.append(pid)
    pidfile.unlink()
    remove_secrets(Path(workdir).glob("*.secret"))
    return stopped


def remove_secrets(paths) -> None:
    """Delete shared-secret files (those already gone are skipped)."""
    for p in list(paths):
        with contextlib.suppress(FileNotFoundError):
            Path(p).unlink()

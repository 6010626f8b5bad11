"""Several hosts on one machine for the tests: Linux network namespaces joined by veth pairs through a bridge.

A ``Hosts`` star holds a *hub* namespace (the server host: a bridge with ``10.213.0.1``) and one namespace per
client host, each joined to the bridge by a veth pair and given its own address ``10.213.0.<10+i>``. Every
address and link lives inside namespaces created here (the root namespace gains no interface, route or
address), so nothing the tests send leaves them. Namespace names carry a prefix and the creating process's pid;
``sweep()`` removes those whose process is gone (a run killed before its finaliser), ``Hosts.close()`` the own
ones, killing whatever still runs inside them first.

``inside(ns)`` moves the calling thread into a namespace (``setns``) and back: processes and threads it starts
meanwhile are born there, which is how the tests put the SuperLink, the front, the ``flwr`` CLI and the link
proxies on the server host. ``exec_prefix(ns)`` (``ip netns exec NS``) starts a command on a client host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

PREFIX = "fsn"  # every namespace the tests create starts with this
SUBNET = "10.213.0"  # a /24 nobody routes: the hub is .1, client host i is .(10 + i)
HUB_IP = f"{SUBNET}.1"
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+[hn]\d*$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None: they can): not Linux, not root, no iproute2, or refused."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:6]}h"
    try:
        res = _ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            return f"ip netns add is refused here: {res.stderr.strip()[:200]}"
        res = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"no bridge inside a network namespace: {res.stderr.strip()[:200]}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def pids_in(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns``."""
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def _remove(ns: str) -> None:
    """Kill what runs inside ``ns`` (all of it was started by the tests in it), then delete it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = pids_in(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + 10
        while pids and time.monotonic() < end and pids_in(ns):
            time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces left by test processes that are gone; return their names."""
    gone = []
    for path in NETNS_DIR.glob(f"{PREFIX}*") if NETNS_DIR.is_dir() else []:
        m = _NAME.match(path.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _remove(path.name)
            gone.append(path.name)
    return gone


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(ns: str):
    """Run the body (and whatever it starts) in network namespace ``ns``; the calling thread only."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        _setns(target)
        yield
    finally:
        _setns(home)
        os.close(home)
        os.close(target)


def exec_prefix(ns: str) -> list[str]:
    """The prefix that runs a command in ``ns`` (``ip netns exec`` execs it: the pid stays the command's)."""
    return ["ip", "netns", "exec", ns]


class Hosts:
    """A hub namespace with a bridge, and client namespaces joined to it by veth pairs (a star on one /24).

    Parameters
    ----------
    clients : int
        How many client hosts to create now (``add`` makes more).
    """

    def __init__(self, clients: int = 0) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:4]}"
        self.hub = f"{self.tag}h"
        self.clients: list[str] = []
        self.ips: dict[str, str] = {self.hub: HUB_IP}
        try:
            _ip("netns", "add", self.hub)
            self._up(self.hub, "lo")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
            self._up(self.hub, "br0")
            for _ in range(clients):
                self.add()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _up(ns: str, dev: str) -> None:
        _ip("-n", ns, "link", "set", dev, "up")

    def add(self) -> str:
        """One more client host: a namespace with ``eth0`` at the next address, its peer on the hub's bridge."""
        i = len(self.clients)
        if i > 200:
            raise ValueError(f"clients={i + 1} is not allowed: at most 201 client hosts fit in {SUBNET}.0/24")
        ns, ip = f"{self.tag}n{i}", f"{SUBNET}.{10 + i}"
        _ip("netns", "add", ns)
        self.clients.append(ns)
        self._up(ns, "lo")
        _ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0")
        self._up(self.hub, f"v{i}")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        self._up(ns, "eth0")
        self.ips[ns] = ip
        return ns

    def names(self) -> list[str]:
        return [self.hub, *self.clients]

    def close(self) -> None:
        """Stop everything still running in these namespaces and delete them (client hosts first)."""
        for ns in [*self.clients, self.hub]:
            if (NETNS_DIR / ns).exists():
                _remove(ns)

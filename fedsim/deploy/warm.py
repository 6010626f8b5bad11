"""A warm SuperExec for a SuperNode: every ClientApp message still runs in a process of its own, forked from
one that has already imported torch and the other heavy third-party modules.

Flower 1.42 runs each message a SuperNode receives in a fresh ``flwr-clientapp`` process (launched by the
node's SuperExec), so every message pays Python's start-up and the imports of torch (2-3 s on a small CPU),
plus ``torch._dynamo`` (1.4-3.5 s), which the first ``torch.optim`` optimiser imports. This module is
Flower's own SuperExec loop (``flwr.supercore.superexec.run_superexec``) with one change: its executor
starts a task by ``os.fork()`` of this warm process instead of ``subprocess.Popen(["flwr-clientapp", ...])``,
and the child runs Flower's own ``run_clientapp`` with the task's token, exactly as the stock command would.
What stays the same: one process per message (nothing is shared between messages but the imported
modules), the Runtime API and its tokens, the App's installed folder and its loading, error replies and exit
codes.

One step is done once per FAB instead of once per message: Flower's ``install_from_fab`` extracts the whole FAB
into a temporary folder and checks every file's hash before it finds the App installed already (0.5 CPU s a
message for fedsim's 226 files). Its outcome depends only on the FAB's bytes, so :func:`install_once` keeps it
by the bytes' SHA-256: a FAB installed and checked once, whose folder is still there, is not extracted again.

Only third-party modules are preloaded (``PRELOAD``): the App's own code, fedsim's included, is imported in
the child from the installed FAB as Flower does. The parent creates no tensor and starts no thread pool
before forking (OpenMP's pools are not fork-safe).

Used by ``python -m fedsim.deploy local`` and ``supernode`` (``--warm``, the default): the SuperNode runs
with ``--isolation process`` and this process beside it::

    python -m fedsim.deploy.warm --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid PID
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time

__all__ = ["PRELOAD", "ForkExecutor", "install_once", "main"]

# heavy third-party imports of a torch ClientApp (torch._dynamo: what torch.optim's first optimiser imports)
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.nn",
    "torch.optim",
    "omegaconf",
    "hydra",
    "flwr.clientapp",
    # Flower's ClientApp runtime: what ``flwr-clientapp`` imports before it reads a message (0.3 CPU s a
    # message when each child imported it)
    "flwr.supernode.runtime.run_clientapp",
    "flwr.supercore.tls",
)
POLL = 0.05  # seconds between the warm SuperExec's task polls (Flower's default: 1 s)


def preload(modules: tuple[str, ...] = PRELOAD) -> float:
    """Import ``modules`` (those that are installed); return the seconds it took."""
    t0 = time.perf_counter()
    for name in modules:
        with contextlib.suppress(ImportError):  # e.g. an App without hydra: nothing to warm
            importlib.import_module(name)
    return time.perf_counter() - t0


class ForkExecutor:
    """A SuperExec executor (the interface of Flower 1.42's ``SubprocessExecutor``) that forks ClientApps.

    Other task types (none on a SuperNode) go to Flower's subprocess executor.
    """

    def __init__(self) -> None:
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self._fallback = SubprocessExecutor()
        self.children: set[int] = set()

    def get_eligible_capacity(self, supported_task_types, *, insecure=False, root_certificates_path=None):
        return supported_task_types, set()

    def wait_for_capacity(self, *args, **kwargs) -> None:
        return None

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self._fallback.launch(spec)
        pid = os.fork()
        if pid == 0:  # the child: Flower's flwr-clientapp, minus the interpreter start and the imports
            os._exit(_run_clientapp(spec))
        self.children.add(pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap the children that ended (no zombies)."""
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)

    def close(self) -> None:
        self.reconcile()


def install_once(install):
    """Flower's ``install_from_fab`` (``install``), run once per FAB: a FAB given as bytes whose SHA-256 was
    installed and checked before, in this ``FLWR_HOME``, and whose App folder is still there, returns that folder
    without extracting the FAB again. Anything else (a path, another folder, an unknown or removed FAB) goes to
    Flower's function, and a FAB it installed is noted (``FLWR_HOME/apps/.fedsim-installed/<sha256>``)."""
    import functools
    import hashlib
    from pathlib import Path

    from flwr.supercore.utils import get_flwr_home

    @functools.wraps(install)
    def install_from_fab(fab_file, install_dir=None, skip_prompt=False):
        if not (isinstance(fab_file, bytes) and install_dir is None and skip_prompt):
            return install(fab_file, install_dir, skip_prompt)
        note = get_flwr_home() / "apps" / ".fedsim-installed" / hashlib.sha256(fab_file).hexdigest()
        with contextlib.suppress(OSError):
            folder = Path(note.read_text())
            if folder.is_dir():
                return folder
        folder = install(fab_file, install_dir, skip_prompt)
        with contextlib.suppress(OSError):  # a note not written: the next message installs again
            note.parent.mkdir(parents=True, exist_ok=True)
            part = note.with_name(f"{note.name}.{os.getpid()}")
            part.write_text(str(folder))
            os.replace(part, note)
        return folder

    return install_from_fab


def _run_clientapp(spec) -> int:
    """In the forked child: what ``flwr-clientapp --token ...`` runs; returns its exit code."""
    code = 1
    try:
        from flwr.supercore.tls import validate_and_resolve_root_certificates
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        sys.argv = ["flwr-clientapp"]  # Flower's exit path looks at the command's name
        run_clientapp(
            runtime_api_address=spec.runtime_api_address,
            token=spec.token,
            insecure=spec.insecure,
            certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
            parent_pid=spec.parent_pid,
            runtime_dependency_install=spec.runtime_dependency_install,
        )
        code = 0
    except SystemExit as e:  # run_clientapp ends with flwr_exit (sys.exit)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001  (report, then leave without the parent's exit handlers)
        print(f"fedsim warm SuperExec: the ClientApp process failed: {e!r}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedsim.deploy.warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port)")
    p.add_argument("--insecure", action="store_true", help="no TLS on the Runtime API (loopback)")
    p.add_argument("--root-certificates", help="CA certificate of the Runtime API's TLS")
    p.add_argument("--parent-pid", type=int, help="stop when this process (the SuperNode) ends")
    p.add_argument(
        "--superexec-auth-secret-file", help="the SuperNode's SuperExec shared secret, if it has one"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.insecure == (args.root_certificates is not None):
        sys.exit("give either --insecure or --root-certificates CA_CERT")
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(POLL))
    secs = preload()
    from flwr.supercore.superexec import run_superexec as stock

    print(f"fedsim warm SuperExec: preloaded {', '.join(PRELOAD)} in {secs:.1f} s", flush=True)
    stock.get_executor = lambda *a, **k: ForkExecutor()  # the one change to Flower's SuperExec loop
    import flwr.supernode.runtime.run_clientapp as clientapp  # (and in the ClientApp: the FAB checked once)

    clientapp.install_from_fab = install_once(clientapp.install_from_fab)
    secret = None
    if args.superexec_auth_secret_file:
        with open(args.superexec_auth_secret_file, "rb") as f:
            secret = f.read()
    stock.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        superexec_auth_secret=secret,
        parent_pid=args.parent_pid,
    )


if __name__ == "__main__":
    main()

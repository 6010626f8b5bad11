"""``python -m fedsim.deploy {certs,local,superlink,supernode,stop}``: certificates, federations, checked nodes.

Examples::

    python -m fedsim.deploy certs certs/ --nodes 3
    python -m fedsim.deploy local --nodes 3 --tls --auth --overrides "num_rounds=2"
    python -m fedsim.deploy local --nodes 3 --keep      # leave it running; then:
    python -m fedsim.deploy stop
    python -m fedsim.deploy superlink --certs certs/ --nodes nodes.yaml --port 9093   # on the server
    python -m fedsim.deploy supernode --superlink server:9093 --root-certificates ca.crt --key supernode0 \\
        --partition-id 0 --num-partitions 3            # on a client machine
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from fedsim.deploy.certs import make_certs, private_folder
from fedsim.deploy.launch import (
    FLWR_ENV,
    FRONTS,
    DeployError,
    Federation,
    Security,
    check_node,
    stop_from_pidfile,
    supernode_command,
    warm_command,
)

# Outside the app folder: `flwr run .` packs every *.toml/*.json under it into the app bundle.
DEFAULT_WORKDIR = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedsim" / "deploy")


def app_folder(given: Path | None) -> Path:
    """The Flower App folder to submit: ``given``, else fedsim's own checkout, else the working directory.

    It must hold a ``pyproject.toml`` with ``[tool.flwr.app]`` (fedsim's does); a plain ``pip install`` of
    fedsim has no such folder, so deployment runs from a checkout.
    """
    candidates = [given] if given is not None else [Path(__file__).resolve().parents[2], Path.cwd()]
    for folder in candidates:
        toml = folder / "pyproject.toml"
        if toml.is_file() and "[tool.flwr.app]" in toml.read_text(encoding="utf-8", errors="replace"):
            return folder.resolve()
    where = given if given is not None else Path.cwd()
    raise DeployError(
        f"{where} is not a Flower App folder (no pyproject.toml with [tool.flwr.app]); "
        "run from the fedsim checkout or pass --app DIR"
    )


LOCAL_NODE_POLL = 0.25  # seconds: the idle poll of `local`'s SuperNodes (fedsim.deploy.node)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedsim.deploy",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("certs", help="write a test CA, a SuperLink certificate and SuperNode key pairs")
    c.add_argument("dir", type=Path, help="output folder")
    c.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs to make (default 3)")
    c.add_argument(
        "--host",
        action="append",
        default=[],
        help="extra host name or IP for the SuperLink certificate (repeatable)",
    )
    c.add_argument(
        "--ca-key",
        type=Path,
        help="keep the CA's private key in this file, outside DIR (default: thrown away after signing)",
    )

    loc = sub.add_parser("local", help="run the app on a SuperLink and N SuperNodes on this machine")
    loc.add_argument("--nodes", type=int, default=3, help="number of SuperNodes = partitions (default 3)")
    loc.add_argument(
        "--tls", action="store_true", help="TLS between all processes (test certs unless --certs)"
    )
    loc.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")
    loc.add_argument(
        "--certs", type=Path, help="certificate folder (default: make test ones in WORKDIR/certs)"
    )
    loc.add_argument("--overrides", default="", help="Hydra overrides, as on the fedsim command line")
    loc.add_argument("--out-dir", help="run folder (default outputs/deploy-<timestamp> in this directory)")
    loc.add_argument(
        "--data-dir", help="per-node data folder; {i} becomes the partition id, e.g. data/node{i}"
    )
    loc.add_argument(
        "--node-poll",
        type=_poll,
        default=LOCAL_NODE_POLL,
        help=f"the SuperNodes' idle poll in seconds through fedsim.deploy.node (default {LOCAL_NODE_POLL:g}: a "
        "federation on one machine is a handful of nodes, and Flower's 3 s would make every round wait up to "
        "3 s; 3 keeps Flower's own loop)",
    )
    loc.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="Flower's stock SuperExec: a fresh flwr-clientapp process (torch imported again) per message",
    )
    loc.add_argument(
        "--cache-dir",
        default=None,
        help="where the SuperNodes keep their partitions between messages (default WORKDIR/partition-cache; "
        "'none': rebuild the data set for every message)",
    )
    loc.add_argument(
        "--app",
        type=Path,
        default=None,
        help="the Flower App folder (default: the fedsim checkout this package runs from, else .)",
    )
    loc.add_argument("--port", type=int, help="public port the SuperNodes use (default: a free one)")
    loc.add_argument(
        "--host", default="127.0.0.1", help="public address the front listens on (default 127.0.0.1)"
    )
    _front_args(loc)
    loc.add_argument(
        "--workdir",
        type=Path,
        default=Path(DEFAULT_WORKDIR),
        help=f"logs, pid file and private FLWR_HOME (default {DEFAULT_WORKDIR})",
    )
    loc.add_argument(
        "--timeout", type=_seconds, default=3600.0, help="seconds to wait for the run (default 3600)"
    )
    loc.add_argument("--keep", action="store_true", help="leave the federation running (stop it with `stop`)")

    sl = sub.add_parser(
        "superlink",
        help="start the server side: SuperLink on 127.0.0.1, SuperExec, public front; register the nodes",
        description="Start a SuperLink on 127.0.0.1, a flower-superexec with a shared secret and a front "
        "on HOST:PORT that forwards only the SuperNodes' Fleet API; register the public keys listed in "
        "--nodes; then wait until Ctrl-C/SIGTERM and stop them all (or leave them with --detach).",
    )
    sl.add_argument("--certs", type=Path, help="folder with ca.crt, server.pem, server.key (TLS)")
    sl.add_argument("--insecure", action="store_true", help="no TLS and no node authentication (trials only)")
    sl.add_argument(
        "--nodes",
        type=Path,
        help="binding file: partition ids -> SuperNode public keys (its keys are registered; pass it to "
        "runs as nodes=FILE)",
    )
    sl.add_argument("--host", default="0.0.0.0", help="public address of the front (default 0.0.0.0)")
    sl.add_argument("--port", type=int, default=9093, help="public port of the front (default 9093)")
    sl.add_argument(
        "--workdir",
        type=Path,
        default=Path(DEFAULT_WORKDIR) / "superlink",
        help="logs, pid file, SuperExec secret and the operator's FLWR_HOME",
    )
    sl.add_argument("--detach", action="store_true", help="leave it running (stop it with `stop --workdir`)")
    _front_args(sl)

    n = sub.add_parser(
        "supernode",
        help="check one SuperNode's settings, then start it (on a client machine)",
        description="Check partition id, certificate and key files, data folder and that the "
        "SuperLink answers, then exec flower-supernode (runtime dependency installation off).",
    )
    n.add_argument("--superlink", required=True, help="the SuperLink's HOST:PORT")
    n.add_argument("--partition-id", type=int, required=True, help="this node's partition id, in [0, N)")
    n.add_argument("--num-partitions", type=int, required=True, help="N: the run's num_clients")
    n.add_argument(
        "--root-certificates", type=Path, help="CA certificate that signed the SuperLink's certificate"
    )
    n.add_argument(
        "--key", type=Path, help="this node's private key (its .pub registered on the SuperLink side)"
    )
    n.add_argument("--insecure", action="store_true", help="no TLS (and so no node authentication)")
    n.add_argument("--data-dir", help="this node's own data folder (train.npz, optional val.npz)")
    n.add_argument(
        "--node-poll",
        type=_poll,
        default=None,
        help="this SuperNode's idle poll in seconds through fedsim.deploy.node (default: Flower's 3 s; 0.25 makes "
        "small federations' rounds seconds faster, at 3/POLL times the idle requests to the SuperLink)",
    )
    n.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="Flower's stock SuperExec: a fresh flwr-clientapp process (torch imported again) per message; "
        "by default each message's process is forked from a warm one (fedsim.deploy.warm)",
    )
    n.add_argument(
        "--cache-dir",
        default=DEFAULT_NODE_CACHE,
        help=f"where this node keeps its partition between messages (default {DEFAULT_NODE_CACHE}; "
        "'none': rebuild the data set for every message)",
    )
    n.add_argument(
        "--port", type=int, default=9094, help="this SuperNode's own Runtime API port (default 9094)"
    )
    n.add_argument(
        "--wait", type=_seconds, default=30.0, help="seconds to wait for the SuperLink (default 30)"
    )
    n.add_argument("--dry-run", action="store_true", help="check and print the command, do not start it")

    s = sub.add_parser("stop", help="stop a federation left running by `local --keep`")
    s.add_argument("--workdir", type=Path, default=Path(DEFAULT_WORKDIR))
    return p


def _front_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        help="largest request body the front forwards, in MB (default: twice the largest Fleet body the model "
        "needs, plus 1 MB: at most 11 MB, with Flower's 5 MB array chunks; see docs/deploy.md)",
    )
    p.add_argument(
        "--front",
        choices=FRONTS,
        default="auto",
        help="what listens on the public address: nginx, fedsim's Python fallback, or auto (nginx if "
        "installed); 'none' exposes the SuperLink itself, Control API included (not recommended)",
    )


DEFAULT_NODE_CACHE = "~/.cache/fedsim/partitions"


def cache_folder(arg: str | None, default: Path | None) -> str | None:
    """The absolute ``cache-dir`` of a SuperNode's config, or ``None`` for ``--cache-dir none``."""
    if arg is not None and arg.strip().lower() in ("", "none"):
        return None
    where = Path(arg).expanduser() if arg is not None else default
    return str(where.resolve()) if where is not None else None


def model_bytes(overrides: str) -> int | None:
    """The size of the model the run ``overrides`` compose, in bytes (None when they do not compose)."""
    import json

    from fedsim.build import build_initial_model
    from fedsim.client_app import MissingSpecError, spec_from_overrides

    try:
        model = build_initial_model(json.loads(spec_from_overrides(overrides)))
    except MissingSpecError:
        return None  # the run fails with the same error, in one line
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def front_limits(max_body_mb: float | None, model: int | None = None):
    """The front's limits: ``--max-body-mb``, else sized from the model (``front.body_limit``)."""
    from fedsim.deploy.front import MB, Limits, body_limit

    if max_body_mb is None:
        return Limits(max_body=body_limit(model))
    if not (math.isfinite(max_body_mb) and max_body_mb > 0):
        raise DeployError(f"--max-body-mb={max_body_mb} is not allowed: expected a number of MB > 0")
    return Limits(max_body=max(1, int(max_body_mb * MB)))


def default_overrides(nodes: int, overrides: str) -> list[str]:
    """``num_clients`` and ``clients_per_round`` set to the number of nodes, then the user's overrides (which win)."""
    return [f"num_clients={nodes}", f"clients_per_round={nodes}", *shlex.split(overrides)]


def run_local(args: argparse.Namespace) -> int:
    """The ``local`` subcommand; returns the exit status (0 when the run completed)."""
    from fedsim.server_app import default_out_dir

    if args.nodes < 1:
        raise DeployError(f"--nodes={args.nodes} is not allowed: expected an integer >= 1")
    app = app_folder(args.app)  # before any process starts
    workdir = private_folder(args.workdir.resolve())
    certs = args.certs
    if args.tls and certs is None:
        certs = workdir / "certs"
        if not (certs / "ca.crt").exists() or (
            args.auth and not (certs / f"supernode{args.nodes - 1}").exists()
        ):
            print(f"# test certificates: python -m fedsim.deploy certs {certs} --nodes {args.nodes}")
            make_certs(certs, nodes=args.nodes)
    sec = Security(tls=args.tls, auth=args.auth, certs=certs.resolve() if certs else None)
    sec.check(args.nodes)
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir()
    overrides = shlex.join(default_overrides(args.nodes, args.overrides))
    t0 = time.monotonic()
    limits = front_limits(args.max_body_mb, model_bytes(overrides) if args.max_body_mb is None else None)
    with Federation(workdir, sec, host=args.host, port=args.port, front=args.front, limits=limits) as fed:
        print(
            f"# SuperLink up after {fed.start_superlink():.1f} s on {fed.control_address}; "
            f"SuperNodes use {fed.address}"
        )
        if sec.auth:
            for i in range(args.nodes):
                fed.register(i)
        for i in range(args.nodes):
            data_dir = args.data_dir.format(i=i) if args.data_dir else None
            fed.start_supernode(
                i,
                args.nodes,
                data_dir=str(Path(data_dir).resolve()) if data_dir else None,
                cache_dir=cache_folder(args.cache_dir, workdir / "partition-cache"),
                warm=args.warm,
                poll=args.node_poll,
            )
        print(f"# {args.nodes} SuperNodes online after {fed.wait_nodes_online(args.nodes):.1f} s")
        run_id = fed.submit(app, {"overrides": overrides, "out-dir": str(out_dir.resolve())})
        status = fed.wait_run(run_id, args.timeout, stream=True)
        print(
            f"# run {run_id}: {status['status']} {status.get('status-details') or ''} "
            f"after {time.monotonic() - t0:.0f} s; run folder {out_dir.resolve()}"
        )
        if args.keep:
            fed.detach()  # leaving the block no longer stops them; pids.json keeps their pids
            print(
                f"# still running; stop with: python -m fedsim.deploy stop --workdir {shlex.quote(str(workdir))}"
            )
    return 0 if status["status"] == "finished:completed" else 1


def run_superlink(args: argparse.Namespace) -> int:
    """The ``superlink`` subcommand: the hardened server side; returns the exit status."""
    from fedsim.node_binding import BindingError, load_binding

    if args.insecure == (args.certs is not None):
        raise DeployError("give either --certs DIR (TLS and node authentication) or --insecure")
    binding = None
    if args.nodes is not None:
        try:
            binding = load_binding(args.nodes)
        except BindingError as e:
            raise DeployError(str(e)) from None
    sec = Security(
        tls=not args.insecure, auth=not args.insecure, certs=args.certs.resolve() if args.certs else None
    )
    workdir = args.workdir.resolve()
    limits = front_limits(args.max_body_mb)
    fed = Federation(workdir, sec, host=args.host, port=args.port, front=args.front, limits=limits)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        print(
            f"# SuperLink up after {fed.start_superlink():.1f} s on {fed.control_address}; SuperNodes use {fed.address}"
        )
        if binding is not None and sec.auth:
            keys = fed.workdir / "keys"
            keys.mkdir(exist_ok=True)
            for pid, idents in sorted(binding.entries.items()):
                for k, ident in enumerate(i for i in idents if i.key is not None):
                    pub = keys / f"partition{pid}-{k}.pub"
                    pub.write_text(_openssh(ident) + "\n")
                    fed.register(None, pub, name=f"partition{pid}" + (f"-{k}" if k else ""))
                named = [i.name for i in idents if i.key is None]
                if named:
                    print(
                        f"# partition {pid}: register the node named {named[0]!r} yourself (its key is not in {args.nodes})"
                    )
        nodes = f" nodes='{args.nodes.resolve()}'" if args.nodes else ""
        print(
            "# submit runs on this host (or over SSH), from the fedsim checkout:\n"
            f"FLWR_HOME={shlex.quote(str(fed.flwr_home))} flwr run . fedsim --stream "
            f"--run-config \"overrides='num_clients=N clients_per_round=N'{nodes}\"",
            flush=True,
        )
        if args.detach:
            fed.detach()
            print(f"# running; stop with: python -m fedsim.deploy stop --workdir {shlex.quote(str(workdir))}")
            return 0
        print("# Ctrl-C stops it", flush=True)
        while not stop and all(p.poll() is None for p in fed.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in fed.procs.items() if p.poll() is not None]
        if dead:
            print(f"fedsim.deploy: {dead[0]} exited:\n{fed.log_tail(dead[0])}", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        fed.stop()


def _openssh(ident) -> str:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_der_public_key(ident.key)
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def run_supernode(args: argparse.Namespace) -> int:
    """The ``supernode`` subcommand: check, print, then run ``flower-supernode`` until it ends (or SIGTERM)."""
    if args.insecure == (args.root_certificates is not None):
        raise DeployError("give either --root-certificates CA_CERT (TLS) or --insecure")
    if args.insecure and args.key is not None:
        raise DeployError("--key (node authentication) needs TLS: drop --insecure, give --root-certificates")
    check_node(
        args.superlink,
        args.partition_id,
        args.num_partitions,
        args.root_certificates,
        args.key,
        args.data_dir,
        args.wait,
    )
    sec = Security(
        tls=not args.insecure,
        auth=args.key is not None,
        certs=args.root_certificates.parent if args.root_certificates else None,
    )
    data_dir = str(Path(args.data_dir).expanduser().resolve()) if args.data_dir else None
    cmd = supernode_command(
        args.superlink,
        args.port,
        args.partition_id,
        args.num_partitions,
        sec,
        key=args.key,
        data_dir=data_dir,
        ca=args.root_certificates,
        cache_dir=cache_folder(args.cache_dir, None),
        warm_secret=Path("SECRET") if args.warm else None,
        poll=args.node_poll,
    )
    warm = warm_command(args.port, Path("SECRET"), parent_pid=os.getpid()) if args.warm else None
    folder = None
    if warm is not None:  # the warm SuperExec stops when this process (which waits for the SuperNode) ends
        import tempfile

        from fedsim.deploy.launch import write_secret

        secret = "<a fresh secret file>"
        if not args.dry_run:
            folder = Path(tempfile.mkdtemp(prefix="fedsim-supernode-"))  # mode 0700
            secret = str(write_secret(folder / "superexec.secret"))
        cmd, warm = ([secret if a == "SECRET" else a for a in c] for c in (cmd, warm))
        print("$ " + shlex.join(warm), flush=True)
    print("$ " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return _run_node(cmd, warm, folder)


def _run_node(cmd: list[str], warm: list[str] | None, folder: Path | None) -> int:
    """Run the SuperNode (and its warm SuperExec) until it exits or this process gets SIGTERM/Ctrl-C; then
    stop both and remove the secret's folder. Returns the SuperNode's exit status."""
    import shutil
    import subprocess

    from fedsim.deploy.launch import terminate

    env = {**os.environ, **FLWR_ENV}
    procs = []
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        if warm is not None:
            procs.append(subprocess.Popen(warm, env=env))
        node = subprocess.Popen(cmd, env=env)
        procs.insert(0, node)
        while node.poll() is None and not stopping:
            time.sleep(0.2)
        return 0 if stopping else int(node.returncode)
    except KeyboardInterrupt:
        return 0
    finally:
        terminate([p.pid for p in procs if p.poll() is None], timeout=15)
        for p in procs:
            p.wait()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # the SuperExec secret lives only as long as the node


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0 (argparse refuses anything else with one line and exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _poll(text: str) -> float:
    """A SuperNode's idle poll: seconds in [0.01, 60]."""
    value = _seconds(text)
    if not 0.01 <= value <= 60:
        raise argparse.ArgumentTypeError(f"expected seconds in [0.01, 60], got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "certs":
            try:
                out = make_certs(args.dir, nodes=args.nodes, hosts=tuple(args.host), ca_key=args.ca_key)
            except ValueError as e:
                raise DeployError(str(e)) from None
            except OSError as e:  # e.g. the folder is a file, or not writable
                raise DeployError(f"cannot write certificates to {args.dir}: {e.strerror}") from None
            for f in sorted(out.iterdir()):
                print(f)
            if args.ca_key:
                print(f"{args.ca_key.resolve()}  (the CA key: keep it offline, never on the SuperLink host)")
            return 0
        if args.cmd == "local":
            return run_local(args)
        if args.cmd == "superlink":
            return run_superlink(args)
        if args.cmd == "supernode":
            return run_supernode(args)
        stopped = stop_from_pidfile(args.workdir)
        print(f"stopped {len(stopped)} process(es): {' '.join(map(str, stopped))}")
        return 0
    except DeployError as e:
        print(f"fedsim.deploy: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

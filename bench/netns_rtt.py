"""A deployed round's cost over a 50 ms round trip, against the same run on localhost (root, Linux, iproute2).

Three federations of the same shape, each a SuperLink with its SuperExec and public front, TLS and node
authentication, three warm SuperNodes (0.25 s idle poll, partition cache), the default experiment on digits
with every node in every round:

- ``localhost``: everything on 127.0.0.1 in this machine's own network namespace (``fedsim.deploy local``);
- ``hosts, 0 ms``: the namespace harness of tests/test_netns.py (the server side on one host, each SuperNode
  on its own, joined by veth pairs), each node through its link proxy (tests/netns_proxy.py) with no delay;
- ``hosts, 50 ms``: the same federation, its links at 50 ms RTT (+-5 ms jitter each way).

Prints the median round time of rounds 2.. of each, side by side, and the 50 ms run's overhead over the
other two. The two namespace runs alternate ``--repeat`` times on one federation.

    python bench/netns_rtt.py [--rounds 6] [--repeat 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import netns
import test_netns as T
from helpers import read_metrics

from fedsim.deploy import Federation, Security, make_certs

N = T.N


def one_run(f: Federation, root: Path, name: str, rounds: int) -> list[float]:
    """Submit the experiment, wait for it; the round times of rounds 2.. (round 1 carries the App bundle)."""
    over = [*T.TINY, f"clients_per_round={N}", f"num_rounds={rounds}", "round_timeout=60"]
    out = root / name
    rid = f.submit(T.APP, {"overrides": shlex.join(over), "out-dir": str(out)})
    status = f.wait_run(rid, 600, poll=1.0, done=(out / "summary.json").exists)
    if status["status"] != "finished:completed":
        sys.exit(f"netns_rtt: run {name} ended {status['status']}")
    return [r["round_time"] for r in read_metrics(out)[2:]]


def localhost(root: Path, rounds: int) -> list[float]:
    certs = make_certs(root / "certs-lo", nodes=N)
    f = Federation(
        root / "work-lo", Security(tls=True, auth=True, certs=certs), cwd=root, echo=lambda _: None
    )
    with f:
        f.start_superlink(timeout=120)
        for i in range(N):
            f.register(i)
            f.start_supernode(i, N, warm=True, poll=0.25, cache_dir=str(root / "cache-lo"))
        f.wait_nodes_online(N, timeout=240)
        return one_run(f, root, "localhost", rounds)


def across_hosts(root: Path, rounds: int, repeat: int) -> dict[int, list[float]]:
    hosts = netns.Hosts(N)
    times: dict[int, list[float]] = {0: [], 50: []}
    try:
        with netns.inside(hosts.hub):
            certs = make_certs(root / "certs", nodes=N, hosts=(netns.HUB_IP,))
            sec = Security(tls=True, auth=True, certs=certs)
            f = T.NetFederation(
                root / "work", sec, host=netns.HUB_IP, cwd=root, echo=lambda _: None, hosts=hosts
            )
            try:
                f.start_superlink(timeout=120)
                for i in range(N):
                    f.register(i)
                    f.link(i, T.Faults(seed=i))
                    f.start_node(i)
                f.wait_nodes_online(N, timeout=240)
                for k in range(repeat):
                    for rtt in (0, 50):
                        for link in f.links.values():
                            link.faults.rtt, link.faults.jitter = rtt / 1000, 0.01 if rtt else 0.0
                        times[rtt] += one_run(f, root, f"rtt{rtt}-{k}", rounds)
            finally:
                f.stop()
                for link in f.links.values():
                    with contextlib.suppress(Exception):
                        link.close()
    finally:
        hosts.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if why := netns.unavailable():
        sys.exit(f"netns_rtt: {why}")
    netns.sweep()
    root = Path(tempfile.mkdtemp(prefix="netns-rtt-"))
    try:
        lo = localhost(root, args.rounds)
        far = across_hosts(root, args.rounds, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {
        "localhost": statistics.median(lo),
        **{f"hosts, {k} ms": statistics.median(v) for k, v in far.items()},
    }
    print(f"\n{N} warm SuperNodes, TLS + node auth, digits, median of rounds 2-{args.rounds} (s):")
    for name, t in med.items():
        print(f"  {name:<14} {t:6.2f}")
    slow = med["hosts, 50 ms"]
    print(
        f"  50 ms RTT costs {slow - med['localhost']:+.2f} s per round over localhost "
        f"({slow / med['localhost']:.2f}x), {slow - med['hosts, 0 ms']:+.2f} s over the 0 ms links"
    )


if __name__ == "__main__":
    main()

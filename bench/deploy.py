"""Deployed rounds: fedsim and a vanilla Flower app of the same size on 3-SuperNode loopback federations.

Three federations in turn, each one SuperLink (TLS off, loopback) and three SuperNodes that stay up while the
variants run (repeats interleaved):

- ``warm-poll`` nodes: ``warm`` nodes whose idle poll is 0.25 s instead of Flower's 3 s
  (``fedsim.deploy.node``; the default of ``python -m fedsim.deploy local``);
- ``warm`` nodes: each SuperNode's ClientApp processes are forked from a process that has imported torch
  (``fedsim.deploy.warm``), with Flower's 3 s idle poll (the default of ``python -m fedsim.deploy supernode``);
- ``stock`` nodes: Flower's own SuperExec, a fresh ``flwr-clientapp`` interpreter per message
  (``--no-warm``).

On each: ``fedsim`` (fedsim's App, the default experiment with ``num_clients=3``, every node each round; the
nodes keep their partitions in a cache folder), ``flower`` (``bench/vanilla_flower_deploy``: plain Flower
FedAvg over the same MLP and data, written as a Flower user would: the data set loaded in every ClientApp
process, Flower's ``strategy.start``) and ``flower-noop`` (the same App, its clients return the model
unchanged without importing torch: what Flower itself costs per round: the SuperNodes' 3 s idle poll and
``send_and_receive``'s 3 s pull interval, plus the process per message). ``inprocess`` is the same fedsim
run in one process: the training itself.

Per-round times are the gaps between consecutive evaluations of the global model (round 0 first), so both
apps are timed the same way. The table gives round 1 (first messages: caches cold) and the median of the
later rounds, then what a fresh ``flwr-clientapp`` process pays before it trains on a stock node.

    python bench/deploy.py                      # 4 rounds, 1 repeat: about 5 minutes on 2 cores
    python bench/deploy.py --rounds 6 --repeat 2 --nodes warm

``--wire`` measures instead what a deployed round costs on the wire against the ``bytes_up``/``bytes_down`` the
run records (``fedsim.comm``: Flower's RecordDict protobuf sizes), for the default MLP and for top-k at 1 %. One
federation of ``warm-poll`` nodes behind fedsim's Python front, which counts every forwarded request's bytes
(``--count-file``: request line, headers and body as HTTP/1.1 carries them, TLS off). Replies travel as
``push-messages`` and ``push-object`` requests, instructions as ``pull-messages`` (the answers that hold a
message), ``pull-object`` and ``confirm-message-received``; each is counted both ways (a pull's request goes
up, its answer down), idle polls, heartbeats, ``get-run`` and ``get-fab`` apart (``wire_totals``). Each case
runs twice, ``WIRE_ROUNDS`` rounds, and the differences are divided, so what a run pays once (discovery, the
App bundle) drops out.

    python bench/deploy.py --wire               # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench

NODES = 3
FEDSIM_APP = HERE.parent
VANILLA_APP = HERE / "vanilla_flower_deploy"
VARIANTS = ("fedsim", "flower", "flower-noop", "inprocess")
KINDS = ("warm-poll", "warm", "stock")
NODE_POLL = 0.25  # the warm-poll nodes' idle poll (--node-poll); Flower's own is 3 s
FEDSIM_OVERRIDES = [f"num_clients={NODES}", f"clients_per_round={NODES}"]

# what a fresh flwr-clientapp process does before it trains, each in its own interpreter
SPEC = "import time; from fedsim import build; from fedsim.config import compose; "
SPEC += f"s = build.client_spec(compose({', '.join(map(repr, FEDSIM_OVERRIDES))}), device='cpu'); "
PER_MESSAGE = {
    "import torch + flwr.clientapp": "import torch, flwr.clientapp",
    "import fedsim.client_app": "import fedsim.client_app",
    "fedsim client task, data set built": SPEC + "t = time.perf_counter(); build.client_task(s, 1)",
    "fedsim client task, read from the node's cache": SPEC
    + "t = time.perf_counter(); build.client_task(s, 1, {cache!r})",
    "first torch.optim.SGD (imports torch._dynamo)": (
        "import torch; torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)"
    ),
}


def fresh_process_seconds(code: str, repeat: int = 3) -> float:
    """Median wall time of ``python -c code`` in a fresh interpreter, minus an empty interpreter's.

    Code that sets ``t = time.perf_counter()`` is timed from there to its end instead (the part after its
    imports), inside the interpreter.
    """

    def wall(src: str) -> float:
        if "t = time.perf_counter()" in src:
            src += "; print(time.perf_counter() - t)"
            out = subprocess.run([sys.executable, "-c", src], check=True, env=bench.ENV, capture_output=True)
            return float(out.stdout.split()[-1])
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", src], check=True, env=bench.ENV, capture_output=True)
        return time.perf_counter() - t0

    empty = (
        0.0 if "t = time.perf_counter()" in code else statistics.median(wall("pass") for _ in range(repeat))
    )
    return statistics.median(wall(code) for _ in range(repeat)) - empty


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def run_fedsim(fed, out: Path, rounds: int, timeout: float) -> list[float]:
    overrides = shlex.join([*FEDSIM_OVERRIDES, f"num_rounds={rounds}", "checkpoint_every=0"])
    run_id = fed.submit(FEDSIM_APP, {"overrides": overrides, "out-dir": str(out)})
    status = fed.wait_run(run_id, timeout, done=(out / "summary.json").exists)
    if status["status"] != "finished:completed":
        sys.exit(f"fedsim's run {run_id} ended {status}:\n{fed.run_log(run_id)[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return gaps([r["wall_time"] for r in recs if "eval_accuracy" in r])


def run_vanilla(fed, times: Path, rounds: int, noop: bool, timeout: float) -> list[float]:
    from fedsim.deploy.launch import CONNECTION

    config = f"num-server-rounds={rounds} num-partitions={NODES} times-file={json.dumps(str(times))} "
    config += f"noop={'true' if noop else 'false'}"  # TOML values, typed as the App declares them
    run_id = int(fed.flwr("run", str(VANILLA_APP), CONNECTION, "--run-config", config)["run-id"])
    status = fed.wait_run(run_id, timeout)
    if status["status"] != "finished:completed":
        sys.exit(f"the vanilla run {run_id} ended {status}:\n{fed.run_log(run_id)[-3000:]}")
    return gaps([float(x) for x in times.read_text().split()])


def run_inprocess(out: Path, rounds: int) -> list[float]:
    over = [*FEDSIM_OVERRIDES, f"num_rounds={rounds}", "engine=inprocess", "checkpoint_every=0", "quiet=true"]
    cmd = [sys.executable, "-m", "fedsim", *over, f"hydra.run.dir={out}"]
    subprocess.run(cmd, check=True, env=bench.ENV, capture_output=True)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return gaps([r["wall_time"] for r in recs if "eval_accuracy" in r])


WIRE_ROUNDS = (2, 5)  # each --wire case runs this many rounds, twice; per-round figures are the differences
WIRE_CASES = {"MLP, dense": [], "MLP, top-k 1 %": ["compression=topk", "compression.ratio=0.01"]}
# the Fleet routes that move a reply to the SuperLink, and those that move an instruction to a node
REPLY_ROUTES = {"push-messages", "push-object"}
INSTRUCTION_ROUTES = {"pull-messages", "pull-object", "confirm-message-received"}


def wire_totals(lines: list[dict]) -> dict[str, int]:
    """Per kind of traffic in a front's count lines: ``reply`` (a node pushing its reply: the request and
    answer bytes of ``push-messages`` and ``push-object``), ``instruction`` (a node pulling a message: the
    ``pull-messages`` exchanges that return one, ``pull-object``, ``confirm-message-received``) and ``other``
    (idle polls, heartbeats, ``get-run``, ``get-fab``, ...): ``<kind>`` the bytes both ways, ``<kind>_body``
    the protobuf bodies that carry the message (requests for a reply, answers for an instruction),
    ``<kind>_requests`` the requests; and ``up``/``down``: every byte from the nodes and to them."""
    out: dict[str, int] = {"up": 0, "down": 0}
    for x in lines:
        route = x["route"].rsplit("/", 1)[-1]
        if route in REPLY_ROUTES:
            kind, body = "reply", x["up_body"]
        elif route in INSTRUCTION_ROUTES and (route != "pull-messages" or x["down_body"]):
            kind, body = "instruction", x["down_body"]  # (an empty pull-messages answer is an idle poll)
        else:
            kind, body = "other", 0
        for key, value in ((kind, x["up"] + x["down"]), (f"{kind}_body", body), (f"{kind}_requests", 1)):
            out[key] = out.get(key, 0) + value
        out["up"] += x["up"]
        out["down"] += x["down"]
    return out


def run_wire(tmp: Path, timeout: float) -> None:
    """``--wire``: see the module docstring."""
    from fedsim.deploy.launch import Federation, Security

    counts = tmp / "front-counts.jsonl"

    class Counted(Federation):
        def front_command(self, tls_name: str = "") -> list[str]:
            return [*super().front_command(tls_name), "--count-file", str(counts)]

    before = bench.machine_line()
    rows = []
    with Counted(
        tmp / "work-wire", Security(tls=False, auth=False), front="python", echo=lambda _: None
    ) as fed:
        fed.start_superlink()
        for i in range(NODES):
            fed.start_supernode(i, NODES, cache_dir=str(tmp / "partition-cache"), warm=True, poll=NODE_POLL)
        fed.wait_nodes_online(NODES)
        for name, extra in WIRE_CASES.items():
            got = []
            for rounds in WIRE_ROUNDS:
                out = tmp / f"wire-{len(rows)}-{rounds}"
                start = counts.stat().st_size if counts.exists() else 0
                overrides = shlex.join(
                    [*FEDSIM_OVERRIDES, *extra, f"num_rounds={rounds}", "checkpoint_every=0"]
                )
                run_id = fed.submit(FEDSIM_APP, {"overrides": overrides, "out-dir": str(out)})
                status = fed.wait_run(run_id, timeout, done=(out / "summary.json").exists)
                if status["status"] != "finished:completed":
                    sys.exit(f"fedsim's run {run_id} ended {status}:\n{fed.run_log(run_id)[-3000:]}")
                time.sleep(1.0)  # the last confirmations and polls of the run reach the count file
                with counts.open("rb") as f:
                    f.seek(start)
                    lines = [json.loads(x) for x in f.read().decode().splitlines() if x.strip()]
                summary = json.loads((out / "summary.json").read_text())
                got.append((summary["total_bytes_up"], summary["total_bytes_down"], wire_totals(lines)))
            (up1, down1, w1), (up2, down2, w2) = got
            rows.append((name, up2 - up1, down2 - down1, {k: w2.get(k, 0) - w1.get(k, 0) for k in w2}))
            print(f"# {name}: {got}", flush=True)
    n = WIRE_ROUNDS[1] - WIRE_ROUNDS[0]
    print(
        f"\n{NODES} local SuperNodes (warm, {NODE_POLL} s poll) behind fedsim's Python front, HTTP/1.1, TLS off; "
        f"bytes per round over {n} rounds ({WIRE_ROUNDS[1]} - {WIRE_ROUNDS[0]}); before: {before}; "
        f"after: {bench.machine_line()}"
    )
    # one table each way: the run's recorded bytes against the wire bytes of its replies / instructions
    for col, kind, recorded, wire in (
        (1, "reply", "recorded up", "replies wire"),
        (2, "instruction", "recorded down", "instr. wire"),
    ):
        print(
            "{:<17}{:>14}{:>14}{:>7}{:>8}{:>10}".format("case", recorded, wire, "ratio", "bodies", "requests")
        )
        for row in rows:
            name, rec, w = row[0], row[col], row[3]
            print(
                f"{name:<17}{rec / n:>14.0f}{w[kind] / n:>14.0f}{w[kind] / rec:>7.2f}"
                f"{w[kind + '_body'] / rec:>8.2f}{w[kind + '_requests'] / n:>10.1f}"
            )
    for name, up, down, w in rows:
        print(
            f"{name}: every byte per round, from the nodes {w['up'] / n:.0f} (recorded up {up / n:.0f}), to them "
            f"{w['down'] / n:.0f} (recorded down {down / n:.0f}); idle polls, heartbeats and the like "
            f"{w.get('other', 0) / n:.0f} of them"
        )
    if len(rows) == 2:
        (_, up_dense, _, w_dense), (_, up_topk, _, w_topk) = rows
        print(
            f"top-k 1 % upload cut: {up_dense / up_topk:.1f}x recorded, {w_dense['reply'] / w_topk['reply']:.1f}x "
            f"in reply traffic on the wire, {w_dense['up'] / w_topk['up']:.1f}x in all bytes from the nodes"
        )


def main() -> None:
    from fedsim.deploy.launch import Federation, Security

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--nodes", default=",".join(KINDS), help="SuperNode kinds, each a federation of its own")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--wire", action="store_true", help="bytes on the wire against the recorded bytes (only)")
    args = ap.parse_args()
    if args.wire:
        with tempfile.TemporaryDirectory() as tmp:
            run_wire(Path(tmp), args.timeout)
        return
    variants = args.variants.split(",")
    before = bench.machine_line()
    rows: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "partition-cache"
        if "inprocess" in variants:
            rows["inprocess"] = [
                run_inprocess(tmp / f"inprocess-{r}", args.rounds) for r in range(args.repeat)
            ]
            print(f"# inprocess: rounds {', '.join(f'{x:.2f}' for x in rows['inprocess'][0])} s", flush=True)
        for kind in args.nodes.split(","):
            work = tmp / f"work-{kind}"
            with Federation(work, Security(tls=False, auth=False), echo=lambda _: None) as fed:
                fed.start_superlink()
                for i in range(NODES):
                    warm, poll = kind.startswith("warm"), NODE_POLL if kind.endswith("poll") else None
                    fed.start_supernode(i, NODES, cache_dir=str(cache), warm=warm, poll=poll)
                fed.wait_nodes_online(NODES)
                for rep in range(args.repeat):
                    for v in (v for v in variants if v != "inprocess"):
                        where = tmp / f"{v}-{kind}-{rep}"
                        if v == "fedsim":
                            got = run_fedsim(fed, where, args.rounds, args.timeout)
                        else:
                            got = run_vanilla(fed, where, args.rounds, v == "flower-noop", args.timeout)
                        rows.setdefault(f"{v}, {kind} nodes", []).append(got)
                        print(
                            f"# {v}, {kind} nodes: rounds {', '.join(f'{x:.2f}' for x in got)} s", flush=True
                        )
        print(
            f"\n{NODES} local SuperNodes, {args.rounds} rounds x {args.repeat}; before: {before}; "
            f"after: {bench.machine_line()}"
        )
        print(f"{'variant':<28}{'round 1 s':>10}{'later rounds s (median)':>26}")
        later = {}
        for v, runs in rows.items():
            first = statistics.median(r[0] for r in runs)
            later[v] = statistics.median(x for r in runs for x in r[1:])
            print(f"{v:<28}{first:>10.2f}{later[v]:>26.2f}")
        train = later.get("inprocess")
        for kind in args.nodes.split(","):
            fs, fl, noop = (later.get(f"{v}, {kind} nodes") for v in ("fedsim", "flower", "flower-noop"))
            if fs is not None and train is not None:
                over = fs - train
                print(
                    f"{kind} nodes: fedsim's deployed round above the training itself {over:.2f} s "
                    f"(goal <= 3 s: {'met' if over <= 3 else 'not met'})"
                )
            if fs is not None and fl is not None:
                print(f"{kind} nodes: vanilla Flower / fedsim per deployed round {fl / fs:.2f}")
            if noop is not None:
                print(
                    f"{kind} nodes: Flower itself (clients return the model, no torch) {noop:.2f} s per round"
                )
        print(
            "per message, a fresh flwr-clientapp process on a stock node pays (each alone in a fresh "
            "interpreter; the task lines time the call alone, after the imports):"
        )
        for name, code in PER_MESSAGE.items():
            code = code.format(cache=str(cache))
            secs = fresh_process_seconds(code)
            print(f"  {name:<50}{secs:6.2f} s")


if __name__ == "__main__":
    main()

"""Host work a round: the server thread's CPU time outside the cohort's training steps, evaluation and recording.

Runs the ``fedsim`` command (the default experiment unless overrides are given) in a fresh process and times,
in CPU seconds of the thread that runs the rounds (``time.thread_time``):

- the round: from the end of one round's ``Run.on_round`` to the end of the next;
- the batched SGD steps: ``fedsim.engines.vectorized.train_stacked`` (the gather index included);
- the server's evaluation: ``fedsim.server.evaluate_finite``;
- recording: ``Run.on_round`` itself (metrics.jsonl, progress line).

**Host work** is the round minus those three: cohort sampling, the train messages, preparing the cohort
(instructions, plans, seeded batch orders, start models), replies, screening, sizes and the aggregation — the
work that grows with the cohort instead of with the model's arithmetic. The same functions exist in every
fedsim tree since the vectorized engine, so one tree can be compared with another: ``--pythons`` takes one
interpreter per tree (each with that tree's fedsim installed); every child runs in an empty folder, so each
imports its own. Runs are interleaved (a change in the machine's load hits every tree), idle and beside a process
spinning on every core (``--load``), and the table gives medians over rounds 2..R and over the repeats.

    python bench/host_work.py                                     # this tree, idle and busy
    python bench/host_work.py --pythons before=OLD/bin/python,now=NEW/bin/python --rounds 300 --repeat 3
    python bench/host_work.py --rounds 100 -- clipping=fixed       # any fedsim overrides after --
    python bench/host_work.py --cohorts 10,100 --pythons before=OLD,now=NEW   # the cost of one more client

**Per client.** With ``--cohorts A,B`` every tree runs with ``num_clients=B`` and ``clients_per_round`` A and
then B; the host work of one more client in the cohort is the slope ``(host(B) - host(A)) / (B - A)``: what
grows with the cohort, without the per-round work (sampling, the new global model's record) that does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ENV, BusyNeighbour, machine_line

PIECES = ("round", "steps", "evaluation", "recording", "host")


def child(rounds: int, overrides: list[str]) -> dict:
    """In this process: run ``fedsim`` with timers around the pieces; per-round thread CPU ms of each piece."""
    import functools
    import shutil
    import threading
    import time

    from fedsim import cli, run, server
    from fedsim.engines import vectorized

    main_thread = threading.get_ident()
    spent = dict.fromkeys(("steps", "evaluation", "recording"), 0.0)
    rows: list[dict] = []
    mark = [None]

    def timed(piece, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if threading.get_ident() != main_thread:  # not in the rounds' thread: not part of its CPU time
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[piece] += time.thread_time() - t0

        return wrapper

    on_round = run.Run.on_round

    def recording(self, record, state):
        t0 = time.thread_time()
        on_round(self, record, state)
        now = time.thread_time()
        spent["recording"] += now - t0
        if mark[0] is not None and record.get("round", 0) > 0:
            row = {k: 1e3 * v for k, v in spent.items()}
            row["round"] = 1e3 * (now - mark[0])
            row["host"] = row["round"] - row["steps"] - row["evaluation"] - row["recording"]
            row["clients"] = record.get("num_clients", 0)
            rows.append(row)
        for k in spent:
            spent[k] = 0.0
        mark[0] = time.thread_time()

    run.Run.on_round = recording
    server.evaluate_finite = timed("evaluation", server.evaluate_finite)
    vectorized.train_stacked = timed("steps", vectorized.train_stacked)
    out = Path(tempfile.mkdtemp(prefix="fedsim-host-"))
    sys.argv = [
        "fedsim",
        f"num_rounds={rounds}",
        *overrides,
        "quiet=true",
        "checkpoint_every=0",
        f"hydra.run.dir={out}",
    ]
    try:
        cli.main()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows = rows[1:]  # round 1 warms caches up
    res = {p: statistics.median(r[p] for r in rows) for p in PIECES}
    res["clients"] = statistics.median(r["clients"] for r in rows)
    return res


def run_child(python: str, rounds: int, overrides: list[str]) -> dict:
    """One child run with ``python`` in an empty folder (so it imports its own fedsim); its result dict."""
    with tempfile.TemporaryDirectory() as cwd:
        cmd = [python, str(Path(__file__).resolve()), "--child", "--rounds", str(rounds), "--", *overrides]
        proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **ENV}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slopes(
    results: dict[tuple[str, str], list[dict]], names: list[str], loads: list[str], cohorts: list[int]
) -> list[str]:
    """The host work of one more client (the slope between the two cohort sizes), per tree and load."""
    lines = []
    a, b = cohorts
    for ld in loads:
        host = {
            (n, c): statistics.median(r["host"] for r in results[f"{ld}@{c}", n])
            for n in names
            for c in cohorts
        }
        per = {n: (host[n, b] - host[n, a]) / (b - a) for n in names}
        lines.append(
            f"\n{ld}: host work, thread CPU ms a round at {a} and {b} clients a round, and per added client"
        )
        lines.append(f"{'':<26}" + "".join(f"{n:>12}" for n in names))
        for c in cohorts:
            lines.append(f"{f'host, {c} clients':<26}" + "".join(f"{host[n, c]:>12.3f}" for n in names))
        lines.append(f"{'host per added client':<26}" + "".join(f"{per[n]:>12.4f}" for n in names))
        first = names[0]
        for n in names[1:]:
            lines.append(f"({ld}) host work per added client, {first} / {n}: {per[first] / per[n]:.2f}x")
    return lines


def table(results: dict[tuple[str, str], list[dict]], names: list[str], loads: list[str]) -> list[str]:
    """One block per load: a row per piece, a column per tree (medians over the repeats), then the ratio of the
    first tree's host work to each other's."""
    lines = []
    for ld in loads:
        med = {
            n: {p: statistics.median(r[p] for r in results[ld, n]) for p in (*PIECES, "clients")}
            for n in names
        }
        lines.append(f"\n{ld}: thread CPU ms a round (median over rounds 2..R, then over the repeats)")
        lines.append(f"{'piece':<26}" + "".join(f"{n:>12}" for n in names))
        for p in PIECES:
            lines.append(f"{p:<26}" + "".join(f"{med[n][p]:>12.3f}" for n in names))
        per_client = {n: med[n]["host"] / max(med[n]["clients"], 1) for n in names}
        lines.append(f"{'host work per client':<26}" + "".join(f"{per_client[n]:>12.3f}" for n in names))
        first = names[0]
        for n in names[1:]:
            lines.append(
                f"({ld}) host work a round, {first} / {n}: {med[first]['host'] / med[n]['host']:.2f}x; "
                f"the round: {med[first]['round'] / med[n]['round']:.2f}x"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pythons", default=f"this={sys.executable}", help="NAME=PYTHON,... one per fedsim tree")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tree and load, interleaved (medians)")
    ap.add_argument(
        "--load", default="idle,busy", help="idle, busy (beside a process spinning on every core)"
    )
    ap.add_argument(
        "--cohorts", help="A,B: run clients_per_round A and B (num_clients=B); the per-client slope"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="fedsim overrides (after --)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.overrides)))
        return
    pythons = dict(item.split("=", 1) for item in args.pythons.split(","))
    loads = args.load.split(",")
    before = machine_line()
    cohorts = [int(c) for c in args.cohorts.split(",")] if args.cohorts else []
    if cohorts and (len(cohorts) != 2 or not 0 < cohorts[0] < cohorts[1]):
        raise SystemExit(f"--cohorts {args.cohorts}: expected two cohort sizes A,B with 0 < A < B")
    cases = {
        f"{ld}@{c}": [f"num_clients={cohorts[1]}", f"clients_per_round={c}"] for ld in loads for c in cohorts
    }
    cases = cases or {ld: [] for ld in loads}
    results: dict[tuple[str, str], list[dict]] = {(case, n): [] for case in cases for n in pythons}
    for _ in range(args.repeat):
        for case, extra in cases.items():
            for name, python in pythons.items():
                overrides = [*args.overrides, *extra]
                if case.startswith("busy"):
                    with BusyNeighbour():
                        results[case, name].append(run_child(python, args.rounds, overrides))
                else:
                    results[case, name].append(run_child(python, args.rounds, overrides))
    print(
        f"host work: fedsim {' '.join(['num_rounds=' + str(args.rounds), *args.overrides])}; {args.repeat} runs per "
        f"tree and load, interleaved; before: {before}; after: {machine_line()}"
    )
    if cohorts:
        print("\n".join(slopes(results, list(pythons), loads, cohorts)))
    else:
        print("\n".join(table(results, list(pythons), loads)))
    print(
        "host: the round minus the batched SGD steps (train_stacked), the server's evaluation and recording "
        "(on_round): sampling, messages, preparation, replies, screening, sizes, aggregation."
    )


if __name__ == "__main__":
    main()

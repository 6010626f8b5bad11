"""Per-client state at population scale: SCAFFOLD's per-client control variates for 10^5 clients.

Scenario (c) of ``bench/scale.py`` (10^5 clients, 20 lazily made images each, 100 per round, the small CNN),
run with ``strategy=scaffold`` (every client keeps a model-sized control variate between its rounds) next to
plain FedAvg, each in a fresh process. Peak memory is the RSS of the process tree; the client state lives in
the run folder (``client_state/``), so memory follows the cohort, not the population.

    python bench/client_state.py               # 3 rounds, 10^5 clients (about a minute or two)
    python bench/client_state.py --small       # 2,000 clients (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale

import bench

VARIANTS = {"fedavg": [], "scaffold": ["strategy=scaffold"]}


def child(variant: str, rounds: int, small: bool) -> dict:
    """One run in this process: round times, accuracy, the client state on disk and its size per client."""
    from fedsim.cli import quiet_loggers
    from fedsim.config import compose
    from fedsim.run import run_experiment

    quiet_loggers()
    sc = scale.SCENARIOS["c"]
    over = [*sc["overrides"], *(sc["small"] if small else []), *VARIANTS[variant], f"num_rounds={rounds}"]
    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(compose(*over, "quiet=true", "checkpoint_every=0"), out)
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        files = list((Path(out) / "client_state").glob("*.npz"))
        disk = sum(f.stat().st_size for f in files)
    return {
        "rounds": [r["round_time"] for r in recs if r["round"] > 0],
        "accuracy": summary["final_eval_accuracy"],
        "state_files": len(files),
        "state_mb": disk / 2**20,
        "num_clients": int(summary["config"]["num_clients"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.small)))
        return
    t0, rows = time.perf_counter(), {}
    for name in VARIANTS:
        argv = [__file__, "--child", name, "--rounds", str(args.rounds), *(["--small"] if args.small else [])]
        rows[name] = bench.run_child(argv, timeout=900)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(
        f"\nper-client state at scale; {bench.machine_line()}; {scale.SCENARIOS['c']['title']}, {args.rounds} rounds"
    )
    print(
        f"{'variant':<10}{'clients':>9}{'peak MB':>9}{'round s':>9}{'state files':>12}{'state MB':>10}{'accuracy':>10}"
    )
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<10}failed: {r['error']}")
            continue
        per = statistics.median(r["rounds"][1:] or r["rounds"])
        print(
            f"{name:<10}{r['num_clients']:>9}{r['peak_mb']:>9.0f}{per:>9.3f}{r['state_files']:>12}"
            f"{r['state_mb']:>10.1f}{r['accuracy']:>10.4f}"
        )
    a, b = rows.get("fedavg", {}), rows.get("scaffold", {})
    if "peak_mb" in a and "peak_mb" in b:
        print(f"scaffold - fedavg peak: {b['peak_mb'] - a['peak_mb']:+.0f} MB (target: all under 4 GiB)")


if __name__ == "__main__":
    main()

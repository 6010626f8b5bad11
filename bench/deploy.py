"""Deployed rounds: per-round wall time of a 3-SuperNode loopback federation, and what one message costs.

Runs ``python -m fedsim.deploy local --nodes 3`` (SuperLink, SuperExec and three SuperNodes on this machine,
TLS off) for a few rounds of the default experiment, reads the run's ``metrics.jsonl`` and prints the time of
each round next to what a SuperNode pays per message: Flower 1.42 starts a fresh ``flwr-clientapp`` process
for every message, so each message pays the imports of the client's path and the data set again (measured
here in fresh processes), and the synchronous ``send_and_receive`` and the idle SuperNodes poll every 3 s.

    python bench/deploy.py                # 3 rounds, about 2 minutes on 2 cores
    python bench/deploy.py --rounds 5

Not included yet: the same federation running a hand-written vanilla Flower app (issue 18, item 4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench

# what a fresh flwr-clientapp process does before it trains, each in its own interpreter
PER_MESSAGE = {
    "import torch + flwr.clientapp": "import torch, flwr.clientapp",
    "import fedsim.client_app": "import fedsim.client_app",
    "digits data set (scikit-learn)": "from fedsim.data.digits import load_digits; load_digits(seed=0)",
    "import torch, first torch.optim.SGD (torch._dynamo)": (
        "import torch; torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)"
    ),
}


def fresh_process_seconds(code: str, repeat: int = 2) -> float:
    """Median wall time of ``python -c code`` in a fresh interpreter, minus an empty interpreter's."""

    def wall(src: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", src], check=True, env=bench.ENV, capture_output=True)
        return time.perf_counter() - t0

    empty = statistics.median(wall("pass") for _ in range(repeat))
    return statistics.median(wall(code) for _ in range(repeat)) - empty


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    before = bench.machine_line()
    with tempfile.TemporaryDirectory() as tmp:
        out, work = Path(tmp) / "run", Path(tmp) / "work"
        cmd = [sys.executable, "-m", "fedsim.deploy", "local", "--nodes", "3", "--out-dir", str(out)]
        cmd += ["--workdir", str(work), "--overrides", f"num_rounds={args.rounds}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=bench.ENV, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"fedsim.deploy local failed:\n{proc.stderr[-2000:]}")
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rounds = [r["round_time"] for r in recs if r["round"] > 0]
    print(
        f"\nfedsim deployed, 3 local SuperNodes, {args.rounds} rounds; before: {before}; after: {bench.machine_line()}"
    )
    print(
        f"  wall {wall:.1f} s (start-up and shutdown included); round times: {', '.join(f'{x:.1f}' for x in rounds)} s"
    )
    print(f"  median round {statistics.median(rounds):.1f} s; final accuracy {recs[-1].get('eval_accuracy')}")
    print(
        "per message, a fresh flwr-clientapp process pays (each line alone in a fresh interpreter; they overlap):"
    )
    for name, code in PER_MESSAGE.items():
        print(f"  {name:<48}{fresh_process_seconds(code):6.2f} s")
    print("plus Flower's polling: send_and_receive and idle SuperNodes poll every 3 s (Flower 1.42).")


if __name__ == "__main__":
    main()

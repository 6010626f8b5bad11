"""The size and write time of ``checkpoint.pt`` against the length of the run.

The default experiment's model, strategy and config; ``N`` records like a real round's are logged to a
``Recorder`` (metrics.jsonl), then the checkpoint writer is called directly, as ``Run.save_checkpoint`` calls
it after round ``N`` (no training: 10,000 rounds of it would take hours on 2 cores). Each write is timed
``--repeat`` times (the median and the minimum are printed).

    python bench/checkpoint_size.py                       # 30, 300, 3,000 and 10,000 rounds
    python bench/checkpoint_size.py --rounds 30,10000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _record(rnd: int) -> dict:
    """A record with the fields and magnitudes of a default round's (fedsim.schema)."""
    return {
        "round": rnd,
        "num_clients": 10,
        "failures": 0,
        "bytes_down": 183_210,
        "bytes_up": 181_960,
        "train_loss": 0.123456789 + rnd * 1e-7,
        "sim_time": 12.345678 * rnd,
        "eval_loss": 0.23456789 + rnd * 1e-7,
        "eval_accuracy": 0.87654321,
        "round_time": 0.00512345,
    }


def measure(rounds: int, repeat: int) -> tuple[int, float, float]:
    """``(bytes, median s, min s)`` of checkpoint.pt after ``rounds`` recorded rounds."""
    from flwr.app import ArrayRecord

    from fedsim import checkpoint
    from fedsim.config import compose, quiet_loggers
    from fedsim.experiment import build_experiment
    from fedsim.recorder import Recorder
    from fedsim.state import RunState

    quiet_loggers()
    exp = build_experiment(compose("quiet=true"))
    state = RunState(arrays=ArrayRecord(exp.initial_model.state_dict()), round=rounds, initial_recorded=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rec = Recorder(out, rounds, quiet=True)
        for r in range(rounds + 1):
            rec.log(_record(r))
        history = rec.history(rounds) if hasattr(rec, "history") else rec.records  # before: every record
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            checkpoint.save(out / "checkpoint.pt", state, exp.strategy, history, exp.resolved, None)
            times.append(time.perf_counter() - t0)
        size = (out / "checkpoint.pt").stat().st_size
        rec.close()
    return size, statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", default="30,300,3000,10000", help="comma-separated run lengths")
    ap.add_argument("--repeat", type=int, default=7, help="timed writes per length")
    args = ap.parse_args()
    print(f"{'rounds':>7} {'checkpoint.pt bytes':>20} {'write median ms':>16} {'write min ms':>13}")
    for n in (int(x) for x in args.rounds.split(",")):
        size, med, best = measure(n, args.repeat)
        print(f"{n:>7} {size:>20,} {med * 1e3:>16.2f} {best * 1e3:>13.2f}", flush=True)


if __name__ == "__main__":
    main()

"""What a busy neighbour costs each engine: the default experiment's round, quiet and beside a process spinning
on every core (``bench.BusyNeighbour``), per engine setting.

Each run is the ``fedsim`` command as a user runs it (``bench.fedsim_child(as_user=True)``: recording and
checkpoints on), in a fresh process; quiet and busy runs of every setting are interleaved, and each pair gives the
ratio busy / quiet of the median round (rounds 2..R), in wall seconds and in CPU seconds of the round's thread
(the CPU clock leaves out worker processes: for ``inprocess-w2`` only the wall clock counts). The table gives the
min / median of the pairs' ratios; the goal is a busy neighbour costing at most 2x per round in wall time.

    python bench/busy.py                                  # every setting, 60 rounds, 3 pairs
    python bench/busy.py --settings auto,vectorized-null --rounds 30 --repeat 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

SETTINGS = {  # name -> fedsim overrides
    "auto": ["engine=auto"],  # the default: one thread
    "vectorized": ["engine=vectorized"],
    "vectorized-null": [
        "engine=vectorized",
        "engine.threads=null",
    ],  # the free cores (fedsim.groups.free_cores)
    "vectorized-2threads": ["engine=vectorized", "engine.threads=2"],  # what null meant before, on 2 cores
    "inprocess": ["engine=inprocess"],
    "inprocess-w2": ["engine=inprocess", "engine.workers=2"],
    "ray": ["engine=ray"],  # not in the default list: Ray's start-up takes minutes on a shared 2-core machine
}
GOAL = 2.0  # the most a busy neighbour may cost a round (wall clock)


def child(setting: str, rounds: int) -> dict:
    """One run of ``setting`` in this process: its per-round times in both clocks."""
    res = bench.fedsim_child([*SETTINGS[setting], f"num_rounds={rounds}"], as_user=True)
    return {"rounds_wall": res["rounds_wall"], "rounds_cpu": res["rounds_cpu"], "accuracy": res["accuracy"]}


def _median_round(rounds: list[float]) -> float:
    return statistics.median(rounds[1:] if len(rounds) > 1 else rounds)


def lines(runs: dict, settings: list[str]) -> list[str]:
    """The table: per setting the quiet and busy median round, and the busy / quiet ratios of the pairs."""
    out = [
        f"{'setting':<22}{'quiet ms':>10}{'busy ms':>10}{'busy/quiet':>16}{'quiet ms':>10}{'busy ms':>10}"
        f"{'busy/quiet':>16}",
        f"{'':<22}{'wall clock':>36}{'round thread CPU clock':>36}   ratio: min / median of the pairs",
    ]
    verdicts = []
    for s in settings:
        pairs = [
            (q, b) for q, b in zip(runs[s, "quiet"], runs[s, "busy"]) if "error" not in q and "error" not in b
        ]
        if not pairs:
            errs = [r["error"] for r in runs[s, "quiet"] + runs[s, "busy"] if "error" in r]
            out.append(f"{s:<22}failed: {errs[-1] if errs else 'no run'}")
            continue
        row, judged = f"{s:<22}", {}
        for clk in ("wall", "cpu"):
            quiet = [_median_round(q[f"rounds_{clk}"]) for q, _ in pairs]
            busy = [_median_round(b[f"rounds_{clk}"]) for _, b in pairs]
            ratios = [b / q for q, b in zip(quiet, busy)]
            row += f"{1e3 * statistics.median(quiet):10.2f}{1e3 * statistics.median(busy):10.2f}"
            row += f"{min(ratios):8.2f} /{statistics.median(ratios):5.2f}"
            judged[clk] = statistics.median(ratios)
        out.append(row)
        verdicts.append(
            f"({s}) busy / quiet, wall clock, median of the pairs: {judged['wall']:.2f} "
            f"(goal <= {GOAL}: {'met' if judged['wall'] <= GOAL else 'NOT met'})"
        )
    return out + verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--settings", default="auto,vectorized,vectorized-null,vectorized-2threads,inprocess,inprocess-w2"
    )
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3, help="pairs of quiet and busy runs per setting")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        sys.exit(f"--settings {unknown[0]!r}: expected a comma list of {', '.join(SETTINGS)}")
    before = bench.machine_line()
    runs: dict[tuple[str, str], list[dict]] = {(s, ld): [] for s in settings for ld in ("quiet", "busy")}
    for r in range(args.repeat):  # interleaved: a change in the machine's load hits every setting
        for s in settings:
            for ld in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
                argv = [__file__, "--child", s, "--rounds", str(args.rounds)]
                with bench.BusyNeighbour() if ld == "busy" else contextlib.nullcontext():
                    runs[s, ld].append(bench.run_child(argv, timeout=900))
    print(
        f"\nthe default experiment ({args.rounds} rounds, as a user runs it), quiet and beside a process spinning on "
        f"every core; {args.repeat} interleaved pairs of fresh processes; before: {before}; after: "
        f"{bench.machine_line()}"
    )
    print("\n".join(lines(runs, settings)))


if __name__ == "__main__":
    main()

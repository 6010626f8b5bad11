"""FedAvg vs FedAsync vs FedBuff in simulated time on one heterogeneous population (experiment=async_vs_sync).

Runs the sweep (or reads one already run), prints the simulated time each strategy needs to reach the
experiment's target accuracy per seed, the mean, and the speed-up over synchronous FedAvg, and writes a plot
of accuracy against simulated time with one colour per strategy.

    python bench/async_vs_sync.py                       # runs the sweep (about 1-2 min on 2 CPU cores)
    python bench/async_vs_sync.py --sweep-dir DIR --no-run   # summarise a finished sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fedsim.config import FLOWER_ENV

STRATEGIES = ("fedavg", "fedasync", "fedbuff")


def run_sweep(sweep_dir: Path, seeds: str, extra: list[str]) -> None:
    env = {**os.environ, **FLOWER_ENV}
    cmd = [
        sys.executable,
        "-m",
        "fedsim",
        "-m",
        "experiment=async_vs_sync",
        f"strategy={','.join(STRATEGIES)}",
        f"seed={seeds}",
        "quiet=true",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def load(sweep_dir: Path) -> dict[str, list[tuple[dict, list[dict]]]]:
    """``{strategy: [(summary, metrics records), ...]}`` over the sweep's job folders."""
    runs: dict[str, list] = {}
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        summary = json.loads((job / "summary.json").read_text())
        recs = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
        runs.setdefault(
            summary["choices"].get("strategy") or summary["config"]["strategy"]["_target_"], []
        ).append((summary, recs))
    return runs


def report(runs: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = {}
    print(f"{'strategy':10s} {'seed':>4s} {'time to target (sim s)':>23s} {'versions':>9s}")
    for name, items in runs.items():
        times = []
        for summary, _ in items:
            t = summary.get("target_sim_time")
            times.append(t if t is not None else float("inf"))
            print(
                f"{name:10s} {summary['config']['seed']:>4d} {t if t is None else round(t, 2)!s:>23s} "
                f"{summary['rounds_done']:>9d}"
            )
        mean[name] = statistics.mean(times)
    base = mean.get("fedavg")
    print()
    for name, m in mean.items():
        finite = math.isfinite(base or math.nan) and math.isfinite(m)
        ratio = f"  ({base / m:.2f}x sooner than fedavg)" if finite and name != "fedavg" else ""
        if not math.isfinite(m):
            ratio = "  (some seeds never reached the target)"
        print(f"mean {name:10s} {m:6.2f} s{ratio}")
    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    target = None
    for (name, items), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for i, (_, recs) in enumerate(items):
            ev = [r for r in recs if r.get("eval_accuracy") is not None]
            ax.plot(
                [r["sim_time"] for r in ev],
                [r["eval_accuracy"] for r in ev],
                color=color,
                alpha=0.75,
                lw=1,
                label=name if i == 0 else None,
            )
        target = items[0][0].get("target_accuracy")
    if target:
        ax.axhline(target, color="gray", ls=":", lw=1)
    ax.set(
        xlabel="simulated time (s)",
        ylabel="test accuracy",
        title="50 clients, lognormal speeds (σ=1), Dirichlet(0.3) digits",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out_png, dpi=80)
    print(f"\nplot: {out_png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep-dir", type=Path, help="a finished sweep to summarise, or where to run it")
    ap.add_argument("--no-run", action="store_true", help="only summarise --sweep-dir")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("async_vs_sync.png"))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. num_rounds=3)")
    args = ap.parse_args()
    sweep_dir = args.sweep_dir or Path("multirun") / "async_vs_sync"
    if not args.no_run:
        run_sweep(sweep_dir.resolve(), args.seeds, args.overrides)
    report(load(sweep_dir), args.out)


if __name__ == "__main__":
    main()

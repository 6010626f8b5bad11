"""Run the paper reproductions of docs/reproductions.md and print their tables (and draw their figures).

    python bench/reproduce.py --out repro_runs                 # run every sweep, then print the tables
    python bench/reproduce.py --out repro_runs --only fedprox  # one reproduction
    python bench/reproduce.py --out repro_runs --no-run        # tables from sweeps already in --out
    python bench/reproduce.py --out repro_runs --no-run --figures docs/figures

Each sweep is one ``fedsim -m ...`` command (listed in SWEEPS and in each experiment's YAML header) whose
runs land in ``OUT/<sweep>/<job>/``; the tables are read back from each run's summary.json and metrics.jsonl.
Rounds to a target are read from the accuracy curve, so a target below the one a run stopped at can be
reported too (the rounds before a stop are identical to those of a run that did not stop).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from fedsim.config import FLOWER_ENV

ENV = dict(FLOWER_ENV)

# reproduction -> [(sweep name, fedsim -m arguments)]
SWEEPS = {
    "fedavg_digits": [
        ("digits_fedsgd", "experiment=fedavg_digits partitioner=iid,shards client=fedsgd"),
        (
            "digits_fedavg",
            "experiment=fedavg_digits partitioner=iid,shards client.local_epochs=1,5,20 "
            "client.batch_size=0,10",
        ),
    ],
    "fedavg_mnist": [
        ("fmnist_fedsgd", "experiment=fedavg_mnist partitioner=iid,shards client=fedsgd"),
        (
            "fmnist_fedavg",
            "experiment=fedavg_mnist partitioner=iid,shards client.local_epochs=1,5 "
            "client.batch_size=50,10 num_rounds=60",
        ),
    ],
    "fedprox": [
        ("fedprox_fedavg", "experiment=fedprox_synthetic strategy=fedavg heterogeneity.straggler_prob=0,0.9"),
        (
            "fedprox_prox",
            "experiment=fedprox_synthetic strategy=fedprox strategy.proximal_mu=0,1 "
            "heterogeneity.straggler_prob=0,0.9 heterogeneity.partial_work=true",
        ),
        # a second data draw: seed 1 (FedProx mu=0 without stragglers is FedAvg, so it is left out)
        (
            "fedprox_fedavg_seed1",
            "experiment=fedprox_synthetic strategy=fedavg heterogeneity.straggler_prob=0,0.9 seed=1",
        ),
        (
            "fedprox_prox_seed1_mu1",
            "experiment=fedprox_synthetic strategy=fedprox strategy.proximal_mu=1 "
            "heterogeneity.straggler_prob=0,0.9 heterogeneity.partial_work=true "
            "seed=1",
        ),
        (
            "fedprox_prox_seed1_mu0",
            "experiment=fedprox_synthetic strategy=fedprox strategy.proximal_mu=0 "
            "heterogeneity.straggler_prob=0.9 heterogeneity.partial_work=true seed=1",
        ),
    ],
    # DP: Poisson sampling (the default) and, for comparison, fixed-size cohorts (replace-one accounting).
    # noise_seed is published (and so is not secret: debug_noise_seed accepts it) so that the tables can be
    # reproduced; these runs demonstrate accuracy against epsilon, they protect no one.
    "dp": [
        (
            "dp_fixed",
            "experiment=dp_fedavg clipping.noise_multiplier=0,0.5,1,2,4,8 clipping.noise_seed=1 clipping.debug_noise_seed=true",
        ),
        (
            "dp_adaptive",
            "experiment=dp_fedavg clipping=adaptive ~clipping.clip_norm clipping.noise_multiplier=0,1,4 "
            "clipping.noise_seed=1 clipping.debug_noise_seed=true",
        ),
        (
            "dp_fixed_size",
            "experiment=dp_fedavg clipping.sampling=fixed clipping.noise_multiplier=1,4 clipping.noise_seed=1 clipping.debug_noise_seed=true",
        ),
    ],
    "client_drift": [
        (
            "drift_digits",
            "experiment=client_drift strategy=fedavg,fedprox,scaffold,fednova,feddyn,ditto,fedper",
        ),
        (
            "drift_fmnist",
            "experiment=client_drift dataset=fashion_mnist dataset.max_train=12000 dataset.max_test=2000 "
            "partitioner=shards ~partitioner.alpha num_clients=50 model.hidden=[128] target_accuracy=0.70 num_rounds=60 "
            "strategy=fedavg,fedprox,scaffold,fednova,feddyn,ditto,fedper",
        ),
    ],
}
TARGETS = {"fedavg_digits": (0.90, 0.90), "fedavg_mnist": (0.80, 0.70)}  # (IID, shards)


def run_sweep(out: Path, name: str, args: str) -> float:
    """Run one sweep into OUT/name; return its wall-clock seconds."""
    cmd = [sys.executable, "-m", "fedsim", "-m", *args.split(), "quiet=true", f"hydra.sweep.dir={out / name}"]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=False, env={**os.environ, **ENV})
    return time.perf_counter() - t0


def runs(out: Path, name: str) -> list[dict]:
    """summary.json (plus 'records' from metrics.jsonl) of every run of a sweep, in job order."""
    found = []
    for job in sorted((out / name).glob("[0-9]*"), key=lambda p: int(p.name)):
        if not (job / "summary.json").exists():
            continue
        s = json.loads((job / "summary.json").read_text())
        s["records"] = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines() if x]
        found.append(s)
    return found


def rounds_to(records: list[dict], target: float) -> int | None:
    return next((r["round"] for r in records if (r.get("eval_accuracy") or 0.0) >= target), None)


def _label_eb(s: dict) -> tuple[str, int, str]:
    c = s["config"]["client"]
    if s["choices"]["client"] == "fedsgd":
        return "FedSGD", 1, "inf"
    return "FedAvg", int(c["local_epochs"]), "inf" if int(c["batch_size"]) == 0 else str(c["batch_size"])


def fedavg_table(out: Path, prefix: str, targets: tuple[float, float]) -> str:
    rows: dict[tuple, dict] = {}
    for sweep in (f"{prefix}_fedsgd", f"{prefix}_fedavg"):
        for s in runs(out, sweep):
            key = _label_eb(s)
            part = s["choices"]["partitioner"]
            tgt = targets[0] if part == "iid" else targets[1]
            rows.setdefault(key, {})[part] = (rounds_to(s["records"], tgt), s["rounds_done"], s["wall_time"])
    base = rows.get(("FedSGD", 1, "inf"), {})
    lines = [
        f"| method | E | B | IID: rounds to {targets[0]:.2f} | shards: rounds to {targets[1]:.2f} "
        "| wall s (both runs) |",
        "|---|---|---|---|---|---|",
    ]

    def order(k):
        return k[0] != "FedSGD", k[1], k[2] != "inf", -int(k[2]) if k[2] != "inf" else 0

    for key in sorted(rows, key=order):
        cells, wall = [], 0.0
        for part in ("iid", "shards"):
            if part not in rows[key]:
                cells.append("–")
                continue
            r, done, w = rows[key][part]
            wall += w
            b = base.get(part, (None, 0, 0))
            if r is None:
                cells.append(f"> {done}")
            elif key[0] == "FedSGD" or b[0] is None:
                cells.append(f"{r}" + (f" (≥ {b[1] / r:.1f}×)" if key[0] != "FedSGD" and b[1] else ""))
            else:
                cells.append(f"{r} ({b[0] / r:.1f}×)")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cells[0]} | {cells[1]} | {wall:.0f} |")
    return "\n".join(lines)


def _mean_last(records: list[dict], key: str, n: int = 10) -> float:
    vals = [r[key] for r in records if r.get(key) is not None][-n:]
    return sum(vals) / max(len(vals), 1)


def fedprox_rows(out: Path, suffix: str = "") -> list[tuple[str, float, dict]]:
    rows = []
    more = sorted(p.name for p in out.glob(f"fedprox_prox{suffix}_*")) if suffix else []
    sweeps = [f"fedprox_fedavg{suffix}", f"fedprox_prox{suffix}", *more]
    for sweep in sweeps:
        for s in runs(out, sweep):
            c = s["config"]
            strag = c["heterogeneity"]["straggler_prob"]
            if s["choices"]["strategy"] == "fedavg":
                name = "FedAvg (drops stragglers)"
            else:
                mu = c["strategy"]["proximal_mu"]
                if strag == 0 and mu == 0:
                    continue  # identical to FedAvg without stragglers
                name = f"FedProx μ={mu:g}"
            rows.append((name, strag, s))
    return rows


def fedprox_table(out: Path, suffix: str = "") -> str:
    lines = [
        "| stragglers | method | final acc | mean acc, last 10 rounds | min acc after round 10 | "
        "final test loss | rounds skipped | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, strag, s in sorted(fedprox_rows(out, suffix), key=lambda t: (t[1], t[0])):
        rec = s["records"]
        skipped = sum(1 for r in rec if r.get("skipped"))
        later = [r["eval_accuracy"] for r in rec if r["round"] > 10 and r.get("eval_accuracy") is not None]
        lines.append(
            f"| {strag:.0%} | {name} | {s['final_eval_accuracy']:.3f} "
            f"| {_mean_last(rec, 'eval_accuracy'):.3f}"
            f" | {min(later, default=float('nan')):.3f} | {s['final_eval_loss']:.3f} | {skipped} |"
            f" {s['wall_time']:.0f} |"
        )
    return "\n".join(lines)


def independent_epsilon(s: dict, accountant: str = "rdp") -> float | None:
    """epsilon of a DP run straight from dp-accounting (not through fedsim's accountant), or None without noise.

    The DpEvent is rebuilt here from the run's config: Poisson sampling at q = m/N with add/remove-one
    adjacency, or m of N without replacement with replace-one adjacency (sensitivity 2C, so the Gaussian's
    multiplier is z/2; dp-accounting has no PLD for it). Every round drawn is charged, so T = rounds done.
    """
    import dp_accounting
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    c = s["config"]
    z, delta, sampling = c["clipping"]["noise_multiplier"], c["clipping"]["delta"], c["clipping"]["sampling"]
    n, m = int(c["num_clients"]), int(c["clients_per_round"])
    if not z:
        return None
    if sampling == "poisson":
        event = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
        relation = NeighboringRelation.ADD_OR_REMOVE_ONE
    elif accountant == "pld":
        return None
    else:
        event = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z / 2))
        relation = NeighboringRelation.REPLACE_ONE
    acc = RdpAccountant(neighboring_relation=relation) if accountant == "rdp" else PLDAccountant(relation)
    logging.getLogger("absl").setLevel(logging.ERROR)  # a warning per RDP order it skips
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, int(s["rounds_done"]))).get_epsilon(delta)


def _eps(e: float | None, none: str = "∞ (no noise)") -> str:
    return none if e is None else f"{e:.3f}"


def dp_table(out: Path, sweep: str = "dp_fixed") -> str:
    adaptive = sweep == "dp_adaptive"
    lines = [
        "| sampling | z | final acc | best acc | ε fedsim (RDP) | ε dp-accounting direct: RDP | PLD | "
        "cohort size: mean (min–max) | rounds skipped | noise std (last) | "
        + ("C (last) | noisy unclipped fraction (last) | " if adaptive else "")
        + "wall s |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if adaptive else "") + "---|",
    ]
    for s in runs(out, sweep):
        z = s["config"]["clipping"]["noise_multiplier"]
        recs = [r for r in s["records"] if r["round"] > 0]
        done = [r for r in recs if not r.get("skipped")]
        last = done[-1] if done else {}
        sizes = [r["num_clients"] for r in recs]
        direct = independent_epsilon(s)
        pld = independent_epsilon(s, "pld")
        sampling = s["config"]["clipping"]["sampling"] if z else "fixed (no DP)"
        row = (
            f"| {sampling} | {z:g} | {s['final_eval_accuracy']:.3f} | {s['best_eval_accuracy']:.3f} | "
            f"{_eps(s.get('final_epsilon'))} | {_eps(direct)} | {_eps(pld, '–') if z else '∞'} | "
            f"{sum(sizes) / len(sizes):.1f} ({min(sizes)}–{max(sizes)}) | "
            f"{sum(1 for r in recs if r.get('skipped'))} | {last.get('noise_std', 0.0):.4f} | "
        )
        if adaptive:
            frac = last.get("noisy_unclipped_fraction")
            row += f"{last.get('clip_norm', float('nan')):.3f} | {'–' if frac is None else f'{frac:.2f}'} | "
        lines.append(row + f"{s['wall_time']:.0f} |")
    return "\n".join(lines)


def drift_table(out: Path, sweep: str) -> str:
    """Client drift: rounds to target and final accuracy per strategy; personal accuracy (mean, p10)."""
    lines = [
        "| strategy | rounds to target | final global acc. | personal acc. (mean, last 10 rounds) | personal p10 |",
        "|---|---|---|---|---|",
    ]
    for s in runs(out, sweep):
        target = s.get("target_accuracy")
        reached = rounds_to(s["records"], target) if target else None
        shown = str(reached) if reached is not None else f"> {s['rounds_done']}"
        lines.append(
            f"| {s['choices']['strategy']} | {shown} "
            f"| {s['final_eval_accuracy']:.3f} | {_mean_last(s['records'], 'personal_eval_accuracy'):.3f} "
            f"| {_mean_last(s['records'], 'personal_eval_accuracy_p10'):.3f} |"
        )
    return "\n".join(lines)


def figures(out: Path, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dest.mkdir(parents=True, exist_ok=True)

    def acc(s):
        return [r["round"] for r in s["records"]], [r["eval_accuracy"] for r in s["records"]]

    for prefix, targets in (("fmnist", TARGETS["fedavg_mnist"]), ("digits", TARGETS["fedavg_digits"])):
        found = [s for sw in (f"{prefix}_fedsgd", f"{prefix}_fedavg") for s in runs(out, sw)]
        if not found:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
        for ax, part, tgt in zip(axes, ("iid", "shards"), targets):
            for s in (s for s in found if s["choices"]["partitioner"] == part):
                m, e, b = _label_eb(s)
                ax.plot(*acc(s), lw=1.2, label="FedSGD" if m == "FedSGD" else f"E={e} B={b}")
            ax.axhline(tgt, color="grey", ls=":", lw=1)
            ax.set_title(f"{part} (target {tgt:.2f})")
            ax.set_xlabel("round")
            ax.set_xscale("log")
        axes[0].set_ylabel("test accuracy")
        axes[0].set_ylim(0.3, None)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(dest / f"fedavg_{prefix}.png", dpi=80)
        plt.close(fig)

    rows = fedprox_rows(out)
    if rows:
        colors = {
            "FedAvg (drops stragglers)": "tab:blue",
            "FedProx μ=0": "tab:orange",
            "FedProx μ=1": "tab:green",
        }
        fig, axes = plt.subplots(2, 2, figsize=(9, 5.6), sharex=True, sharey="row")
        for col, strag in enumerate((0.0, 0.9)):
            for name, st, s in rows:
                if st == strag:
                    rnd = [r["round"] for r in s["records"]]
                    axes[0, col].plot(
                        rnd,
                        [r["eval_accuracy"] for r in s["records"]],
                        lw=1.2,
                        label=name,
                        color=colors.get(name),
                    )
                    axes[1, col].plot(
                        rnd,
                        [r["eval_loss"] for r in s["records"]],
                        lw=1.2,
                        label=name,
                        color=colors.get(name),
                    )
            axes[0, col].set_title(f"Synthetic(1,1), {strag:.0%} stragglers")
            axes[1, col].set_xlabel("round")
            axes[0, col].legend(fontsize=7)
        axes[0, 0].set_ylabel("test accuracy")
        axes[1, 0].set_ylabel("test loss")
        fig.tight_layout()
        fig.savefig(dest / "fedprox_synthetic.png", dpi=80)
        plt.close(fig)

    dp = runs(out, "dp_fixed")
    if dp:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for i, s in enumerate(dp):
            z = s["config"]["clipping"]["noise_multiplier"]
            axes[0].plot(*acc(s), lw=1.2, label=f"z={z:g}", color=f"C{i}")
            pts = [(r["epsilon"], r["eval_accuracy"]) for r in s["records"] if r.get("epsilon")]
            if pts:
                axes[1].plot(*zip(*pts), lw=1.2, label=f"z={z:g}", color=f"C{i}")
        zs = [s["config"]["clipping"]["noise_multiplier"] for s in dp]
        for s in runs(out, "dp_fixed_size"):  # fixed-size cohorts, replace-one: dashed, same colour per z
            z = s["config"]["clipping"]["noise_multiplier"]
            pts = [(r["epsilon"], r["eval_accuracy"]) for r in s["records"] if r.get("epsilon")]
            color = f"C{zs.index(z)}" if z in zs else "grey"
            axes[1].plot(*zip(*pts), lw=1.2, ls="--", label=f"z={z:g}, fixed size", color=color)
        axes[0].set_xlabel("round")
        axes[0].set_ylabel("test accuracy")
        axes[0].legend(fontsize=7)
        axes[1].set_xlabel("ε (δ = 1e-5, RDP), accumulated")
        axes[1].set_xscale("log")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(dest / "dp_fedavg.png", dpi=80)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the sweeps (outside the repository)")
    ap.add_argument("--only", choices=sorted(SWEEPS), action="append", help="run only these reproductions")
    ap.add_argument("--no-run", action="store_true", help="only read sweeps already in --out")
    ap.add_argument("--figures", type=Path, help="also draw the figures into this folder")
    a = ap.parse_args()
    chosen = a.only or list(SWEEPS)
    if not a.no_run:
        for rep in chosen:
            for name, args in SWEEPS[rep]:
                print(f"{name}: {run_sweep(a.out, name, args):.0f} s wall", flush=True)
    for rep in chosen:
        print(f"\n## {rep}\n")
        if rep in TARGETS:
            print(fedavg_table(a.out, "fmnist" if rep == "fedavg_mnist" else "digits", TARGETS[rep]))
        elif rep == "fedprox":
            print(fedprox_table(a.out))
            if (a.out / "fedprox_fedavg_seed1").exists():
                print("\nseed 1 (another Synthetic(1,1) draw):\n")
                print(fedprox_table(a.out, "_seed1"))
        elif rep == "client_drift":
            for sweep, title in (
                ("drift_digits", "digits, Dirichlet(0.1), 20 clients"),
                ("drift_fmnist", "Fashion-MNIST (12k), 2 shards per client, 50 clients"),
            ):
                if (a.out / sweep).exists():
                    print(f"\n{title}:\n")
                    print(drift_table(a.out, sweep))
        else:
            print(dp_table(a.out))
            print("\nadaptive clipping (Andrew et al. 2021):\n")
            print(dp_table(a.out, "dp_adaptive"))
            if (a.out / "dp_fixed_size").exists():
                print("\nfixed-size cohorts (clipping.sampling=fixed, replace-one accounting):\n")
                print(dp_table(a.out, "dp_fixed_size"))
    if a.figures:
        figures(a.out, a.figures)


if __name__ == "__main__":
    main()

"""Writes the tutorial notebooks (outputs stripped). Run: python notebooks/make_notebooks.py

The notebooks read FEDSIM_NB_SMALL=1 (set by the test suite) to run on tiny settings.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''import json, os
from pathlib import Path

import matplotlib.pyplot as plt
from fedsim.cli import quiet_loggers
from fedsim.config import compose, flower_env
from fedsim.run import run_experiment

flower_env()
quiet_loggers()
SMALL = os.environ.get("FEDSIM_NB_SMALL") == "1"   # tiny settings for CI
OUT = Path("nb_outputs")


def config(*overrides):
    """fedsim's config with these overrides, as on the command line."""
    return compose("quiet=true", *overrides)


def metrics(run_dir):
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def run(name, *overrides):
    """Run one experiment into OUT/name and return (summary, metrics)."""
    summary = run_experiment(config(*overrides), OUT / name)
    return summary, metrics(OUT / name)'''

NOTEBOOKS = {
    "01_quickstart": [
        new_markdown_cell(
            "# fedsim quick start\n\nCompose a config with Hydra's compose API, run a federated "
            "simulation, plot its curves and load the saved model. The same run from a shell is "
            "`fedsim num_rounds=30`."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            "rounds = 5 if SMALL else 30\n"
            'cfg = config(f"num_rounds={rounds}")\n'
            'print(cfg.dataset, cfg.partitioner, cfg.strategy, sep="\\n")'
        ),
        new_code_cell(
            'summary = run_experiment(cfg, OUT / "quickstart")\n'
            'print({k: summary[k] for k in ("final_eval_accuracy", "best_eval_accuracy", "rounds_done", '
            '"wall_time")})'
        ),
        new_markdown_cell("Every round is one line of `metrics.jsonl`:"),
        new_code_cell(
            'recs = metrics(OUT / "quickstart")\n'
            "fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))\n"
            'ax[0].plot([r["round"] for r in recs], [r["eval_accuracy"] for r in recs], marker=".")\n'
            'ax[0].set(xlabel="round", ylabel="test accuracy")\n'
            'ax[1].plot([r["round"] for r in recs[1:]], [r["train_loss"] for r in recs[1:]], marker=".")\n'
            'ax[1].set(xlabel="round", ylabel="train loss")\n'
            "plt.show()"
        ),
        new_markdown_cell("`model.pt` is the final global `state_dict`; load it into the configured model:"),
        new_code_cell(
            "import torch\n"
            "from fedsim import build\n"
            "from fedsim.training import evaluate\n\n"
            'spec = json.loads(build.client_spec(cfg, "cpu"))\n'
            "model = build.build_initial_model(spec)\n"
            'model.load_state_dict(torch.load(OUT / "quickstart" / "model.pt"))\n'
            "ds = build.build_dataset(spec)\n"
            "loss, acc = evaluate(model, torch.as_tensor(ds.x_test), torch.as_tensor(ds.y_test))\n"
            'print(f"reloaded model: accuracy {acc:.4f}")\n'
            'assert abs(acc - summary["final_eval_accuracy"]) < 1e-9'
        ),
    ],
    "02_partitions": [
        new_markdown_cell(
            "# Partitions: IID, Dirichlet(α), shards, quantity skew\n\nEach partitioner is a pure "
            "function `(labels, num_clients, rng) -> list of index arrays`. Below: each client's label "
            "histogram, then how accuracy changes with the Dirichlet α."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            "import numpy as np\n"
            "from fedsim.data import partition\n"
            "from fedsim.data.digits import load_digits\n\n"
            "ds = load_digits(seed=0)\n"
            "schemes = {\n"
            '    "iid": lambda r: partition.iid(ds.y_train, 20, r),\n'
            '    "dirichlet α=0.1": lambda r: partition.dirichlet(ds.y_train, 20, r, alpha=0.1),\n'
            '    "dirichlet α=1": lambda r: partition.dirichlet(ds.y_train, 20, r, alpha=1.0),\n'
            '    "shards (2/client)": lambda r: partition.shards(ds.y_train, 20, r, shards_per_client=2),\n'
            '    "quantity skew": lambda r: partition.quantity(ds.y_train, 20, r),\n'
            "}\n"
            "fig, axes = plt.subplots(1, len(schemes), figsize=(18, 4), sharey=True)\n"
            "for ax, (name, fn) in zip(axes, schemes.items()):\n"
            "    parts = fn(np.random.default_rng(0))\n"
            "    counts = np.stack([np.bincount(ds.y_train[p], minlength=10) for p in parts])  # (clients, classes)\n"
            "    left = np.zeros(len(parts))\n"
            "    for c in range(10):\n"
            "        ax.barh(range(len(parts)), counts[:, c], left=left, color=plt.cm.tab10(c))\n"
            "        left += counts[:, c]\n"
            '    ax.set(title=name, xlabel="examples")\n'
            'axes[0].set_ylabel("client")\n'
            "plt.show()"
        ),
        new_markdown_cell(
            "Accuracy after a fixed number of FedAvg rounds for several α (smaller α = more skew):"
        ),
        new_code_cell(
            "alphas = [0.1, 1.0] if SMALL else [0.05, 0.1, 0.3, 1.0, 10.0]\n"
            "rounds = 3 if SMALL else 30\n"
            "acc = {}\n"
            "for a in alphas:\n"
            '    s, _ = run(f"alpha{a}", f"partitioner.alpha={a}", f"num_rounds={rounds}")\n'
            '    acc[a] = s["final_eval_accuracy"]\n'
            'plt.semilogx(list(acc), list(acc.values()), marker="o")\n'
            'plt.xlabel("Dirichlet α"); plt.ylabel(f"accuracy after {rounds} rounds"); plt.show()\n'
            "acc"
        ),
    ],
    "03_strategies_and_privacy": [
        new_markdown_cell(
            "# Strategies and privacy\n\nFedAvg vs FedProx vs FedAdam vs robust aggregation on "
            "non-IID data; fixed vs adaptive clipping; accuracy against ε under DP noise."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            "rounds = 3 if SMALL else 40\n"
            'common = [f"num_rounds={rounds}", "partitioner.alpha=0.1"]\n'
            "curves = {}\n"
            'for strat in ["fedavg", "fedprox", "fedadam", "fedmedian"]:\n'
            '    _, recs = run(strat, f"strategy={strat}", *common)\n'
            "    curves[strat] = recs\n"
            '    plt.plot([r["round"] for r in recs], [r["eval_accuracy"] for r in recs], label=strat)\n'
            'plt.xlabel("round"); plt.ylabel("test accuracy"); plt.legend(); plt.show()'
        ),
        new_markdown_cell(
            "Clipping of the client updates: a fixed norm vs the adaptive norm that tracks the "
            "median update norm (Andrew et al. 2021)."
        ),
        new_code_cell(
            'for name, over in {"fixed C=0.5": ["clipping=fixed", "clipping.clip_norm=0.5"],\n'
            '                   "adaptive": ["clipping=adaptive"]}.items():\n'
            "    _, recs = run(name.split()[0], *over, *common)\n"
            '    plt.plot([r["round"] for r in recs[1:]], [r["clip_norm"] for r in recs[1:]], label=name)\n'
            'plt.xlabel("round"); plt.ylabel("clip norm"); plt.legend(); plt.show()'
        ),
        new_markdown_cell(
            "Differential privacy: Gaussian noise z·C/m on the average of m clipped updates, ε from "
            "an RDP accountant at δ=1e-5."
        ),
        new_code_cell(
            "points = []\n"
            "for z in ([0.5, 1.0] if SMALL else [0.3, 0.5, 1.0, 2.0]):\n"
            '    s, recs = run(f"dp{z}", "clipping=fixed", "clipping.clip_norm=1.0",\n'
            '                  f"clipping.noise_multiplier={z}", *common)\n'
            '    points.append((recs[-1]["epsilon"], s["final_eval_accuracy"], z))\n'
            "for eps, acc, z in points:\n"
            '    plt.scatter(eps, acc); plt.annotate(f"z={z}", (eps, acc))\n'
            'plt.xscale("log"); plt.xlabel("ε (δ=1e-5)"); plt.ylabel("test accuracy"); plt.show()\n'
            "points"
        ),
    ],
    "04_async": [
        new_markdown_cell(
            "# Asynchronous FL under client heterogeneity\n\nClients differ in speed (lognormal, "
            "σ=1: the slowest of 50 is about 10x below the median). Synchronous FedAvg waits for the "
            "slowest sampled client every round; FedAsync mixes each update in as it arrives; FedBuff "
            "steps after every K updates. All three run on the same virtual clock, so accuracy "
            "against *simulated* time compares them directly. The same sweep from a shell: "
            "`fedsim -m experiment=async_vs_sync strategy=fedavg,fedasync,fedbuff`."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            "cap = 30 if SMALL else 400   # server model versions at most; each run stops at the target\n"
            'common = ["experiment=async_vs_sync", f"num_rounds={cap}"]\n'
            'runs = {s: run(s, f"strategy={s}", *common) for s in ["fedavg", "fedasync", "fedbuff"]}\n'
            "for name, (summary, recs) in runs.items():\n"
            '    ev = [r for r in recs if r.get("eval_accuracy") is not None]\n'
            '    plt.plot([r["sim_time"] for r in ev], [r["eval_accuracy"] for r in ev], label=name)\n'
            'plt.axhline(runs["fedavg"][0]["target_accuracy"], color="gray", ls=":")\n'
            'plt.xlabel("simulated time (s)"); plt.ylabel("test accuracy"); plt.legend(); plt.show()'
        ),
        new_markdown_cell(
            "Simulated time to the target accuracy, and how stale the asynchronous updates were:"
        ),
        new_code_cell(
            "for name, (summary, recs) in runs.items():\n"
            '    stale = [r["staleness_mean"] for r in recs if "staleness_mean" in r]\n'
            "    mean_stale = sum(stale) / len(stale) if stale else 0.0\n"
            "    print(f\"{name:9s} target at t={summary['target_sim_time']}  versions={summary['rounds_done']}  \"\n"
            '          f"mean staleness={mean_stale:.2f}")'
        ),
        new_markdown_cell(
            "Per-client speeds drawn by the heterogeneity model (seeded; `heterogeneity.speed` picks "
            "constant, uniform, lognormal, exponential or a list):"
        ),
        new_code_cell(
            "from fedsim.clock import Heterogeneity\n"
            'h = Heterogeneity(50, seed=0, speed="lognormal", sigma=1.0)\n'
            'plt.hist(h.speeds, bins=20); plt.xlabel("speed (1 = reference device)"); plt.ylabel("clients")\n'
            "plt.show()"
        ),
    ],
}

for name, cells in NOTEBOOKS.items():
    nb = new_notebook(
        cells=cells,
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    nbformat.write(nb, HERE / f"{name}.ipynb")
    print("wrote", name)

"""Benchmark: the default experiment on fedsim's engines vs vanilla Flower vs a plain torch loop.

Each variant runs in its own fresh Python process, so start-up (imports, Ray) is counted; the table gives
end-to-end wall time, time per round after the first, peak memory (max RSS of the process tree) and the
final accuracy, with ratios against the plain torch loop and against vanilla Flower.

    python bench/bench.py                 # all variants, default experiment (digits, 20 clients, 60 rounds)
    python bench/bench.py --rounds 20 --variants inprocess,torch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
       "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "PYTHONUNBUFFERED": "1"}
VARIANTS = ("inprocess", "ray", "flower", "torch")


def child(variant: str, rounds: int) -> dict:
    """Run one variant in this process; return its figures."""
    if variant in ("inprocess", "ray"):
        from fedsim.cli import quiet_loggers
        from fedsim.run import run_experiment
        from hydra import compose, initialize_config_module

        quiet_loggers()
        with initialize_config_module(config_module="fedsim.conf", version_base=None):
            cfg = compose(config_name="config", overrides=[f"engine={variant}", f"num_rounds={rounds}", "quiet=true",
                                                            "checkpoint_every=0"])
        with tempfile.TemporaryDirectory() as out:
            s = run_experiment(cfg, out)
            recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        first = recs[1]["wall_time"]
        return {"accuracy": s["final_eval_accuracy"],
                "per_round": (recs[-1]["wall_time"] - first) / max(1, rounds - 1)}
    if variant == "flower":
        import logging

        sys.path.insert(0, str(HERE))
        import vanilla_flower_app as va
        from flwr.simulation import run_simulation

        va.ROUNDS = rounds
        logging.getLogger("flwr").setLevel(logging.ERROR)
        sink: dict = {}
        run_simulation(server_app=va.make_server_app(sink), client_app=va.client_app, num_supernodes=va.NUM_CLIENTS,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": os.cpu_count(), "include_dashboard": False}})
        return {"accuracy": sink.get("accuracy")}
    if variant == "torch":
        return plain_torch(rounds)
    raise ValueError(variant)


def plain_torch(rounds: int) -> dict:
    """The same FedAvg SGD steps in one plain torch loop (same data, cohorts, batches and init as fedsim)."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    from fedsim.data.digits import load_digits
    from fedsim.data.partition import dirichlet, split_train_val
    from fedsim.models import build_model, mlp
    from fedsim.server import sample_cohort

    torch.set_num_threads(1)
    seed, n_clients, m, epochs, bs, lr = 0, 20, 10, 2, 16, 0.1
    ds = load_digits(seed=seed)
    parts = dirichlet(ds.y_train, n_clients, np.random.default_rng([seed, 7]), alpha=0.5)
    parts = [split_train_val(p, 0.1, np.random.default_rng([seed, 8, i]))[0] for i, p in enumerate(parts)]
    data = [(torch.as_tensor(ds.x_train[p]), torch.as_tensor(ds.y_train[p])) for p in parts]
    model = build_model(mlp, ds.input_shape, 10, seed=seed)
    xt, yt = torch.as_tensor(ds.x_test), torch.as_tensor(ds.y_test)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    t_first = None
    for rnd in range(1, rounds + 1):
        acc_sum = {k: torch.zeros_like(v) for k, v in glob.items()}
        total = 0
        for pid in sample_cohort(seed, rnd, n_clients, m):
            x, y = data[pid]
            model.load_state_dict(glob)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 3, rnd, pid]).generate_state(1)[0]))
            for _ in range(epochs):
                for idx in torch.randperm(len(y), generator=gen).split(bs):
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            for k, v in model.state_dict().items():
                acc_sum[k] += v * len(y)
            total += len(y)
        glob = {k: v / total for k, v in acc_sum.items()}
        model.load_state_dict(glob)
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        if rnd == 1:
            t_first = time.perf_counter()
    per_round = (time.perf_counter() - t_first) / max(1, rounds - 1)
    return {"accuracy": acc, "per_round": per_round}


def tree_rss(root: int) -> int:
    """Resident bytes of process ``root`` and all its descendants (Ray's raylet and workers too); Linux /proc."""
    parent, rss = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    return sum(rss.get(p, 0) for p in tree)


def measure(variant: str, rounds: int) -> dict:
    """Run ``variant`` in a fresh process; wall time and peak tree RSS are measured from outside."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child_proc = subprocess.Popen([sys.executable, __file__, "--child", variant, "--rounds", str(rounds)],
                                      env=ENV, stdout=out, stderr=err, text=True)
        peak = 0
        while child_proc.poll() is None:
            peak = max(peak, tree_rss(child_proc.pid))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child_proc.returncode != 0:
        return {"variant": variant, "error": stderr.strip().splitlines()[-1] if stderr else "failed"}
    res = json.loads(stdout.strip().splitlines()[-1])
    res.update(variant=variant, wall=wall, peak_mb=peak / 2**20)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        res = child(args.child, args.rounds)
        print(json.dumps(res))
        return
    rows = [measure(v, args.rounds) for v in args.variants.split(",")]
    ok = {r["variant"]: r for r in rows if "error" not in r}
    print(f"\ndefault experiment (digits, 20 clients, 10 per round, {args.rounds} rounds), "
          f"{os.cpu_count()} CPU cores; each variant in a fresh process")
    print(f"{'variant':<12}{'wall s':>9}{'per round s':>13}{'peak RSS MB':>13}{'accuracy':>10}"
          f"{'torch/this':>12}{'flower/this':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} failed: {r['error']}")
            continue
        vs_torch = ok["torch"]["wall"] / r["wall"] if "torch" in ok else float("nan")
        vs_flower = ok["flower"]["wall"] / r["wall"] if "flower" in ok else float("nan")
        pr = r.get("per_round")
        print(f"{r['variant']:<12}{r['wall']:>9.2f}{(pr if pr is not None else float('nan')):>13.4f}"
              f"{r['peak_mb']:>13.0f}{(r['accuracy'] or 0):>10.4f}{vs_torch:>12.2f}{vs_flower:>13.2f}")
    print("torch/this: plain-torch wall time / this variant's (1.0 = no overhead); "
          "flower/this: how many times faster than vanilla Flower run_simulation.")


if __name__ == "__main__":
    main()

"""Scale benchmark: fedsim's engines vs vanilla Flower vs plain torch on three workloads, one table.

(a) 1,000 clients, 100 per round, the small CNN on Fashion-MNIST-shaped synthetic images (60k, 1x28x28),
    Dirichlet(0.5) label skew, 1 local epoch of batch-16 SGD;
(b) the default experiment (digits, MLP, 20 clients, 10 per round);
(c) a population of 10^5 clients (20 examples each, images made on demand: ``dataset.lazy=true``),
    100 per round, same CNN; ``inprocess-pop1e4`` runs 10^4 clients to show memory follows the cohort.

Every variant runs in a fresh process (start-up counted); peak memory is the RSS of the whole process tree.
The server evaluates on 2,000 test images each round in every variant. The plain-torch loop does the same
SGD steps on the same data, cohorts, batches and initial weights (so its accuracy matches inprocess); the
vanilla Flower variant is a hand-written ClientApp/ServerApp (below) run by ``run_simulation``.

    python bench/scale.py                                   # everything, 3 rounds (several minutes)
    python bench/scale.py --scenarios a --variants inprocess,torch --rounds 2 --small
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench

IMAGES = ["dataset=synthetic_images", "dataset.num_test=2000", "model=cnn", "client.local_epochs=1"]
SCENARIOS = {
    "a": {
        "title": "1,000 clients, 100/round, CNN, 1x28x28 synthetic images, 1 local epoch",
        "overrides": [*IMAGES, "num_clients=1000", "clients_per_round=100"],
        "small": ["num_clients=40", "clients_per_round=4", "dataset.num_train=2000", "dataset.num_test=200"],
    },
    "b": {"title": "default experiment: digits, MLP, 20 clients, 10/round", "overrides": [], "small": []},
    "c": {
        "title": "10^5 clients, 100/round, CNN, lazily made images (20 per client)",
        "overrides": [
            *IMAGES,
            "partitioner=iid",
            "dataset.lazy=true",
            "num_clients=100000",
            "dataset.num_train=2000000",
            "clients_per_round=100",
        ],
        "small": [
            "num_clients=2000",
            "dataset.num_train=40000",
            "clients_per_round=10",
            "dataset.num_test=200",
        ],
    },
}
FEDSIM = {
    **{k: v for k, v in bench.VARIANTS.items() if v is not None},
    "vectorized-vmap": ["engine=vectorized", "engine.vmap_conv_cpu=true"],  # grouped for Sequential CNNs
    "inprocess-pop1e4": ["engine=inprocess", "num_clients=10000", "dataset.num_train=200000"],
}
DEFAULT_VARIANTS = {
    "a": "auto,auto-2threads,inprocess,inprocess-w2,vectorized-vmap,ray,flower,torch,batched",
    "b": "auto,inprocess,inprocess-w2,ray,flower,torch,batched",
    # ray is left out of (c): fedsim's discovery sends one query per node through Ray (10^5 Ray calls)
    "c": "auto,inprocess,inprocess-pop1e4,inprocess-w2,flower,torch",
}


# ---------------------------------------------------------------- a hand-written vanilla Flower app
# Written as a Flower user would: task settings travel in the train config, each actor builds the data set
# and partitions once (lru_cache) and keeps one model; FedAvg samples the clients.
@functools.lru_cache(maxsize=2)
def _vanilla_data(task_json: str):
    import numpy as np

    from fedsim.data.partition import dirichlet, iid, split_train_val
    from fedsim.data.synthetic_images import synthetic_images
    from fedsim.models import cnn

    t = json.loads(task_json)
    ds = synthetic_images(t["seed"], **t["dataset"])
    rng = np.random.default_rng([t["seed"], 7])
    parts = (
        iid(ds.y_train, t["num_clients"], rng)
        if t["partitioner"] == "iid"
        else dirichlet(ds.y_train, t["num_clients"], rng, alpha=0.5)
    )
    train = [
        split_train_val(p, 0.1, np.random.default_rng([t["seed"], 8, i]))[0] for i, p in enumerate(parts)
    ]
    return ds, train, cnn(ds.input_shape, ds.num_classes)


@functools.lru_cache(maxsize=1)
def vanilla_client_app():
    """The vanilla ClientApp (made on first call, so that importing this module stays light)."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from torch.nn import functional as F

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        cfg = msg.content["config"]
        ds, parts, model = _vanilla_data(str(cfg["task"]))
        pid = int(context.node_config["partition-id"])
        x, y = torch.as_tensor(ds.x_train[parts[pid]]), torch.as_tensor(ds.y_train[parts[pid]])
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
        seed = int(np.random.SeedSequence([0, 3, int(cfg["server-round"]), pid]).generate_state(1)[0])
        gen, total, steps = torch.Generator().manual_seed(seed), 0.0, 0
        for _ in range(int(cfg["epochs"])):
            for idx in torch.randperm(len(y), generator=gen).split(int(cfg["batch-size"])):
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, steps = total + float(loss), steps + 1
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": len(y), "train-loss": total / steps}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def _vanilla_server(task: dict, rounds: int, per_round: int, lr: float, epochs: int, batch: int):
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fedsim.models import build_model, cnn

    task_json = json.dumps(task, sort_keys=True)

    def factory(sink):
        app = ServerApp()

        @app.main()
        def main(grid: Grid, context: Context) -> None:
            ds, _, model = _vanilla_data(task_json)
            xt, yt = torch.as_tensor(ds.x_test), torch.as_tensor(ds.y_test)

            def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
                model.load_state_dict(arrays.to_torch_state_dict())
                with torch.no_grad():
                    acc = float((model(xt).argmax(1) == yt).float().mean())
                sink["accuracy"] = acc
                return MetricRecord({"accuracy": acc})

            n = task["num_clients"]
            strategy = FedAvg(
                fraction_train=per_round / n,
                fraction_evaluate=0.0,
                min_available_nodes=n,
                min_train_nodes=per_round,
            )
            init = ArrayRecord(
                build_model(cnn, ds.input_shape, ds.num_classes, seed=task["seed"]).state_dict()
            )
            cfg = ConfigRecord({"task": task_json, "lr": lr, "epochs": epochs, "batch-size": batch})
            strategy.start(
                grid=grid, initial_arrays=init, num_rounds=rounds, train_config=cfg, evaluate_fn=evaluate_fn
            )

        return app

    return factory


# ------------------------------------------------------------------------------------------ child side
def compose(overrides: list[str]):
    from fedsim.config import compose as fedsim_compose

    return fedsim_compose(*overrides)


def child(scenario: str, variant: str, rounds: int, small: bool, extra: tuple[str, ...] = ()) -> dict:
    """Run one variant of one scenario (plus ``extra`` overrides) in this process; return its figures."""
    sc = SCENARIOS[scenario]
    overrides = [*sc["overrides"], *(sc["small"] if small else []), f"num_rounds={rounds}", *extra]
    if variant in FEDSIM:
        return bench.fedsim_child([*overrides, *FEDSIM[variant]])
    if scenario == "b":
        return bench.child(variant, rounds)
    from fedsim import build

    cfg = compose(overrides)
    spec = json.loads(build.client_spec(cfg, device="cpu"))
    local = build.local_training(spec)
    per_round = int(cfg.clients_per_round)
    if variant in (
        "torch",
        "batched",
    ):  # batched: the hand-batched torch limit (grouped convolutions, chunks of 8)
        ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
        loop = bench.plain_fedavg if variant == "torch" else functools.partial(bench.batched_fedavg, chunk=8)
        return loop(
            ds,
            train,
            build.model_factory(spec),
            seed=int(cfg.seed),
            per_round=per_round,
            rounds=rounds,
            epochs=local.local_epochs,
            batch_size=local.batch_size,
            lr=local.lr,
        )
    if variant == "flower":
        import scale as mod  # by name: Ray actors then import this module's helpers instead of __main__'s

        ds_args = {k: v for k, v in spec["dataset"].items() if k != "_target_"}
        task = {
            "seed": int(cfg.seed),
            "num_clients": int(cfg.num_clients),
            "dataset": ds_args,
            "partitioner": "iid" if "iid" in spec["partitioner"]["_target_"] else "dirichlet",
        }
        server = _vanilla_server(task, rounds, per_round, local.lr, local.local_epochs, local.batch_size)
        return bench.flower_child(server, mod.vanilla_client_app(), int(cfg.num_clients))
    raise ValueError(f"unknown variant {variant!r}")


# ----------------------------------------------------------------------------------------- parent side
def targets(rows: list[tuple[str, str, dict]]) -> list[str]:
    """The issue's targets, met or not, from the measured rows."""
    got = {(sc, v): s for sc, v, s in rows if "error" not in s}
    out = [*bench.goals(rows, "a", round_goal=1.0), *bench.goals(rows, "b")]
    for sc in ("a", "b"):
        fl = got.get((sc, "flower"))
        fed = {v: s for (s2, v), s in got.items() if s2 == sc and v in FEDSIM and v != "ray"}
        if fl and fed:
            best = min(fed, key=lambda v: fed[v]["wall"])
            r, ri = (
                fl["wall"] / fed[best]["wall"],
                fl["wall"] / fed["inprocess"]["wall"] if "inprocess" in fed else None,
            )
            out.append(
                f"({sc}) vanilla Flower / fedsim end to end: {best} {r:.1f}x"
                + (f", inprocess {ri:.1f}x" if ri and best != "inprocess" else "")
                + f" (target >= 5: {'met' if r >= 5 else 'NOT met'})"
            )
    fed_c = {v: s for (sc, v), s in got.items() if sc == "c" and v in FEDSIM}
    if fed_c:
        peak = max(s["peak_mb"] for s in fed_c.values()) / 1024
        part = max((s["partitions_s"] or 0) for s in fed_c.values())
        out.append(
            f"(c) fedsim peak memory {peak:.2f} GiB (target <= 4: {'met' if peak <= 4 else 'NOT met'}), "
            f"partitions built in {part:.2f} s"
        )
        if "inprocess" in fed_c and "inprocess-pop1e4" in fed_c:
            a, b = fed_c["inprocess-pop1e4"], fed_c["inprocess"]
            out.append(
                f"(c) population 10^4 -> 10^5 with the same cohort: peak {a['peak_mb']:.0f} -> {b['peak_mb']:.0f} MB, "
                f"start-up {a['startup']:.1f} -> {b['startup']:.1f} s"
            )
    return out


SWEEPS = {  # label -> overrides of scenario (c); 20 lazily made images per client
    "population": {
        f"10^{e}": [f"num_clients={10**e}", f"dataset.num_train={20 * 10**e}", "clients_per_round=100"]
        for e in (3, 4, 5, 6)
    },
    "cohort": {
        str(c): ["num_clients=100000", "dataset.num_train=2000000", f"clients_per_round={c}"]
        for c in (10, 100, 1000)
    },
}


def sweep(kind: str, rounds: int, timeout: float) -> None:
    """Print peak memory, partition time, start-up and time per round of (c) on the default engine."""
    before = bench.machine_line()
    lines = [f"{kind:>12}{'peak MB':>9}{'partitions s':>14}{'start-up s':>12}{'round s':>9}{'wall s':>8}"]
    for label, extra in SWEEPS[kind].items():
        argv = [__file__, "--child", "c", "auto", "--rounds", str(rounds)]
        argv += [a for o in extra for a in ("--override", o)]
        s = bench.summarise([bench.run_child(argv, timeout)])
        print(f"  {kind} {label}: {s.get('wall') or s.get('error')}", file=sys.stderr, flush=True)
        if "error" in s:
            lines.append(f"{label:>12}  failed: {s['error']}")
            continue
        lines.append(
            f"{label:>12}{s['peak_mb']:>9.0f}{s['partitions_s']:>14.2f}{s['startup']:>12.2f}"
            f"{bench._f(s['per_round'], '9.3f')}{s['wall']:>8.1f}"
        )
    print(
        f"\n(c) sweep over the {kind}, engine auto, {rounds} rounds; before: {before}; after: {bench.machine_line()}"
    )
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="a,b,c")
    ap.add_argument("--variants", default=None, help="comma list; default: every variant of each scenario")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant (medians reported)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--small", action="store_true", help="tiny populations (smoke test)")
    ap.add_argument("--child", nargs=2, metavar=("SCENARIO", "VARIANT"))
    ap.add_argument("--override", action="append", default=[], help="extra fedsim override (child side)")
    ap.add_argument(
        "--sweep",
        choices=("population", "cohort"),
        help="(c) with the default engine: peak memory and time per round against the population "
        "(10^3 ... 10^6, 100 per round) or against the cohort (10 ... 1,000 of 10^5)",
    )
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.rounds, args.small, tuple(args.override))))
        return
    if args.sweep:
        sweep(args.sweep, args.rounds, args.timeout)
        return
    unknown = [sc for sc in args.scenarios.split(",") if sc not in DEFAULT_VARIANTS]
    if unknown:
        ap.error(f"--scenarios {unknown[0]!r}: expected a comma list of {', '.join(DEFAULT_VARIANTS)}")
    before, plan = bench.machine_line(), []
    for sc in args.scenarios.split(","):
        wanted = (args.variants or DEFAULT_VARIANTS[sc]).split(",")
        order = [v for v in DEFAULT_VARIANTS[sc].split(",") if v in wanted]
        plan += [(sc, v) for v in order + [v for v in wanted if v not in order]]
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in plan}
    for _ in range(args.repeat):  # repeats interleaved: a change in the machine's load hits every variant
        for sc, v in plan:
            argv = [
                __file__,
                "--child",
                sc,
                v,
                "--rounds",
                str(args.rounds),
                *(["--small"] if args.small else []),
            ]
            t0 = time.perf_counter()
            runs[(sc, v)].append(bench.run_child(argv, args.timeout))
            print(f"  {sc} {v}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    rows = [(sc, v, bench.summarise(r)) for (sc, v), r in runs.items()]
    print(
        f"\nfedsim scale benchmark, {args.rounds} rounds{' (small)' if args.small else ''}, median of "
        f"{args.repeat}; before: {before}; after: {bench.machine_line()}"
    )
    for sc in args.scenarios.split(","):
        print(f"  ({sc}) {SCENARIOS[sc]['title']}")
    print("\n".join(bench.format_rows(rows)))
    print("\n".join(targets(rows)))


if __name__ == "__main__":
    main()

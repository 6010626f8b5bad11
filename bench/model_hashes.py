"""The final models of the shipped configurations, as one hash per configuration and engine.

A change to the server's or the batched engine's code that must leave the models alone (a refactor) is checked by
comparing this script's output before and after it: every hash must be the same. Each configuration runs a few
rounds of a small experiment in this process on the default engine and on ``engine=inprocess``.

    python bench/model_hashes.py                        # print the hashes (JSON)
    python bench/model_hashes.py --write FILE           # keep them
    python bench/model_hashes.py --check FILE           # compare with kept ones; exit 1 on any difference

``bench/results/model_hashes.json`` keeps the hashes of the tree before the cohort (issue 38), which the
cohort's one form gave on both engines, except the 16 cells of the default engine that train plain SGD on the
batched MLP step: since that step hands the SGD rule each weight's gradient unformed (``fedsim.local.Outer``)
and the rule steps along it in one ``baddbmm_`` (rounded once where forming the gradient and subtracting it
rounds twice), their last bits differ and their hashes were written anew; every ``inprocess`` cell, and every
batched one that forms its gradients (FedProx's term, momentum, weight decay), kept its hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

SMALL = ["num_clients=8", "clients_per_round=4", "num_rounds=3", "quiet=true", "eval_every=3"]
NOISE = [
    "clipping.noise_multiplier=0.5",
    "clipping.noise_seed=123456789012345678901",
    "clipping.debug_noise_seed=true",
]
CONFIGS = {
    "default": [],
    "fedavgm": ["strategy=fedavgm"],
    "fedprox": ["strategy=fedprox"],
    "fedmedian": ["strategy=fedmedian"],
    "krum": ["strategy=krum"],
    "fedtrimmedavg": ["strategy=fedtrimmedavg", "strategy.beta=0.25"],
    "fednova": ["strategy=fednova", "client=sgd"],
    "scaffold": ["strategy=scaffold", "client=sgd"],
    "clip_fixed_noise": ["clipping=fixed", *NOISE],
    "clip_small_noise": ["clipping=fixed", "clipping.clip_norm=0.05", *NOISE],
    "clip_small_fednova": ["clipping=fixed", "clipping.clip_norm=0.05", "strategy=fednova", "client=sgd"],
    "fednova_partial": [
        "strategy=fednova",
        "client=sgd",
        "heterogeneity=exponential",
        "heterogeneity.deadline=0.3",
        "heterogeneity.partial_work=true",
    ],
    "clip_client": ["clipping=fixed", "clipping.side=client"],
    "sign_flip": ["attack=sign_flip"],
    "alie": ["attack=alie"],
    "alie_median": ["attack=alie", "strategy=fedmedian"],
    "topk": ["compression=topk"],
    "qsgd": ["compression=qsgd"],
    "power_of_choice": ["selection=power_of_choice"],
    "faults": ["faults.error=0.1", "faults.nan=0.15", "faults.shape=0.1", "faults.dtype=0.1"],
    "fedavgm_sign_flip_clip": ["strategy=fedavgm", "attack=sign_flip", "clipping=fixed"],
}
ENGINES = ("auto", "inprocess")


def model_hash(path: Path) -> str:
    """sha256 of a saved model's tensors (names, dtypes, shapes and bytes, in the state dict's order)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    h = hashlib.sha256()
    for name, t in state.items():
        t = t.detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def run_one(overrides: list[str], out: Path) -> str:
    """The hash of the final model of one small run (a failed run's status instead)."""
    from fedsim.config import compose
    from fedsim.run import run_experiment

    summary = run_experiment(compose(*SMALL, *overrides), out)
    if summary.get("status") != "completed":
        return f"status={summary.get('status')}"
    return model_hash(out / "model.pt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="keep the hashes in this JSON file")
    parser.add_argument("--check", type=Path, help="compare with the hashes kept in this JSON file")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for engine in ENGINES:
                key = f"{name}/{engine}"
                hashes[key] = run_one([*CONFIGS[name], f"engine={engine}"], Path(tmp) / key)
                print(key, hashes[key], file=sys.stderr, flush=True)
    if args.write:
        args.write.write_text(json.dumps(hashes, indent=1) + "\n")
    if args.check:
        kept = json.loads(args.check.read_text())
        differ = {k: (kept.get(k), v) for k, v in hashes.items() if kept.get(k) != v}
        for k, (was, now) in differ.items():
            print(f"DIFFERS {k}: was {was}, now {now}")
        print(f"{len(hashes) - len(differ)} of {len(hashes)} equal")
        return 1 if differ else 0
    if not (args.write or args.check):
        print(json.dumps(hashes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

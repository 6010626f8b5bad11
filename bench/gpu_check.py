"""GPU check: fedsim's GPU paths end to end in a few minutes, with their figures, on a CUDA machine.

Runs, each in a fresh process (start-up counted, peak RSS of the process tree, peak GPU memory of the
server process), scenario (a) of ``bench/scale.py`` (1,000 clients, 100 per round, CNN, 1x28x28) for
3 rounds:

* ``inprocess-gpu``: ``placement=gpu engine=inprocess`` (clients one after the other on the GPU);
* ``vectorized-gpu``: ``placement=gpu engine=vectorized`` (the cohort as one vmapped model on the GPU);
* ``ray-gpu-shared``: ``placement=gpu_shared engine=ray`` (4 Ray actors sharing the GPU, 0.25 each);
* ``torch-gpu``: the plain torch loop on the GPU, same SGD steps;

then the digits MLP (default experiment) with ``inprocess`` and ``vectorized`` on the GPU, whose final
models must agree (the ``model norm`` column). Without CUDA it exits at once with a message.

    python bench/gpu_check.py                 # about 2-4 minutes on one GPU
    python bench/gpu_check.py --dry-run-cpu   # the same script on the CPU (checks the script, not the GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale

import bench

BUDGET_S = 280  # stop starting new runs after this, so the check ends within 5 minutes
CNN = [*scale.SCENARIOS["a"]["overrides"], "num_rounds=3"]
MLP = ["num_rounds=5"]
RUNS = {  # name -> (scenario, fedsim overrides, or None for the plain torch loop)
    "inprocess-gpu": ("a", [*CNN, "placement=gpu", "engine=inprocess"]),
    "vectorized-gpu": ("a", [*CNN, "placement=gpu", "engine=vectorized"]),
    "ray-gpu-shared": (
        "a",
        [*CNN, "placement=gpu_shared", "engine=ray", "placement.num_gpus_per_client=0.25"],
    ),
    "torch-gpu": ("a", None),
    "inprocess-gpu-mlp": ("b", [*MLP, "placement=gpu", "engine=inprocess"]),
    "vectorized-gpu-mlp": ("b", [*MLP, "placement=gpu", "engine=vectorized"]),
}


def child(name: str, device: str) -> dict:
    """Run one check in this process."""
    _, overrides = RUNS[name]
    if overrides is not None:
        if device == "cpu":  # dry run: same script, CPU placement
            overrides = [o for o in overrides if not o.startswith("placement")] + ["placement=cpu"]
        return bench.fedsim_child(overrides)
    from fedsim import build

    cfg = scale.compose([*CNN, f"placement.device={device}"])
    spec = json.loads(build.client_spec(cfg, device=device))
    local = build.local_training(spec)
    ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
    return bench.plain_fedavg(
        ds,
        train,
        build.model_factory(spec),
        seed=int(cfg.seed),
        per_round=int(cfg.clients_per_round),
        rounds=int(cfg.num_rounds),
        epochs=local.local_epochs,
        batch_size=local.batch_size,
        lr=local.lr,
        device=device,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run-cpu", action="store_true", help="run the same checks on the CPU")
    ap.add_argument("--only", default=None, help="comma list of checks (default: all)")
    ap.add_argument("--child")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device)))
        return
    unknown = [n for n in (args.only or "").split(",") if n and n not in RUNS]
    if unknown:
        ap.error(f"--only {unknown[0]!r}: expected a comma list of {', '.join(RUNS)}")
    import torch

    if not torch.cuda.is_available() and not args.dry_run_cpu:
        sys.exit(
            "gpu_check: no CUDA device is visible to torch (torch.cuda.is_available() is False); run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch, or use --dry-run-cpu to test the script."
        )
    device = "cpu" if args.dry_run_cpu else "cuda"
    gpu = "CPU dry run" if device == "cpu" else torch.cuda.get_device_name(0)
    t0, rows, extra = time.perf_counter(), [], {}
    for name in (args.only or ",".join(RUNS)).split(","):
        left = BUDGET_S - (time.perf_counter() - t0)
        if left < 20:
            rows.append((RUNS[name][0], name, {"error": "skipped: time budget spent"}))
            continue
        res = bench.run_child([__file__, "--child", name, "--device", device], timeout=min(150, left))
        rows.append((RUNS[name][0], name, bench.summarise([res])))
        extra[name] = res
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = [(sc, "torch" if n == "torch-gpu" else n, s) for sc, n, s in rows]  # the table's torch baseline
    print(
        f"\nfedsim GPU check on {gpu}; {bench.machine_line()}; (a) = {scale.SCENARIOS['a']['title']}, "
        "3 rounds; (b) = digits MLP, 5 rounds"
    )
    print("\n".join(bench.format_rows(rows)))
    print(f"{'check':<22}{'GPU peak MB':>12}{'model norm':>14}")
    for name, res in extra.items():
        if "error" not in res:
            print(
                f"{name:<22}{res.get('gpu_peak_mb', float('nan')):>12.0f}{res.get('model_norm', float('nan')):>14.6f}"
            )
    a, b = extra.get("inprocess-gpu-mlp", {}), extra.get("vectorized-gpu-mlp", {})
    if "model_norm" in a and "model_norm" in b:
        rel = abs(a["model_norm"] - b["model_norm"]) / a["model_norm"]
        print(
            f"vectorized vs inprocess on {device} (digits MLP): model norms differ by {rel:.1e} relative "
            f"({'OK' if rel < 1e-4 else 'MISMATCH'})"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

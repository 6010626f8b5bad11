"""GPU check: correctness first, then placement, memory and timing of fedsim's GPU paths (at most 5 minutes).

Each check runs in a fresh process. In order (the time budget drops the last ones first):

1. **agree**: the engines agree on the GPU: the digits MLP, then a CIFAR-size CNN (3x32x32) with
   ``placement.deterministic`` true and false, ``inprocess`` against ``vectorized``; the largest relative
   difference of the final models against the tolerance the precision allows (``fedsim.build.agreement_tolerance``),
   and whether every vectorized client really trained batched; the MLP again under the coordinate median with
   server momentum and ALIE, and under DP with client-side clipping (both aggregate the cohort's stacked replies
   on the device).
2. **placement**: ``auto`` and every ``cuda:N`` resolve where the client runs; pool workers (``engine.workers=N``)
   spread over the visible GPUs; an injected out-of-memory error shrinks the vectorized batch and the run
   completes with the same model.
3. **timing**: 100 clients per round of the CIFAR-size CNN, per client (``inprocess``) against ``vectorized``
   (its eager steps; ``vectorized-graph``: the steps replayed as CUDA graphs, the default on a GPU) against a
   plain torch loop and the batched limits (``limit-eager``: one ``vmap`` loop, data on the device;
   ``limit-graph``: its step as a CUDA graph), also for 1,000 clients a round (``k1000-*``) and for 450 examples
   a client and 5 epochs (``real-*``, 145 steps); with GPU busy fraction (``nvidia-smi`` sampled every 0.2 s),
   the peak GPU memory of every process (``nvidia-smi --query-compute-apps``), peak RSS, and how many clients
   trained batched. Section 4 prints the speed targets (fedsim's round against the limits), met or not.

    python bench/gpu_check.py             # on a CUDA machine, about 3-5 minutes
    python bench/gpu_check.py --dry-run   # every path of the script on the CPU, small sizes (checks the script)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench

BUDGET_S = 285  # stop starting new checks after this, so the whole check ends within 5 minutes
CIFAR = ["dataset=synthetic_images", "dataset.shape=[3,32,32]", "model=cnn", "partitioner=iid"]
MLP = ["num_clients=20", "clients_per_round=10", "num_rounds=3"]
# the MLP's agreement under the wrappers and rules that take stacked replies on the device
MLP_PATHS = {
    "agree-mlp-alie-median": [
        "strategy=fedmedian",
        "strategy.server_momentum=0.9",
        "attack=alie",
        "attack.fraction=0.3",
    ],
    "agree-mlp-client-dp": [
        "clipping=fixed",
        "clipping.side=client",
        "clipping.clip_norm=0.5",
        "clipping.noise_multiplier=0.5",
        "clipping.sampling=fixed",
        "clipping.noise_seed=20261205",
        "clipping.debug_noise_seed=true",
    ],
}
CNN_AGREE = [*CIFAR, "num_clients=20", "clients_per_round=10", "num_rounds=2", "client.local_steps=3"]
CNN_TIME = [*CIFAR, "num_clients=1000", "clients_per_round=100", "num_rounds=6", "dataset.num_train=50000"]
WORKLOADS = {  # the timing workloads of the speed targets (issue: small, 1,000 clients a round, realistic)
    "small": CNN_TIME,  # 45 examples a client, batch 16, 2 epochs = 6 steps
    "k1000": [
        *CIFAR,
        "num_clients=1000",
        "clients_per_round=1000",
        "num_rounds=3",
        "dataset.num_train=50000",
    ],
    "real": [  # 450 examples a client, 5 epochs = 145 steps
        *CIFAR,
        "num_clients=100",
        "clients_per_round=100",
        "num_rounds=3",
        "dataset.num_train=50000",
        "client.local_epochs=5",
    ],
}
SMALL = {  # --dry-run: the same checks, CPU-sized
    "agree-mlp": ["num_rounds=2"],
    "agree-cnn": ["num_clients=6", "clients_per_round=3", "dataset.num_train=600", "dataset.num_test=100"],
    "time": [
        "num_clients=40",
        "clients_per_round=8",
        "num_rounds=2",
        "dataset.num_train=2000",
        "dataset.num_test=200",
    ],
}


# ------------------------------------------------------------------------------------------------ child side
def _run(overrides: list[str], out: Path, count_batched: bool = False) -> dict:
    """One fedsim run in this process; its final model, round times and (optionally) the clients trained batched."""
    import torch

    from fedsim import recorder
    from fedsim.cli import quiet_loggers
    from fedsim.config import compose
    from fedsim.engines import vectorized
    from fedsim.run import run_experiment

    quiet_loggers()
    batched, stamps = [], []
    log = recorder.Recorder.log

    def stamped(self, record):  # when each round's record is written (wall clock, to match the GPU samples)
        stamps.append(time.time())
        return log(self, record)

    recorder.Recorder.log = stamped
    if count_batched:
        original = vectorized._train_bucket

        def counting(members, *args):
            batched.append(len(members))
            return original(members, *args)

        vectorized._train_bucket = counting
    try:
        summary = run_experiment(compose(*overrides, "quiet=true", "checkpoint_every=0"), out)
    finally:
        recorder.Recorder.log = log
        if count_batched:
            vectorized._train_bucket = original
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "model": torch.load(out / "model.pt"),
        "rounds": [r["round_time"] for r in recs if r["round"] > 0],
        "accuracy": summary["final_eval_accuracy"],
        "batched": sum(batched),
        "trained": sum(r.get("num_clients", 0) for r in recs),
        # wall clock from round 0's record to the last round's
        "window": [stamps[0], stamps[-1]] if len(stamps) > 1 else None,
    }


def _fail_fast(vectorized) -> None:
    """A batched group that fails raises here instead of rerunning its clients one by one (a check of the
    CUDA-graph path must not spend minutes in the sequential fallback)."""
    attempt = vectorized.VectorizedGrid._attempt

    def strict(self, item):
        out = attempt(self, item)
        if out[2] is not None:
            raise RuntimeError(f"batched training failed: {out[2]}")
        return out

    vectorized.VectorizedGrid._attempt = strict


def _max_rel(a: dict, b: dict) -> float:

    return max(float((a[k].double() - b[k].double()).norm() / (a[k].double().norm() + 1e-12)) for k in a)


def child_agree(name: str, device: str, deterministic: bool, small: bool, graph: bool = False) -> dict:
    """inprocess against vectorized on ``device``: the largest relative model difference and the tolerance.
    ``graph``: the vectorized engine replays its steps as CUDA graphs (``vectorized.CUDA_GRAPHS``)."""
    import torch

    from fedsim import build
    from fedsim.engines import vectorized

    vectorized.CUDA_GRAPHS = vectorized.CUDA_GRAPHS_DENSE = graph
    if graph:
        _fail_fast(vectorized)

    over = [*MLP, *MLP_PATHS[name]] if name in MLP_PATHS else MLP if name == "agree-mlp" else CNN_AGREE
    if graph and name == "agree-mlp":  # every client the same steps, so that the graph path runs
        over = [*over, "client.local_steps=5", "partitioner=iid"]
    over = [
        *over,
        *(SMALL["agree-mlp" if name in MLP_PATHS else name] if small else []),
        f"placement.device={device}",
        f"placement.server_device={device}",
        f"placement.deterministic={str(deterministic).lower()}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        seq = _run([*over, "engine=inprocess"], Path(tmp) / "seq")
        vec = _run(
            [*over, "engine=vectorized", "engine.vmap_conv_cpu=true"], Path(tmp) / "vec", count_batched=True
        )
    steps = 3 * 2 if name == "agree-cnn" else 60
    tol = build.agreement_tolerance(device, deterministic, steps)
    a, b = seq["model"], vec["model"]
    return {
        "max_abs": max(float((a[k].double() - b[k].double()).abs().max()) for k in a),
        "close": all(torch.allclose(b[k].double(), a[k].double(), rtol=tol, atol=tol) for k in a),
        "tolerance": tol,
        "batched": vec["batched"],
        "trained": vec["trained"],
    }


def child_placement(device: str, small: bool) -> dict:
    """Device names as each kind of client process resolves them; workers over GPUs; an injected OOM."""
    import os

    import torch

    from fedsim import build
    from fedsim.engines import vectorized

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    emulated = device == "cpu"
    real = torch.cuda.is_available, torch.cuda.device_count
    if emulated:  # the dry run: pretend two GPUs for name resolution only
        torch.cuda.is_available, torch.cuda.device_count, count = (lambda: True), (lambda: 2), 2
    names = {
        "auto": build.resolve_device("auto"),
        **{f"cuda:{i}": build.resolve_device(f"cuda:{i}") for i in range(count)},
    }
    workers = []
    for k in range(max(2, count)):
        os.environ[build.WORKER_INDEX_ENV] = str(k)
        workers.append(build.resolve_device("cuda"))
    del os.environ[build.WORKER_INDEX_ENV]
    torch.cuda.is_available, torch.cuda.device_count = real
    over = [*MLP, f"placement.device={device}", f"placement.server_device={device}"]
    original = vectorized._train_bucket
    sizes = []

    def limited(members, *args):
        sizes.append(len(members))
        if len(members) > 4:
            raise torch.OutOfMemoryError("injected by gpu_check")
        return original(members, *args)

    with tempfile.TemporaryDirectory() as tmp:
        plain = _run([*over, "engine=vectorized"], Path(tmp) / "plain")
        vectorized._train_bucket = limited
        try:
            oom = _run([*over, "engine=vectorized"], Path(tmp) / "oom")
        finally:
            vectorized._train_bucket = original
        pool = _run([*over, "engine=inprocess", "engine.workers=2"], Path(tmp) / "pool")
    return {
        "resolved": names,
        "pool_workers": workers,
        "oom_batch_sizes": sorted(set(sizes)),
        "oom_same_model": _max_rel(plain["model"], oom["model"]) < 1e-5,
        "pool_rounds_s": pool["rounds"],
        "pool_accuracy": pool["accuracy"],
    }


def _loop_args(over: list[str], device: str):
    """The arguments of bench.py's plain and batched torch loops for the fedsim config ``over``: the same data,
    partitions, model and local training as the fedsim run they are measured against."""
    from fedsim import build
    from fedsim.config import compose

    cfg = compose(*over)
    spec = json.loads(build.client_spec(cfg, device=device))
    local = build.local_training(spec)
    ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
    kwargs = dict(
        seed=int(cfg.seed),
        per_round=int(cfg.clients_per_round),
        rounds=int(cfg.num_rounds),
        epochs=local.local_epochs,
        batch_size=local.batch_size,
        lr=local.lr,
        device=device,
    )
    return (ds, train, build.model_factory(spec)), kwargs


def child_time(variant: str, device: str, small: bool, workload: str = "small") -> dict:
    """One timing run of the CIFAR-size CNN: a fedsim engine, plain torch, or the batched limits
    (``limit-eager``: the cohort's steps as one ``vmap(functional_call)`` loop, data on the device;
    ``limit-graph``: the same step captured once as a CUDA graph and replayed)."""
    import torch

    over = [
        *WORKLOADS[workload],
        *(SMALL["time"] if small else []),
        f"placement.device={device}",
        f"placement.server_device={device}",
    ]
    if variant.startswith("limit"):
        graph = variant == "limit-graph" and device != "cpu"
        args, kwargs = _loop_args(over, device)
        return bench.batched_fedavg(*args, **kwargs, forward_kind="vmap", graph=graph)
    if variant == "torch":
        args, kwargs = _loop_args(over, device)
        return bench.plain_fedavg(*args, **kwargs)
    from fedsim.engines import vectorized

    vectorized.CUDA_GRAPHS = vectorized.CUDA_GRAPHS_DENSE = variant == "vectorized-graph"
    if vectorized.CUDA_GRAPHS:
        _fail_fast(vectorized)
    batched = variant.startswith("vectorized")
    extra = ["engine=vectorized", "engine.vmap_conv_cpu=true"] if batched else ["engine=inprocess"]
    with tempfile.TemporaryDirectory() as tmp:
        res = _run([*over, *extra], Path(tmp) / "run", count_batched=batched)
    res.pop("model")
    if torch.cuda.is_available():
        res["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return res


# ------------------------------------------------------------------------------------------------ GPU sampling
class GpuSampler:
    """``nvidia-smi`` every 0.2 s while a check runs: busy fraction and peak memory of each process."""

    def __init__(self) -> None:
        self.util: list[float] = []
        self.proc_mb: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def _query(self, *args: str) -> list[str]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [ln.strip() for ln in out.splitlines() if ln.strip()]

    def _loop(self) -> None:
        while not self._stop.is_set():
            for line in self._query("--query-gpu=utilization.gpu"):
                self.util.append((time.time(), float(line) / 100))
            for line in self._query("--query-compute-apps=pid,used_memory"):
                pid, mb = (x.strip() for x in line.split(","))
                self.proc_mb[pid] = max(self.proc_mb.get(pid, 0.0), float(mb))
            time.sleep(0.2)

    def figures(self, window: list[float] | None = None) -> dict:
        """Busy fraction over the whole check and, given the rounds' ``window`` (wall clock), over the rounds."""
        if not self.available:
            return {"busy": None, "busy_rounds": None, "proc_mb": {}}
        inside = [u for t, u in self.util if window and window[0] <= t <= window[1]]
        return {
            "busy": _mean([u for _, u in self.util]),
            "busy_rounds": _mean(inside),
            "rounds_samples": len(inside),
            "proc_mb": self.proc_mb,
        }


# ------------------------------------------------------------------------------------------------ parent side
CHECKS = [  # (name, child args, section)
    ("agree-mlp", ["agree", "agree-mlp", "1"], "correctness"),
    ("agree-cnn-deterministic", ["agree", "agree-cnn", "1"], "correctness"),
    ("agree-cnn-fast", ["agree", "agree-cnn", "0"], "correctness"),
    ("agree-cnn-graph", ["agree", "agree-cnn", "1", "graph"], "correctness"),
    ("agree-mlp-graph", ["agree", "agree-mlp", "1", "graph"], "correctness"),
    ("agree-mlp-alie-median", ["agree", "agree-mlp-alie-median", "1"], "correctness"),
    ("agree-mlp-client-dp", ["agree", "agree-mlp-client-dp", "1"], "correctness"),
    ("placement", ["placement"], "placement"),
    ("time-inprocess", ["time", "inprocess"], "timing"),
    ("time-vectorized", ["time", "vectorized"], "timing"),
    ("time-vectorized-graph", ["time", "vectorized-graph"], "timing"),
    ("time-torch", ["time", "torch"], "timing"),
    ("time-limit-eager", ["time", "limit-eager"], "timing"),
    ("time-limit-graph", ["time", "limit-graph"], "timing"),
    ("k1000-vectorized", ["time", "vectorized", "k1000"], "targets"),
    ("k1000-limit-eager", ["time", "limit-eager", "k1000"], "targets"),
    ("real-vectorized", ["time", "vectorized", "real"], "targets"),
    ("real-vectorized-graph", ["time", "vectorized-graph", "real"], "targets"),
    ("real-limit-eager", ["time", "limit-eager", "real"], "targets"),
    ("real-limit-graph", ["time", "limit-graph", "real"], "targets"),
]


def _in_process(args: list[str]) -> dict:
    """A dry-run check in this process (small sizes on the CPU): its result, or ``{"error": ...}``."""
    import resource

    t0 = time.perf_counter()
    try:
        res = json.loads(json.dumps(child(args, "cpu", True)))  # what a child would have printed
    except Exception as e:  # noqa: BLE001  (reported like a failed child)
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {**res, "wall": time.perf_counter() - t0, "peak_mb": peak}


def child(args: list[str], device: str, small: bool) -> dict:
    kind = args[0]
    if kind == "agree":
        return child_agree(args[1], device, args[2] == "1", small, graph=args[3:] == ["graph"])
    if kind == "placement":
        return child_placement(device, small)
    return child_time(args[1], device, small, args[2] if len(args) > 2 else "small")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every check on the CPU with small sizes")
    ap.add_argument("--only", default=None, help="comma list of checks (default: all)")
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument(
        "--budget", type=float, default=BUDGET_S, help="stop starting checks after this many seconds"
    )
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.small)))
        return
    names = [c[0] for c in CHECKS]
    unknown = [n for n in (args.only or "").split(",") if n and n not in names]
    if unknown:
        ap.error(f"--only {unknown[0]!r}: expected a comma list of {', '.join(names)}")
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit(
            "gpu_check: no CUDA device is visible to torch (torch.cuda.is_available() is False); run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch, or use --dry-run to test the script."
        )
    device = "cpu" if args.dry_run else "cuda"
    where = "CPU dry run (small sizes; GPU names emulated)" if args.dry_run else torch.cuda.get_device_name(0)
    t0, results, failed = time.perf_counter(), {}, 0
    for name, child_args, section in CHECKS:
        if args.only and name not in args.only.split(","):
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < 20:
            results[name] = {"error": "skipped: time budget spent"}
            continue
        argv = [__file__, "--child", *child_args, "--device", device, *(["--small"] if args.dry_run else [])]
        with GpuSampler() as gpu:
            # the dry run checks the script's paths, not timings: one process, not a fresh one per check
            res = _in_process(child_args) if args.dry_run else bench.run_child(argv, timeout=min(150, left))
        res.update(gpu.figures(res.get("window")))
        results[name] = res
        print(f"  {section}/{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\nfedsim GPU check on {where}; {bench.machine_line()}")
    print("\n1. correctness (inprocess vs vectorized, final models)")
    for name in (
        "agree-mlp",
        "agree-cnn-deterministic",
        "agree-cnn-fast",
        "agree-cnn-graph",
        "agree-mlp-graph",
        "agree-mlp-alie-median",
        "agree-mlp-client-dp",
    ):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            failed += 1
            print(f"  {name:<26} FAILED: {r['error']}")
            continue
        ok = r["close"] and r["batched"] == r["trained"]
        failed += not ok
        print(
            f"  {name:<26} max abs diff {r['max_abs']:.1e} (rtol = atol = {r['tolerance']:.1e}), "
            f"batched {r['batched']}/{r['trained']} clients: {'OK' if ok else 'MISMATCH'}"
        )
    r = results.get("placement")
    if r is not None:
        print("\n2. placement and memory")
        if "error" in r:
            failed += 1
            print(f"  FAILED: {r['error']}")
        else:
            ok = r["oom_same_model"] and max(r["oom_batch_sizes"]) > 4 and min(r["oom_batch_sizes"]) <= 4
            failed += not ok
            print(f"  resolved: {r['resolved']}")
            print(f"  pool workers 0..{len(r['pool_workers']) - 1} use: {r['pool_workers']}")
            print(
                f"  engine.workers=2 run: accuracy {r['pool_accuracy']:.4f}, rounds {[round(x, 2) for x in r['pool_rounds_s']]} s"
            )
            print(
                f"  injected OOM: batch sizes tried {r['oom_batch_sizes']}, same model as without: "
                f"{r['oom_same_model']} ({'OK' if ok else 'MISMATCH'})"
            )
    timing = {n: results[n] for n, _, sec in CHECKS if sec in ("timing", "targets") and n in results}
    if timing:
        print(
            "\n3. timing: CIFAR-size CNN (3x32x32), 100 clients per round"
            + (" (small)" if args.dry_run else "")
        )
        print(
            f"  {'variant':<18}{'round s':>9}{'torch/this':>11}{'GPU busy':>9}{'in rounds':>10}{'peak RSS MB':>12}"
            f"{'batched':>10}  GPU MB per process"
        )
        base = timing.get("time-torch", {})
        base_round = _median(base.get("rounds"))
        for name, r in timing.items():
            if "error" in r:
                failed += 1
                print(f"  {name:<18}FAILED: {r['error']}")
                continue
            per = _median(r.get("rounds"))
            ratio = base_round / per if base_round and per else None
            busy = r.get("busy")
            batched = f"{r['batched']}/{r['trained']}" if "batched" in r else "-"
            print(
                f"  {name:<18}{_fmt(per, '9.3f')}{_fmt(ratio, '11.2f')}{_fmt(busy, '9.0%')}"
                f"{_fmt(r.get('busy_rounds'), '10.0%')}"
                f"{_fmt(r.get('peak_mb'), '12.0f')}{batched:>10}  {r.get('proc_mb') or '-'}"
            )
    lines, missed = targets(results, on_gpu=device == "cuda")
    if lines:
        print("\n4. speed targets (fedsim's round against the batched limits measured above, same run)")
        print("\n".join(lines))
    print(
        f"\ntotal {time.perf_counter() - t0:.0f} s; {'all checks passed' if not failed else f'{failed} check(s) failed'}"
    )
    sys.exit(1 if failed else 0)


TARGETS = [  # (what, fedsim's check, the limit's check, most fedsim/limit, least GPU busy in fedsim's rounds)
    ("100 clients, 6 steps: fedsim / eager vmap limit", "time-vectorized", "time-limit-eager", 1.5, 0.5),
    (
        "100 clients, 6 steps: fedsim graph / eager limit",
        "time-vectorized-graph",
        "time-limit-eager",
        1.5,
        0.5,
    ),
    ("1,000 clients, 6 steps: fedsim / eager vmap limit", "k1000-vectorized", "k1000-limit-eager", 1.3, 0.5),
    ("100 clients, 145 steps: fedsim / CUDA-graph limit", "real-vectorized", "real-limit-graph", 1.5, 0.7),
    (
        "100 clients, 145 steps: fedsim graph / graph limit",
        "real-vectorized-graph",
        "real-limit-graph",
        1.5,
        0.7,
    ),
    ("100 clients, 6 steps: eager limit / graph limit", "time-limit-eager", "time-limit-graph", None, None),
    ("100 clients, 145 steps: eager limit / graph limit", "real-limit-eager", "real-limit-graph", None, None),
]


def targets(results: dict, on_gpu: bool = True) -> tuple[list[str], int]:
    """One line per speed target: the ratio of round times (median of rounds 2..R), GPU busy, met or not.

    A target is judged only from GPU figures: with ``on_gpu=False`` (the CPU dry run: small sizes on the CPU),
    a timing that is missing or failed, or no GPU busy figure (``nvidia-smi`` not sampled), it says "not
    measured" (and counts as missed), never "met"."""
    lines, missed = [], 0
    for what, ours, limit, most, busy_min in TARGETS:
        a, b = results.get(ours, {}), results.get(limit, {})
        ra, rb = _median(a.get("rounds")), _median(b.get("rounds"))
        if ra and rb:
            ratio, busy = ra / rb, a.get("busy_rounds")
            line = f"  {what:<52}{ra * 1e3:9.1f} ms / {rb * 1e3:7.1f} ms = {ratio:5.2f}x"
        elif most is None:
            continue
        else:
            ratio, busy = None, None
            line = f"  {what:<52}{'-':>9} ms / {'-':>7} ms = {'-':>5}x"
        if most is None:
            lines.append(line)
            continue
        why = (
            "no GPU (CPU dry run)"
            if not on_gpu
            else "no timing"
            if ratio is None
            else "no GPU busy figure"
            if busy is None
            else None
        )
        verdict = (
            f"not measured: {why}" if why else "met" if ratio <= most and busy >= busy_min else "NOT met"
        )
        missed += verdict != "met"
        lines.append(
            line + f" (goal <= {most}x, GPU busy {_fmt(busy, '.0%')} goal >= {busy_min:.0%}: {verdict})"
        )
    return lines, missed


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    import statistics

    xs = list(xs or [])
    return statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else None


def _fmt(v, fmt: str) -> str:
    return format("-", f">{fmt.split('.')[0]}") if v is None else format(v, fmt)


if __name__ == "__main__":
    main()

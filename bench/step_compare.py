"""fedsim's batched SGD step against the tight limit's, alone, in one process: the same stacked MLP clients, the
same batches, interleaved repetitions timed on the thread's CPU clock.

fedsim's step is the default engine's (``fedsim.engines.steps._sgd_step`` over ``fedsim.engines.dense.DenseStep``
and ``fedsim.local.sgd_update_``); the limit's is ``bench.tight_fedavg``'s (``bench._tight_steps``). Both start
from the same weights and must end on the same ones (to 1e-6); the ratio is the limit's time over fedsim's.

    python bench/step_compare.py                       # the default experiment's shapes: 10 clients, 8x8 digits
    python bench/step_compare.py --clients 100 --input 1x28x28 --width 32
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import bench
    from fedsim.engines.dense import DenseStep
    from fedsim.engines.steps import _sgd_step
    from fedsim.local import LocalTraining
    from fedsim.models import mlp
    from fedsim.tasks import CLASSIFICATION

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--input", default="1x8x8", help="one example's shape, e.g. 1x28x28")
    ap.add_argument("--width", type=int, default=16, help="examples a step (the batch size)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--repeat", type=int, default=7, help="interleaved timings of each")
    ap.add_argument("--inner", type=int, default=20, help="rounds of steps a timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    k, width, steps = args.clients, args.width, args.steps
    shape = tuple(int(v) for v in args.input.split("x"))
    model = mlp(shape, 10)
    names = [n for n, _ in model.named_parameters()]
    linears = [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
    gen = torch.Generator().manual_seed(0)
    n = max(k * width * 2, 1000)
    x = torch.rand(n, *shape, generator=gen)
    idx = torch.randint(0, n, (steps, k, width), generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen).index_select(0, idx.reshape(-1)).view(idx.shape)
    w = torch.full((steps, k, width), 1.0 / width)
    start = {
        name: p.detach().unsqueeze(0).expand(k, *p.shape).clone() for name, p in model.named_parameters()
    }
    step = DenseStep(model, CLASSIFICATION)
    sgd = functools.partial(_sgd_step, step, None, CLASSIFICATION, names, LocalTraining(lr=0.1), 0.0)
    flat, ys, ws = x.flatten(1), y.unsqueeze(-1), w.unsqueeze(-1)

    def fedsim() -> list[torch.Tensor]:
        params = {name: t.clone() for name, t in start.items()}
        loss = torch.zeros(k, dtype=torch.float64)
        for t in range(steps):
            sgd(
                params,
                {},
                None,
                loss,
                x.index_select(0, idx[t].reshape(-1)).view(k, width, *shape),
                y[t],
                w[t],
            )
        return [params[f"{name}.weight"] for name in linears]

    def tight() -> list[torch.Tensor]:
        params = [(start[f"{name}.weight"].clone(), start[f"{name}.bias"].clone()) for name in linears]
        bench._tight_steps(params, 0.1, flat, idx, ys, ws, [k] * steps, [width] * k)
        return [wb[0] for wb in params]

    diff = max(float((a - b).abs().max()) for a, b in zip(fedsim(), tight()))
    times: dict[str, list[float]] = {"fedsim": [], "tight": []}
    for _ in range(args.repeat):
        for name, fn in (("fedsim", fedsim), ("tight", tight)):
            t0 = time.thread_time()
            for _ in range(args.inner):
                fn()
            times[name].append((time.thread_time() - t0) / args.inner / steps)
    ratios = [t / f for f, t in zip(times["fedsim"], times["tight"])]
    print(
        f"{k} clients x {width} examples of {args.input}, {steps} steps; thread CPU per step: fedsim "
        f"{1e6 * statistics.median(times['fedsim']):.0f} us, tight limit {1e6 * statistics.median(times['tight']):.0f} us; "
        f"tight / fedsim min {min(ratios):.2f}, median {statistics.median(ratios):.2f}; "
        f"weights after the steps differ by {diff:.1e}"
    )
    if not diff <= 1e-6:
        sys.exit(f"fedsim's step and the tight limit's disagree by {diff:.1e} (allowed 1e-6)")


if __name__ == "__main__":
    main()

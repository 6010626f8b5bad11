"""Local training and evaluation in plain PyTorch (no Flower here)."""

from __future__ import annotations

import torch
from torch import nn

from fedsim.algorithms.base import LocalRun, LocalSGD
from fedsim.local import (  # noqa: F401  (the settings and step arithmetic, re-exported for callers)
    OPTIMIZERS,
    LocalTraining,
    batch_size_for,
    examples_processed,
    make_optimizer,
    num_local_steps,
    steps_within,
)
from fedsim.messages import TrainInstruction
from fedsim.tasks import CLASSIFICATION, Task


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    proximal_mu: float = 0.0,
    max_steps: int | None = None,
    algorithm=None,
    run=None,
    task: Task = CLASSIFICATION,
) -> tuple[float, int, int]:
    """Train ``model`` in place on ``(x, y)`` with a client algorithm's hooks (``fedsim.algorithms.base``).

    Returns ``(mean train loss, optimiser steps, examples processed)``. Without ``algorithm``/``run``: plain
    local SGD with the configured optimiser, FedProx's ``mu/2 * ||w - w_start||^2`` when ``proximal_mu > 0``, and
    averaged SGD's Polyak-Ruppert average with ``asgd``. ``max_steps`` caps the steps (a client that must stop at
    a deadline and send the work it finished). The loss is ``run.task``'s (``task`` when no ``run`` is given).
    """
    n = x.shape[0]
    bs = batch_size_for(n, cfg)
    steps = num_local_steps(n, cfg, max_steps)
    if algorithm is None:
        algorithm = LocalSGD(cfg)
    if run is None:
        start = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        run = LocalRun(model, TrainInstruction(spec="", proximal_mu=proximal_mu), cfg, -1, start, task=task)
    run.steps, run.x, run.y, run.generator = steps, x, y, generator
    params = [p for _, p in run.params]
    opt = make_optimizer(params, cfg)
    algorithm.before_training(run)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=x.device)  # summed on the device: no sync per step
    seen = 0
    while run.done < steps:
        order = torch.randperm(n, generator=generator).to(x.device)  # one pass over the data
        for start_ in range(0, n, bs):
            if run.done == steps:
                break
            idx = order[start_ : start_ + bs]
            loss = run.task.loss(model(x[idx]), y[idx])
            total += loss.detach().double()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            algorithm.on_gradients(run)
            opt.step()
            run.done += 1
            seen += idx.numel()
            algorithm.after_step(run)
    algorithm.after_training(run)
    return float(total) / max(run.done, 1), run.done, seen


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024, task: Task = CLASSIFICATION
) -> tuple[float, float]:
    """Return ``(mean loss, metric)`` of ``model`` on ``(x, y)`` under ``task`` (cross-entropy and accuracy by
    default)."""
    model.eval()
    n = x.shape[0]
    if n == 0:
        return float("nan"), float("nan")
    loss, total = 0.0, 0
    for s in range(0, n, batch_size):
        out = model(x[s : s + batch_size])
        loss += float(task.loss(out, y[s : s + batch_size], reduction="sum"))
        total += task.score(out, y[s : s + batch_size])
    return loss / n, task.finish(total, y)

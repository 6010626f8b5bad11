"""How a client trains locally: the settings (:class:`LocalTraining`, one frozen copy travels with the run spec),
the step arithmetic every engine shares, and the optimiser they build. The training loop itself is
``fedsim.training``; the client algorithms' hooks (``fedsim.algorithms``) sit between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsim.checks import integer, number
from fedsim.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "asgd")


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains locally; one frozen copy travels with the run spec.

    ``local_steps > 0`` overrides ``local_epochs``. ``batch_size = 0`` means full batch (FedSGD).
    """

    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    local_epochs: int = 1
    local_steps: int = 0
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        number("lr", self.lr, 0.0, lo_open=True)
        number("momentum", self.momentum, 0.0, 1.0, hi_open=True)
        if self.optimizer == "nesterov" and not self.momentum > 0:
            raise ConfigError("momentum", self.momentum, "a number in (0, 1) with client.optimizer=nesterov")
        number("weight_decay", self.weight_decay, 0.0)
        integer("batch_size", self.batch_size, 0, what="an integer >= 1, or 0 for full batch")
        integer("local_steps", self.local_steps, 0)
        if self.local_steps == 0:
            integer("local_epochs", self.local_epochs, 1, what="an integer >= 1 (or set client.local_steps)")


MOMENTUM = ("momentum", "nesterov")  # the optimisers that keep a momentum buffer


class Outer:
    """The gradient of a cohort's stacked weight ``(k, out, in)`` as the batched product ``a @ b`` not yet formed
    (``a``: ``(k, out, rows)``, ``b``: ``(k, rows, in)``), as the batched engine's dense step has it: the
    backward's output gradients times the layer's inputs. :func:`sgd_update_` steps along it without making the
    product where the step is the gradient's alone (plain SGD); everything else forms it (:meth:`tensor`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def tensor(self) -> torch.Tensor:
        return torch.bmm(self.a, self.b)


def sgd_update_(
    p: torch.Tensor, g: torch.Tensor | Outer, buf: torch.Tensor | None, cfg: LocalTraining
) -> None:
    """One SGD step of ``p`` in place from its gradient ``g``: the one definition of the rule, for a client's
    parameter (:class:`SGD`) and for a cohort's stacked parameters (the batched engine).

    ``torch.optim.SGD``'s rule with dampening 0: weight decay ``g + wd p``; with ``buf`` (the momentum buffer,
    zeros before the first step, so that its first value is the gradient, as torch's clone of it) ``buf = m buf
    + g`` and the step along ``buf`` (Nesterov: ``g + m buf``); ``p -= lr * step``. A gradient given as an
    unformed product (:class:`Outer`) is, for plain SGD, one ``p.baddbmm_(a, b, alpha=-lr)``: the same step,
    rounded once where forming the product and subtracting it rounds twice (the last bits of ``p`` differ).
    """
    if isinstance(g, Outer):
        if cfg.weight_decay == 0 and buf is None:
            p.baddbmm_(g.a, g.b, alpha=-cfg.lr)
            return
        g = g.tensor()
    if cfg.weight_decay != 0:
        g = g.add(p, alpha=cfg.weight_decay)
    if buf is not None:
        buf.mul_(cfg.momentum).add_(g)
        g = g.add(buf, alpha=cfg.momentum) if cfg.optimizer == "nesterov" else buf
    p.add_(g, alpha=-cfg.lr)


def proximal_gradient_(g: torch.Tensor, p: torch.Tensor, start: torch.Tensor, mu: float) -> torch.Tensor:
    """FedProx's term added to the gradient ``g`` in place: ``g + mu (p - start)``, the gradient of
    ``mu/2 ||p - start||^2`` (one definition, per client and for stacked rows)."""
    return g.add_(p - start, alpha=mu)


class SGD(torch.optim.Optimizer):
    """A client's SGD (plain, momentum, Nesterov, with weight decay) stepping with :func:`sgd_update_`, the rule
    the batched engine applies to stacked parameters: one definition, the same bits on every engine."""

    def __init__(self, params, cfg: LocalTraining) -> None:
        super().__init__(params, {"lr": cfg.lr})
        self.cfg = cfg

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        keeps = self.cfg.optimizer in MOMENTUM
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = None
                if keeps:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                sgd_update_(p, p.grad, buf, self.cfg)
        return loss


def make_optimizer(params, cfg: LocalTraining) -> torch.optim.Optimizer:
    """Return the configured optimiser over ``params``: :class:`SGD` for the SGD family (averaged SGD takes
    plain SGD steps; ``fedsim.algorithms`` keeps the average of its iterates), torch's Adam."""
    if cfg.optimizer in ("sgd", "asgd", *MOMENTUM):
        return SGD(params, cfg)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; allowed: {OPTIMIZERS}")


def batch_size_for(n: int, cfg: LocalTraining) -> int:
    """The batch size a client with ``n`` examples uses (``batch_size = 0``: full batch)."""
    return n if cfg.batch_size <= 0 else min(cfg.batch_size, n)


def num_local_steps(n: int, cfg: LocalTraining, max_steps: int | None = None) -> int:
    """Number of optimiser steps a client with ``n`` examples takes (at most ``max_steps`` when given)."""
    steps = cfg.local_steps if cfg.local_steps > 0 else cfg.local_epochs * -(-n // batch_size_for(n, cfg))
    return steps if max_steps is None else min(steps, max(0, int(max_steps)))


def examples_processed(n: int, cfg: LocalTraining, max_steps: int | None = None) -> int:
    """Examples a client with ``n`` examples processes in local training (what ``train_local`` reports).

    The server uses it to predict a task's simulated duration before sending it.
    """
    if n <= 0:
        return 0
    bs = batch_size_for(n, cfg)
    steps = num_local_steps(n, cfg, max_steps)
    per_pass = -(-n // bs)
    return (steps // per_pass) * n + (steps % per_pass) * bs


def steps_within(n: int, cfg: LocalTraining, examples: int) -> int:
    """The most local steps whose examples processed stay within ``examples`` (FedProx partial work)."""
    lo, hi = 0, num_local_steps(n, cfg)
    while lo < hi:  # largest s with examples_processed(n, cfg, s) <= examples (monotone in s)
        mid = (lo + hi + 1) // 2
        if examples_processed(n, cfg, mid) <= examples:
            lo = mid
        else:
            hi = mid - 1
    return lo

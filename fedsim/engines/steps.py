"""The batched SGD step of the vectorized engine (the gradients of the cohort's stacked parameters, then
``fedsim.local``'s SGD rule and FedProx's term, the ones a client's own training applies) and its CUDA graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedsim.local import proximal_gradient_, sgd_update_

if TYPE_CHECKING:
    from fedsim.engines.vectorized import _Client


def _sgd_step(step, forward, learnt, names, local, mu, params, bufs, anchor, loss_sum, xb, yb, w) -> None:
    """One SGD step of the first ``k = len(w)`` clients in place: gradients (the dense step, or autograd
    through ``forward``), then FedProx's term and the SGD rule of ``fedsim.local`` (``bufs``: momentum buffers,
    zeros before the first step) on each stacked parameter; losses added to ``loss_sum``."""
    k, width = w.shape
    full = k == len(loss_sum)  # every client still trains: no views of the first k rows
    rows = params if full else {n: params[n][:k] for n in names}
    if step is not None:  # an MLP on cross-entropy: the hand-written batched step
        # the weights' gradients unformed (Outer) unless FedProx's term is added to them
        per_client, by_name = step(rows, xb, yb, w, factored=anchor is None)
        grads = [by_name[n] for n in names]
    else:
        leaves = {n: rows[n].detach().requires_grad_() for n in names}
        with torch.enable_grad():
            out = forward(leaves, xb)  # (k, width, classes)
            losses = learnt.loss(out.flatten(0, 1), yb.flatten(), reduction="none").view(k, width)
            per_client = (losses * w).sum(1)  # (k,) each client's mean batch loss
            grads = torch.autograd.grad(per_client.sum(), [leaves[n] for n in names])
        per_client = per_client.detach()
    # no autograd below: the stacked parameters, buffers and losses never require grad
    if full:
        loss_sum += per_client.double()
    else:
        loss_sum[:k] += per_client.double()
    for n, g in zip(names, grads):
        p = rows[n]
        if anchor is not None:
            g = proximal_gradient_(g, p, anchor[n] if full else anchor[n][:k], mu)
        sgd_update_(p, g, (bufs[n] if full else bufs[n][:k]) if bufs else None, local)


class _StepGraph:
    """A cohort's SGD step on static buffers, captured once as a CUDA graph (``capture``) and replayed."""

    def __init__(self, sgd, params, anchor, k: int, width: int, x, y, capture: bool) -> None:
        self.params = {n: torch.zeros_like(p) for n, p in params.items()}
        momentum = sgd.args[4].optimizer != "sgd"
        self.bufs = {n: torch.zeros_like(p) for n, p in params.items()} if momentum else {}
        self.anchor = None if anchor is None else {n: torch.zeros_like(p) for n, p in anchor.items()}
        self.loss_sum = torch.zeros(k, dtype=torch.float64, device=x.device)
        cap = _capacity(x.shape[0])
        self.x = torch.zeros((cap, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.y = torch.zeros(cap, dtype=y.dtype, device=y.device)
        self.idx = torch.zeros(k, width, dtype=torch.long, device=x.device)
        self.w = torch.zeros(k, width, dtype=x.dtype, device=x.device)

        def fn() -> None:
            sgd(
                self.params, self.bufs, self.anchor, self.loss_sum, self.x[self.idx], self.y[self.idx], self.w
            )

        self.fn, self.graph = fn, None
        if capture:
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up before capture (the state is reset before every use)
                    fn()
            torch.cuda.current_stream(x.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()

    def run(self, params, anchor, x, y, gather, weight) -> tuple[dict[str, torch.Tensor], list[float]]:
        for n, p in self.params.items():
            p.copy_(params[n])
        for b in self.bufs.values():
            b.zero_()
        if self.anchor is not None:
            for n, a in self.anchor.items():
                a.copy_(anchor[n])
        self.loss_sum.zero_()
        self.x[: x.shape[0]].copy_(x)
        self.y[: y.shape[0]].copy_(y)
        for t in range(gather.shape[0]):
            self.idx.copy_(gather[t])
            self.w.copy_(weight[t])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.fn()
        return {n: p.clone() for n, p in self.params.items()}, self.loss_sum.cpu().tolist()


def _stack_starts(members: list[_Client], names: list[str], device: str) -> dict[str, torch.Tensor]:
    """The clients' start parameters as ``(clients, *shape)`` tensors on ``device`` (one copy of a start
    model the whole cohort shares, expanded)."""
    k = len(members)
    first = members[0].start
    if all(c.start is first for c in members):
        out = {}
        for n in names:
            p = first[n].to(device)
            out[n] = p.unsqueeze(0).expand(k, *p.shape).clone()
        return out
    return {n: torch.stack([c.start[n] for c in members]).to(device) for n in names}


def _capacity(n: int) -> int:
    """Rows of a static data buffer for ``n`` examples (a power of two: uneven cohorts reuse one graph)."""
    return 1 << max(0, (n - 1).bit_length())

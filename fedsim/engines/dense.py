"""A cohort's MLPs as one batched model with a hand-written backward pass (``bmm``, no autograd, no vmap).

For a plain ``nn.Sequential`` of ``Flatten``/``Linear``/``ReLU``/``Identity`` layers trained on
cross-entropy, a step of ``k`` clients is: the forward pass as one ``baddbmm`` per linear layer on
``(k, batch, features)`` activations; the loss's gradient written out (``softmax - onehot``, times each
example's weight ``1/b``, 0 for padding); the backward pass as two ``bmm`` per linear layer (weights and
inputs; the batched engine asks for the weights' one unformed, :class:`fedsim.local.Outer`, and plain SGD steps
along it in one ``baddbmm_``) and one mask per ReLU. On the CPU, the ``vmap(functional_call)`` forward and
``autograd.grad`` measured more than the whole of this step (their per-op dispatch dominates for a small MLP). Other losses
(a ``Task`` that is not exactly :class:`fedsim.tasks.Classification`) take autograd through the same
``bmm`` forward.

The math is each client's own forward and backward: the gradients equal the per-client ones to float
rounding (test).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedsim.local import Outer
from fedsim.tasks import Classification, Task

LAYERS = (nn.Linear, nn.ReLU, nn.Flatten, nn.Identity)
_RELU_BACKWARD = torch.ops.aten.threshold_backward  # (g, out, 0): g where out > 0, else 0 (bit for bit)


def supports(model: nn.Module) -> bool:
    """True when ``model`` is an ``nn.Sequential`` of :data:`LAYERS` with at least one ``Linear`` and
    flattens only the axes after the batch axis."""
    if type(model) is not nn.Sequential or not any(type(m) is nn.Linear for m in model):
        return False
    for m in model:
        if type(m) not in LAYERS:
            return False
        if type(m) is nn.Flatten and (m.start_dim, m.end_dim) != (1, -1):
            return False
    return True


class DenseStep:
    """``step(params, x, y, w)``: per-client mean losses ``(k,)`` and gradients by parameter name.

    ``params[name]``: stacked parameters ``(k, *shape)``; ``x``: inputs ``(k, batch, *input)``; ``y``: labels
    ``(k, batch)``; ``w``: each example's weight in its client's loss ``(k, batch)`` (``1/b``, 0 for padding).
    """

    def __init__(self, model: nn.Sequential, task: Task) -> None:
        if not supports(model):
            raise ValueError("DenseStep: not a Sequential of Flatten/Linear/ReLU/Identity layers")
        self.layers: list[tuple[str, str]] = []
        self.names: list[tuple[str, str]] = []  # each layer's parameter names (weight, bias), made once
        for name, m in model.named_children():
            kind = {nn.Linear: "linear", nn.ReLU: "relu", nn.Flatten: "flatten"}.get(type(m))
            if kind is not None:
                self.layers.append((kind, name))
                self.names.append((f"{name}.weight", f"{name}.bias"))
        self.first = next(i for i, (kind, _) in enumerate(self.layers) if kind == "linear")
        self.task = task
        self.manual = type(task) is Classification
        self._minus_one: torch.Tensor | None = None  # the cached -1 source of the onehot (``_minus``)

    def forward(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, saved: list | None = None
    ) -> torch.Tensor:
        """Outputs ``(k, batch, outputs)``; ``saved`` collects what the backward pass needs."""
        k, h = x.shape[0], x
        for (kind, _), (wname, bname) in zip(self.layers, self.names):
            if kind == "flatten":
                if saved is not None:
                    saved.append(h.shape)
                if h.dim() > 3:  # (k, batch, features) already: nothing to flatten
                    h = h.flatten(2)
            elif kind == "linear":
                w, b = params[wname], params.get(bname)
                flat = h.dim() == 3  # (k, rows, in) as it is: no reshape, no view back
                rows = h if flat else h.reshape(k, -1, h.shape[-1])
                if saved is not None:
                    saved.append((rows, None if flat else h.shape))
                out = (
                    torch.bmm(rows, w.transpose(1, 2))
                    if b is None
                    else torch.baddbmm(b.unsqueeze(1), rows, w.transpose(1, 2))
                )
                h = out if flat else out.view(*h.shape[:-1], out.shape[-1])
            else:  # relu
                h = torch.relu(h)
                if saved is not None:
                    saved.append(h)
        return h

    def __call__(
        self,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        factored: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``factored``: each linear weight's gradient as the unformed product :class:`fedsim.local.Outer`
        (``fedsim.local.sgd_update_`` steps along it without making it)."""
        if not self.manual:
            return self._autograd(params, x, y, w)
        saved: list = []
        logits = self.forward(params, x, saved)  # (k, batch, classes)
        logp = F.log_softmax(logits, dim=-1)
        y1 = y.unsqueeze(-1)
        nll = -logp.gather(-1, y1).squeeze(-1)  # (k, batch)
        losses = (nll * w).sum(1)
        g = logp.exp_()  # d loss / d logits = w * (softmax - onehot)
        g.scatter_add_(-1, y1, self._minus(g))
        g.mul_(w.unsqueeze(-1))
        grads: dict[str, torch.Tensor] = {}
        first = self.first
        for i in range(len(self.layers) - 1, first - 1, -1):
            kind = self.layers[i][0]
            s = saved[i]
            if kind == "linear":
                wname, bname = self.names[i]
                rows, shape = s
                g2 = g if shape is None else g.reshape(rows.shape[0], -1, g.shape[-1])  # (k, rows, out)
                a = g2.transpose(1, 2)  # the weight's gradient (k, out, in) is a @ rows
                grads[wname] = Outer(a, rows) if factored else torch.bmm(a, rows)
                if bname in params:
                    grads[bname] = g2.sum(1)
                if i > first:
                    g = torch.bmm(g2, params[wname])
                    g = g if shape is None else g.view(shape)
            elif kind == "relu":
                g = _RELU_BACKWARD(g, s, 0)  # g * (s > 0), one op
            elif g.shape != s:  # flatten
                g = g.view(s)
        return losses, grads

    def _minus(self, g: torch.Tensor) -> torch.Tensor:
        """``-1`` of the shape ``(k, batch, 1)`` of ``g``'s first column (the onehot's source), made once a shape
        and sliced for the steps where fewer clients train."""
        m = self._minus_one
        if (
            m is None
            or m.dtype != g.dtype
            or m.device != g.device
            or m.shape[1] != g.shape[1]
            or len(m) < len(g)
        ):
            m = self._minus_one = torch.full_like(g[..., :1], -1.0)
        return m if len(m) == len(g) else m[: len(g)]

    def _autograd(self, params, x, y, w):
        names = list(params)
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        with torch.enable_grad():
            out = self.forward(leaves, x)
            k, b = out.shape[:2]
            losses = (self.task.loss(out.flatten(0, 1), y.flatten(), reduction="none").view(k, b) * w).sum(1)
            grads = torch.autograd.grad(losses.sum(), [leaves[n] for n in names])
        return losses.detach(), dict(zip(names, grads))

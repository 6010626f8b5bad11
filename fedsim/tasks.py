"""What is learnt: the loss every client minimises and the metric every evaluation reports (``task=`` group).

A task is a small object with three parts:

- ``loss(out, y, reduction)``: the local objective (``"mean"`` for a step, ``"none"`` per example for the
  vectorized engine, ``"sum"`` for evaluation);
- ``metric`` (its name, e.g. ``accuracy``), ``higher_is_better``, and ``score(out, y)`` / ``finish(total, y)``:
  a per-batch sum and the metric computed from it over a whole split;
- ``targets``: the kind of labels it learns from (``classes`` or ``values``), checked against the data set.

The metric's name becomes metrics.jsonl's ``eval_<metric>``, ``fed_eval_<metric>`` and
``personal_eval_<metric>``, summary.json's ``final_eval_<metric>`` / ``best_eval_<metric>``, and the target key
``target_<metric>``. ``task=classification`` (cross-entropy, accuracy) is the default; ``task=regression`` is
mean squared error with R² as its metric. A user's own task is a ``_target_`` naming a subclass of :class:`Task`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # torch is imported where a loss is computed: reading a task's name and metric needs none
    import torch

__all__ = ["Classification", "Regression", "Task"]


class Task:
    """The loss and metric of a learning task (subclass it for your own; see the module docstring)."""

    name: ClassVar[str] = "task"
    metric: ClassVar[str] = "metric"
    higher_is_better: ClassVar[bool] = True
    targets: ClassVar[str] = "classes"  # the data set's labels: "classes" (int64 ids) or "values" (float32)

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The loss of model outputs ``out`` (batch, outputs) against labels ``y`` (batch,)."""
        raise NotImplementedError

    def score(self, out: torch.Tensor, y: torch.Tensor) -> float:
        """A per-batch quantity whose sum over a split gives the metric through :meth:`finish`."""
        raise NotImplementedError

    def finish(self, total: float, y: torch.Tensor) -> float:
        """The metric over a whole split with labels ``y`` from the summed :meth:`score` ``total``."""
        raise NotImplementedError

    def better(self, a: float, b: float) -> bool:
        """``a`` is at least as good as ``b``."""
        return a >= b if self.higher_is_better else a <= b

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Classification(Task):
    """Cross-entropy on class ids; the metric is accuracy (the share of argmax predictions that are right)."""

    name = "classification"
    metric = "accuracy"
    higher_is_better = True
    targets = "classes"

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        from torch.nn.functional import cross_entropy

        return cross_entropy(out, y, reduction=reduction)

    def score(self, out: torch.Tensor, y: torch.Tensor) -> float:
        return int((out.argmax(1) == y).sum())

    def finish(self, total: float, y: torch.Tensor) -> float:
        return total / y.shape[0]


class Regression(Task):
    """Mean squared error of a single output; the metric is R² = 1 - SSE / SST over the split.

    R² is 1 for a perfect fit and 0 for always predicting the split's own mean (negative when worse); it is
    undefined (NaN) for a split whose targets are all equal, and a client replies 0 for such a validation split.
    Federated evaluation averages the clients' R² weighted by their examples (as Flower averages any metric).
    """

    name = "regression"
    metric = "r2"
    higher_is_better = True
    targets = "values"

    @staticmethod
    def _pred(out: torch.Tensor) -> torch.Tensor:
        return out.squeeze(-1) if out.dim() > 1 and out.shape[-1] == 1 else out

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        from torch.nn.functional import mse_loss

        return mse_loss(self._pred(out), y, reduction=reduction)

    def score(self, out: torch.Tensor, y: torch.Tensor) -> float:
        return float(((self._pred(out).double() - y.double()) ** 2).sum())  # the batch's squared errors

    def finish(self, total: float, y: torch.Tensor) -> float:
        sst = float(((y.double() - y.double().mean()) ** 2).sum())
        return 1.0 - total / sst if sst > 0 else float("nan")


CLASSIFICATION = Classification()

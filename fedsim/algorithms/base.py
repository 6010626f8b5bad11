"""The client-algorithm contract: what an FL algorithm may do on the client, in one small class.

A client algorithm is the client half of an FL algorithm, the way a strategy (``fedsim.strategies``) is the
server half. Every engine runs it through fedsim's one ClientApp; it never sees Flower. Its hooks, called by
the local-training loop (``fedsim.training.train_local``) in this order for one task:

1. :meth:`ClientAlgorithm.before_training` with a :class:`LocalRun`: the model holds the global weights
   (``run.start`` keeps a copy), ``run.incoming`` holds the extra arrays the server sent with them (e.g.
   SCAFFOLD's server control variate), ``run.state`` the arrays this client kept from its previous task.
2. Per local step, after ``loss.backward()``: :meth:`~ClientAlgorithm.on_gradients` (a gradient correction:
   FedProx's ``mu (w - w_start)``, SCAFFOLD's ``c - c_i``), then the optimiser's step, then
   :meth:`~ClientAlgorithm.after_step` (e.g. the running average of averaged SGD).
3. :meth:`~ClientAlgorithm.after_training`: final adjustments of the model, arrays to send back in
   ``run.outgoing`` (one ArrayRecord each, next to the model), metrics in ``run.metrics``, and the new
   persistent state in ``run.state`` (saved by the ClientApp when ``stateful`` is set).

The objective is the task's loss (cross-entropy) plus whatever the gradient hook adds. ``client=`` picks the
optimiser settings (:class:`fedsim.local.LocalTraining`); ``client._target_`` the algorithm class (default
:class:`LocalSGD`); a strategy names the algorithm its clients need (``client_algorithm``) and fedsim uses it.
Keys of the ``client`` group that are not optimiser settings are the algorithm's own constructor parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsim.local import LocalTraining, proximal_gradient_
from fedsim.messages import TrainInstruction
from fedsim.tasks import CLASSIFICATION, Task


@dataclass
class LocalRun:
    """One task of one client, as the algorithm's hooks see it."""

    model: nn.Module
    instruction: TrainInstruction
    local: LocalTraining
    partition_id: int
    start: dict[str, torch.Tensor]  # the trainable parameters as received, by name
    incoming: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # extra arrays from the server
    state: dict[str, np.ndarray] = field(default_factory=dict)  # this client's persistent arrays
    outgoing: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # extra arrays to send back
    metrics: dict[str, float] = field(default_factory=dict)  # extra reply metrics
    steps: int = 0  # local steps planned
    done: int = 0  # local steps taken so far
    scratch: dict[str, Any] = field(default_factory=dict)  # the algorithm's own per-task values
    x: torch.Tensor | None = None  # the client's training data (set by the training loop)
    y: torch.Tensor | None = None
    generator: torch.Generator | None = None  # the task's minibatch-order generator (after the main loop)
    task: Task = CLASSIFICATION  # the loss to minimise (``task=`` group): ``run.task.loss(model(x), y)``

    @property
    def params(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters, by name, in the model's order."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]


class ClientAlgorithm:
    """Local training with the configured optimiser; subclasses override the hooks they need.

    Parameters
    ----------
    local : LocalTraining
        The ``client`` group's optimiser settings (optimiser, lr, momentum, epochs or steps, batch size).

    Attributes
    ----------
    stateful : bool
        The client keeps ``run.state`` between its tasks (per-client state, see ``fedsim.algorithms.state``).
    sends : tuple of (str, str)
        What it sends back besides its model, as ``(what, kind)`` with a kind of
        ``fedsim.strategies.composition.KINDS`` (SCAFFOLD: ``("its control-variate delta dc_i", "raw")``);
        DP refuses what its wrapper does not privatise.
    keeps : str or None
        What per-client state never leaves the client (named in the README's privacy table).
    batched : bool
        The vectorized engine may train it as one batched model (only plain local SGD with FedProx's term,
        which it implements itself); otherwise its clients run through the ClientApp. Read from the class's
        own body only: a subclass (of ``LocalSGD``, say) is not batched unless it says so again.
    """

    stateful = False
    batched = False
    sends: tuple[tuple[str, str], ...] = ()
    keeps: str | None = None

    def __init__(self, local: LocalTraining) -> None:
        self.local = local

    def before_training(self, run: LocalRun) -> None:
        """Before the first local step (the model holds the global weights)."""
        if self.local.optimizer == "asgd":
            run.scratch["average"] = [p.detach().clone() for _, p in run.params]

    def on_gradients(self, run: LocalRun) -> None:
        """After ``backward``, before the optimiser step: FedProx's proximal gradient ``mu (w - w_start)``."""
        mu = run.instruction.proximal_mu
        if mu > 0:
            with torch.no_grad():
                for name, p in run.params:
                    proximal_gradient_(p.grad, p, run.start[name], mu)

    def after_step(self, run: LocalRun) -> None:
        """After the optimiser step (``run.done`` steps taken): averaged SGD's running mean of the iterates."""
        average = run.scratch.get("average")
        if average is not None:
            with torch.no_grad():
                for a, (_, p) in zip(average, run.params):
                    a.add_(p - a, alpha=1.0 / run.done)

    def after_training(self, run: LocalRun) -> None:
        """After the last step: averaged SGD ends at the average of its iterates."""
        average = run.scratch.get("average")
        if average is not None and run.done:
            with torch.no_grad():
                for a, (_, p) in zip(average, run.params):
                    p.copy_(a)

    def personalize(self, model: nn.Module, state: dict[str, np.ndarray]) -> None:
        """Turn the global model (loaded in ``model``) into the model this client would use, from its state.

        Called before federated evaluation. Default: the global model itself (no personal part).
        """


class LocalSGD(ClientAlgorithm):
    """Plain local training: SGD (with momentum, Nesterov, weight decay), Adam or averaged SGD, and FedProx's
    proximal term when the strategy sends ``proximal-mu``. The vectorized engine batches its SGD variants."""

    batched = True


def local_training_fields() -> tuple[str, ...]:
    """The ``client`` keys that are optimiser settings (the rest go to the algorithm's constructor)."""
    return tuple(LocalTraining.__dataclass_fields__)

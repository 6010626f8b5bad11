"""FedDyn's client half (Acar et al., ICLR 2021, https://arxiv.org/abs/2111.04263): a dynamic regulariser.

Client ``k`` minimises ``L_k(w) - <g_k, w> + alpha/2 ||w - x||^2`` from the server model ``x`` (``alpha`` arrives
as ``feddyn-alpha`` in the train config), so each local step adds ``-g_k + alpha (w - x)`` to the gradient. After
training, its persistent ``g_k`` (the gradient of its loss at its last model, by the first-order condition)
becomes ``g_k - alpha (w_k - x)``. The server half is ``fedsim.features.feddyn.server.FedDyn``.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsim.algorithms.base import ClientAlgorithm, LocalRun

ALPHA = "feddyn-alpha"  # train-config key: the regulariser weight
_STATE = "g_k/"


class FedDyn(ClientAlgorithm):
    """FedDyn client: local training on the dynamically regularised objective; keeps ``g_k``."""

    stateful = True
    strategy = "fedsim.features.feddyn.server.FedDyn"
    keeps = "its gradient correction g_k"

    def before_training(self, run: LocalRun) -> None:
        super().before_training(run)
        if ALPHA not in run.instruction.unhandled:
            raise ValueError(f"FedDyn client: the train config holds no '{ALPHA}' (run strategy=feddyn)")
        run.scratch["alpha"] = float(run.instruction.unhandled[ALPHA])
        run.scratch["g"] = {
            name: torch.as_tensor(
                np.asarray(run.state.get(_STATE + name, np.zeros(tuple(p.shape))), np.float64),
                dtype=p.dtype,
                device=p.device,
            )
            for name, p in run.params
        }

    def on_gradients(self, run: LocalRun) -> None:
        super().on_gradients(run)
        alpha = run.scratch["alpha"]
        with torch.no_grad():
            for name, p in run.params:
                p.grad.sub_(run.scratch["g"][name]).add_(p - run.start[name], alpha=alpha)

    def after_training(self, run: LocalRun) -> None:
        super().after_training(run)
        alpha = run.scratch["alpha"]
        run.state = {
            _STATE + name: (
                run.scratch["g"][name].double() - alpha * (p.detach().double() - run.start[name].double())
            )
            .cpu()
            .numpy()
            for name, p in run.params
        }

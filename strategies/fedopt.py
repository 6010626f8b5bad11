"""Shared server loop of the adaptive optimisers of Reddi et al., ICLR 2021 (https://arxiv.org/abs/2003.00295)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedsim.aggregate import SecondMoment, fedopt_step, is_float
from fedsim.checks import number
from fedsim.records import to_numpy
from fedsim.strategies.fedavg import FedAvg


class FedOpt(FedAvg):
    """FedAvg's mean as a pseudo-gradient ``delta = mean - x`` fed to an adaptive server optimiser.

    Algorithm 2 of Reddi et al.: ``m = b1 m + (1 - b1) delta``, ``v = rule(v, delta)``,
    ``x = x + eta m / (sqrt(v) + tau)``, with ``m`` starting at 0 and ``v`` at ``tau^2``, and no bias
    correction. Subclasses set ``rule``. Differences from Flower's ``FedOpt`` family: Flower's ``FedAdam``
    adds an Adam bias correction with exponent ``round + 1`` and returns float64 arrays for a float32 model;
    Flower starts ``v`` at 0. Flower's ``eta_l`` (the client learning rate, unused by its server) is accepted
    and kept as ``self.eta_l``; fedsim's clients train with ``client.lr``.

    Parameters
    ----------
    eta : float
        Server learning rate, > 0.
    beta_1, beta_2 : float
        Decay of the first and second moments, in [0, 1).
    tau : float
        Adaptivity (added to ``sqrt(v)``), > 0.
    eta_l : float, optional
        Flower's client learning rate: kept, not used (set ``client.lr``).
    **kwargs
        Passed to ``FedAvg``.
    """

    rule: SecondMoment

    def __init__(
        self, eta: float, beta_1: float, beta_2: float, tau: float, eta_l: float | None = None, **kwargs: Any
    ) -> None:
        self.eta = number("eta", eta, 0.0, lo_open=True)
        self.eta_l = None if eta_l is None else number("eta_l", eta_l, 0.0, lo_open=True)
        self.beta_1 = number("beta_1", beta_1, 0.0, 1.0, hi_open=True)
        self.beta_2 = number("beta_2", beta_2, 0.0, 1.0, hi_open=True)
        self.tau = number("tau", tau, 0.0, lo_open=True)
        super().__init__(**kwargs)
        self.current: dict[str, np.ndarray] | None = None
        self.m: dict[str, np.ndarray] | None = None
        self.v: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global model ``x`` the step starts from; then FedAvg's messages."""
        self.current = to_numpy(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def server_step(self, avg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One adaptive step from the current global model by ``avg - x`` (``avg``: the weighted mean; updates
        ``m`` and ``v``)."""
        if self.current is None:
            raise RuntimeError(f"{type(self).__name__}.aggregate_train called before configure_train")
        floats = [k for k, a in self.current.items() if is_float(a)]
        x = {k: self.current[k] for k in floats}
        delta = {k: avg[k] - np.asarray(x[k], np.float64) for k in floats}
        x, self.m, self.v = fedopt_step(
            x,
            delta,
            self.m,
            self.v,
            second_moment=type(self).rule,
            eta=self.eta,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            tau=self.tau,
        )
        return {**avg, **x}

    def state_dict(self) -> dict:
        """The moment estimates (``None`` before the first aggregation)."""
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.m, self.v = state["m"], state["v"]

"""FedYogi (Reddi et al., ICLR 2021, https://arxiv.org/abs/2003.00295)."""

from __future__ import annotations

from typing import Any

from fedsim.aggregate import yogi_second_moment
from fedsim.strategies.fedopt import FedOpt


class FedYogi(FedOpt):
    """Yogi on the server: ``v = v - (1 - beta_2) delta^2 sign(v - delta^2)`` (see ``FedOpt`` for the step).

    Parameters
    ----------
    eta : float
        Server learning rate, > 0.
    beta_1, beta_2 : float
        Moment decays in [0, 1) (paper: 0.9, 0.99).
    tau : float
        Adaptivity, > 0 (paper: 1e-3).
    **kwargs
        Passed to ``FedAvg``.
    """

    rule = staticmethod(yogi_second_moment)

    def __init__(
        self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3, **kwargs: Any
    ) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, **kwargs)

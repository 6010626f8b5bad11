"""FedAdagrad (Reddi et al., ICLR 2021, https://arxiv.org/abs/2003.00295)."""

from __future__ import annotations

from typing import Any

from fedsim.aggregate import adagrad_second_moment
from fedsim.strategies.fedopt import FedOpt


class FedAdagrad(FedOpt):
    """Adagrad on the server: ``v = v + delta^2`` (see ``FedOpt`` for the step).

    Parameters
    ----------
    eta : float
        Server learning rate, > 0.
    beta_1 : float
        First-moment decay in [0, 1); 0 (Flower's fixed choice) makes the step use ``delta`` itself.
    tau : float
        Adaptivity, > 0 (paper: 1e-3).
    **kwargs
        Passed to ``FedAvg``.
    """

    rule = staticmethod(adagrad_second_moment)

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.0, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=0.0, tau=tau, **kwargs)

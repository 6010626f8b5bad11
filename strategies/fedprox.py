"""FedProx (Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedsim import keys
from fedsim.checks import number
from fedsim.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """FedAvg whose clients add the proximal term ``mu/2 * ||w - w_global||^2`` to their local loss.

    The server side is FedAvg; ``configure_train`` puts ``proximal-mu`` into the train config, and fedsim's
    client implements the term. ``proximal_mu = 0`` is plain FedAvg.

    Parameters
    ----------
    proximal_mu : float
        Weight of the proximal term, >= 0 (the paper tries 0.001 to 1).
    **kwargs
        Passed to ``FedAvg``.
    """

    def __init__(self, proximal_mu: float = 0.01, **kwargs: Any) -> None:
        mu = number("proximal_mu", proximal_mu, 0.0)
        super().__init__(**kwargs)
        self.proximal_mu = mu

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's train messages with ``proximal-mu`` in the config."""
        config[keys.PROXIMAL_MU] = self.proximal_mu
        return super().configure_train(server_round, arrays, config, grid)

"""FedDyn's server half (Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, ICLR 2021).

With ``N`` clients in the population, ``P`` the round's valid replies ``w_k`` and ``x`` the model sent::

    h <- h - alpha / N * sum_{k in P} (w_k - x)
    x <- mean_{k in P} w_k - h / alpha

The clients (``fedsim.features.feddyn.client.FedDyn``) receive ``alpha`` as ``feddyn-alpha`` in the train config.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedsim.aggregate import cast_like, is_float
from fedsim.checks import integer, number
from fedsim.features.feddyn.client import ALPHA
from fedsim.records import to_numpy, to_record
from fedsim.strategies.composition import COHORT_SCALED, Release
from fedsim.strategies.fedavg import FedAvg


class FedDyn(FedAvg):
    """FedDyn with regulariser weight ``alpha``.

    Parameters
    ----------
    num_clients : int
        N, the population.
    alpha : float
        The dynamic regulariser's weight (> 0); the paper uses 0.01-0.1.
    **kwargs
        Passed to fedsim's FedAvg.
    """

    client_algorithm = "fedsim.features.feddyn.client.FedDyn"
    releases = (
        Release("its global model (mean - h / alpha, h summing every reply's update)", COHORT_SCALED),
    )

    def __init__(self, num_clients: int, alpha: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_clients = integer("num_clients", num_clients, 1)
        self.alpha = number("alpha", alpha, 0.0, lo_open=True)
        self.h: dict[str, np.ndarray] | None = None
        self.current: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's train messages with ``feddyn-alpha`` in their config."""
        self.current = to_numpy(arrays)
        config[ALPHA] = self.alpha
        return super().configure_train(server_round, arrays, config, grid)

    def combine(self, models, weights):
        """``mean(w_k) - h / alpha`` after ``h -= alpha / N sum(w_k - x)`` (uniform over the replies)."""
        x = self.current
        floats = [k for k in x if is_float(x[k])]
        if self.h is None:
            self.h = {k: np.zeros(np.shape(x[k]), np.float64) for k in floats}
        for k in floats:
            drift = sum(np.asarray(m[k], np.float64) - x[k] for m in models)
            self.h[k] = self.h[k] - self.alpha / self.num_clients * drift
        mean = {k: np.mean([np.asarray(m[k], np.float64) for m in models], axis=0) for k in models[0]}
        return {k: (mean[k] - self.h[k] / self.alpha if k in self.h else mean[k]) for k in mean}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's parsing, FedDyn's combination."""
        valid, models, weights = self._parse(replies)
        if not valid:
            return None, None
        arrays = to_record(cast_like(self.combine(models, weights), models[0]))
        return arrays, self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)

    def state_dict(self) -> dict:
        """The server state ``h``."""
        return {"h": None if self.h is None else {k: v.copy() for k, v in self.h.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.h = None if state["h"] is None else {k: np.asarray(v, np.float64) for k, v in state["h"].items()}

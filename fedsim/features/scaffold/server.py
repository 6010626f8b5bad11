"""SCAFFOLD's server half (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020), with a global step size.

Each round the server sends the model ``x`` and its control variate ``c`` (the ArrayRecord ``scaffold-c``); the
clients (``fedsim.features.scaffold.client.Scaffold``) return their models ``y_i`` and ``dc_i``. Then::

    x <- x + lr_g * mean_i (y_i - x)
    c <- c + (|S| / N) * mean_i dc_i            # = c + sum_i dc_i / N

with the mean uniform over the ``|S|`` valid replies, as in the paper (Algorithm 1), and ``N`` the population.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsim import keys
from fedsim.aggregate import cast_like, is_float
from fedsim.checks import integer, number
from fedsim.features.scaffold.client import DELTA_C, SERVER_C
from fedsim.records import reply_arrays, to_numpy, to_record
from fedsim.strategies.composition import MEAN, RAW, Release
from fedsim.strategies.fedavg import FedAvg


class Scaffold(FedAvg):
    """SCAFFOLD (option II control variates, global learning rate ``server_lr``).

    Parameters
    ----------
    num_clients : int
        N, the population (the ``c`` update is ``sum_i dc_i / N``).
    server_lr : float
        Global step size ``lr_g`` > 0 (1.0: the new model is the mean of the client models).
    **kwargs
        Passed to fedsim's FedAvg (Flower's keyword arguments).
    """

    client_algorithm = "fedsim.features.scaffold.client.Scaffold"
    releases = (Release("its global model", MEAN), Release("its control variate c", RAW))

    def __init__(self, num_clients: int, server_lr: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_clients = integer("num_clients", num_clients, 1)
        self.server_lr = number("server_lr", server_lr, 0.0, lo_open=True)
        self.c: dict[str, np.ndarray] | None = None
        self.current: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's messages, each also carrying the control variate ``c``."""
        self.current = to_numpy(arrays)
        if self.c is None:
            self.c = {k: np.zeros(np.shape(a), np.float64) for k, a in self.current.items() if is_float(a)}
        c_record = ArrayRecord({k: Array(v.astype(np.float32)) for k, v in self.c.items()})
        out = []
        for msg in super().configure_train(server_round, arrays, config, grid):
            msg.content = RecordDict({**dict(msg.content.items()), SERVER_C: c_record})
            out.append(msg)
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``x + lr_g mean(y_i - x)`` and ``c + sum(dc_i) / N`` over the valid replies."""
        # Flower's reply check wants exactly one ArrayRecord per reply; SCAFFOLD's carry two
        valid = [
            m for m in replies if not m.has_error() and keys.ARRAYS in m.content and DELTA_C in m.content
        ]
        if not valid or self.current is None:
            return None, None
        x = self.current
        floats = [k for k in x if is_float(x[k])]
        models = [reply_arrays(m) for m in valid]
        new = {
            k: np.asarray(x[k], np.float64)
            + self.server_lr * np.mean([np.asarray(y[k], np.float64) - x[k] for y in models], axis=0)
            for k in floats
        }
        for m in valid:
            dc = to_numpy(m.content[DELTA_C])
            for k in self.c:
                if k in dc:
                    self.c[k] = self.c[k] + np.asarray(dc[k], np.float64) / self.num_clients
        arrays = to_record(cast_like({**models[-1], **new}, models[0]))
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return arrays, metrics

    def state_dict(self) -> dict:
        """The control variate ``c`` (float64 arrays)."""
        return {"c": None if self.c is None else {k: v.copy() for k, v in self.c.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.c = None if state["c"] is None else {k: np.asarray(v, np.float64) for k, v in state["c"].items()}

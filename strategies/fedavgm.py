"""FedAvg with server momentum, FedAvgM (Hsu, Qi, Brown 2019, https://arxiv.org/abs/1909.06335), and the same
server step for any rule that turns the replies into one model (the robust rules' ``server_momentum``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedsim.aggregate import is_float, momentum_step
from fedsim.checks import number
from fedsim.records import to_numpy
from fedsim.strategies.fedavg import FedAvg


class ServerMomentum(FedAvg):
    """A server SGD step with momentum on the pseudo-gradient ``x - agg``, where ``agg`` is what the strategy's
    rule made of the replies (FedAvg: their weighted mean; the robust rules: a median, a trimmed mean, Krum's
    choice).

    ``v = momentum * v + (x - agg)``, ``x = x - lr * v``. With ``lr = 1`` and ``momentum = 0`` the step is
    skipped and the new global model is ``agg`` itself, bit for bit. ``x`` is the global model handed to
    ``configure_train`` each round, so a wrapper that changes the aggregate (DP noise) or a resumed run stays
    consistent. Only floating-point arrays take the step; integer buffers keep ``agg``'s values.

    Parameters
    ----------
    server_learning_rate : float
        Server step size, > 0.
    server_momentum : float
        Momentum in [0, 1).
    **kwargs
        Passed to ``FedAvg``.
    """

    def __init__(
        self, server_learning_rate: float = 1.0, server_momentum: float = 0.0, **kwargs: Any
    ) -> None:
        lr = number("server_learning_rate", server_learning_rate, 0.0, lo_open=True)
        mom = number("server_momentum", server_momentum, 0.0, 1.0, hi_open=True)
        super().__init__(**kwargs)
        self.server_learning_rate, self.server_momentum = lr, mom
        self.current: dict[str, np.ndarray] | None = None
        self.velocity: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global model the step starts from; then FedAvg's messages."""
        self.current = to_numpy(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def server_step(self, agg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One momentum step from the current global model to ``agg`` (updates the velocity)."""
        if self.server_learning_rate == 1.0 and self.server_momentum == 0.0:
            return agg
        if self.current is None:
            raise RuntimeError(f"{type(self).__name__}.aggregate_train called before configure_train")
        floats = [k for k, a in self.current.items() if is_float(a)]
        x, self.velocity = momentum_step(
            {k: self.current[k] for k in floats},
            {k: agg[k] for k in floats},
            self.velocity,
            self.server_learning_rate,
            self.server_momentum,
        )
        return {**agg, **x}

    def state_dict(self) -> dict:
        """The momentum buffer (``None`` before the first step)."""
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.velocity = state["velocity"]


class FedAvgM(ServerMomentum):
    """FedAvg followed by a server SGD step with momentum on the pseudo-gradient ``x - mean``.

    ``v = momentum * v + (x - mean)``, ``x = x - lr * v``; ``lr = 1, momentum = 0`` is FedAvg. Unlike Flower's
    ``FedAvgM``, which remembers its own last output, ``x`` is the global model handed to ``configure_train``
    each round, so a wrapper that changes the aggregate (DP noise) or a resumed run stays consistent. Only
    floating-point arrays take the step; integer buffers are averaged.

    Parameters
    ----------
    server_learning_rate : float
        Server step size, > 0.
    server_momentum : float
        Momentum in [0, 1); Hsu et al. use 0.9 (with lr 1.0).
    **kwargs
        Passed to ``FedAvg``.
    """

    def __init__(
        self, server_learning_rate: float = 1.0, server_momentum: float = 0.9, **kwargs: Any
    ) -> None:
        super().__init__(server_learning_rate=server_learning_rate, server_momentum=server_momentum, **kwargs)

"""FedBuff (Nguyen et al., AISTATS 2022, https://arxiv.org/abs/2106.06639): buffered asynchronous aggregation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fedsim.aggregate import cast_like, is_float
from fedsim.checks import integer, number
from fedsim.records import to_numpy, to_record
from fedsim.strategies.async_base import AsyncStrategy

Arrays = Mapping[str, np.ndarray]


def server_step(
    x: Arrays, delta: Arrays, velocity: Arrays | None, lr: float, momentum: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One server step along the mean buffered update ``delta`` (float64); returns ``(x', v')``.

    ``v = momentum * v + delta`` (``v = delta`` the first time), ``x' = x + lr * v``. Keys are ``delta``'s.
    """
    v = {k: np.asarray(d, np.float64) for k, d in delta.items()}
    if velocity is not None:
        v = {k: momentum * np.asarray(velocity[k], np.float64) + v[k] for k in v}
    return {k: np.asarray(x[k], np.float64) + lr * v[k] for k in v}, v


class FedBuff(AsyncStrategy):
    """FedBuff: buffer ``K`` staleness-weighted client deltas, then take one server step.

    For each update trained from ``x_start`` (the version the client received) with staleness ``s``::

        buffer += s_w(s) * (x_client - x_start)          # s_w(s) = 1/sqrt(1+s) by default
        after K updates:  v = momentum * v + buffer / K;  x <- x + server_lr * v;  buffer <- 0

    Only the K-th update of a buffer makes a new server model version. With ``K = 1``, ``momentum = 0`` and no
    staleness this is FedAsync with ``alpha = server_lr`` and constant weights. Integer arrays (e.g. BatchNorm
    step counters) are taken from the last client of the buffer. Updates are not weighted by example count
    (as in the paper).

    Parameters
    ----------
    buffer_size : int
        K, updates per server step (>= 1); the paper uses 10 (also FLSim's Sent140 example).
    server_lr : float
        Server learning rate eta_g (> 0); 1.0 makes a step the plain mean of the buffered deltas.
    server_momentum : float
        Server momentum beta in [0, 1); FLSim's example uses 0.9 with lr 0.7.
    staleness, staleness_a, staleness_b, hinge_a
        Staleness weighting (see ``fedsim.strategies.staleness``); default ``polynomial`` with ``a = 0.5``.
    concurrency : int
        Clients kept busy at once (>= 1, at most the population).
    max_staleness : int or None
        Updates staler than this are dropped by the loop (counted as ``dropped_stale``); None: keep all.
    wall_clock : bool
        True in deployment: real arrival order and wall-clock time instead of the simulated clock.
    proximal_mu : float
        Weight >= 0 of the clients' proximal term ``mu/2 ||w - w_start||^2`` (sent as ``proximal-mu``); 0: off.
    **flower_kwargs
        ``fraction_train`` and friends, passed to every strategy by fedsim's builder; ignored.
    """

    def __init__(
        self,
        buffer_size: int = 10,
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        staleness: str = "polynomial",
        staleness_a: float = 0.5,
        staleness_b: float = 4.0,
        hinge_a: float = 10.0,
        concurrency: int | None = 10,
        max_staleness: int | None = None,
        wall_clock: bool = False,
        proximal_mu: float = 0.0,
        **flower_kwargs: Any,
    ) -> None:
        self.buffer_size = integer("buffer_size", buffer_size, 1)
        self.server_lr = number("server_lr", server_lr, 0.0, lo_open=True)
        self.server_momentum = number("server_momentum", server_momentum, 0.0, 1.0, hi_open=True)
        super().__init__(
            staleness,
            staleness_a,
            staleness_b,
            concurrency,
            max_staleness,
            wall_clock,
            flower_kwargs,
            proximal_mu,
            hinge_a=hinge_a,
        )
        self.buffer: dict[str, np.ndarray] | None = None  # sum of weighted deltas (float64)
        self.count = 0  # updates in the buffer
        self.others: dict[str, np.ndarray] = {}  # non-float arrays of the latest buffered update
        self.velocity: dict[str, np.ndarray] | None = None
        self.steps = 0  # server steps taken

    def on_update(
        self, current: ArrayRecord, update: ArrayRecord, start: ArrayRecord, staleness: int, num_examples: int
    ) -> ArrayRecord | None:
        """Buffer ``update - start`` weighted by staleness; after K updates return the new global model."""
        w = self.weight(staleness)
        xc, xs = to_numpy(update), to_numpy(start)
        floats = [k for k, a in xs.items() if is_float(a)]
        delta = {k: w * (np.asarray(xc[k], np.float64) - np.asarray(xs[k], np.float64)) for k in floats}
        self.buffer = delta if self.buffer is None else {k: self.buffer[k] + delta[k] for k in floats}
        self.others = {k: np.asarray(a) for k, a in xc.items() if k not in delta}
        self.count += 1
        if self.count < self.buffer_size:
            return None
        x = to_numpy(current)
        mean = {k: b / self.buffer_size for k, b in self.buffer.items()}
        new, self.velocity = server_step(x, mean, self.velocity, self.server_lr, self.server_momentum)
        self.buffer, self.count, self.steps = None, 0, self.steps + 1
        return to_record(cast_like({**x, **self.others, **new}, x))

    def state_dict(self) -> dict:
        """Buffer, its count, the non-float arrays, the momentum and the step count (for checkpoints)."""
        return {
            "buffer": self.buffer,
            "count": self.count,
            "others": self.others,
            "velocity": self.velocity,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.buffer, self.count, self.others = state["buffer"], int(state["count"]), dict(state["others"])
        self.velocity, self.steps = state["velocity"], int(state["steps"])

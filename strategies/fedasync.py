"""FedAsync (Xie, Koyejo, Gupta 2019, https://arxiv.org/abs/1903.03934): mix every client model in at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fedsim.aggregate import cast_like, is_float
from fedsim.checks import number
from fedsim.records import to_numpy, to_record
from fedsim.strategies.async_base import AsyncStrategy


def mix(
    x: Mapping[str, np.ndarray], x_client: Mapping[str, np.ndarray], alpha: float
) -> dict[str, np.ndarray]:
    """``x + alpha (x_client - x)`` = ``(1 - alpha) x + alpha x_client`` on float arrays (float64).

    Integer arrays (e.g. BatchNorm step counters) are taken from the client.
    """
    out = {}
    for k, a in x.items():
        if is_float(a):
            xa = np.asarray(a, np.float64)
            out[k] = xa + alpha * (np.asarray(x_client[k], np.float64) - xa)
        else:
            out[k] = np.asarray(x_client[k])
    return out


class FedAsync(AsyncStrategy):
    """FedAsync: each client model is mixed into the global one as it arrives, down-weighted by staleness.

    On an update ``x_client`` trained from version ``tau`` and arriving at version ``t``::

        alpha_t = alpha * s(t - tau)
        x      <- (1 - alpha_t) x + alpha_t x_client        # a new server model version

    fedsim's asynchronous loop (``fedsim.async_server.run_async``) keeps ``concurrency`` clients busy, drops
    updates staler than ``max_staleness`` before they reach the strategy, and calls ``on_update`` for each
    valid one. With ``proximal_mu = rho > 0`` each client minimises ``f(x) + rho/2 ||x - x_tau||^2`` (the
    paper's regularised local problem, ``x_tau`` the model it started from), as FedProx's clients do.

    Parameters
    ----------
    alpha : float
        Mixing weight in (0, 1]; the paper and implementations use 0.6 (Plato 0.9).
    staleness : str
        ``constant``, ``polynomial`` ((1+s)^-a) or ``hinge`` (1 if s <= b else 1/(a_h(s-b)+1)).
    staleness_a : float
        The polynomial's exponent ``a`` (0.5).
    staleness_b : float
        The hinge's knee ``b`` (4).
    hinge_a : float
        The hinge's slope ``a_h``; 10 as in Xie et al. 2019.
    concurrency : int
        Clients kept busy at once (>= 1, at most the population).
    max_staleness : int or None
        Updates staler than this are dropped (counted as ``dropped_stale``); None: keep all.
    wall_clock : bool
        True in deployment: real arrival order and wall-clock time instead of the simulated clock.
    proximal_mu : float
        The paper's rho >= 0, sent to the clients as ``proximal-mu``; 0 (default) is plain local SGD.
    default_num_rounds : int, optional
        Only for the config: the run's ``num_rounds`` defaults to it (one version per update needs more
        versions than a synchronous run has rounds).
    **flower_kwargs
        ``fraction_train`` and friends, passed to every strategy by fedsim's builder; ignored.
    """

    def __init__(
        self,
        alpha: float = 0.6,
        staleness: str = "polynomial",
        staleness_a: float = 0.5,
        staleness_b: float = 4.0,
        hinge_a: float = 10.0,
        concurrency: int | None = 10,
        max_staleness: int | None = None,
        wall_clock: bool = False,
        proximal_mu: float = 0.0,
        default_num_rounds: int | None = None,
        **flower_kwargs: Any,
    ) -> None:
        del default_num_rounds  # read by the config (the run's num_rounds default), not by the strategy
        self.alpha = number("alpha", alpha, 0.0, 1.0, lo_open=True)
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
        self.updates = 0  # updates mixed in so far

    def mixing_weight(self, staleness: int) -> float:
        """``alpha_t = alpha * s(staleness)``."""
        return self.alpha * self.weight(staleness)

    def on_update(
        self, current: ArrayRecord, update: ArrayRecord, start: ArrayRecord, staleness: int, num_examples: int
    ) -> ArrayRecord:
        """Mix the client model ``update`` into ``current``; always a new version.

        ``start`` (the model the client began from) and ``num_examples`` are not used by FedAsync.
        """
        x = to_numpy(current)
        new = mix(x, to_numpy(update), self.mixing_weight(staleness))
        self.updates += 1
        return to_record(cast_like(new, x))

    def state_dict(self) -> dict:
        """FedAsync keeps no state besides its update count."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.updates = int(state["updates"])

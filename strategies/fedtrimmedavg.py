"""Coordinate-wise trimmed mean (Yin, Chen, Ramchandran, Bartlett, ICML 2018, https://arxiv.org/abs/1803.01498)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsim.aggregate import trimmed_mean_stacked
from fedsim.checks import integer, number
from fedsim.strategies.composition import ROBUST, Release
from fedsim.strategies.fedavgm import ServerMomentum

log = logging.getLogger("fedsim")


class FedTrimmedAvg(ServerMomentum):
    """Per coordinate, drop the ``floor(beta * n)`` largest and smallest client values and average the rest.

    Weights are ignored. Same result as Flower's ``FedTrimmedAvg`` without its popping of the replies' arrays.
    ``server_momentum`` > 0 (or ``server_learning_rate`` != 1) takes a server SGD step with momentum towards
    the trimmed mean instead (``ServerMomentum``).

    Parameters
    ----------
    beta : float
        Fraction trimmed from each end, in [0, 0.5); it should exceed the fraction of Byzantine clients.
    server_learning_rate, server_momentum : float
        The server step (``ServerMomentum``); 1 and 0, the defaults, make the trimmed mean the new model.
    **kwargs
        Passed to ``FedAvg``.
    """

    releases = (Release("its global model (a coordinate-wise trimmed mean)", ROBUST),)

    def __init__(self, beta: float = 0.2, **kwargs: Any) -> None:
        self.beta = number("beta", beta, 0.0, 0.5, hi_open=True)
        super().__init__(**kwargs)

    def check_cohort(self, cohort_size: int) -> None:
        """fedsim's pre-run hook: validate ``beta`` against the cohort size (``clients_per_round``).

        Raises ``ConfigError`` for a cohort size below 1; logs a warning when ``floor(beta * cohort_size)`` is
        0, i.e. nothing would be trimmed and this is the plain mean.
        """
        integer("clients_per_round", cohort_size, 1)
        if self.beta > 0 and int(self.beta * cohort_size) == 0:
            log.warning(
                "fedtrimmedavg: beta=%g trims nothing from a cohort of %d; this is the plain mean "
                "(use beta >= %.3g)",
                self.beta,
                cohort_size,
                1 / cohort_size,
            )

    def combine_cohort(self, cohort, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """The server step towards the coordinate-wise beta-trimmed mean of the cohort's models (float64)."""
        return self.server_step(trimmed_mean_stacked(cohort.host_arrays(), self.beta))

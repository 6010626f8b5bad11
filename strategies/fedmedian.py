"""Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, ICML 2018, https://arxiv.org/abs/1803.01498)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsim.aggregate import coordinate_median_stacked
from fedsim.strategies.composition import ROBUST, Release
from fedsim.strategies.fedavgm import ServerMomentum


class FedMedian(ServerMomentum):
    """The new global model is the coordinate-wise median of the client models (weights are ignored).

    Same result as Flower's ``FedMedian``, which however pops the arrays out of the replies it is given;
    this one leaves them untouched. ``server_momentum`` > 0 (or ``server_learning_rate`` != 1) takes a server
    SGD step with momentum towards the median instead of jumping to it (``ServerMomentum``), as the distributed
    SGD of the robust-aggregation papers does.

    Parameters
    ----------
    server_learning_rate, server_momentum : float
        The server step (``ServerMomentum``); 1 and 0, the defaults, make the median the new model.
    **kwargs
        Passed to ``FedAvg``.
    """

    releases = (Release("its global model (a coordinate-wise median)", ROBUST),)

    def combine_cohort(self, cohort, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """The server step towards the coordinate-wise median of the cohort's models (float64)."""
        return self.server_step(coordinate_median_stacked(cohort.host_arrays()))

"""Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, ICML 2018, https://arxiv.org/abs/1803.01498)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsim.strategies.aggregate import coordinate_median
from fedsim.strategies.composition import ROBUST, Release
from fedsim.strategies.fedavg import FedAvg


class FedMedian(FedAvg):
    """The new global model is the coordinate-wise median of the client models (weights are ignored).

    Same result as Flower's ``FedMedian``, which however pops the arrays out of the replies it is given;
    this one leaves them untouched.

    Parameters
    ----------
    **kwargs
        Passed to ``FedAvg``.
    """

    releases = (Release("its global model (a coordinate-wise median)", ROBUST),)

    def combine(
        self, models: Sequence[dict[str, np.ndarray]], weights: Sequence[float]
    ) -> dict[str, np.ndarray]:
        """Coordinate-wise median of ``models``."""
        return coordinate_median(models)

"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020, https://arxiv.org/abs/2007.07481): normalised averaging.

Clients that take different numbers of local steps ``tau_i`` (partial work before a deadline, different data
sizes) pull a plain average toward the objective of the busiest ones. FedNova averages the clients' *normalised*
updates and rescales by the effective number of steps (vanilla local SGD: ``a_i = tau_i``)::

    p_i = n_i / sum_j n_j                       # the round's data-size weights
    tau_eff = sum_i p_i tau_i
    x <- x - server_lr * tau_eff * sum_i p_i (x - y_i) / tau_i

With equal ``tau_i`` this is FedAvg. ``tau_i`` is the reply's ``num-steps``.

Computed on the round's cohort (its models stacked where they sit, ``combine_cohort``): with ``v_i = p_i / tau_i``
and ``S = sum_i v_i``, ``sum_i p_i (x - y_i) / tau_i = S (x - sum_i v_i y_i / S)``, so one weighted mean of the
rows (weights ``v``) gives the step (equal to the per-client sum up to float64 rounding).

**Under DP** (``clipping.noise_multiplier > 0``) the clipping wrapper privatises the normalised updates: it
clips ``(y_i - x) / tau_i`` to ``C`` and releases, with uniform weights and ``xi ~ N(0, (z C / m)^2)``::

    x + server_lr * dp_tau_eff * (sum_i clip((y_i - x) / tau_i) / m + xi)

``dp_tau_eff`` is a public number of steps standing in for ``sum_i p_i tau_i`` (which depends on the clients'
data). One client moves the noised mean by at most ``C / m``, so epsilon is DP-FedAvg's at the same ``z``.
Without ``dp_tau_eff`` DP refuses FedNova.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fedsim import keys
from fedsim.aggregate import is_float, normalised_weights
from fedsim.checks import number
from fedsim.strategies.composition import NORMALISED, Release
from fedsim.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from fedsim.messages import Cohort


class FedNova(FedAvg):
    """FedNova for local SGD (``a_i = tau_i``), weighted by example count, with a server learning rate."""

    releases = (Release("its global model", NORMALISED),)
    needs_local = "sgd"
    needs_local_why = (
        "plain SGD local steps (normaliser a_i = tau_i); Wang et al.'s normaliser for momentum or Adam "
        "is not implemented"
    )

    def __init__(self, server_lr: float = 1.0, dp_tau_eff: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.server_lr = number("server_lr", server_lr, 0.0, lo_open=True)
        self.dp_tau_eff = None if dp_tau_eff is None else number("dp_tau_eff", dp_tau_eff, 0.0, lo_open=True)
        self._steps: list[float] = []
        self.current: dict[str, np.ndarray] | None = None

    def configure_train(self, server_round, arrays, config, grid):
        """Flower's train messages; remembers the model sent."""
        from fedsim.records import to_numpy

        self.current = to_numpy(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def combine_cohort(self, cohort: Cohort, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """``x - lr * tau_eff * S (x - sum_i v_i y_i / S)``, ``v_i = p_i / tau_i``, ``tau_i`` the rows'
        ``num-steps`` (one weighted mean where the rows are); arrays that are not floating point from the plain
        mean."""
        x = self.current
        p = normalised_weights(weights)
        tau = np.maximum([float(m.get(keys.NUM_STEPS, 1)) for m in cohort.metrics], 1.0)
        tau_eff = float(np.sum(p * tau))
        v = p / tau
        s = float(np.sum(v))
        out = cohort.weighted_mean(v)
        if not all(is_float(x[k]) for k in out):
            plain = cohort.weighted_mean(weights)
            out = {k: (out[k] if is_float(x[k]) else plain[k]) for k in out}
        for k in out:
            if is_float(x[k]):
                xk = np.asarray(x[k], np.float64)
                out[k] = xk - self.server_lr * tau_eff * s * (xk - out[k])
        return out

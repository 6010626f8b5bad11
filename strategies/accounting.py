"""Privacy accounting of repeated Poisson-subsampled Gaussian releases with dp-accounting's RDP accountant."""

from __future__ import annotations

import logging

import dp_accounting
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon


class RoundAccountant:
    """epsilon after ``T`` rounds, each a Gaussian mechanism with multiplier ``z`` on a Poisson sample of rate ``q``.

    RDP is additive over rounds, so the per-round RDP curve is computed once (dp-accounting's
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` at its default orders) and ``epsilon(T)`` converts
    ``T`` times it at ``delta``: the same number as composing ``SelfComposedDpEvent(event, T)`` in a fresh
    ``RdpAccountant``, without recomputing the curve every round.

    fedsim draws a fixed-size cohort of ``m`` out of ``N`` clients rather than a Poisson sample; as in
    DP-FedAvg and TF-Federated, the accountant treats it as Poisson sampling with ``q = m / N``.
    """

    def __init__(self, sample_rate: float, noise_multiplier: float, delta: float) -> None:
        if not 0 < sample_rate <= 1 or not noise_multiplier > 0 or not 0 < delta < 1:
            raise ValueError(
                f"need 0 < q <= 1, z > 0, 0 < delta < 1; got {sample_rate}, {noise_multiplier}, {delta}"
            )
        self.sample_rate, self.noise_multiplier, self.delta = sample_rate, noise_multiplier, delta
        event = dp_accounting.PoissonSampledDpEvent(
            sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
        absl = logging.getLogger("absl")  # dp-accounting warns per order it cannot evaluate (it skips them)
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            acc = RdpAccountant().compose(event)
        finally:
            absl.setLevel(level)
        self._orders, self._rdp = acc.orders, acc.rdp

    def epsilon(self, rounds: int) -> float:
        """epsilon at ``delta`` after ``rounds`` releases (0 for none)."""
        if rounds <= 0:
            return 0.0
        return float(compute_epsilon(self._orders, rounds * self._rdp, self.delta)[0])

    def max_rounds(self, max_epsilon: float, limit: int = 10**6) -> int:
        """The most rounds whose epsilon stays <= ``max_epsilon`` (bisection; epsilon grows with rounds)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.epsilon(mid) <= max_epsilon else (lo, mid - 1)
        return lo

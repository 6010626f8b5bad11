"""Privacy accounting of the clipping wrapper's rounds with dp-accounting (RDP or PLD), matched to its sampler.

One round of DP-FedAvg is a Gaussian mechanism on a sampled cohort. Which dp-accounting event describes it
depends on how the cohort is drawn, and so does the neighbouring relation the resulting epsilon refers to:

``sampling="poisson"`` (the default)
    Every client joins independently with probability ``q = m / N`` (``m = clients_per_round``); the server
    releases ``sum_k clip(d_k) / m + N(0, (z C / m)^2)``. Adjacency is **add/remove one client**
    (dp-accounting's ``NeighboringRelation.ADD_OR_REMOVE_ONE``): one client moves the sum by at most ``C``, so
    the noise is ``z`` times the sensitivity and the round is
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``.

``sampling="fixed"``
    Exactly ``m`` of the ``N`` clients, drawn uniformly without replacement. dp-accounting analyses
    ``SampledWithoutReplacementDpEvent`` only under **replace-one** adjacency
    (``NeighboringRelation.REPLACE_ONE``: the population size ``N`` is public, one client's data is swapped
    for anyone else's). Replacing a client's clipped update ``u`` by ``u'`` moves the sum by
    ``||u - u'|| <= 2C``, and dp-accounting's ``GaussianDpEvent(noise_multiplier)`` means noise std over
    l2-sensitivity, so the round is ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))``.
    (The adaptive clipping count query keeps this form: its centred count moves by 1 under replace-one
    against 1/2 under add/remove, the same factor 2.) Only the RDP accountant handles this event;
    dp-accounting's PLD accountant has no sampling-without-replacement event, so ``fixed`` with ``pld`` is
    refused.

epsilon values for the two relations are not interchangeable: replace-one is the stronger notion (one replace
is at most one removal plus one addition), and it is paid for by the doubled sensitivity.
"""

from __future__ import annotations

import logging

import dp_accounting
from dp_accounting import NeighboringRelation
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")
ADJACENCY = {"poisson": "add_or_remove_one", "fixed": "replace_one"}  # as summary.json names them


def neighbouring_relation(sampling: str) -> NeighboringRelation:
    """dp-accounting's neighbouring relation for ``sampling`` (see the module docstring)."""
    return NeighboringRelation.REPLACE_ONE if sampling == "fixed" else NeighboringRelation.ADD_OR_REMOVE_ONE


def round_event(
    sampling: str, num_clients: int, clients_per_round: int, noise_multiplier: float
) -> dp_accounting.DpEvent:
    """The DpEvent of one round: a sampled Gaussian mechanism with multiplier ``z`` (see the module docstring)."""
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(
            clients_per_round / num_clients, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
    if sampling == "fixed":
        return dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, clients_per_round, dp_accounting.GaussianDpEvent(noise_multiplier / 2)
        )
    raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")


def _quiet_absl():
    """dp-accounting logs a warning per RDP order it cannot evaluate (it skips them); silence that."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    return absl, level


class RoundAccountant:
    """epsilon at ``delta`` after ``T`` identical rounds (``round_event``), from dp-accounting.

    ``accountant="rdp"``: RDP is additive over rounds, so the per-round RDP curve is computed once (at
    dp-accounting's default orders) and ``epsilon(T)`` converts ``T`` times it: the same number as
    ``RdpAccountant(neighboring_relation=...).compose(SelfComposedDpEvent(event, T)).get_epsilon(delta)``.
    ``accountant="pld"``: ``PLDAccountant(neighboring_relation=...).compose(SelfComposedDpEvent(event, T))``
    (default discretisation), computed once per ``T`` and cached (about a second each).
    """

    def __init__(
        self,
        num_clients: int,
        clients_per_round: int,
        noise_multiplier: float,
        delta: float,
        sampling: str = "poisson",
        accountant: str = "rdp",
    ) -> None:
        if not 1 <= clients_per_round <= num_clients or not noise_multiplier > 0 or not 0 < delta < 1:
            raise ValueError(
                "need 1 <= clients_per_round <= num_clients, z > 0, 0 < delta < 1; got "
                f"{clients_per_round}, {num_clients}, {noise_multiplier}, {delta}"
            )
        if sampling not in SAMPLINGS or accountant not in ACCOUNTANTS:
            raise ValueError(
                f"sampling in {SAMPLINGS}, accountant in {ACCOUNTANTS}; got {sampling}, {accountant}"
            )
        if (sampling, accountant) == ("fixed", "pld"):
            raise ValueError("dp-accounting's PLD accountant has no sampling-without-replacement event")
        self.num_clients, self.clients_per_round = num_clients, clients_per_round
        self.noise_multiplier, self.delta = noise_multiplier, delta
        self.sampling, self.accountant = sampling, accountant
        self.relation = neighbouring_relation(sampling)
        self.event = round_event(sampling, num_clients, clients_per_round, noise_multiplier)
        self._cache: dict[int, float] = {0: 0.0}
        if accountant == "rdp":
            absl, level = _quiet_absl()
            try:
                acc = RdpAccountant(neighboring_relation=self.relation).compose(self.event)
            finally:
                absl.setLevel(level)
            self._orders, self._rdp = acc.orders, acc.rdp

    @property
    def sample_rate(self) -> float:
        """``q = m / N``."""
        return self.clients_per_round / self.num_clients

    def epsilon(self, rounds: int) -> float:
        """epsilon at ``delta`` after ``rounds`` rounds (0 for none)."""
        rounds = max(int(rounds), 0)
        if rounds not in self._cache:
            if self.accountant == "rdp":
                eps = compute_epsilon(self._orders, rounds * self._rdp, self.delta)[0]
            else:
                acc = PLDAccountant(neighboring_relation=self.relation)
                eps = acc.compose(dp_accounting.SelfComposedDpEvent(self.event, rounds)).get_epsilon(
                    self.delta
                )
            self._cache[rounds] = float(eps)
        return self._cache[rounds]

    def max_rounds(self, max_epsilon: float, limit: int = 10**6) -> int:
        """The most rounds whose epsilon stays <= ``max_epsilon`` (epsilon grows with rounds).

        Doubling, then bisection: about ``2 log2(T)`` evaluations (cheap with RDP, a second each with PLD).
        """
        if self.epsilon(1) > max_epsilon:
            return 0
        lo = 1
        while lo < limit and self.epsilon(min(2 * lo, limit)) <= max_epsilon:
            lo = min(2 * lo, limit)
        hi = min(2 * lo, limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.epsilon(mid) <= max_epsilon else (lo, mid - 1)
        return lo

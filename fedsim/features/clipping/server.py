"""Update clipping and central DP noise as wrappers around any Flower strategy (``clipping=`` in fedsim).

``FixedClipping`` is DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018, https://arxiv.org/abs/1710.06963);
``AdaptiveClipping`` adapts the clip norm to a quantile of the update norms (Andrew, Thakkar, McMahan,
Ramaswamy, NeurIPS 2021, https://arxiv.org/abs/1905.03871). The round-by-round pipeline (Poisson or fixed-size
sampling, clip, fixed denominator, shared secret noise, accounting, ``StopRun`` at ``max_epsilon``, private
metrics, checkpoints) is in ``fedsim.features.clipping.wrapper``; the DpEvents and neighbouring relations in
``fedsim.features.clipping.accounting``.
"""

from __future__ import annotations

import logging

from flwr.serverapp.strategy import Strategy

from fedsim import keys
from fedsim.aggregate import adaptive_clip_norm, noisy_unclipped_fraction, split_noise_multiplier
from fedsim.checks import number
from fedsim.errors import ConfigError
from fedsim.features.clipping.wrapper import COUNT_NOISE, ClippingWrapper
from fedsim.strategies.flower_names import alias

log = logging.getLogger(__name__)


class FixedClipping(ClippingWrapper):
    """Clip every update to a fixed L2 norm, optionally with central Gaussian noise (DP-FedAvg).

    Parameters
    ----------
    strategy : Strategy
        Any Flower strategy; it receives the clipped (and noised) replies.
    num_clients : int
        Population size ``N`` (for the sampling rate ``q = m / N``).
    clients_per_round : int
        ``m``: the cohort size (its expected size with Poisson sampling) and the fixed denominator of the
        DP estimate and of the noise std ``z C / m``.
    clip_norm : float
        ``C`` > 0.
    side : {"server", "client"}
        Who clips: the server, or the clients (``clip-norm`` in the train config).
    noise_multiplier : float
        ``z`` >= 0; 0 = clipping only, no privacy guarantee, the inner strategy's own weights. With ``z > 0``
        clients are weighted uniformly: ``sum_k clip(d_k) / m + N(0, (z C / m)^2)``.
    delta : float
        delta in (0, 1) at which epsilon is reported; keep it below ``1 / num_clients`` (warned otherwise).
    max_epsilon : float or None
        Stop the run (``StopRun``) before a round that would take epsilon above this.
    seed : int
        The run's seed (fedsim passes it): only the cohort draw without noise uses it; it never seeds noise.
    sampling : {"poisson", "fixed"}
        DP-mode cohorts: each client with probability ``q = m / N`` (accounted with add/remove-one
        adjacency), or exactly ``m`` without replacement (replace-one adjacency, sensitivity ``2C``).
    accountant : {"rdp", "pld"}
        dp-accounting's RDP or PLD accountant (PLD only with Poisson sampling).
    noise_seed : int or None
        Server-only seed of the noise and of the DP cohorts; ``None`` (the only value outside the debug mode):
        drawn from OS entropy (128 bits) and kept in the checkpoint, which a reproduction resumes. Set (with
        ``debug_noise_seed``), it must differ from ``seed``, which every client receives.
    debug_metrics : bool
        Also report exact per-round client statistics (clipped fraction, update norms) in DP mode. This
        breaks the privacy guarantee of metrics.jsonl; for debugging only.
    debug_noise_seed : bool
        Accept an operator's ``noise_seed``, with a warning (tests, published reproductions); the noise is
        then not secret and the guarantee does not hold.
    clipping_norm, num_sampled_clients : optional
        Flower's names (``DifferentialPrivacy*FixedClipping``) for ``clip_norm`` and ``clients_per_round``.
    """

    option_name = "fixed"

    def __init__(
        self,
        strategy: Strategy,
        num_clients: int,
        clients_per_round: int | None = None,
        clip_norm: float = 1.0,
        side: str = "server",
        noise_multiplier: float = 0.0,
        delta: float = 1e-5,
        max_epsilon: float | None = None,
        seed: int = 0,
        sampling: str = "poisson",
        accountant: str = "rdp",
        noise_seed: int | None = None,
        debug_metrics: bool = False,
        debug_noise_seed: bool = False,
        clipping_norm: float | None = None,
        num_sampled_clients: int | None = None,
    ) -> None:
        super().__init__(
            strategy,
            num_clients,
            alias("clients_per_round", clients_per_round, None, "num_sampled_clients", num_sampled_clients),
            alias("clip_norm", clip_norm, 1.0, "clipping_norm", clipping_norm),
            side,
            noise_multiplier,
            delta,
            max_epsilon,
            seed,
            sampling=sampling,
            accountant=accountant,
            noise_seed=noise_seed,
            debug_metrics=debug_metrics,
            debug_noise_seed=debug_noise_seed,
        )


class AdaptiveClipping(ClippingWrapper):
    """Clip to a norm that tracks a quantile of the update norms (Andrew et al. 2021), optionally with DP noise.

    After each round ``C <- C exp(-clip_norm_lr (b - target_quantile))`` with ``b`` the (noised) fraction
    of updates that were NOT clipped: C grows while most updates are clipped and shrinks when none are.
    Flower's adaptive wrappers use the clipped fraction here, which moves C the wrong way, and they noise
    the update with the already-updated C; neither is copied.

    With ``noise_multiplier = z > 0`` the count of unclipped updates gets noise of std ``clipped_count_stddev``
    (default ``max(m / 20, z)``: Andrew et al.'s ``m / 20``, raised to ``z`` for small cohorts) and the update noise multiplier becomes
    ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so that both queries together are accounted as one
    Gaussian mechanism with multiplier ``z``; this needs ``z < 2 sigma_b``. (Under add/remove-one the centred
    count moves by 1/2 and the update sum by ``C``; under replace-one, for ``sampling="fixed"``, by 1 and ``2C``:
    the same factor 2 on both, so the pair is still one Gaussian mechanism, with multiplier ``z / 2``.) In DP
    mode the noised estimate is reported as ``noisy-unclipped-fraction``; the exact fraction is not.

    Parameters
    ----------
    strategy, num_clients, clients_per_round, side, noise_multiplier, delta, max_epsilon, seed, sampling, \
    accountant, noise_seed, debug_metrics, debug_noise_seed
        As for ``FixedClipping``.
    initial_clip_norm : float
        Starting ``C`` > 0 (paper: 0.1).
    target_quantile : float
        Fraction of updates meant to stay unclipped, in (0, 1) (paper: 0.5, the median norm).
    clip_norm_lr : float
        Geometric step ``eta_C`` > 0 (paper: 0.2).
    clipped_count_stddev : float or None
        Std ``sigma_b`` >= 0 of the noise on the unclipped count; ``None``: ``max(m / 20, z)`` with noise, else 0.
    initial_clipping_norm, target_clipped_quantile, num_sampled_clients : optional
        Flower's names (``DifferentialPrivacy*AdaptiveClipping``) for ``initial_clip_norm``, ``target_quantile``
        and ``clients_per_round``.
    """

    option_name = "adaptive"

    def __init__(
        self,
        strategy: Strategy,
        num_clients: int,
        clients_per_round: int | None = None,
        initial_clip_norm: float = 0.1,
        target_quantile: float = 0.5,
        clip_norm_lr: float = 0.2,
        clipped_count_stddev: float | None = None,
        side: str = "server",
        noise_multiplier: float = 0.0,
        delta: float = 1e-5,
        max_epsilon: float | None = None,
        seed: int = 0,
        sampling: str = "poisson",
        accountant: str = "rdp",
        noise_seed: int | None = None,
        debug_metrics: bool = False,
        debug_noise_seed: bool = False,
        initial_clipping_norm: float | None = None,
        target_clipped_quantile: float | None = None,
        num_sampled_clients: int | None = None,
    ) -> None:
        clients_per_round = alias(
            "clients_per_round", clients_per_round, None, "num_sampled_clients", num_sampled_clients
        )
        initial_clip_norm = alias(
            "initial_clip_norm", initial_clip_norm, 0.1, "initial_clipping_norm", initial_clipping_norm
        )
        target_quantile = alias(
            "target_quantile", target_quantile, 0.5, "target_clipped_quantile", target_clipped_quantile
        )
        super().__init__(
            strategy,
            num_clients,
            clients_per_round,
            initial_clip_norm,
            side,
            noise_multiplier,
            delta,
            max_epsilon,
            seed,
            clip_key="initial_clip_norm",
            sampling=sampling,
            accountant=accountant,
            noise_seed=noise_seed,
            debug_metrics=debug_metrics,
            debug_noise_seed=debug_noise_seed,
        )
        self.target_quantile = number(
            "target_quantile", target_quantile, 0.0, 1.0, lo_open=True, hi_open=True
        )
        self.clip_norm_lr = number("clip_norm_lr", clip_norm_lr, 0.0, lo_open=True)
        if clipped_count_stddev is None:
            # Andrew et al.'s m/20, raised to z where the cohort is small, so that z < 2*sigma_b always holds
            # (z_delta is then at most z/sqrt(3/4) ~= 1.155 z)
            clipped_count_stddev = max(self.clients_per_round / 20, self.noise_multiplier) if self.dp else 0.0
        self.clipped_count_stddev = number("clipped_count_stddev", clipped_count_stddev, 0.0)
        try:
            self.update_noise_multiplier = split_noise_multiplier(
                self.noise_multiplier, self.clipped_count_stddev
            )
        except ValueError:
            raise ConfigError(
                "noise_multiplier",
                noise_multiplier,
                f"a number < 2 * clipped_count_stddev = {2 * self.clipped_count_stddev:g}",
                "Raise clipped_count_stddev (default max(clients_per_round / 20, noise_multiplier)) or lower noise_multiplier.",
            ) from None

    def _after_round(self, server_round: int, unclipped: list[bool]) -> dict[str, float]:
        """Geometric clip-norm update from the (noised) unclipped fraction; reports it in DP mode."""
        noise = 0.0
        if self.clipped_count_stddev > 0:
            noise = float(self._rng(server_round, COUNT_NOISE).normal(0.0, self.clipped_count_stddev))
        denominator = self.clients_per_round if self.dp else len(unclipped)
        frac = noisy_unclipped_fraction(unclipped, denominator, noise)
        self.clip_norm = adaptive_clip_norm(self.clip_norm, frac, self.target_quantile, self.clip_norm_lr)
        return {keys.AGG_NOISY_UNCLIPPED_FRACTION: frac} if self.dp else {}

"""The wrapper machinery behind ``fedsim.features.clipping.server``: sample, clip, noise, delegate, account.

DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018, https://arxiv.org/abs/1710.06963) with fixed clipping,
and adaptive clipping to a target quantile (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021,
https://arxiv.org/abs/1905.03871).

**DP mode** (``noise_multiplier = z > 0``). Per round:

1. ``sample_cohort`` (fedsim's loop asks it for every round's cohort) charges the round to the accountant and
   draws the cohort: with ``sampling="poisson"`` every client independently with probability
   ``q = m / N`` (``m = clients_per_round``), so the cohort size varies; with ``sampling="fixed"`` exactly
   ``m`` clients without replacement. epsilon is accounted for exactly that sampler
   (``fedsim.features.clipping.accounting``: add/remove-one adjacency for Poisson, replace-one for fixed). The
   round is charged once, **when its cohort is drawn**, and every charged round releases exactly what the
   analysed mechanism releases (3.): the loop skips no DP round (``releases_every_round``). An empty Poisson
   cohort, a round whose every reply failed or was dropped, and one with fewer than ``min_replies`` valid
   replies all release ``x + sum_k clip(d_k) / m + xi`` over the valid replies (an empty sum: ``x + xi``).
   Dropping a round's few replies instead (releasing ``x + xi``, or ``x`` unnoised) would let one client
   switch the release between the two, which the sensitivity ``C`` does not cover. If one more round would
   take epsilon above ``max_epsilon`` nothing is charged and ``configure_train`` raises ``StopRun`` (the loop
   catches it there and stops cleanly; so that it gets that far, ``sample_cohort`` then returns the whole
   population, to which nothing is ever sent). Used outside fedsim's loop (no ``sample_cohort`` call), ``configure_train`` charges the
   round instead, once per round number.
2. ``configure_train`` remembers the global model ``x`` and with ``side="client"`` puts ``clip-norm`` into
   the train config (fedsim's client clips and reports ``clipped`` and ``update-norm``). For an empty cohort
   it sends nothing (the inner strategy configures the round on a stand-in node, whose message is dropped).
3. ``aggregate_train`` takes each update ``d_k = reply_k - x`` (floating-point arrays, flat over all of them),
   drops one holding NaN/Inf, and clips it to ``C`` (server side; client side it re-clips, which is a no-op
   for honest clients, and warns about clients that did not clip). The replies become
   ``x + (n/m) clip(d_k) + xi`` with weight 1 each, ``n`` the valid replies and ``xi ~ N(0, (z C / m)^2)``
   one draw shared by all replies (``z`` is AdaptiveClipping's reduced ``z_delta``). For a uniform mean this
   is the fixed-denominator estimator ``sum_k clip(d_k) / m + xi`` of DP-FedAvg: clients are weighted
   uniformly (``num-examples`` is ignored) and each moves the release by at most ``C / m`` whatever the
   cohort size, which is what the noise is calibrated to. Putting ``xi`` into the replies rather than onto
   the inner strategy's output gives the same aggregate for any translation-equivariant rule (mean, median,
   trimmed mean, Krum) and means a server optimiser (FedAvgM, FedAdam...) only ever sees the noised
   pseudo-gradient, so its state is post-processing of private releases. The DP guarantee is for mean-type
   inner strategies; robust rules get the same noise but their sensitivity is not analysed here. Without a
   valid reply the inner strategy aggregates one stand-in reply ``x + xi`` (weight 1; FedNova's
   ``x + tau_pub xi``): the same release, and a server optimiser steps on the noised pseudo-gradient as in any other round.
4. Reports ``clip-norm`` (used this round; a function of earlier private releases), ``noise-std``,
   ``epsilon`` (spent so far, every drawn round included) and, for adaptive clipping, the noised unclipped
   fraction ``noisy-unclipped-fraction`` it moves ``C`` with (the count of unclipped valid replies, 0
   without any, plus its noise, over the fixed denominator ``m`` like the update sum). No exact per-round client statistic is
   reported (no exact ``clipped-fraction``, the clients' ``clipped``/``update-norm`` are dropped from the
   train metrics) unless ``debug_metrics=True``, which breaks the guarantee. The example-weighted
   ``train-loss`` is passed on and is not covered by the guarantee.
5. ``AdaptiveClipping`` then moves ``C`` toward the ``target_quantile`` of the update norms.

**Secrets.** The noise and the DP cohort are drawn from generators derived from ``noise_seed``, never from the
run ``seed`` (every client receives the run seed in the client spec and could regenerate anything derived
from it). It is drawn from OS entropy (``np.random.SeedSequence()``, 128 bits). An operator's seed is refused
whatever its length (a seed near any guessable value, ``2**63 + 4321``, is found by trying the neighbourhood,
and with it every noise draw); ``debug_noise_seed=True`` accepts one with a warning (tests, published
reproductions: the noise is then not secret). It stays on the server: the ``clipping`` config section is not part of the client spec. The
seed in use is kept in ``state_dict`` (a resumed run draws the same noise and cohorts, bit-identical) and in
no summary, metric or log (``summary_fields`` says only where it came from).

**Without noise** (``z = 0``) nothing is private: ``sample_cohort`` returns the loop's own uniform draw of
``m`` clients from the run seed (results are bit-identical to the loop's), the inner strategy keeps its own
weights (``num-examples`` for FedAvg), and ``clipped-fraction`` is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim import keys, schema
from fedsim.aggregate import (
    cast_like,
    is_float,
    noise_std,
)
from fedsim.checks import integer, number
from fedsim.errors import ConfigError, StopRun
from fedsim.features.clipping.accounting import ACCOUNTANTS, ADJACENCY, SAMPLINGS, RoundAccountant
from fedsim.features.clipping.rows import STAND_IN_NODE, noise_reply, row_norms, row_updates
from fedsim.grid_utils import SampledGrid, first_line
from fedsim.records import to_numpy
from fedsim.strategies import base, composition
from fedsim.strategies.wrapper import Wrapper

log = logging.getLogger("fedsim")

SIDES = ("server", "client")
# Draws from the secret noise_seed: np.random.default_rng([noise_seed, SECRET_TAG, purpose, round]). The tag keeps
# them apart from every draw fedsim derives from the run seed ([seed, purpose, ...] with small purposes).
SECRET_TAG = 0x5EC2E7
COHORT, UPDATE_NOISE, COUNT_NOISE = 1, 2, 3
# Without noise (nothing secret): the loop's cohort draw and the count noise derive from the run seed as before.
_PUBLIC_COHORT, _PUBLIC_NOISE, _PUBLIC_PURPOSE = 1, 5, {UPDATE_NOISE: 0, COUNT_NOISE: 1}
_CLIENT_TOLERANCE = 1e-3  # a client-clipped update may exceed C by this relative margin (float32 rounding)
_CLIENT_STATISTICS = (keys.CLIPPED, keys.UPDATE_NORM)  # exact per-client values; dropped in DP mode


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(key, value, " or ".join(allowed))
    return str(value)


def seed_policy(noise_seed: object, debug_noise_seed: object) -> None:
    """Refuse an operator's ``noise_seed`` outside the explicit debug mode (``debug_noise_seed=true``).

    The noise is only as secret as its seed, and a seed an operator typed is guessable whatever its length
    (``2**63 + 4321`` was found by trying ``2**63 .. 2**63 + 9999``). A DP run therefore draws 128 bits from the
    OS, kept in ``checkpoint.pt`` only; reproducing it means resuming that checkpoint. The value never appears
    in the message (it would be in the console and the logs).
    """
    if noise_seed is None:
        return
    if debug_noise_seed is not True:
        raise ConfigError(
            "noise_seed",
            schema.SECRET,
            "null: a DP run draws 128 bits from the OS; resume its checkpoint to reproduce it",
            "A seed someone typed can be guessed whatever its length, and with it the noise removed. "
            "clipping.debug_noise_seed=true accepts one for tests and published reproductions (no guarantee).",
        )
    log.warning(
        "clipping: debug_noise_seed=true: the noise comes from an operator's noise_seed, which can be guessed; "
        "the privacy guarantee does not hold for this run"
    )


class ClippingWrapper(Wrapper):
    """Shared machinery of ``FixedClipping`` and ``AdaptiveClipping`` (see the module docstring).

    Declares (``fedsim.strategies.composition``) that in DP mode it privatises a mean of the clipped updates:
    a strategy that releases anything else is refused before any work.
    """

    # clip to C, fixed denominator m, noise std z C / m; a step-normalised strategy's updates divided by tau_i first
    privatises = frozenset({composition.MEAN, composition.NORMALISED})
    fold_order = 10  # innermost: the attack, compression and selection around it are what it sees
    draws_cohort = "every cohort itself (DP's sampler is the one epsilon is accounted for)"

    def __init__(
        self,
        strategy: Strategy,
        num_clients: int,
        clients_per_round: int,
        clip_norm: float,
        side: str,
        noise_multiplier: float,
        delta: float,
        max_epsilon: float | None,
        seed: int,
        clip_key: str = "clip_norm",
        sampling: str = "poisson",
        accountant: str = "rdp",
        noise_seed: int | None = None,
        debug_metrics: bool = False,
        debug_noise_seed: bool = False,
    ) -> None:
        super().__init__(strategy)
        self.num_clients = integer("num_clients", num_clients, 1)
        if isinstance(clients_per_round, int) and clients_per_round > self.num_clients:
            raise ConfigError(
                "clients_per_round",
                clients_per_round,
                f"an integer in [1, num_clients={self.num_clients}]",
                f"The sampling rate q = clients_per_round / num_clients = {clients_per_round / self.num_clients:g} "
                "must be at most 1.",
            )
        self.clients_per_round = integer("clients_per_round", clients_per_round, 1, self.num_clients)
        self.clip_norm = number(clip_key, clip_norm, 0.0, lo_open=True)
        self.side = _choice("side", side, SIDES)
        self.noise_multiplier = number("noise_multiplier", noise_multiplier, 0.0)
        self.delta = number("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
        self.seed = integer("seed", seed, 0)
        self.sampling = _choice("sampling", sampling, SAMPLINGS)
        self.accountant_name = _choice("accountant", accountant, ACCOUNTANTS)
        if (self.sampling, self.accountant_name) == ("fixed", "pld"):
            raise ConfigError(
                "accountant",
                accountant,
                "rdp with sampling=fixed",
                "dp-accounting's PLD accountant has no sampling-without-replacement event; "
                "use clipping.sampling=poisson for PLD.",
            )
        if not isinstance(debug_metrics, bool):
            raise ConfigError("debug_metrics", debug_metrics, "true or false")
        self.debug_metrics = debug_metrics
        if not isinstance(debug_noise_seed, bool):
            raise ConfigError("debug_noise_seed", debug_noise_seed, "true or false")
        seed_policy(noise_seed, debug_noise_seed)
        if noise_seed is not None:
            noise_seed = integer("noise_seed", noise_seed, 0)
        self.strategy = strategy
        self.update_noise_multiplier = self.noise_multiplier  # AdaptiveClipping lowers it for the count query
        self.accountant: RoundAccountant | None = None
        self.noise_seed: int | None = None
        if self.dp:
            if noise_seed is not None and noise_seed == self.seed:
                raise ConfigError(
                    "noise_seed",
                    noise_seed,
                    "null or an integer other than the run's seed",
                    "Every client receives the run's seed, so noise drawn from it could be removed.",
                )
            self.noise_seed_source = "operator" if noise_seed is not None else "entropy"
            # server-only secret: set by the operator, else 128 bits of OS entropy
            self.noise_seed = int(noise_seed if noise_seed is not None else np.random.SeedSequence().entropy)
            self.accountant = RoundAccountant(
                self.num_clients,
                self.clients_per_round,
                self.noise_multiplier,
                self.delta,
                self.sampling,
                self.accountant_name,
            )
            if self.delta >= 1 / self.num_clients:
                log.warning(
                    "clipping: delta=%g >= 1/num_clients=%g: such a guarantee allows releasing a client's "
                    "data outright with probability delta; choose delta well below 1/num_clients",
                    self.delta,
                    1 / self.num_clients,
                )
            if self.debug_metrics:
                log.warning(
                    "clipping: debug_metrics=true reports exact per-round client statistics "
                    "(clipped fraction, update norms): the privacy guarantee does not hold for metrics.jsonl"
                )
        self.max_epsilon = None
        if max_epsilon is not None:
            self.max_epsilon = number("max_epsilon", max_epsilon, 0.0, lo_open=True)
            if self.accountant is None:
                raise ConfigError(
                    "max_epsilon",
                    max_epsilon,
                    "null when noise_multiplier is 0",
                    "Without noise there is no privacy guarantee to budget.",
                )
            if self.accountant.epsilon(1) > self.max_epsilon:
                raise ConfigError(
                    "max_epsilon",
                    max_epsilon,
                    f"at least {self.accountant.epsilon(1):.4g}, the epsilon of a single round",
                    "Raise noise_multiplier or max_epsilon.",
                )
            if self.accountant_name == "rdp":  # PLD costs about a second per evaluation: not precomputed
                log.info(
                    "clipping: max_epsilon=%g allows %d rounds",
                    self.max_epsilon,
                    self.accountant.max_rounds(self.max_epsilon),
                )
        self.rounds_accounted = 0
        self.last_round_charged = 0  # the round number the last charge was for (charged once per round)
        self.current: dict[str, np.ndarray] | None = None
        self._stop_reason: str | None = None
        self.error_replies = 0  # error replies received and not aggregated, over the run (Flower's own loop)

    # ---------------------------------------------------------------- privacy bookkeeping
    @classmethod
    def async_refusal(cls, section: str, node: Any, strategy: object) -> tuple[str, str]:
        """From the asynchronous strategy's declared releases (``composition.dp_refusal``)."""
        dp = float(node.get("noise_multiplier") or 0) > 0
        why = composition.dp_refusal(strategy, frozenset(), dp=dp)
        return why, composition.refusal_fix(why)

    @property
    def dp(self) -> bool:
        """True when Gaussian noise is added (DP mode)."""
        return self.noise_multiplier > 0

    @property
    def releases_every_round(self) -> bool:
        """DP mode: every sampled round releases the global model plus its noise, even without a valid reply
        (``fedsim.strategies.base.ReleasesEveryRound``: the loop then skips no round)."""
        return self.dp

    def epsilon(self) -> float | None:
        """epsilon at ``delta`` spent so far (``None`` without noise)."""
        return None if self.accountant is None else self.accountant.epsilon(self.rounds_accounted)

    def _charge(self, server_round: int) -> bool:
        """Account for round ``server_round`` once; False (nothing charged) when it would exceed ``max_epsilon``."""
        if server_round == self.last_round_charged:
            return True
        after = self.accountant.epsilon(self.rounds_accounted + 1)
        if self.max_epsilon is not None and after > self.max_epsilon:
            self._stop_reason = (
                f"privacy budget: one more round would take epsilon from {self.epsilon():.4g} to "
                f"{after:.4g} > max_epsilon={self.max_epsilon:g} (delta={self.delta:g})"
            )
            return False
        self.rounds_accounted += 1
        self.last_round_charged = server_round
        return True

    def _rng(self, server_round: int, purpose: int) -> np.random.Generator:
        """The generator of ``purpose`` in ``server_round``: from the secret noise seed in DP mode."""
        if self.dp:
            return np.random.default_rng([self.noise_seed, SECRET_TAG, purpose, server_round])
        return np.random.default_rng([self.seed, _PUBLIC_NOISE, server_round, _PUBLIC_PURPOSE[purpose]])

    # ---------------------------------------------------------------- Strategy interface
    def sample_cohort(self, server_round: int, num_clients: int, clients_per_round: int) -> list[int]:
        """The partition ids of round ``server_round``'s cohort; in DP mode also charges the round.

        DP mode: Poisson sampling at rate ``q = clients_per_round / num_clients`` (a cohort of varying size,
        possibly empty) or ``clients_per_round`` clients without replacement (``sampling="fixed"``), drawn
        from the secret noise seed. Without noise: the loop's own uniform draw from the run seed.
        """
        if (num_clients, clients_per_round) != (self.num_clients, self.clients_per_round):
            raise RuntimeError(
                f"{type(self).__name__} was built for num_clients={self.num_clients}, clients_per_round="
                f"{self.clients_per_round} but asked to sample {clients_per_round} of {num_clients}"
            )
        if not self.dp:
            rng = np.random.default_rng([self.seed, _PUBLIC_COHORT, server_round])
            return sorted(int(p) for p in rng.choice(num_clients, size=clients_per_round, replace=False))
        if not self._charge(server_round):
            return list(range(num_clients))  # configure_train raises StopRun before anything is sent
        rng = self._rng(server_round, COHORT)
        if self.sampling == "poisson":
            return [int(p) for p in np.flatnonzero(rng.random(num_clients) < clients_per_round / num_clients)]
        return sorted(int(p) for p in rng.choice(num_clients, size=clients_per_round, replace=False))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Stop if the budget is spent, remember the global model, ask clients to clip (client side).

        In DP mode a grid without nodes (an empty Poisson cohort) gets no message, but the inner strategy still
        configures the round on a stand-in node (its messages are dropped), so that a server optimiser steps
        from this round's model when ``aggregate_train`` releases the noise.
        """
        if self.dp and not self._charge(server_round):
            raise StopRun(self._stop_reason)
        self.current = to_numpy(arrays)
        if self.side == "client":
            config[keys.CLIP_NORM] = self.clip_norm
        if self.dp and not list(grid.get_node_ids()):
            list(
                self.strategy.configure_train(
                    server_round, arrays, config, SampledGrid(grid, [STAND_IN_NODE])
                )
            )
            return []
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def on_error_replies(self, server_round: int, errors: list[Message]) -> None:
        """Error replies handed to ``aggregate_train`` by Flower's own loop: counted over the run, logged."""
        self.error_replies += len(errors)
        log.warning(
            "round %d: %d error repl(ies) not aggregated (%d in this run), e.g. node %d: %s",
            server_round,
            len(errors),
            self.error_replies,
            errors[0].metadata.src_node_id,
            first_line(str(errors[0].error.reason)),
        )

    def aggregate_cohort(
        self, server_round: int, cohort: Any
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, (noise,) delegate, report; see the module docstring. Each row's update ``y_k - x`` (divided by
        its ``num-steps`` under FedNova) is clipped to ``C`` in float64 where the rows are, the rows rebuilt as
        ``x + gain (scale clip(d_k) + xi)``, then the inner strategy aggregates them. Client side, the clipped
        bits are the ones the clients report (``clipped``). A row whose update is not finite is dropped."""
        if self.current is None:
            raise RuntimeError(f"{type(self).__name__}.aggregate_train called before configure_train")
        if len(cohort):
            cohort, factor, bits, update = self._clip(server_round, cohort)
        if not len(cohort):
            return self._empty_round(server_round)
        c, m, tau_pub = self.clip_norm, self.clients_per_round, self._public_tau_eff()
        floats = [k for k, a in self.current.items() if is_float(a)]
        scale, gain = 1.0, 1.0 if tau_pub is None else tau_pub
        shift = dict.fromkeys(floats)
        if self.dp:
            scale = len(cohort) / m
            rng = self._rng(server_round, UPDATE_NOISE)
            sigma = noise_std(self.update_noise_multiplier, c, m)
            device = next(iter(cohort.arrays.values())).device
            shift = {
                k: torch.as_tensor(rng.normal(0.0, sigma, np.shape(self.current[k])), device=device)
                for k in floats
            }
        arrays = dict(cohort.arrays)
        for k in floats:
            d = update(k) * (scale * factor).view(-1, *([1] * (np.ndim(self.current[k]))))
            if shift[k] is not None:
                d = d + shift[k]
            arrays[k] = (update.x[k] + gain * d).to(cohort.arrays[k].dtype)
        metrics = [{**mt, **self._override()} for mt in cohort.metrics] if self.dp else None
        out, aggregated = base.aggregate(self.strategy, server_round, cohort.replace(arrays, metrics))
        if out is None:
            return None, aggregated
        if self.dp:  # the replies' own weights: train_loss means the same with and without noise
            aggregated = (
                base.train_metrics(self.strategy, cohort, base.weight_key(self.strategy)) or aggregated
            )
            if aggregated is not None and not self.debug_metrics:
                aggregated = {k: v for k, v in dict(aggregated).items() if k not in _CLIENT_STATISTICS}
        return out, MetricRecord(
            {**(dict(aggregated) if aggregated is not None else {}), **self._report(server_round, bits)}
        )

    def _override(self) -> dict[str, Any]:
        """What DP sets in every reply's metrics: weight 1 (and FedNova's public ``num-steps``)."""
        key, tau_pub = base.weight_key(self.strategy), self._public_tau_eff()
        return {key: 1} if tau_pub is None else {key: 1, keys.NUM_STEPS: float(tau_pub)}

    def _clip(self, server_round: int, cohort: Any) -> tuple[Any, Any, list[bool], Any]:
        """The rows with a finite update, their clipping factors ``min(1, C / norm)``, their bits (True = not
        clipped) and their updates (a function of the parameter name, in float64 where the rows are)."""
        device = next(iter(cohort.arrays.values())).device
        floats = [k for k, a in self.current.items() if is_float(a)]
        norms = row_norms(cohort, self._updates(cohort, device), floats)
        finite = torch.isfinite(norms)
        if not bool(finite.all()):
            keep = [i for i, ok in enumerate(finite.tolist()) if ok]
            for _ in range(len(cohort) - len(keep)):
                log.warning("round %d: dropped a reply whose update holds NaN or Inf", server_round)
            cohort, norms = cohort.take(keep), norms[finite]
        update = self._updates(cohort, device)
        c = self.clip_norm
        factor = torch.where(norms <= c, torch.ones_like(norms), c / norms)
        bits = [bool(b) for b in (norms <= c).tolist()]
        if self.side == "client":  # the clients' own bits
            seen = [
                self._client_clipped(n, mt.get(keys.CLIPPED)) for n, mt in zip(norms.tolist(), cohort.metrics)
            ]
            bits = [not was_clipped for was_clipped, _ in seen]
            above = sum(a for _, a in seen)
            if above:
                self._warn_above(server_round, above)
        return cohort, factor, bits, update

    def _updates(self, cohort: Any, device: Any) -> Any:
        """The rows' updates (``rows.row_updates``), per local step under FedNova."""
        return row_updates(self.current, cohort, device, per_step=self._public_tau_eff() is not None)

    def _empty_round(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """A round without a valid reply: nothing without DP; under DP the release of an empty sum, the global
        model plus the round's noise ``x + gain * xi`` (one stand-in reply of weight 1)."""
        if not self.dp:
            return None, None
        from fedsim.messages import Cohort

        floats = [k for k, a in self.current.items() if is_float(a)]
        tau_pub = self._public_tau_eff()
        gain = 1.0 if tau_pub is None else tau_pub
        rng = self._rng(server_round, UPDATE_NOISE)
        sigma = noise_std(self.update_noise_multiplier, self.clip_norm, self.clients_per_round)
        shift = {k: rng.normal(0.0, sigma, np.shape(self.current[k])) for k in floats}
        noised = {k: np.asarray(self.current[k], np.float64) + gain * shift[k] for k in floats}
        reply = noise_reply(
            server_round, cast_like({**self.current, **noised}, self.current), self._override()
        )
        log.info("round %d: no valid reply; released the global model plus the round's noise", server_round)
        out, _ = base.aggregate(self.strategy, server_round, Cohort.from_replies([reply]))
        if out is None:
            return None, None
        return out, MetricRecord(self._report(server_round, []))

    def _client_clipped(self, norm: float, reported: Any) -> tuple[bool, bool]:
        """Client side: whether the update of norm ``norm`` counts as clipped (its client's ``clipped`` flag, else a
        norm at ``C``; an update above ``C`` always does, the server clips it) and whether it was above ``C``."""
        c = self.clip_norm
        above = norm > c * (1 + _CLIENT_TOLERANCE)
        was_clipped = bool(reported) if reported is not None else norm >= c * (1 - 1e-6)
        return was_clipped or above, above

    def _warn_above(self, server_round: int, count: int) -> None:
        log.warning(
            "round %d: %d client(s) sent updates above clip-norm=%g; clipped them on the server",
            server_round,
            count,
            self.clip_norm,
        )

    def _report(self, server_round: int, bits: list[bool]) -> dict[str, float]:
        """The round's clipping metrics from the not-clipped bits of its valid replies (and the round hook's)."""
        report = {
            keys.AGG_CLIP_NORM: self.clip_norm,
            keys.AGG_NOISE_STD: noise_std(
                self.update_noise_multiplier, self.clip_norm, self.clients_per_round
            ),
        }
        if bits and (not self.dp or self.debug_metrics):
            report[keys.AGG_CLIPPED_FRACTION] = 1.0 - float(np.mean(bits))
        if self.dp:
            report[keys.AGG_EPSILON] = self.epsilon()
        report.update(self._after_round(server_round, bits))
        return report

    def _public_tau_eff(self) -> float | None:
        """DP over a step-normalised strategy (FedNova): its public ``dp_tau_eff``; otherwise None."""
        inner = base.unwrap(self.strategy)
        if not self.dp or not any(r.kind == composition.NORMALISED for r in composition.releases(inner)):
            return None
        tau = getattr(inner, "dp_tau_eff", None)
        if tau is None:  # fedsim's build refuses this before any work (composition.check)
            raise RuntimeError(f"DP over {type(inner).__name__} needs a public dp_tau_eff")
        return float(tau)

    def _after_round(self, server_round: int, unclipped: list[bool]) -> dict[str, float]:
        """Hook run after a released round with the not-clipped bits of its valid replies; its metrics."""
        return {}

    def summary(self) -> None:
        """Log the clipping settings, then the inner strategy's summary."""
        log.info(
            "%s: side=%s clip_norm=%g noise_multiplier=%g delta=%g max_epsilon=%s%s",
            type(self).__name__,
            self.side,
            self.clip_norm,
            self.noise_multiplier,
            self.delta,
            self.max_epsilon,
            (
                f" sampling={self.sampling} (q={self.clients_per_round / self.num_clients:g}, "
                f"{ADJACENCY[self.sampling]}) accountant={self.accountant_name}; "
                f"uniform weights, fixed denominator m={self.clients_per_round}"
                if self.dp
                else ""
            ),
        )
        self.strategy.summary()

    def own_summary_fields(self) -> dict[str, Any]:
        """summary.json entries: the guarantee (epsilon, delta, accountant, sampling, adjacency); not the seed.

        ``epsilon`` (also written as ``final_epsilon``) is the accountant's total over every drawn round.
        """
        if not self.dp:
            return {"sampling": "fixed", "noise_multiplier": 0.0}
        eps = self.epsilon()
        return {
            "epsilon": eps,
            "final_epsilon": eps,
            "delta": self.delta,
            "accountant": self.accountant_name,
            "sampling": self.sampling,
            "adjacency": ADJACENCY[self.sampling],
            "noise_multiplier": self.noise_multiplier,
            "rounds_accounted": self.rounds_accounted,
            "noise_seed_source": getattr(
                self, "noise_seed_source", "entropy"
            ),  # the seed itself stays in checkpoint.pt only
            "debug_metrics": self.debug_metrics,
        }

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Clip norm, accounting, the noise seed in use and the inner strategy's state (``state_dict`` or pickle)."""
        return {
            "clip_norm": self.clip_norm,
            "rounds_accounted": self.rounds_accounted,
            "last_round_charged": self.last_round_charged,
            "seed": self.seed,
            "noise_seed": self.noise_seed,
            **base.inner_state(self.strategy),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a resumed run continues with the same noise seed)."""
        self.clip_norm = float(state["clip_norm"])
        self.rounds_accounted = int(state["rounds_accounted"])
        self.last_round_charged = int(state.get("last_round_charged", 0))
        if state.get("noise_seed") is not None:
            self.noise_seed = int(state["noise_seed"])
        self._stop_reason = None
        self.strategy = base.load_inner_state(self.strategy, state)

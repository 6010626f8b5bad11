"""The wrapper machinery behind ``fedsim.strategies.clipping``: clip, noise, delegate, account.

DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018, https://arxiv.org/abs/1710.06963) with fixed clipping,
and adaptive clipping to a target quantile (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021,
https://arxiv.org/abs/1905.03871). Per round:

1. ``configure_train`` refuses to start a round whose release would exceed ``max_epsilon`` (``StopRun``),
   remembers the global model ``x``, and with ``side="client"`` puts ``clip-norm`` into the train config
   (fedsim's client clips and reports ``clipped`` and ``update-norm``).
2. ``aggregate_train`` takes each update ``d_k = reply_k - x`` (floating-point arrays, flat over all of them),
   drops one holding NaN/Inf, and clips it to ``C`` (server side; client side it re-clips, which is a no-op
   for honest clients, and warns about clients that did not clip).
3. Without noise it hands the inner strategy new replies ``x + clip(d_k)`` with their own weights.
   With ``noise_multiplier = z > 0`` (DP mode) the replies become ``x + (n/m) clip(d_k) + xi`` with
   weight 1 each, where ``m = clients_per_round``, ``n`` the valid replies and ``xi ~ N(0, (z C / m)^2)`` one
   draw shared by all replies (``z`` is AdaptiveClipping's reduced ``z_delta``). For a uniform mean this is
   the fixed-denominator estimator
   ``sum_k clip(d_k) / m + xi`` of DP-FedAvg: each client moves it by at most ``C / m`` even when replies are
   missing, which is what the noise is calibrated to. Putting ``xi`` into the replies rather than onto the
   inner strategy's output gives the same aggregate for any translation-equivariant rule (mean, median,
   trimmed mean, Krum) and means a server optimiser (FedAvgM, FedAdam...) only ever sees the noised
   pseudo-gradient, so its state is post-processing of private releases. The DP guarantee is for mean-type
   inner strategies; robust rules get the same noise but their sensitivity is not analysed here.
4. Reports ``clip-norm`` (used this round), ``clipped-fraction`` (of the valid replies; a diagnostic, not
   private), ``noise-std`` and, in DP mode, ``epsilon`` after this round (``fedsim.strategies.accounting``:
   RDP, Poisson sampling with ``q = m / N``). Train metrics are not covered by the guarantee.
5. ``AdaptiveClipping`` then moves ``C`` toward the ``target_quantile`` of the update norms.

Noise is drawn from generators derived from ``(seed, purpose, round)``, so a resumed run draws the same
numbers and no generator state needs saving. ``state_dict``/``load_state_dict`` hold the clip norm, the
rounds accounted and the inner strategy's state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim import keys
from fedsim.errors import ConfigError, StopRun
from fedsim.strategies import base
from fedsim.strategies.accounting import RoundAccountant
from fedsim.strategies.aggregate import (
    cast_like,
    clip,
    is_float,
    noise_std,
    subtract,
)
from fedsim.strategies.checks import integer, number
from fedsim.strategies.records import rebuild_reply, reply_arrays, reply_metrics, to_numpy

log = logging.getLogger("fedsim")

SIDES = ("server", "client")
UPDATE_NOISE, COUNT_NOISE = 0, 1  # purposes of the per-round generators
_CLIENT_TOLERANCE = 1e-3  # a client-clipped update may exceed C by this relative margin (float32 rounding)


class ClippingWrapper(Strategy):
    """Shared machinery of ``FixedClipping`` and ``AdaptiveClipping`` (see the module docstring)."""

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
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise ConfigError("strategy", type(strategy).__name__, "a flwr.serverapp.strategy.Strategy")
        self.num_clients = integer("num_clients", num_clients, 1)
        self.clients_per_round = integer("clients_per_round", clients_per_round, 1, self.num_clients)
        self.clip_norm = number(clip_key, clip_norm, 0.0, lo_open=True)
        if side not in SIDES:
            raise ConfigError("side", side, "server or client")
        self.noise_multiplier = number("noise_multiplier", noise_multiplier, 0.0)
        self.delta = number("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
        self.seed = integer("seed", seed, 0)
        self.strategy, self.side = strategy, side
        self.update_noise_multiplier = self.noise_multiplier  # AdaptiveClipping lowers it for the count query
        self.accountant = None
        if self.noise_multiplier > 0:
            q = self.clients_per_round / self.num_clients
            self.accountant = RoundAccountant(q, self.noise_multiplier, self.delta)
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
            log.info(
                "clipping: max_epsilon=%g allows %d rounds",
                self.max_epsilon,
                self.accountant.max_rounds(self.max_epsilon),
            )
        self.rounds_accounted = 0
        self.current: dict[str, np.ndarray] | None = None

    # ---------------------------------------------------------------- privacy bookkeeping
    @property
    def dp(self) -> bool:
        """True when Gaussian noise is added (DP mode)."""
        return self.noise_multiplier > 0

    def epsilon(self) -> float | None:
        """epsilon at ``delta`` spent so far (``None`` without noise)."""
        return None if self.accountant is None else self.accountant.epsilon(self.rounds_accounted)

    def _rng(self, server_round: int, purpose: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 5, server_round, purpose])

    # ---------------------------------------------------------------- Strategy interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Stop if the budget is spent, remember the global model, ask clients to clip (client side)."""
        if (
            self.max_epsilon is not None
            and self.accountant.epsilon(self.rounds_accounted + 1) > self.max_epsilon
        ):
            raise StopRun(
                f"privacy budget: one more round would take epsilon from {self.epsilon():.4g} to "
                f"{self.accountant.epsilon(self.rounds_accounted + 1):.4g} > max_epsilon="
                f"{self.max_epsilon:g} (delta={self.delta:g})"
            )
        self.current = to_numpy(arrays)
        if self.side == "client":
            config[keys.CLIP_NORM] = self.clip_norm
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, (noise,) delegate, account; see the module docstring."""
        if self.current is None:
            raise RuntimeError(f"{type(self).__name__}.aggregate_train called before configure_train")
        c, m = self.clip_norm, self.clients_per_round
        floats = [k for k, a in self.current.items() if is_float(a)]
        kept: list[tuple[Message, dict, dict]] = []
        bits: list[bool] = []  # True = not clipped (Andrew et al.'s b_k)
        unclipping_clients = 0
        for msg in replies:
            if msg.has_error():
                continue
            arrays = reply_arrays(msg)
            try:
                clipped, norm, was_clipped = clip(subtract({k: arrays[k] for k in floats}, self.current), c)
            except ValueError:
                log.warning("round %d: dropped a reply whose update holds NaN or Inf", server_round)
                continue
            if self.side == "client":
                reported = reply_metrics(msg).get(keys.CLIPPED)
                unclipping_clients += norm > c * (1 + _CLIENT_TOLERANCE)
                was_clipped = bool(reported) if reported is not None else norm >= c * (1 - 1e-6)
                was_clipped = was_clipped or norm > c * (1 + _CLIENT_TOLERANCE)
            kept.append((msg, arrays, clipped))
            bits.append(not was_clipped)
        if unclipping_clients:
            log.warning(
                "round %d: %d client(s) sent updates above clip-norm=%g; clipped them on the server",
                server_round,
                unclipping_clients,
                c,
            )
        if not kept:
            return None, None

        sigma = noise_std(self.update_noise_multiplier, c, m)
        scale, shift = 1.0, {k: 0.0 for k in floats}
        if self.dp:
            scale = len(kept) / m
            rng = self._rng(server_round, UPDATE_NOISE)
            shift = {k: rng.normal(0.0, sigma, np.shape(self.current[k])) for k in floats}
        weight_key = base.weight_key(self.strategy)
        rebuilt = []
        for msg, arrays, clipped in kept:
            new = {k: np.asarray(self.current[k], np.float64) + scale * clipped[k] + shift[k] for k in floats}
            new = cast_like({**arrays, **new}, arrays)
            rebuilt.append(rebuild_reply(msg, new, {weight_key: 1} if self.dp else None))

        out, metrics = self.strategy.aggregate_train(server_round, rebuilt)
        if out is None:
            return None, metrics
        if self.dp:
            self.rounds_accounted += 1
            # the replies' own weights: train_loss means the same with and without noise
            metrics = base.train_metrics(self.strategy, [msg for msg, _, _ in kept], weight_key) or metrics
        report = {
            keys.AGG_CLIP_NORM: c,
            keys.AGG_CLIPPED_FRACTION: 1.0 - float(np.mean(bits)),
            keys.AGG_NOISE_STD: sigma,
        }
        if self.dp:
            report[keys.AGG_EPSILON] = self.epsilon()
        self._after_round(server_round, bits)
        return out, MetricRecord({**(dict(metrics) if metrics is not None else {}), **report})

    def _after_round(self, server_round: int, unclipped: list[bool]) -> None:
        """Hook run after a released round with the not-clipped bits of its valid replies."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluation messages."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The inner strategy's evaluation aggregate."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the clipping settings, then the inner strategy's summary."""
        log.info(
            "%s: side=%s clip_norm=%g noise_multiplier=%g delta=%g max_epsilon=%s",
            type(self).__name__,
            self.side,
            self.clip_norm,
            self.noise_multiplier,
            self.delta,
            self.max_epsilon,
        )
        self.strategy.summary()

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Clip norm, rounds accounted, seed and the inner strategy's state (its ``state_dict`` or a pickle)."""
        inner = base.state_dict(self.strategy)
        return {
            "clip_norm": self.clip_norm,
            "rounds_accounted": self.rounds_accounted,
            "seed": self.seed,
            "inner_state": inner,
            "inner_pickle": None if inner is not None else base.pickle(self.strategy),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.clip_norm = float(state["clip_norm"])
        self.rounds_accounted = int(state["rounds_accounted"])
        if state.get("inner_state") is not None:
            self.strategy.load_state_dict(state["inner_state"])
        elif state.get("inner_pickle") is not None:
            self.strategy = base.unpickle(state["inner_pickle"])

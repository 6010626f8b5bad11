"""Krum and multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017, https://arxiv.org/abs/1703.02757)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from fedsim.aggregate import cast_like, is_float, krum_select
from fedsim.checks import integer
from fedsim.errors import ConfigError
from fedsim.records import to_record
from fedsim.strategies import base
from fedsim.strategies.composition import ROBUST, Release
from fedsim.strategies.fedavgm import ServerMomentum
from fedsim.strategies.flower_names import alias

log = logging.getLogger("fedsim")


class Krum(ServerMomentum):
    """Keep the ``num_selected`` client models with the lowest Krum scores and average them uniformly.

    A model's score is the sum of squared L2 distances (over its floating-point arrays) to its
    ``n - f - 2`` nearest other models, with ``f = num_malicious``. ``num_selected = 1`` is Krum,
    more is multi-Krum (uniform mean of the selected, as in the paper; Flower weights it by
    ``num-examples``). Metrics are averaged over the selected replies only. Distances are computed by direct
    differences in float64 (Flower expands ``|x|^2 + |y|^2 - 2 x.y``, which cancels badly on full weights).

    Needs ``n >= 2f + 3`` and ``num_selected <= n - f`` valid replies. fedsim calls ``check_cohort`` with
    ``clients_per_round`` before training; in fedsim's loop a round that still ends with too few valid replies
    raises ``ConfigError``, which the loop records as a skipped round (set ``min_replies`` to at least
    ``max(2f + 3, num_selected + f)`` to skip such rounds before aggregation). Inside Flower's own round loop
    (``start``, a plain Flower ServerApp) such a round is skipped with a warning and the model is kept.
    ``server_momentum`` > 0 (or ``server_learning_rate`` != 1) takes a server SGD step with momentum towards
    the selected models' mean instead (``ServerMomentum``).

    Parameters
    ----------
    num_malicious : int
        Number ``f`` of Byzantine clients tolerated, >= 0 (Flower's name: ``num_malicious_nodes``).
    num_selected : int
        Number of models kept, >= 1 (Flower's MultiKrum: ``num_nodes_to_select``).
    server_learning_rate, server_momentum : float
        The server step (``ServerMomentum``); 1 and 0, the defaults, make the selected mean the new model.
    **kwargs
        Passed to ``FedAvg``.
    """

    releases = (Release("its global model (the Krum-selected replies' mean)", ROBUST),)

    def __init__(
        self,
        num_malicious: int = 0,
        num_selected: int = 1,
        num_malicious_nodes: int | None = None,
        num_nodes_to_select: int | None = None,
        **kwargs: Any,
    ) -> None:
        num_malicious = alias("num_malicious", num_malicious, 0, "num_malicious_nodes", num_malicious_nodes)
        num_selected = alias("num_selected", num_selected, 1, "num_nodes_to_select", num_nodes_to_select)
        self.num_malicious = integer("num_malicious", num_malicious, 0)
        self.num_selected = integer("num_selected", num_selected, 1)
        self._in_flower_loop = False
        super().__init__(**kwargs)

    def start(self, *args: Any, **kwargs: Any):
        """Flower's round loop; a round with too few replies for Krum is skipped there (with a warning)."""
        self._in_flower_loop = True
        try:
            return super().start(*args, **kwargs)
        finally:
            self._in_flower_loop = False

    def min_cohort(self) -> int:
        """The smallest number of valid replies Krum accepts: ``max(2f + 3, num_selected + f)``."""
        return max(2 * self.num_malicious + 3, self.num_selected + self.num_malicious)

    def check_cohort(self, cohort_size: int) -> None:
        """Raise ``ConfigError`` unless ``cohort_size >= 2f + 3`` and ``num_selected <= cohort_size - f``.

        fedsim's pre-run hook (called with ``clients_per_round``); also run on every aggregation with the
        number of valid replies.
        """
        f = self.num_malicious
        if cohort_size < 3:  # no num_malicious helps: the cohort itself is too small
            raise ConfigError(
                "clients_per_round",
                cohort_size,
                f"an integer >= 2 * num_malicious + 3 = {2 * f + 3} for Krum",
                "Krum scores each model by its distances to the others and needs at least 3 per round.",
            )
        if cohort_size < 2 * f + 3:
            raise ConfigError(
                "num_malicious",
                f,
                f"an integer <= (cohort - 3) / 2 = {(cohort_size - 3) // 2} for a cohort of {cohort_size}",
                "Krum needs at least 2 * num_malicious + 3 clients per round.",
            )
        if self.num_selected > cohort_size - f:
            raise ConfigError(
                "num_selected",
                self.num_selected,
                f"an integer in [1, {cohort_size - f}] (cohort {cohort_size} - num_malicious {f})",
            )

    def aggregate_rows(self, server_round: int, cohort) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Select rows by Krum score; the server step to their uniform mean, their averaged metrics. A cohort
        too small for Krum raises ``ConfigError`` (the loop skips the round), or inside Flower's own loop
        skips the round with a warning."""
        if len(cohort) < self.min_cohort():
            return self._too_few(server_round, len(cohort))
        host = cohort.host_arrays()
        n = len(cohort)
        flat = np.concatenate([a.reshape(n, -1) for a in host.values() if is_float(a)], axis=1)  # (n, d)
        chosen = krum_select(flat, self.num_malicious, self.num_selected)
        kept = cohort.take(chosen)
        arrays = self.server_step(kept.weighted_mean([1.0] * len(chosen)))
        return to_record(cast_like(arrays, cohort.dtypes())), base.train_metrics(
            self, kept, self.weighted_by_key
        )

    def _too_few(self, server_round: int, valid: int) -> tuple[None, None]:
        if getattr(self, "_in_flower_loop", False):  # absent in strategies pickled before it existed
            log.warning(
                "round %d skipped: %d valid replies, Krum needs at least %d (num_malicious=%d, "
                "num_selected=%d); the model is kept",
                server_round,
                valid,
                self.min_cohort(),
                self.num_malicious,
                self.num_selected,
            )
            return None, None
        raise ConfigError(
            f"round {server_round} valid replies",
            valid,
            f"at least {self.min_cohort()} for Krum (num_malicious={self.num_malicious}, "
            f"num_selected={self.num_selected})",
            f"Set min_replies >= {self.min_cohort()} to skip such rounds before aggregation.",
        )

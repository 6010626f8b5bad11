"""Federated Averaging (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from logging import INFO
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.supercore import log as flwr_log

from fedsim.aggregate import cast_like, weighted_mean
from fedsim.records import reply_arrays, reply_metrics, to_record
from fedsim.strategies import base

if TYPE_CHECKING:
    from fedsim.messages import Cohort

log = logging.getLogger("fedsim")


class FedAvg(FlowerFedAvg):
    """FedAvg: the new global model is the mean of the client models weighted by ``num-examples``.

    Flower's ``FedAvg`` with one change: the mean is taken in float64 and cast back to each array's own dtype
    (Flower's turns integer buffers such as BatchNorm's ``num_batches_tracked`` into float64, which fedsim's reply
    screening would then reject next round). If every weight is 0 the replies count equally.

    The aggregation is written once, against the round's cohort (``aggregate_cohort``; ``fedsim.messages.Cohort``:
    the clients' models stacked where they sit, the weighted mean taken there); ``aggregate_train`` (Flower's,
    on Messages) stacks the valid replies and calls it. Subclasses replace ``combine_cohort`` (how the rows
    become one model), or only ``server_step`` (what the server does with the weighted mean: FedAvgM, FedOpt).
    A subclass may instead give ``combine(models, weights)``, the per-client form over one numpy dict per
    client: it is then called with the rows' models in float64, on every engine.

    Parameters
    ----------
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (``fraction_train``, ``fraction_evaluate``,
        ``min_*_nodes``, ``weighted_by_key``, ...). fedsim samples the cohort itself and passes
        ``fraction_train=1.0, min_train_nodes=1, min_available_nodes=1``.
    """

    def server_step(self, mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model from the clients' weighted mean (float64); FedAvg: the mean itself."""
        return mean

    def combine_cohort(self, cohort: Cohort, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """The aggregate of the cohort's models (float64): ``server_step`` of their weighted mean, taken where
        the rows are (on the CPU the bits of ``aggregate.weighted_mean`` of the rows)."""
        # a per-client form of its own (a subclass's, or one set on the instance)
        if type(self).combine is not FedAvg.combine or "combine" in vars(self):
            return self.combine(cohort.host_models(), weights)
        return self.server_step(cohort.weighted_mean(weights))

    def combine(
        self, models: Sequence[dict[str, np.ndarray]], weights: Sequence[float]
    ) -> dict[str, np.ndarray]:
        """The per-client form of :meth:`combine_cohort` (one numpy dict per client): ``server_step`` of their
        weighted mean. A subclass that replaces it (and may call it) gets its own on every engine."""
        return self.server_step(weighted_mean(models, weights))

    def _parse(self, replies: Iterable[Message]) -> tuple[list[Message], list[dict], list[float]]:
        """Valid replies, their arrays and their weights (uniform if they sum to 0), for a subclass that
        aggregates Messages itself (FedDyn)."""
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        models = [reply_arrays(m) for m in valid]
        weights = _weights(
            [float(reply_metrics(m)[self.weighted_by_key]) for m in valid], self.weighted_by_key
        )
        return valid, models, weights

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's form: Flower's checks of the replies, then :meth:`aggregate_cohort` of the valid ones."""
        from fedsim.messages import Cohort

        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        if not valid:
            return None, None
        return self.aggregate_rows(server_round, Cohort.from_replies(valid))

    def aggregate_cohort(
        self, server_round: int, cohort: Cohort
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Combine the cohort's models (``combine_cohort``); average their metrics with Flower's metric
        aggregation (``train_metrics_aggr_fn``)."""
        if not len(cohort):
            return None, None
        key = self.weighted_by_key
        if any(key not in m for m in cohort.metrics):  # Flower's checks say what is wrong
            self._check_and_log_replies(cohort.replies(), is_train=True)
        flwr_log(INFO, "%s: Received %s results and %s failures", "aggregate_train", len(cohort), 0)
        return self.aggregate_rows(server_round, cohort)

    def aggregate_rows(
        self, server_round: int, cohort: Cohort
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """:meth:`aggregate_cohort` of a checked cohort: the new model and the train metrics."""
        weights = _weights([float(m[self.weighted_by_key]) for m in cohort.metrics], self.weighted_by_key)
        arrays = to_record(cast_like(self.combine_cohort(cohort, weights), cohort.dtypes()))
        return arrays, base.train_metrics(self, cohort, self.weighted_by_key)


def _weights(weights: list[float], key: str) -> list[float]:
    """``weights``, or equal ones (with a warning) when they sum to 0."""
    if weights and sum(weights) <= 0:
        log.warning("all replies have %s = 0; weighting them equally", key)
        return [1.0] * len(weights)
    return weights

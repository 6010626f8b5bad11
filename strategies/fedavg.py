"""Federated Averaging (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedsim.strategies.aggregate import cast_like, weighted_mean
from fedsim.strategies.records import reply_arrays, reply_metrics, to_record

log = logging.getLogger("fedsim")


class FedAvg(FlowerFedAvg):
    """FedAvg: the new global model is the mean of the client models weighted by ``num-examples``.

    Flower's ``FedAvg`` with one change in ``aggregate_train``: the mean is taken in float64 and cast back
    to each array's own dtype (Flower's turns integer buffers such as BatchNorm's ``num_batches_tracked``
    into float64, which fedsim's reply screening would then reject next round). If every weight is 0 the
    replies count equally. Subclasses replace ``combine`` (how models become one) and keep the rest.

    Parameters
    ----------
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (``fraction_train``, ``fraction_evaluate``,
        ``min_*_nodes``, ``weighted_by_key``, ...). fedsim samples the cohort itself and passes
        ``fraction_train=1.0, min_train_nodes=1, min_available_nodes=1``.
    """

    def combine(
        self, models: Sequence[dict[str, np.ndarray]], weights: Sequence[float]
    ) -> dict[str, np.ndarray]:
        """The aggregate of the client models (float64); FedAvg: their weighted mean."""
        return weighted_mean(models, weights)

    def _parse(self, replies: Iterable[Message]) -> tuple[list[Message], list[dict], list[float]]:
        """Valid replies, their arrays and their weights (uniform if they sum to 0)."""
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        models = [reply_arrays(m) for m in valid]
        weights = [float(reply_metrics(m)[self.weighted_by_key]) for m in valid]
        if valid and sum(weights) <= 0:
            log.warning("all replies have %s = 0; weighting them equally", self.weighted_by_key)
            weights = [1.0] * len(valid)
        return valid, models, weights

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Combine the valid replies' arrays; average their metrics with Flower's metric aggregation."""
        valid, models, weights = self._parse(replies)
        if not valid:
            return None, None
        arrays = to_record(cast_like(self.combine(models, weights), models[0]))
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return arrays, metrics

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

from fedsim.strategies import base
from fedsim.strategies.aggregate import cast_like, weighted_mean
from fedsim.strategies.records import reply_arrays, reply_metrics, to_record

if TYPE_CHECKING:
    from fedsim.messages import StackedReplies

log = logging.getLogger("fedsim")


class FedAvg(FlowerFedAvg):
    """FedAvg: the new global model is the mean of the client models weighted by ``num-examples``.

    Flower's ``FedAvg`` with one change in ``aggregate_train``: the mean is taken in float64 and cast back
    to each array's own dtype (Flower's turns integer buffers such as BatchNorm's ``num_batches_tracked``
    into float64, which fedsim's reply screening would then reject next round). If every weight is 0 the
    replies count equally. Subclasses replace ``combine`` (how models become one), or only ``server_step``
    (what the server does with the weighted mean: FedAvgM, FedOpt), and keep the rest.

    ``aggregate_stacked`` is ``aggregate_train`` for a cohort the vectorized engine trained batched, whose
    models stayed stacked on the device (``fedsim.messages.StackedReplies``): the weighted mean is taken there
    and the result equals ``aggregate_train``'s of the per-client Messages (the same bits on the CPU). The loop
    uses it when ``takes_stacked()``: for this class and the subclasses that keep its ``combine``,
    ``aggregate_train`` and reply checks, or give their batched form of them (the robust rules), and declare only
    mean or robust releases (``composition.releases``).

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
        """The aggregate of the client models (float64): ``server_step`` of their weighted mean."""
        return self.server_step(weighted_mean(models, weights))

    def server_step(self, mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model from the clients' weighted mean (float64); FedAvg: the mean itself."""
        return mean

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

    def combine_stacked(self, stacked: StackedReplies, weights: Sequence[float]) -> dict[str, np.ndarray]:
        """``combine`` of the stacked rows' models (float64), taken where they are: ``server_step`` of their
        weighted mean. A subclass that replaces ``combine`` (or ``_parse``) gives its batched form here too,
        or gets per-client Messages (``takes_stacked``)."""
        return self.server_step(stacked.weighted_mean(weights))

    def takes_stacked(self) -> bool:
        """True when ``aggregate_stacked`` equals this strategy's ``aggregate_train``: the class that gave
        ``combine_stacked`` also gave (or inherited) every method it stands in for (``aggregate_train``,
        ``combine``, the reply checks), and the strategy releases only means, step-normalised means or robust
        aggregates (median, trimmed mean, Krum), nothing that carries other state per client."""
        from fedsim.strategies import composition

        cls = type(self)
        batched = _defined_in(cls, "combine_stacked")
        own = all(issubclass(batched, _defined_in(cls, n)) for n in _STACKED_METHODS)
        kinds = (composition.MEAN, composition.NORMALISED, composition.ROBUST)
        return own and all(r.kind in kinds for r in composition.releases(cls))

    def aggregate_stacked(
        self, server_round: int, stacked: StackedReplies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``aggregate_train`` of ``stacked.replies()``, without making them: the weighted mean where the
        models are, then ``server_step`` and the metrics' aggregation."""
        n = len(stacked)
        if not n:
            return None, None
        key = self.weighted_by_key
        if any(key not in m for m in stacked.metrics):  # Flower's checks say what is wrong
            return self.aggregate_train(server_round, stacked.replies())
        flwr_log(INFO, "%s: Received %s results and %s failures", "aggregate_train", n, 0)
        weights = [float(m[key]) for m in stacked.metrics]
        if sum(weights) <= 0:
            log.warning("all replies have %s = 0; weighting them equally", key)
            weights = [1.0] * n
        arrays = to_record(cast_like(self.combine_stacked(stacked, weights), stacked.dtypes()))
        return arrays, base.stacked_train_metrics(self, stacked, key)


# what aggregate_stacked stands in for: a subclass that replaces one of these without giving combine_stacked
# aggregates per-client Messages
_STACKED_METHODS = ("aggregate_train", "combine", "_parse", "_check_and_log_replies")


def _defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body defines ``name``."""
    return next(k for k in cls.__mro__ if name in vars(k))

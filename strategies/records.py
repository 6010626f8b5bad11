"""Glue between Flower messages and the numpy dicts of ``fedsim.strategies.aggregate``; nothing here mutates a record."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of a record as ``{key: ndarray}``, in record order."""
    return {k: a.numpy() for k, a in record.items()}


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A new ArrayRecord holding ``arrays``."""
    return ArrayRecord({k: Array(np.array(a, order="C", copy=None)) for k, a in arrays.items()})  # keeps 0-d


def reply_arrays(msg: Message) -> dict[str, np.ndarray]:
    """The arrays of a train reply (its only ArrayRecord)."""
    return to_numpy(next(iter(msg.content.array_records.values())))


def reply_metrics(msg: Message) -> MetricRecord:
    """The metrics of a reply (its only MetricRecord)."""
    return next(iter(msg.content.metric_records.values()))


def rebuild_reply(
    msg: Message, arrays: Mapping[str, np.ndarray] | None = None, metrics: Mapping | None = None
) -> Message:
    """A new reply with the same metadata as ``msg`` and its arrays and/or metrics replaced.

    Metric values in ``metrics`` override or add to the reply's own. Records not replaced are shared (they are
    not modified); the given message is left untouched.
    """
    records = {}
    for key, rec in msg.content.items():
        if isinstance(rec, ArrayRecord) and arrays is not None:
            rec = to_record(arrays)
        elif isinstance(rec, MetricRecord) and metrics is not None:
            rec = MetricRecord({**dict(rec), **dict(metrics)})
        records[key] = rec
    return Message(content=RecordDict(records), metadata=copy.deepcopy(msg.metadata))

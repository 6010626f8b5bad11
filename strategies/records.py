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


MODEL_RECORD = "arrays"  # the reply's model record (fedsim.keys.ARRAYS, Flower's quickstart name)


def rebuild_reply(
    msg: Message, arrays: Mapping[str, np.ndarray] | None = None, metrics: Mapping | None = None
) -> Message:
    """A new reply with the same metadata as ``msg`` and its model arrays and/or metrics replaced.

    The model is the ArrayRecord named ``arrays`` (Flower's and fedsim's name), or the reply's only ArrayRecord;
    other ArrayRecords (SCAFFOLD's ``scaffold-dc``, FedDyn's, ...) are kept. Metric values in ``metrics``
    override or add to the reply's own. Records not replaced are shared (they are not modified); the given
    message is left untouched.
    """
    array_keys = [k for k, r in msg.content.items() if isinstance(r, ArrayRecord)]
    model = MODEL_RECORD if MODEL_RECORD in array_keys else (array_keys[0] if len(array_keys) == 1 else None)
    records = {}
    for key, rec in msg.content.items():
        if key == model and arrays is not None:
            rec = to_record(arrays)
        elif isinstance(rec, MetricRecord) and metrics is not None:
            rec = MetricRecord({**dict(rec), **dict(metrics)})
        records[key] = rec
    return Message(content=RecordDict(records), metadata=copy.deepcopy(msg.metadata))

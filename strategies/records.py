"""Glue between Flower messages and the numpy dicts of ``fedsim.strategies.aggregate``; nothing here mutates a record."""

from __future__ import annotations

import copy
import functools
import io
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=1024)
def _npy_header(head: bytes) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype of an ``np.save`` header (read by numpy's own parser), or None when the values cannot be
    viewed in place (Fortran order, Python objects, a format version this does not know)."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, fortran, dtype = read[version](f)
    except (KeyError, ValueError):
        return None
    if fortran or dtype.hasobject:
        return None
    return tuple(shape), dtype


def array_values(a: Array, *, writable: bool = True) -> np.ndarray:
    """An Array's values as an ndarray: the same values and dtype as ``Array.numpy()``, faster.

    ``Array.numpy()`` runs ``np.load`` on the bytes, parsing the header each time (about 25 us an array); here
    the header's parse is cached (records of a run repeat a handful of headers) and the values are taken from
    the bytes directly: copied into a new writable array, or with ``writable=False`` a read-only view that
    copies nothing (for checks that only read). Anything but a plain C-order numpy payload goes through
    ``Array.numpy()``.
    """
    data = a.data
    if a.stype == "numpy.ndarray" and data[:6] == _NPY_MAGIC and len(data) >= 10:
        size = int.from_bytes(data[8:10], "little") if data[6] == 1 else int.from_bytes(data[8:12], "little")
        end = (10 if data[6] == 1 else 12) + size
        parsed = _npy_header(bytes(data[:end]))
        if parsed is not None:
            shape, dtype = parsed
            count = math.prod(shape)
            if len(data) - end == count * dtype.itemsize:
                x = np.frombuffer(data, dtype=dtype, count=count, offset=end).reshape(shape)
                return x.copy() if writable else x
    return a.numpy()


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of a record as ``{key: ndarray}`` (new writable arrays), in record order."""
    return {k: array_values(a) for k, a in record.items()}


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

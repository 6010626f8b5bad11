"""Glue between Flower messages and the numpy dicts of ``fedsim.aggregate``; nothing here mutates a record."""

from __future__ import annotations

import copy
import functools
import io
import math
from collections.abc import Mapping, Sequence

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
    """A new ArrayRecord holding ``arrays`` (the bytes ``Array(ndarray)`` writes, without ``np.save``)."""
    return ArrayRecord({k: numpy_array(a) for k, a in arrays.items()})


def numpy_array(a: np.ndarray) -> Array:
    """``Array(a)`` in C order with one copy instead of ``np.save``'s two (header cached per dtype and shape)."""
    x = np.array(a, order="C", copy=None)  # keeps 0-d
    if x.dtype.hasobject or x.dtype.fields is not None:
        return Array(x)
    data = npy_header(x.dtype.str, x.shape) + x.tobytes()
    return Array(dtype=str(x.dtype), shape=tuple(x.shape), stype="numpy.ndarray", data=data)


@functools.lru_cache(maxsize=256)
def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
    return buf.getvalue()[: -int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize or None]


def average_metrics(metrics: Sequence[Mapping], weighting_key: str) -> MetricRecord:
    """Flower's ``aggregate_metricrecords`` (the default ``train_metrics_aggr_fn``) over plain metric dicts:
    the same products and sums in the same order, without a MetricRecord per reply."""
    weights = [m[weighting_key] for m in metrics]
    total = sum(weights)
    out: dict = {}
    for m, factor in zip(metrics, [w / total for w in weights]):
        for key, value in m.items():
            if key == weighting_key:
                continue
            if key not in out:
                out[key] = [v * factor for v in value] if isinstance(value, list) else value * factor
            elif isinstance(value, list):
                out[key] = [c + v * factor for c, v in zip(out[key], value, strict=True)]
            else:
                out[key] = out[key] + value * factor
    return MetricRecord(out)


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

"""Communication cost: the serialised size of the messages a round sends and receives.

What is measured, exactly: a message's size is that of its RecordDict in Flower's protobuf encoding
(``recorddict_to_proto``: arrays, the train config with fedsim's run spec, metrics); the routing metadata
(about a hundred bytes) is left out. Flower's strategies hand every message of a round the same RecordDict
object, so each distinct object is sized once.

What it is not: the bytes on the wire. In simulation nothing travels. In a deployment Flower 1.42 does not
send one RecordDict protobuf between SuperLink and SuperNode: a SuperNode pulls a message and then each of its
objects (records, arrays, array chunks) in requests of their own (``pull-messages``, ``pull-object``,
``confirm-message-received``), and pushes a reply the same way (``push-messages``, ``push-object``), each
request and answer with its own HTTP headers and, with TLS, records. ``python bench/deploy.py --wire`` counts
those bytes at fedsim's Python front; measured on the digits MLP with 3 nodes (HTTP/1.1, TLS off, per round):
a dense reply costs 1.9x its recorded ``bytes_up`` on the wire (1.2x in protobuf bodies alone, the rest
headers of about 13 requests per reply), an instruction 1.8x its ``bytes_down``, and a top-k 1 % reply 15x
(4.3x in bodies), so top-k 1 %'s 23x cut of the recorded upload is 2.9x in reply traffic on the wire.

Arrays are sized without being encoded: an ``Array`` message is its header (dtype, shape, stype: encoded
once per kind and cached) plus its ``data`` field, and each enclosing message adds its fields' tags and
length prefixes, which :func:`recorddict_bytes` adds up the way the protobuf wire format lays them out.
Metric and config records are small and encoded as they are. A test checks the sum against Flower's own
encoder, byte for byte.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import config_record_to_proto, metric_record_to_proto
from flwr.proto.recorddict_pb2 import Array as ProtoArray
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict


def message_bytes(messages: Iterable[Message]) -> int:
    """Total serialised size in bytes of the messages' contents (those without content count 0)."""
    sizes: dict[int, int] = {}
    total = 0
    for msg in messages:
        if not msg.has_content():
            continue
        key = id(msg.content)
        if key not in sizes:
            sizes[key] = recorddict_bytes(msg.content)
        total += sizes[key]
    return total


def cohort_bytes(stacked) -> int:
    """``message_bytes(cohort.replies())`` for a cohort the engine trained batched (``fedsim.messages.Cohort``),
    without making the replies, from the pieces :func:`recorddict_bytes` adds up: every row's ArrayRecord has
    the same size, and a MetricRecord's size depends on its keys and integers only (a float is always 8 bytes)."""
    from fedsim import keys
    from fedsim.records import npy_header

    if not len(stacked):
        return 0
    record = 0
    for name, t in stacked.arrays.items():
        dtype = torch_numpy_dtype(t.dtype)
        shape = tuple(int(d) for d in t.shape[1:])
        data = len(npy_header(dtype.str, shape)) + math.prod(shape) * dtype.itemsize
        record += _array_entry(name, str(dtype), shape, "numpy.ndarray", data)
    return len(stacked) * _array_item(keys.ARRAYS, record) + sum(
        _metric_item_bytes(keys.METRICS, _size_key(m)) for m in stacked.metrics
    )


@functools.lru_cache(maxsize=64)
def torch_numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype a tensor of torch ``dtype`` converts to."""
    import torch

    return torch.empty(0, dtype=dtype).numpy().dtype


def _size_key(metrics: dict) -> tuple:
    """What a MetricRecord's encoded size depends on: its keys, its integers, and where floats are."""
    return tuple(
        (k, 1.0 if isinstance(v, float) else tuple(1.0 if isinstance(x, float) else x for x in v))
        if isinstance(v, (float, list))
        else (k, v)
        for k, v in metrics.items()
    )


@functools.lru_cache(maxsize=65536)
def _metric_item_bytes(key: str, size_key: tuple) -> int:
    """The encoded size of a RecordDict item holding a MetricRecord laid out as ``size_key``."""
    record = MetricRecord({k: (list(v) if isinstance(v, tuple) else v) for k, v in size_key})
    return _field(ProtoRecordDict.Item(key=key, metric_record=metric_record_to_proto(record)).ByteSize())


def recorddict_bytes(content: RecordDict) -> int:
    """``recorddict_to_proto(content).ByteSize()``, without copying any array's data into a protobuf."""
    total = 0
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            total += _array_item(key, _array_record_bytes(record))
        elif isinstance(record, MetricRecord):
            total += _metric_item_bytes(key, _size_key(dict(record.items())))
        elif isinstance(record, ConfigRecord):
            item = ProtoRecordDict.Item(key=key, config_record=config_record_to_proto(record)).ByteSize()
            total += _field(item)  # RecordDict.items, field 1
        else:
            raise ValueError(f"Unsupported record type: {type(record)}")
    return total


def _array_item(key: str, record: int) -> int:
    """A RecordDict item (field 1) holding an ArrayRecord of ``record`` bytes (field 2, always set)."""
    return _field(_string(key) + _field(record))


def _array_record_bytes(record: ArrayRecord) -> int:
    return sum(
        _array_entry(key, array.dtype, tuple(array.shape), array.stype, len(array.data))
        for key, array in record.items()
    )


def _array_entry(name: str, dtype: str, shape: tuple[int, ...], stype: str, data: int) -> int:
    """An ArrayRecord item ``{key: 1, value: 2 (always set)}`` for an Array of ``data`` bytes of values."""
    size = _array_head(dtype, shape, stype)
    if data:  # Array.data, field 4 (an empty bytes field is not written)
        size += _field(data)
    return _field(_string(name) + _field(size))


@functools.lru_cache(maxsize=4096)
def _array_head(dtype: str, shape: tuple[int, ...], stype: str) -> int:
    """The encoded size of an ``Array`` message without its data (fields 1-3)."""
    return ProtoArray(dtype=dtype, shape=shape, stype=stype).ByteSize()


def _string(text: str) -> int:
    """A string field (tag below 16) of a proto3 message: absent when empty."""
    return _field(len(text.encode())) if text else 0


def _field(length: int) -> int:
    """A length-delimited field whose tag fits one byte (field numbers below 16): tag, length, payload."""
    return 1 + _varint(length) + length


def _varint(value: int) -> int:
    """Bytes of ``value`` as a protobuf varint."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size

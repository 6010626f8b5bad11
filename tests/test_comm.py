"""Communication cost (fedsim.comm): serialised message sizes, and bytes_up / bytes_down in metrics.jsonl."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from helpers import read_metrics, run_tiny
from strategy_helpers import server_identity

from fedsim.comm import message_bytes


def _message(content: RecordDict, node: int = 1) -> Message:
    with server_identity():
        return Message(content, node, "train")


def test_size_is_the_arrays_plus_a_small_overhead():
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(1000, np.float32))})})
    size = message_bytes([_message(content)])
    assert 4000 <= size <= 4000 + 300  # 4000 bytes of float32 and the encoding's framing
    bigger = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(2000, np.float32))})})
    assert message_bytes([_message(bigger)]) - size == 4000


def test_a_shared_content_counts_once_per_message():
    content = RecordDict({"config": ConfigRecord({"spec": "x" * 500})})
    one = message_bytes([_message(content)])
    assert message_bytes([_message(content, n) for n in range(3)]) == 3 * one
    assert message_bytes([]) == 0


@pytest.mark.slow
def test_a_run_records_the_bytes_of_each_round(tmp_path):
    run_tiny(tmp_path, "model=logreg", "num_rounds=2")  # digits: 64 * 10 + 10 float32 = 2600 bytes a model
    for r in read_metrics(tmp_path)[1:]:
        m = r["num_clients"]
        assert r["bytes_down"] % m == 0  # one train message per client, all alike
        assert r["bytes_down"] / m > 2600 and r["bytes_up"] / m > 2600
        assert r["bytes_up"] < r["bytes_down"]  # a reply carries no run spec
    assert "bytes_up" not in read_metrics(tmp_path)[0]  # round 0 sends nothing


@pytest.mark.pictures  # looks at the run's pictures
@pytest.mark.slow
def test_summary_and_sweep_summary_carry_the_total_bytes_and_curves_plot_against_them(tmp_path):
    import matplotlib.image

    from fedsim.sweep import columns_for

    summary = run_tiny(tmp_path, "compression=topk")
    recs = read_metrics(tmp_path)
    assert summary["total_bytes_up"] == sum(r.get("bytes_up", 0) for r in recs) > 0
    assert summary["total_bytes_down"] == sum(r.get("bytes_down", 0) for r in recs) > 0
    assert {"total_bytes_up", "total_bytes_down"} <= set(columns_for([summary]))
    height = matplotlib.image.imread(tmp_path / "curves.png").shape[0]
    assert height == 1050  # three rows: round, simulated time, cumulative bytes (3.5 in each at 100 dpi)


def test_sizes_equal_flowers_own_encoding_byte_for_byte():
    """The arrays are sized without encoding them; Flower's encoder is the oracle, over random records:
    empty and long keys (multi-byte length prefixes), empty and large arrays, metric and config records."""
    from flwr.app import MetricRecord
    from flwr.common.serde import recorddict_to_proto

    from fedsim.comm import recorddict_bytes

    rng = np.random.default_rng(0)
    for _ in range(150):
        records = {}
        for r in range(int(rng.integers(0, 4))):
            name = "" if rng.random() < 0.1 else "k" * int(rng.integers(1, 200)) + "é"
            kind = int(rng.integers(0, 3))
            if kind == 0:
                arrays = {}
                for a in range(int(rng.integers(0, 5))):
                    n = int(rng.choice([0, 1, 100, 20000, 300000]))  # 300000 float32: a 3-byte length prefix
                    shape = (n,) if rng.random() < 0.5 else (1, n)
                    arrays["" if rng.random() < 0.1 else f"p{a}" * int(rng.integers(1, 90))] = Array(
                        np.zeros(shape, np.float32 if rng.random() < 0.5 else np.float64)
                    )
                records[name + str(r)] = ArrayRecord(arrays)
            elif kind == 1:
                records[name + str(r)] = MetricRecord({"a": 1, "b": 2.5, "c": [1.0, 2.0]})
            else:
                text, raw = "x" * int(rng.integers(0, 300)), b"\0" * int(rng.integers(0, 200))
                records[name + str(r)] = ConfigRecord({"s": text, "b": raw, "t": True})
        content = RecordDict(records)
        assert recorddict_bytes(content) == recorddict_to_proto(content).ByteSize(), list(records)
    empty = RecordDict(
        {
            "a": ArrayRecord({"w": Array(dtype="float32", shape=(0,), stype="numpy.ndarray", data=b"")}),
            "b": ArrayRecord({}),
        }
    )
    # an empty data field is not written
    assert recorddict_bytes(empty) == recorddict_to_proto(empty).ByteSize()

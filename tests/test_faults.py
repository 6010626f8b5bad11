"""Client faults: each kind is dropped from its round, counted by kind, logged once per kind and round."""

import logging
from collections import Counter

import pytest
from helpers import read_metrics, run_tiny

from fedsim.errors import ConfigError
from fedsim.features.faults.client import FaultRates

RATES = {"error": 0.2, "timeout": 0.1, "nan": 0.1, "shape": 0.1, "dtype": 0.1}
KIND_OF = {"error": "error", "timeout": "timeout", "nan": "nonfinite", "shape": "shape", "dtype": "dtype"}


@pytest.mark.slow
def test_every_fault_kind_is_dropped_and_counted(tmp_path, caplog):
    over = ["num_clients=10", "clients_per_round=10", "num_rounds=3", "faults=mixed", "partitioner=iid"]
    over += [f"faults.{k}={v}" for k, v in RATES.items()]
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        summary = run_tiny(tmp_path, *over)
    rates = FaultRates(**RATES)
    recs = read_metrics(tmp_path)[1:]
    assert summary["rounds_done"] == 3
    seen = Counter()
    for r in recs:
        expected = Counter(KIND_OF[k] for pid in range(10) if (k := rates.draw(0, r["round"], pid)))
        assert r.get("failure_kinds", {}) == dict(expected), r["round"]
        assert r["num_clients"] == 10 - sum(expected.values())
        assert r["eval_accuracy"] is not None  # the round went on
        seen.update(expected)
        warnings = [m for m in caplog.messages if m.startswith(f"round {r['round']}:")]
        assert len(warnings) == len(expected)  # one line per kind and round, not one per client
    assert len(seen) >= 4  # the draw exercised most kinds
    assert not any("Traceback" in m for m in caplog.messages)


@pytest.mark.slow
def test_round_below_quorum_is_skipped_and_run_goes_on(tmp_path):
    summary = run_tiny(
        tmp_path,
        "num_clients=10",
        "clients_per_round=10",
        "num_rounds=3",
        "min_replies=5",
        "faults=mixed",
        "faults.error=0.3",
    )
    recs = read_metrics(tmp_path)
    skipped = [r for r in recs[1:] if r.get("skipped")]
    assert skipped and summary["rounds_done"] == 3
    # (a run with every round skipped fails: test_reliability)
    assert len(skipped) < 3 and summary["status"] == "completed"
    first = skipped[0]["round"]
    # a skipped round leaves the global model as it was
    assert recs[first]["eval_accuracy"] == recs[first - 1]["eval_accuracy"]


@pytest.mark.parametrize(
    "over, key", [(["faults.error=1.5"], "faults.error"), (["faults.error=0.6", "faults.nan=0.6"], "faults")]
)
def test_bad_fault_rates_are_config_errors(tmp_path, over, key):
    with pytest.raises(ConfigError, match=key):
        run_tiny(tmp_path, "faults=mixed", *over)


@pytest.mark.slow
def test_cohort_too_big_for_memory_is_refused_up_front(tmp_path, monkeypatch):
    import fedsim.experiment as run_mod

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 2**30 // 4096}  # pretend 1 GiB is free
    monkeypatch.setattr(run_mod.os, "sysconf", lambda name: pages[name])
    # MLP 64-4000-4000-10: ~16.3M params, ~65 MB a copy; 20 copies + 4 exceed 1 GiB
    with pytest.raises(ConfigError, match="clients_per_round") as err:
        run_tiny(tmp_path, "num_clients=20", "clients_per_round=20", "model.hidden=[4000,4000]")
    assert "GiB needed" in str(err.value) and "1.0 GiB RAM free" in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()
    run_tiny(tmp_path / "ok", "num_clients=20", "clients_per_round=2", "num_rounds=1")  # a small cohort fits


def test_error_replies_are_classified_by_flower_error_code():
    import numpy as np
    from flwr.app import ArrayRecord, Error, Message, MessageType, RecordDict
    from flwr.common.constant import ErrorCode
    from strategy_helpers import server_identity

    from fedsim.grid_utils import screen_replies

    with server_identity():

        def reply(code, reason):
            msg = Message(RecordDict(), 1, MessageType.TRAIN)
            msg.metadata.__dict__["_message_id"] = f"m{code}"
            return Message(Error(code=code, reason=reason), reply_to=msg)

        replies = [
            reply(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable"),
            reply(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "<class 'RuntimeError'>:<'boom'>"),
            reply(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "<class 'fedsim.faults.SimulatedTimeout'>:<'late'>"),
        ]
        valid, failures = screen_replies(replies, ArrayRecord([np.zeros(2, np.float32)]))
    assert valid == [] and [k for k, _ in failures] == ["unavailable", "error", "timeout"]

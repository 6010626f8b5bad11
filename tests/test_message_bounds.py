"""Bounded messages: a deployed node takes no value from a message's config outside the operator's bounds.

Flower's Fleet API lets any registered SuperNode push an instruction to any node, so a node refuses, in one
line, a message asking more local work than the operator's spec (``{"local-epochs": 100000}`` stalled a node
for 11 minutes) or any other value outside ``fedsim.admission``' table; the refusal is an error reply
and one line in the node's log, never an exception (Flower logs those with a traceback and exit code 800).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from fedsim import build, keys
from fedsim.admission import MAX_INDEX, MAX_PENALTY, MessageRefused, check_config
from fedsim.local import LocalTraining

# The operator's local training, set explicitly: the bounds' independent oracle (2 epochs, lr 0.1).
OVERRIDES = (
    "dataset=synthetic num_clients=3 clients_per_round=3 quiet=true client.local_epochs=2 client.lr=0.1"
)
LOCAL = LocalTraining(lr=0.1, local_epochs=2)


def _context(tmp_path, overrides: str | None = OVERRIDES) -> Context:
    """A deployed node's Context (the operator's ``overrides`` in the run config), or a simulated one."""
    run_config = {"overrides": overrides, "out-dir": "", "nodes": ""} if overrides is not None else {}
    node = {"partition-id": 0, "num-partitions": 3, "cache-dir": str(tmp_path / "cache")}
    return Context(run_id=7, node_id=100, node_config=node, state=RecordDict(), run_config=run_config)


def _train(spec: str, extra: dict, kind: str = "train") -> Message:
    """An instruction from node 1 (any registered node may address any other) with ``extra`` in its config,
    carrying the operator's model."""
    from fedsim.client_app import spec_from_overrides

    model = build.build_initial_model(json.loads(spec_from_overrides(OVERRIDES)))
    config = ConfigRecord({keys.RUN_SPEC: spec, keys.SERVER_ROUND: 1, **extra})
    content = RecordDict({keys.ARRAYS: ArrayRecord(model.state_dict()), keys.CONFIG: config})
    meta = Metadata(
        run_id=7,
        message_id="5e1f" * 16,
        src_node_id=1,
        dst_node_id=100,
        reply_to_message_id="",
        group_id="1",
        message_type=kind,
        created_at=time.time(),
        ttl=60,
    )
    return Message(metadata=meta, content=content)


@pytest.fixture(scope="module")
def spec() -> str:
    from fedsim.client_app import spec_from_overrides

    return spec_from_overrides(OVERRIDES)


def test_a_message_asking_for_100000_local_epochs_is_refused_in_one_line_and_nothing_trains(
    spec, tmp_path, monkeypatch, caplog
):
    """The probe's message (the operator's spec plus ``{"local-epochs": 100000}``): an error reply at once,
    one log line naming the key, the value and the operator's bound, no exception, no training."""
    from fedsim import client_app

    trained = []
    monkeypatch.setattr(client_app, "train_local", lambda *a, **k: trained.append(1) or (0.0, 1, 1))
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="fedsim"):
        reply = client_app.app(_train(spec, {"local-epochs": 100000}), _context(tmp_path))
    assert time.monotonic() - t0 < 30 and not trained
    assert reply.has_error() and not reply.has_content()
    reason = str(reply.error.reason)
    assert "\n" not in reason and "refused train message 5e1f" in reason, reason
    assert "local-epochs=100000" in reason and "[1, 2]" in reason and "Nothing was trained" in reason
    assert [r.getMessage() for r in caplog.records if r.name == "fedsim"] == [reason]


@pytest.mark.parametrize(
    "extra",
    [
        {"local-epochs": 3},
        {"local-epochs": 0},
        {"local-epochs": 1.5},
        {"lr": 0.2},
        {"lr": 0.0},
        {"lr": float("nan")},
        {"max-steps": -1},
        {"proximal-mu": MAX_PENALTY * 2},
        {"proximal-mu": -0.1},
        {"feddyn-alpha": float("inf")},
        {"ditto-lambda": 1e9},
        {"clip-norm": 0.0},
        {"clipping_norm": -1.0},
        {"server-round": -1},
        {"task-id": MAX_INDEX + 1},
        {"model-version": "7"},
        {"compress": "pickle"},
        {"compress-ratio": 2.0},
        {"compress-levels": 0},
        {"fedper-layers": "x" * 5000},
        {"attack-label-flip": [0, -1]},
    ],
)
def test_each_value_outside_its_bounds_is_refused(extra):
    ((key, value),) = extra.items()
    with pytest.raises(MessageRefused) as err:
        check_config(extra, LOCAL, "train message 1")
    assert "\n" not in str(err.value) and f"{key}=" in str(err.value), err.value


def test_values_inside_the_bounds_pass():
    check_config(
        {
            "local-epochs": 2,
            "lr": 0.1,
            "max-steps": 0,
            "proximal-mu": 0.01,
            "feddyn-alpha": MAX_PENALTY,
            "clip-norm": 1e6,
            "server-round": 30,
            "task-id": 0,
            "compress": "topk",
            "compress-ratio": 1.0,
            "compress-levels": 16,
            "fedper-layers": "fc1.,fc2.",
            "attack-label-flip": [0, 2],
            "somebody-elses-key": 10**12,  # read by nothing in fedsim
        },
        LOCAL,
        "train message 1",
    )
    check_config({"local-epochs": 2.0}, LOCAL, "train message 1")  # what flower_train_config reads as 2
    with pytest.raises(MessageRefused, match=r"\[1, 1\]"):  # the operator counts steps: at most one epoch
        check_config({"local-epochs": 2}, LocalTraining(local_steps=5), "train message 1")


def test_an_honest_message_within_the_bounds_trains(spec, tmp_path):
    from fedsim import client_app

    reply = client_app.app(_train(spec, {"local-epochs": 1, "lr": 0.05}), _context(tmp_path))
    assert not reply.has_error() and reply.content["metrics"]["num-examples"] > 0


def test_simulation_engines_keep_their_own_messages(spec, tmp_path):
    """Without ``overrides`` in the run config (fedsim's own engines: the message comes from the operator's own
    server in this process) the values are the server's own and are not bounded here."""
    from fedsim import client_app

    reply = client_app.app(_train(spec, {"server-round": MAX_INDEX + 1}), _context(tmp_path, overrides=None))
    assert not reply.has_error()


@pytest.mark.parametrize("kind", ["train", "evaluate", "query"])
def test_a_refused_spec_is_an_error_reply_and_one_log_line_not_an_exception(spec, tmp_path, caplog, kind):
    """Finding 9: a refusal reaches Flower's ``run_clientapp`` as a reply, so the node's log holds one line
    (no "ClientApp raised an exception", no traceback, no exit status 800)."""
    from fedsim import client_app

    crafted = json.dumps({**json.loads(spec), "dataset": {"_target_": "pathlib.Path.write_text"}})
    with caplog.at_level(logging.DEBUG):
        reply = client_app.app(_train(crafted, {}, kind), _context(tmp_path))
    reason = str(reply.error.reason)
    assert reply.has_error() and "its run spec differs" in reason and "\n" not in reason
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in lines] == [reason] and not any(r.exc_info for r in caplog.records)

"""The inprocess engine's worker pool gives the sequential results and cleans up its processes."""

import gc
import json
import os

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim import build, keys
from fedsim.client_app import app as fedsim_app
from fedsim.engines import pool
from fedsim.errors import ConfigError
from fedsim.grid_utils import discover

# A ClientApp for the crash test; workers import it as "test_pool:crash_app".
crash_app = ClientApp()


@crash_app.query()
def _query(msg, context):
    pid = int(context.node_config[keys.NODE_PARTITION_ID])
    if pid == 1:
        os._exit(3)  # a hard crash: no Python exception, no reply
    if pid == 2:
        raise ValueError("client 2 fails")
    return Message(
        RecordDict({keys.METRICS: MetricRecord({keys.PARTITION_ID: pid, "pid": os.getpid()})}), reply_to=msg
    )


@pytest.fixture
def started(monkeypatch):
    """Every worker process a grid starts during the test."""
    procs = []
    original = pool._start_worker

    def recording(app_ref, index=0):
        w = original(app_ref, index)
        procs.append(w.proc)
        return w

    monkeypatch.setattr(pool, "_start_worker", recording)
    return procs


@pytest.mark.slow  # starts worker processes
def test_two_workers_give_the_sequential_run(tmp_path, started):
    over = ["num_rounds=3", "faults=mixed"]  # injected errors and NaNs must come back the same way too
    run_tiny(tmp_path / "seq", "engine=inprocess", *over)
    assert not started
    summary = run_tiny(tmp_path / "pool", "engine=inprocess", "engine.workers=2", *over)
    assert summary["engine"] == "inprocess"
    assert without_wall_time(read_metrics(tmp_path / "seq")) == without_wall_time(
        read_metrics(tmp_path / "pool")
    )
    ma, mb = torch.load(tmp_path / "seq" / "model.pt"), torch.load(tmp_path / "pool" / "model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    gc.collect()
    assert len(started) == 2
    assert all(p.poll() is not None for p in started), "workers still running after the run"


@pytest.mark.slow  # starts worker processes
def test_workers_leave_ctrl_c_to_the_server(started):
    """Ctrl-C reaches the whole process group: a worker ignores SIGINT (no traceback); the server stops it."""
    import signal
    import time

    def round_trip(grid) -> list:  # spec-less queries go to the workers (their replies are errors; fine)
        return list(
            grid.send_and_receive(
                [Message(RecordDict({}), n, MessageType.QUERY) for n in grid.get_node_ids()]
            )
        )

    with pool.PoolGrid(4, workers=2) as grid:
        assert len(round_trip(grid)) == 4  # both workers up and serving
        assert all(
            os.getpgid(pid) != os.getpgid(0) for pid in grid.worker_pids
        )  # a terminal's Ctrl-C misses them
        for pid in grid.worker_pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(p.poll() is None for p in started) and len(started) == 2
        assert len(round_trip(grid)) == 4
    assert all(p.poll() is not None for p in started)


@pytest.mark.slow  # starts worker processes
def test_close_stops_workers_and_is_idempotent(started):
    with pool.PoolGrid(4, workers=2) as grid:
        assert len(grid.worker_pids) == 2 and all(p.poll() is None for p in started)
    assert all(p.poll() is not None for p in started)
    grid.close()
    assert grid.worker_pids == []


@pytest.mark.slow  # starts worker processes
def test_crash_and_exception_become_error_replies(started):
    grid = pool.PoolGrid(4, workers=2, app_ref="test_pool:crash_app")
    try:
        for _ in range(2):  # the crashed worker is replaced; the pool keeps working
            msgs = [Message(RecordDict({}), nid, MessageType.QUERY) for nid in grid.get_node_ids()]
            replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
            assert sorted(replies) == [1, 2, 3, 4]
            assert replies[2].error.code == pool.CLIENT_APP_CRASHED
            assert replies[3].error.code == pool.CLIENT_APP_RAISED_EXCEPTION
            assert "client 2 fails" in replies[3].error.reason
            assert replies[1].content[keys.METRICS][keys.PARTITION_ID] == 0
            assert len(grid.worker_pids) == 2
    finally:
        grid.close()
    assert len(started) >= 3 and all(p.poll() is not None for p in started)


def test_discovery_answers_match_the_client_app():
    spec = build.client_spec(compose_cfg("num_clients=6"), "cpu")
    ids = list(range(1, 7))
    found = discover(pool.PoolGrid(6), ids, spec, 10)
    direct = {}  # the ClientApp called by hand, one Context per node, as a SuperNode would
    for nid in ids:
        ctx = Context(
            run_id=1,
            node_id=nid,
            node_config={keys.NODE_PARTITION_ID: nid - 1},
            state=RecordDict(),
            run_config={},
        )
        msg = Message(RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec})}), nid, MessageType.QUERY)
        metrics = fedsim_app(msg, ctx).content[keys.METRICS]
        direct[int(metrics[keys.PARTITION_ID])] = (nid, int(metrics[keys.NUM_EXAMPLES]))
    assert found == direct


def test_query_fast_path_still_reports_a_broken_client_stack():
    spec = json.loads(build.client_spec(compose_cfg("num_clients=6"), "cpu"))
    spec["model"]["hidden"] = [-1]  # the ClientApp cannot build this model
    msg = Message(
        RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: json.dumps(spec)})}), 1, MessageType.QUERY
    )
    (reply,) = pool.PoolGrid(6).send_and_receive([msg])
    assert reply.has_error()


def test_workers_must_be_a_positive_integer():
    with pytest.raises(ConfigError, match="engine.workers"):
        pool.PoolGrid(3, workers=0)

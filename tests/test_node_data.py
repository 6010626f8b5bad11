"""A SuperNode's partition id and its own data folder (``data-dir``): loader, checks, ClientApp, error replies."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from helpers import compose_cfg
from strategy_helpers import server_identity

from fedsim import build, keys
from fedsim.errors import ConfigError
from fedsim.node_data import load_node_data, node_partition, node_task, save_node_data

SPEC_OVERRIDES = ("num_clients=3", "clients_per_round=3", "num_rounds=1", "quiet=true")


@pytest.fixture(scope="module")
def spec() -> str:
    return build.client_spec(compose_cfg(*SPEC_OVERRIDES), device="cpu")


@pytest.fixture(scope="module")
def digits(spec):
    ds = build.build_dataset(json.loads(spec))
    return ds.x_train, ds.y_train


def test_round_trip_with_val_file(tmp_path):
    x, y = np.random.default_rng(0).random((12, 1, 8, 8)), np.arange(12) % 10
    save_node_data(tmp_path, x, y, x[:3], y[:3])
    xt, yt, xv, yv = load_node_data(tmp_path, val_fraction=0.5)
    assert xt.dtype == np.float32 and yt.dtype == np.int64
    np.testing.assert_allclose(xt, x.astype(np.float32))
    np.testing.assert_array_equal(yt, y)
    assert xv.shape == (3, 1, 8, 8) and list(yv) == [0, 1, 2]  # val.npz wins over val_fraction


def test_val_split_is_seeded_and_disjoint(tmp_path):
    x, y = np.arange(20, dtype=np.float32).reshape(20, 1), np.zeros(20, dtype=np.int64)
    save_node_data(tmp_path, x, y)
    a = load_node_data(tmp_path, val_fraction=0.25, seed=3, partition_id=1)
    b = load_node_data(tmp_path, val_fraction=0.25, seed=3, partition_id=1)
    assert len(a[0]) == 15 and len(a[2]) == 5
    assert set(a[0][:, 0]).isdisjoint(a[2][:, 0]) and len(set(a[0][:, 0]) | set(a[2][:, 0])) == 20
    np.testing.assert_array_equal(a[2], b[2])
    assert len(load_node_data(tmp_path, val_fraction=0.0)[2]) == 0


def test_missing_folder_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data-dir=.*nope.*existing folder"):
        load_node_data(tmp_path / "nope")


def test_missing_train_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="train.npz does not exist"):
        load_node_data(tmp_path)


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"x": np.zeros((3, 2))}, "arrays 'x' and 'y'"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(4, dtype=int)}, r"shape \(n,\)"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(3)}, "integer class ids"),
        ({"x": np.full((3, 2), np.nan), "y": np.zeros(3, dtype=int)}, "finite numeric"),
    ],
)
def test_bad_arrays(tmp_path, arrays, match):
    np.savez(tmp_path / "train.npz", **arrays)
    with pytest.raises(ConfigError, match=match):
        load_node_data(tmp_path)


def test_node_partition(spec):
    assert node_partition({"partition-id": 2, "num-partitions": 3}, spec) == 2
    assert node_partition({"partition-id": 0}, spec) == 0
    with pytest.raises(
        ConfigError, match=r"partition-id=5 is not allowed: expected an integer in \[0, num-partitions=3\)"
    ):
        node_partition({"partition-id": 5, "num-partitions": 3}, spec)
    with pytest.raises(ConfigError, match="partition-id=-1"):
        node_partition({"partition-id": -1, "num-partitions": 3}, spec)
    with pytest.raises(ConfigError, match="partition-id=None.*--node-config"):
        node_partition({}, spec)
    with pytest.raises(ConfigError, match="num-partitions=4 .*num_clients=3"):
        node_partition({"partition-id": 0, "num-partitions": 4}, spec)


def _message(spec: str, kind: str, arrays: ArrayRecord | None = None) -> Message:
    content = RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec, keys.SERVER_ROUND: 1})})
    if arrays is not None:
        content[keys.ARRAYS] = arrays
    return Message(content, dst_node_id=1, message_type=kind)


def _context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def test_client_app_trains_on_its_data_dir(tmp_path, spec, digits):
    x, y = digits
    save_node_data(tmp_path / "node1", x[:40], y[:40], x[40:50], y[40:50])
    ctx = _context({"partition-id": 1, "num-partitions": 3, "data-dir": str(tmp_path / "node1")})
    with server_identity():  # Flower's Message() needs a run id, as inside a SuperNode
        _check_client_app(spec, ctx)


def _check_client_app(spec: str, ctx: Context) -> None:
    from fedsim import client_app

    q = client_app.query(_message(spec, MessageType.QUERY), ctx)
    assert (
        q.content[keys.METRICS][keys.PARTITION_ID] == 1 and q.content[keys.METRICS][keys.NUM_EXAMPLES] == 40
    )
    model = build.build_initial_model(json.loads(spec))
    rep = client_app.train(_message(spec, MessageType.TRAIN, ArrayRecord(model.state_dict())), ctx)
    m = rep.content[keys.METRICS]
    assert m[keys.PARTITION_ID] == 1 and m[keys.NUM_EXAMPLES] == 40
    assert set(rep.content[keys.ARRAYS].keys()) == set(model.state_dict())
    ev = client_app.evaluate_fn(_message(spec, MessageType.EVALUATE, ArrayRecord(model.state_dict())), ctx)
    assert ev.content[keys.METRICS][keys.NUM_EXAMPLES] == 10


def test_data_dir_must_match_the_model(tmp_path, spec):
    save_node_data(tmp_path / "a", np.zeros((5, 1, 7, 7)), np.zeros(5, dtype=int))
    with pytest.raises(ConfigError, match=r"features of shape \(n, 1, 8, 8\)"):
        node_task(spec, str(tmp_path / "a"), 0)
    save_node_data(tmp_path / "b", np.zeros((5, 1, 8, 8)), np.full(5, 10))
    with pytest.raises(ConfigError, match=r"class ids in \[0, 10\)"):
        node_task(spec, str(tmp_path / "b"), 0)


@pytest.mark.parametrize(
    "node_config, match",
    [
        ({"partition-id": 5}, "partition-id=5 is not allowed"),
        ({"data-dir": "/nonexistent/fedsim-node"}, "data-dir='/nonexistent/fedsim-node' is not allowed"),
    ],
)
def test_bad_node_is_an_error_reply_the_server_reports(spec, node_config, match):
    """The ClientApp's error becomes an error reply; node discovery stops at once, its first line says why."""
    from fedsim.engines.pool import PoolGrid
    from fedsim.server import LoopConfig, connect_sizes

    loop = LoopConfig(seed=0, num_clients=3, num_rounds=1, clients_per_round=3, node_timeout=30)
    with PoolGrid(3, node_config=node_config) as grid, pytest.raises(RuntimeError, match=match) as err:
        connect_sizes(grid, loop, spec)
    first = str(err.value).splitlines()[0]
    assert re.search(match, first) and "--node-config" in first  # the node's own words, not a traceback

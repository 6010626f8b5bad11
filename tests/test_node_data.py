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


def _fresh_task(spec: str, cache: str) -> dict:
    """client_task in a fresh interpreter (as in a new flwr-clientapp process): its arrays' digest and imports."""
    import subprocess
    import sys

    code = (
        "import hashlib, json, sys\n"
        "from fedsim import build\n"
        f"t = build.client_task({spec!r}, 1, {cache!r})\n"
        "h = hashlib.sha256(b''.join(a.numpy().tobytes() for a in (t.x_train, t.y_train, t.x_val, t.y_val)))\n"
        "print(json.dumps({'digest': h.hexdigest(), 'data_module': 'fedsim.data.digits' in sys.modules,\n"
        "                  'classes': t.num_classes, 'params': sum(p.numel() for p in t.model.parameters())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _digest(task) -> str:
    import hashlib

    arrays = (task.x_train, task.y_train, task.x_val, task.y_val)
    return hashlib.sha256(b"".join(a.numpy().tobytes() for a in arrays)).hexdigest()


def test_partition_cache_serves_a_fresh_process_without_building_the_data_set(tmp_path, spec):
    """What a deployed node's next message gets: the same arrays and model, read from one file."""
    from fedsim import client_app

    cache = tmp_path / "cache"
    ctx = _context({"partition-id": 1, "num-partitions": 3, keys.NODE_CACHE_DIR: str(cache)})
    with server_identity():
        q = client_app.query(_message(spec, MessageType.QUERY), ctx)  # the first message writes the file
    files = list(cache.glob("partition-1-*.npz"))
    assert len(files) == 1 and not list(cache.glob(".tmp-*"))
    built = build.client_task(spec, 1)  # no cache: from the data set
    got = _fresh_task(spec, str(cache))
    assert got["digest"] == _digest(built) and not got["data_module"]  # read, not rebuilt
    assert got["classes"] == 10 and got["params"] == sum(p.numel() for p in built.model.parameters())
    assert q.content[keys.METRICS][keys.NUM_EXAMPLES] == len(built.y_train)
    # another run's partition is another file; the first one is left alone
    other = build.client_spec(compose_cfg(*SPEC_OVERRIDES, "seed=5"), device="cpu")
    assert _digest(build.client_task(other, 1, str(cache))) != _digest(built)
    assert len(list(cache.glob("partition-1-*.npz"))) == 2


def test_a_broken_or_unwritable_partition_cache_costs_only_speed(tmp_path, spec, caplog):
    from fedsim import partition_cache

    want = _digest(build.client_task(spec, 2))
    cache = tmp_path / "cache"
    build.client_task(spec, 2, str(cache))
    (path,) = cache.glob("partition-2-*.npz")
    path.write_bytes(path.read_bytes()[:100])  # truncated, e.g. by a full disk in an older version
    build.client_task.cache_clear()
    assert _digest(build.client_task(spec, 2, str(cache))) == want
    assert "unreadable partition cache" in caplog.text
    assert partition_cache.load(path) is not None  # rewritten whole
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    build.client_task.cache_clear()
    assert _digest(build.client_task(spec, 2, str(blocker / "cache"))) == want
    assert "partition cache not written" in caplog.text


def test_deploy_passes_the_cache_folder_in_a_node_config_flower_parses(tmp_path):
    from flwr.common.config import parse_config_args

    from fedsim.deploy.__main__ import cache_folder
    from fedsim.deploy.launch import node_config

    where = tmp_path / "a b"
    text = node_config(1, 3, cache_dir=cache_folder(str(where), None))
    assert parse_config_args([text]) == {"partition-id": 1, "num-partitions": 3, "cache-dir": str(where)}
    assert cache_folder("none", tmp_path) is None and cache_folder(None, tmp_path) == str(tmp_path)
    assert node_config(0, 2) == "partition-id=0 num-partitions=2"

"""A SuperNode's own data: which partition it is, and its local data folder (``data-dir``).

A deployed SuperNode is started with ``--node-config "partition-id=K num-partitions=N"``. Without ``data-dir``
it rebuilds partition K of the run's seeded data set and partitioner (the demo: every node holds the same
public data set and keeps only its share). With ``data-dir="/path"`` it trains on its own files instead
(the real-world case). The folder format:

``train.npz`` (required)
    ``x``: features, shape ``(n, *input_shape)``, already preprocessed like the server's ``dataset=`` (for the
    default ``digits``: float in [0, 1], shape ``(n, 1, 8, 8)``); ``y``: integer class ids in
    ``[0, num_classes)``, shape ``(n,)``.
``val.npz`` (optional)
    The same two arrays, the node's validation split (federated evaluation). Without it, ``val_fraction`` of
    ``train.npz`` is held out with a split seeded by the run's seed and the partition id.

Write one with ``save_node_data(folder, x, y)`` or ``numpy.savez(folder / "train.npz", x=x, y=y)``.
``partition-id`` stays required with ``data-dir``: it is the node's id in the federation (the server samples
and reports clients by it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from fedsim import build, keys
from fedsim.errors import ConfigError
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng

TRAIN_FILE = "train.npz"
VAL_FILE = "val.npz"
FORMAT = f"a folder holding {TRAIN_FILE} (arrays x, y) and optionally {VAL_FILE}"


@functools.lru_cache(maxsize=16)
def _num_clients(spec_json: str) -> int:
    return int(json.loads(spec_json)["num_clients"])


def node_partition(node_config: dict, spec_json: str) -> int:
    """This node's partition id from its ``node_config``, checked against the run's ``num_clients``.

    Raises
    ------
    ConfigError
        ``partition-id`` missing, not an integer, or outside ``[0, num-partitions)``; ``num-partitions``
        different from the run's ``num_clients``.
    """
    n = _num_clients(spec_json)
    how = "Start the SuperNode with --node-config 'partition-id=K num-partitions=N'."
    raw = node_config.get(keys.NODE_PARTITION_ID)
    if raw is None:
        raise ConfigError(keys.NODE_PARTITION_ID, None, "an integer in the node config", how)
    try:
        pid = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(keys.NODE_PARTITION_ID, raw, f"an integer in [0, {n})", how) from None
    parts = node_config.get(keys.NODE_NUM_PARTITIONS)
    if parts is not None and int(parts) != n:
        raise ConfigError(
            keys.NODE_NUM_PARTITIONS,
            parts,
            f"the run's num_clients={n}",
            "Give every SuperNode num-partitions equal to the run's num_clients.",
        )
    if not 0 <= pid < n:
        raise ConfigError(keys.NODE_PARTITION_ID, pid, f"an integer in [0, num-partitions={n})", how)
    return pid


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            if "x" not in z or "y" not in z:
                raise ConfigError(
                    keys.NODE_DATA_DIR,
                    str(path),
                    f"{path.name} with arrays 'x' and 'y'",
                    f"It holds {sorted(z.files)}.",
                )
            x, y = z["x"], z["y"]
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(keys.NODE_DATA_DIR, str(path), f"a readable .npz file ({FORMAT})", str(e)) from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(
            keys.NODE_DATA_DIR,
            str(path),
            "x of shape (n, ...) and y of shape (n,)",
            f"Got x {x.shape}, y {y.shape}.",
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(keys.NODE_DATA_DIR, str(path), "integer class ids in y", f"Got dtype {y.dtype}.")
    if np.iscomplexobj(x) or not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
        raise ConfigError(
            keys.NODE_DATA_DIR,
            str(path),
            "finite numeric features in x (not complex)",
            f"Got dtype {x.dtype}.",
        )
    return x.astype(np.float32, copy=False), y.astype(np.int64, copy=False)


def load_node_data(
    data_dir: str | Path, val_fraction: float = 0.0, seed: int = 0, partition_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read a node's folder: ``(x_train, y_train, x_val, y_val)`` as float32 / int64 arrays.

    Without ``val.npz``, ``floor(val_fraction * n)`` training examples are held out (seeded by ``seed`` and
    ``partition_id``, like the simulated partitions).

    Raises
    ------
    ConfigError
        The folder or ``train.npz`` is missing, or an array has the wrong shape or type.
    """
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            keys.NODE_DATA_DIR,
            str(data_dir),
            f"an existing folder: {FORMAT}",
            "Fix data-dir in the SuperNode's --node-config.",
        )
    if not (folder / TRAIN_FILE).is_file():
        raise ConfigError(keys.NODE_DATA_DIR, str(data_dir), FORMAT, f"{folder / TRAIN_FILE} does not exist.")
    x, y = _read_npz(folder / TRAIN_FILE)
    if len(x) == 0:
        raise ConfigError(keys.NODE_DATA_DIR, str(data_dir), f"at least one example in {TRAIN_FILE}")
    if (folder / VAL_FILE).is_file():
        xv, yv = _read_npz(folder / VAL_FILE)
        if xv.shape[1:] != x.shape[1:]:
            raise ConfigError(
                keys.NODE_DATA_DIR,
                str(data_dir),
                f"{VAL_FILE} features shaped like {TRAIN_FILE}'s",
                f"Got {xv.shape[1:]} and {x.shape[1:]}.",
            )
        return x, y, xv, yv
    from fedsim.data.partition import split_train_val

    t, v = split_train_val(
        np.arange(len(x)), val_fraction, seeded_rng(seed, Purpose.TRAIN_VAL_SPLIT, partition_id)
    )
    return x[t], y[t], x[v], y[v]


def save_node_data(
    data_dir: str | Path,
    x: np.ndarray,
    y: np.ndarray,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
) -> Path:
    """Write a node's folder in the format ``load_node_data`` reads; return the folder."""
    folder = Path(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / TRAIN_FILE, x=np.asarray(x, np.float32), y=np.asarray(y, np.int64))
    if x_val is not None and y_val is not None:
        np.savez(folder / VAL_FILE, x=np.asarray(x_val, np.float32), y=np.asarray(y_val, np.int64))
    return folder


def _model_shape(spec: dict) -> tuple[tuple[int, ...], int]:
    """Input shape and number of classes of the run's model (from the spec, else the server's data set)."""
    if "input_shape" in spec and "num_classes" in spec:
        return tuple(int(d) for d in spec["input_shape"]), int(spec["num_classes"])
    ds = build.build_dataset(spec)
    return tuple(ds.input_shape), int(ds.num_classes)


@functools.lru_cache(maxsize=64)
def node_task(spec_json: str, data_dir: str, partition_id: int) -> build.ClientTask:
    """The client task of a node that trains on its own folder ``data_dir`` (see the module docstring)."""
    from fedsim.models import build_model

    spec = json.loads(spec_json)
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    device = build.resolve_device(spec["device"])
    x, y, xv, yv = load_node_data(
        data_dir, float(spec.get("val_fraction", 0.0)), int(spec["seed"]), partition_id
    )
    input_shape, num_classes = _model_shape(spec)
    if tuple(x.shape[1:]) != input_shape:
        raise ConfigError(
            keys.NODE_DATA_DIR,
            data_dir,
            f"features of shape (n, {', '.join(map(str, input_shape))}) like the run's data set",
            f"{TRAIN_FILE} has x of shape {x.shape}.",
        )
    for name, labels in (("y", y), ("val y", yv)):
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise ConfigError(
                keys.NODE_DATA_DIR,
                data_dir,
                f"class ids in [0, {num_classes}) in {name}",
                f"Found {int(labels.min())}..{int(labels.max())}.",
            )
    try:
        model = build_model(build.model_factory(spec), input_shape, num_classes, seed=int(spec["seed"]))
    except ConfigError as e:
        raise e.with_prefix("model") from None

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, device=device)

    return build.ClientTask(
        partition_id,
        model.to(device),
        t(x),
        t(y),
        t(xv),
        t(yv),
        build.local_training(spec),
        int(spec["seed"]),
        device,
        build.fault_rates(spec),
        task=build.build_task(spec),
    )


def task_for(spec: str, node_config) -> build.ClientTask:
    """This node's task: its partition of the run's data set (``partition-id``, cached on disk under
    ``cache-dir`` when set), or its own folder when ``data-dir`` is set."""
    partition_id = node_partition(node_config, spec)
    data_dir = node_config.get(keys.NODE_DATA_DIR)
    if data_dir:
        task = node_task(spec, str(data_dir), partition_id)
    else:
        cache_dir = node_config.get(keys.NODE_CACHE_DIR)
        task = build.client_task(spec, partition_id, str(cache_dir) if cache_dir else None)
    if task.algorithm is None:  # the client algorithm and the model's classes, from the spec
        task.algorithm = build.client_algorithm(json.loads(spec))
    if task.num_classes is None:
        task.num_classes = _model_shape(json.loads(spec))[1]
    return task

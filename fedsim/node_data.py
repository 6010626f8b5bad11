"""A SuperNode's own data: which partition it is, and its local data folder (``data-dir``).

A deployed SuperNode is started with ``--node-config "partition-id=K num-partitions=N"``. Without ``data-dir``
it rebuilds partition K of the run's seeded data set and partitioner (the demo: every node holds the same
public data set and keeps only its share). With ``data-dir="/path"`` it trains on its own files instead
(the real-world case): the folder's format, and its reader and writer, are
:mod:`fedsim.data.node_folder`'s (``save_node_data`` and ``load_node_data`` are importable from here too).
``partition-id`` stays required with ``data-dir``: it is the node's id in the federation (the server samples
and reports clients by it).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from fedsim import build, keys
from fedsim.data.node_folder import (  # noqa: F401  (load_node_data, save_node_data: named by docs/deploy.md)
    TRAIN_FILE,
    load_node_data,
    save_node_data,
)
from fedsim.errors import ConfigError


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

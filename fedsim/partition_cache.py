"""A deployed node's partition, kept on its disk so that a fresh ``flwr-clientapp`` process loads it in ms.

Flower 1.42 starts a new ClientApp process for every message a SuperNode receives, so without a cache each
message rebuilds the whole data set and its partition to keep one client's share. With ``cache-dir`` in the
node config (``fedsim.deploy`` sets it for the SuperNodes it starts), the first message writes the node's
training and validation arrays, the model's input shape and its number of classes to one ``.npz`` file; the
next messages read only that file.

The file's name is a hash of everything that decides the partition: the run's seed, ``num_clients``,
``val_fraction``, data set and partitioner sections, the partition id, and this cache's format version. A
data set read from files the config does not describe (a data folder whose contents changed under the same
path) is not noticed: delete the folder (or give another ``cache-dir``) after changing such files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Partition", "cache_file", "load", "save"]

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the file's contents change meaning
KEYS = ("seed", "num_clients", "val_fraction", "dataset", "partitioner")


@dataclass(frozen=True)
class Partition:
    """One client's share, as its ClientApp needs it."""

    input_shape: tuple[int, ...]
    num_classes: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray


def cache_file(cache_dir: str | Path, spec: dict, partition_id: int) -> Path:
    """The file that holds partition ``partition_id`` of the run ``spec`` describes."""
    what = {k: spec.get(k) for k in KEYS} | {"partition_id": int(partition_id), "format": FORMAT}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache_dir).expanduser() / f"partition-{partition_id}-{digest}.npz"


def load(path: Path) -> Partition | None:
    """The cached partition, or ``None`` when the file is missing or unreadable (then it is rebuilt)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return Partition(
                tuple(int(d) for d in z["input_shape"]),
                int(z["num_classes"]),
                z["x_train"],
                z["y_train"],
                z["x_val"],
                z["y_val"],
            )
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001  (a truncated or foreign file: rebuild it)
        log.warning("ignoring the unreadable partition cache %s (%s); rebuilding it", path, e)
        return None


def save(path: Path, part: Partition) -> None:
    """Write ``part`` atomically (a temp file, then a rename): concurrent processes never read half a file.

    A cache that cannot be written (read-only or full disk) only costs speed: one warning, no error.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    input_shape=np.asarray(part.input_shape, dtype=np.int64),
                    num_classes=np.asarray(part.num_classes, dtype=np.int64),
                    x_train=part.x_train,
                    y_train=part.y_train,
                    x_val=part.x_val,
                    y_val=part.y_val,
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("partition cache not written to %s: %s", path, e)

"""A SuperNode's own data folder (``data-dir``): its file format, read and written.

The folder format:

``train.npz`` (required)
    ``x``: features, shape ``(n, *input_shape)``, already preprocessed like the server's ``dataset=`` (for the
    default ``digits``: float in [0, 1], shape ``(n, 1, 8, 8)``); ``y``: integer class ids in
    ``[0, num_classes)``, shape ``(n,)``.
``val.npz`` (optional)
    The same two arrays, the node's validation split (federated evaluation). Without it, ``val_fraction`` of
    ``train.npz`` is held out with a split seeded by the run's seed and the partition id.

Write one with ``save_node_data(folder, x, y)`` or ``numpy.savez(folder / "train.npz", x=x, y=y)``. The
node's task built from it is :mod:`fedsim.node_data`'s; ``dataset=npz`` (:mod:`fedsim.data.npz`) reads the
same ``train.npz``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsim import keys
from fedsim.errors import ConfigError
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng

TRAIN_FILE = "train.npz"
VAL_FILE = "val.npz"
FORMAT = f"a folder holding {TRAIN_FILE} (arrays x, y) and optionally {VAL_FILE}"


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

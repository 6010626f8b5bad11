"""A user's own arrays in the ``.npz`` format a SuperNode's ``data-dir`` holds (:mod:`fedsim.data.node_folder`).

``path`` is a folder holding ``train.npz`` (arrays ``x``, ``y``, optionally ``groups``: each example's natural
owner, for ``partitioner=natural``) and optionally ``test.npz`` (``x``, ``y``: the server's test set), or one
``.npz`` file (then ``test_fraction`` of it is held out). ``x`` is used as it is (already preprocessed, shape
``(n, *input_shape)``); ``y`` holds integer class ids.
"""

from __future__ import annotations

import pickle
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedsim.data.base import MAX_CLASSES, Dataset
from fedsim.data.digits import stratified_split
from fedsim.data.node_folder import TRAIN_FILE, _read_npz
from fedsim.errors import ConfigError

__all__ = ["load_npz"]

TEST_FILE = "test.npz"
FORMAT = f"a folder holding {TRAIN_FILE} (arrays x, y, optionally groups) and optionally {TEST_FILE}, or one .npz file"


def _read(path: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32) and ``y`` (int64) of one file, with node_data's checks, errors named by ``key``.

    A file that is not a whole ``.npz`` (empty, truncated, random bytes) is one line saying so; numpy would
    otherwise try to read it as a pickle and suggest ``allow_pickle``.
    """
    damaged = "The file is damaged or not an .npz file ({}); write it again with numpy.savez."
    if not zipfile.is_zipfile(path):
        size = path.stat().st_size
        raise ConfigError(
            key, str(path), FORMAT, damaged.format("empty" if not size else f"{size} bytes, no zip")
        )
    try:
        return _read_npz(path)
    except ConfigError as e:
        raise ConfigError(key, str(path), e.allowed, e.hint) from None
    except (zipfile.BadZipFile, EOFError, KeyError, RuntimeError, pickle.UnpicklingError, zlib.error) as e:
        raise ConfigError(key, str(path), FORMAT, damaged.format(_first(e))) from None


def _first(e: BaseException) -> str:
    return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:200]


def _groups(path: Path, n: int) -> np.ndarray | None:
    with np.load(path, allow_pickle=False) as z:
        if "groups" not in z:
            return None
        g = z["groups"]
    if g.shape != (n,):
        raise ConfigError(
            "path", str(path), f"groups of shape ({n},), one owner id per example", f"Got {g.shape}."
        )
    return np.unique(g, return_inverse=True)[1].astype(np.int64)


def load_npz(
    seed: int, path: str | None = None, test_fraction: float = 0.2, num_classes: int | None = None
) -> Dataset:
    """Read a user's arrays (see the module docstring).

    Parameters
    ----------
    seed : int
        Seed of the held-out test split (when there is no ``test.npz``).
    path : str
        The folder or ``.npz`` file; ``~`` is expanded.
    test_fraction : float
        Share of each class held out for the server's test set when there is no ``test.npz``, in (0, 1).
    num_classes : int, optional
        Number of classes; null: the largest label + 1.

    Raises
    ------
    ConfigError
        A missing or unreadable file, arrays of the wrong shape or type, labels outside ``num_classes``.
    """
    if not path:
        raise ConfigError("path", path, FORMAT, "Set it, e.g. dataset.path=/path/to/folder.")
    where = Path(path).expanduser()
    train_file = where / TRAIN_FILE if where.is_dir() else where
    if not train_file.is_file():
        raise ConfigError("path", path, FORMAT, f"{train_file} does not exist.")
    x, y = _read(train_file, "path")
    if len(y) == 0:
        raise ConfigError("path", path, FORMAT, f"{train_file} holds 0 examples.")
    groups = _groups(train_file, len(y))
    if where.is_dir() and (where / TEST_FILE).is_file():
        x_test, y_test = _read(where / TEST_FILE, "path")
        if x_test.shape[1:] != x.shape[1:]:
            raise ConfigError(
                "path",
                path,
                f"{TEST_FILE} features shaped like {TRAIN_FILE}'s",
                f"Got {x_test.shape[1:]} and {x.shape[1:]}.",
            )
    else:
        train, test = stratified_split(y, test_fraction, np.random.default_rng(seed))
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
        groups = None if groups is None else groups[train]
    top = int(max(y.max(initial=-1), y_test.max(initial=-1))) + 1
    if num_classes is None:
        distinct = len(np.union1d(np.unique(y), np.unique(y_test)))
        if top > 2 * distinct:  # over half the classes empty: a damaged label, or 255 marking "no label"
            raise ConfigError(
                "num_classes",
                None,
                f"an explicit number of classes: {path} holds {distinct} distinct labels but label {top - 1}",
                f"Set dataset.num_classes (at most {MAX_CLASSES}) if that many classes is meant; else the file's "
                "labels are damaged.",
            )
        num_classes = top
    elif isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < top:
        raise ConfigError("num_classes", num_classes, f"null or an integer >= {top} (the largest label + 1)")
    return Dataset(
        name=f"npz:{where.name}",
        x_train=np.ascontiguousarray(x),
        y_train=y,
        x_test=np.ascontiguousarray(x_test),
        y_test=y_test,
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in x.shape[1:]),
        groups=groups,
    )

"""Any tabular or image data set that Hugging Face ``datasets`` reads: local parquet, CSV or JSON files, a folder
written by ``Dataset.save_to_disk``, or a Hub name when online (``pip install -e ".[hf]"``).

The feature and label columns are named in the config; a ``group`` column (a writer or user id) gives each
training example its natural owner, so ``partitioner=natural`` makes one client per writer, FEMNIST-style.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedsim.data.base import Dataset
from fedsim.data.digits import stratified_split
from fedsim.errors import ConfigError

__all__ = ["load_hf"]

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
INSTALL = 'pip install -e ".[hf]"'


@functools.cache
def _datasets():
    """The ``datasets`` module, or a one-line ``ConfigError`` naming the extra that provides it."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "dataset", "hf", "the optional dependency 'datasets' installed", f"Install it: {INSTALL}."
        ) from None
    datasets.disable_progress_bars()  # one line per round stays readable
    return datasets


def _split_files(folder: Path) -> dict[str, list[str]]:
    """``{split: files}`` of a folder holding ``train.<ext>`` / ``test.<ext>`` style files of one format."""
    files: dict[str, list[str]] = {}
    for f in sorted(folder.iterdir()):
        if f.suffix in BUILDERS and f.is_file():
            files.setdefault(f.stem.split("-")[0], []).append(str(f))
    return files


def _open(path: str, split: str) -> dict:
    """The splits of ``path`` as ``{name: datasets.Dataset}``."""
    hf = _datasets()
    local = Path(path).expanduser()
    try:
        if local.is_dir() and any((local / n).is_file() for n in ("dataset_info.json", "dataset_dict.json")):
            loaded = hf.load_from_disk(str(local))  # Dataset.save_to_disk / DatasetDict.save_to_disk
            return {split: loaded} if isinstance(loaded, hf.Dataset) else dict(loaded)
        if local.is_file():
            if local.suffix not in BUILDERS:
                raise ConfigError("path", path, f"a file ending in {', '.join(BUILDERS)}")
            return dict(hf.load_dataset(BUILDERS[local.suffix], data_files={split: str(local)}))
        if local.is_dir():
            files = _split_files(local)
            kinds = {BUILDERS[Path(f).suffix] for fs in files.values() for f in fs}
            if len(kinds) != 1:
                raise ConfigError(
                    "path",
                    path,
                    "a folder written by save_to_disk, or holding split files of one format (train.parquet, "
                    "test.parquet, ...)",
                    f"It holds {sorted(p.name for p in local.iterdir())[:6]}.",
                )
            return dict(hf.load_dataset(kinds.pop(), data_files=files))
        return dict(hf.load_dataset(path))  # a Hub name
    except ConfigError:
        raise
    except (ConnectionError, FileNotFoundError, OSError, ValueError) as e:
        raise ConfigError(
            "path",
            path,
            "an existing data file or folder, or a Hugging Face Hub name reachable from here",
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})",
        ) from None


def _column(part, name: str, key: str, path: str) -> np.ndarray:
    if name not in part.column_names:
        raise ConfigError(key, name, f"a column of {path}: {', '.join(part.column_names)}")
    return np.asarray(part.select_columns([name]).with_format("numpy")[:][name])


def _features(part, names: Sequence[str], path: str) -> np.ndarray:
    """One image column as ``(n, C, H, W)``, or numeric columns as ``(n, k)`` (a list column spreads out)."""
    cols = [_column(part, c, "features", path) for c in names]
    if len(cols) == 1 and cols[0].ndim >= 3:  # images: (n, H, W) or (n, H, W, C)
        x = cols[0]
        if x.ndim == 3:
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.transpose(0, 3, 1, 2)
        scale = 255.0 if np.issubdtype(x.dtype, np.integer) else 1.0
        return x.astype(np.float32) / scale
    try:
        x = np.concatenate([c.reshape(len(c), -1).astype(np.float32) for c in cols], axis=1)
    except (TypeError, ValueError):
        raise ConfigError(
            "features", list(names), "numeric columns, or one image column with images of one size"
        ) from None
    return x


def _labels(train: np.ndarray, test: np.ndarray, feature) -> tuple[np.ndarray, np.ndarray, int]:
    """Class ids for both splits: a ClassLabel's own, integers as they are, anything else by sorted value."""
    if getattr(feature, "num_classes", None) is not None:
        return train.astype(np.int64), test.astype(np.int64), int(feature.num_classes)
    values = np.concatenate([train, test])
    if np.issubdtype(values.dtype, np.integer) and (len(values) == 0 or values.min() >= 0):
        return train.astype(np.int64), test.astype(np.int64), int(values.max(initial=0)) + 1
    if np.issubdtype(values.dtype, np.floating) and not np.array_equal(values, np.round(values)):
        raise ConfigError(
            "label",
            "(real-valued)",
            "a column of class labels (integers or names)",
            "Set dataset.targets=values.",
        )
    names, ids = np.unique(values, return_inverse=True)
    return ids[: len(train)].astype(np.int64), ids[len(train) :].astype(np.int64), len(names)


def _subset(n: int, limit: int | None, rng: np.random.Generator, key: str) -> np.ndarray:
    if limit is None or limit >= n:
        return np.arange(n)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(key, limit, "null or an integer >= 1")
    return np.sort(rng.choice(n, size=limit, replace=False))


def load_hf(
    seed: int,
    path: str | None = None,
    features: Sequence[str] | str = ("image",),
    label: str = "label",
    group: str | None = None,
    split: str = "train",
    test_split: str | None = "test",
    test_fraction: float = 0.2,
    targets: str = "classes",
    max_train: int | None = None,
    max_test: int | None = None,
) -> Dataset:
    """Read a data set through Hugging Face ``datasets`` and turn the named columns into arrays.

    Parameters
    ----------
    seed : int
        Seed of the held-out test split and of the ``max_*`` subsets.
    path : str
        A ``.parquet``/``.csv``/``.json(l)``/``.arrow`` file (its rows are split ``split``), a folder written
        by ``save_to_disk`` or holding ``train.<ext>``/``test.<ext>`` files, or a Hub name (online).
    features : str or list of str
        One image column (PIL images or equal-size arrays: scaled to [0, 1] when integer, shape
        ``(n, C, H, W)``), or numeric columns (tabular: standardised with the training mean and std).
    label : str
        The label column: a ClassLabel, integers >= 0, or values (names) mapped to ids in sorted order.
    group : str, optional
        A column of natural owner ids (writer, user) for ``partitioner=natural``.
    split, test_split : str
        The training split, and the split for the server's test set; when the data has no ``test_split``
        (or it is null), ``test_fraction`` of the training split is held out, stratified by label.
    targets : str
        ``classes`` (classification) or ``values`` (real-valued regression targets).
    max_train, max_test : int, optional
        Keep a seeded random subset of at most this many examples.

    Raises
    ------
    ConfigError
        ``datasets`` is not installed, ``path`` cannot be read, a column does not exist, or a value is bad.
    """
    if not path:
        raise ConfigError(
            "path",
            path,
            "a data file or folder, or a Hub name",
            "Set it, e.g. dataset.path=data/train.parquet.",
        )
    names = [features] if isinstance(features, str) else list(features)
    if not names:
        raise ConfigError("features", features, "one image column or a list of numeric columns")
    if targets not in ("classes", "values"):
        raise ConfigError("targets", targets, "classes or values")
    splits = _open(path, split)
    if split not in splits:
        raise ConfigError("split", split, f"a split of {path}: {', '.join(splits)}")
    rng = np.random.default_rng(seed)
    train_part = splits[split]
    y_all = _column(train_part, label, "label", path)
    if test_split is not None and test_split in splits and test_split != split:
        test_part = splits[test_split]
        train_idx = _subset(len(train_part), max_train, rng, "max_train")
        test_idx = _subset(len(test_part), max_test, rng, "max_test")
        x_train, y_train = _features(train_part, names, path)[train_idx], y_all[train_idx]
        x_test = _features(test_part, names, path)[test_idx]
        y_test = _column(test_part, label, "label", path)[test_idx]
        groups = _column(train_part, group, "group", path)[train_idx] if group else None
    else:
        x, g = (
            _features(train_part, names, path),
            (_column(train_part, group, "group", path) if group else None),
        )
        strata = y_all if targets == "classes" else np.zeros(len(y_all), np.int64)
        train_idx, test_idx = stratified_split(np.unique(strata, return_inverse=True)[1], test_fraction, rng)
        train_idx = train_idx[_subset(len(train_idx), max_train, rng, "max_train")]
        test_idx = test_idx[_subset(len(test_idx), max_test, rng, "max_test")]
        x_train, y_train, x_test, y_test = x[train_idx], y_all[train_idx], x[test_idx], y_all[test_idx]
        groups = g[train_idx] if g is not None else None
    if x_train.ndim == 2:  # tabular: standardised with the training statistics
        mean, std = x_train.mean(axis=0), x_train.std(axis=0)
        std[std == 0] = 1.0
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    if targets == "values":
        y_train, y_test, num_classes = y_train.astype(np.float32), y_test.astype(np.float32), 1
    else:
        y_train, y_test, num_classes = _labels(y_train, y_test, train_part.features.get(label))
    if groups is not None:
        groups = np.unique(groups, return_inverse=True)[1].astype(np.int64)
    return Dataset(
        name=f"hf:{Path(path).name or path}",
        x_train=np.ascontiguousarray(x_train, np.float32),
        y_train=y_train,
        x_test=np.ascontiguousarray(x_test, np.float32),
        y_test=y_test,
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in x_train.shape[1:]),
        groups=groups,
        targets=targets,
    )

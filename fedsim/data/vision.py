"""MNIST, Fashion-MNIST (IDX files) and CIFAR-10 (python pickles) read from a local folder with numpy.

No torchvision and no downloads: the files must already be on disk. ``apt-get install dataset-fashion-mnist``
puts Fashion-MNIST in ``/usr/share/datasets/fashion-mnist/``; MNIST and CIFAR-10 have to be downloaded by
the user. Images are scaled to [0, 1] and then normalised with fixed per-channel constants (so that every
client and every deployment node normalises the same way, whatever subset it holds).
"""

from __future__ import annotations

import gzip
import pickle
import zlib
from pathlib import Path

import numpy as np

from fedsim.checks import integer
from fedsim.data.base import Dataset, check_labels
from fedsim.errors import ConfigError, DataNotFoundError

__all__ = ["FASHION_MNIST_ROOT", "load_cifar10", "load_fashion_mnist", "load_mnist", "read_idx"]

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"  # where the Debian package installs it
_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
# Mean and std of the training pixels in [0, 1] (one value per channel).
_MNIST_NORM = ((0.1307,), (0.3081,))
_FASHION_NORM = ((0.2860,), (0.3530,))
_CIFAR_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file of unsigned bytes (MNIST format), gzipped (``.gz``) or raw.

    Parameters
    ----------
    path : str or Path
        The file.

    Returns
    -------
    np.ndarray
        ``uint8`` array with the shape stored in the header, e.g. ``(60000, 28, 28)``.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error):  # a cut-off download or not gzip at all
        data = b""  # reported below as truncated
    ndim = data[3] if len(data) >= 4 else 0
    bad = len(data) < 4 + 4 * ndim or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or ndim == 0
    shape = [] if bad else [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if bad or len(data) != 4 + 4 * ndim + int(np.prod(shape)):
        raise ConfigError(
            "root",
            str(path.parent),
            "IDX files of unsigned bytes (magic 0x0000080N followed by the data)",
            f"{path.name} is truncated or not an IDX file; download it again.",
        )
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _root(root: str | Path) -> Path:
    if not isinstance(root, (str, Path)) or not str(root):
        raise ConfigError("root", root, "a folder path")
    return Path(root).expanduser()


def _check_cap(key: str, value: object) -> int | None:
    return integer(key, value, 1, allow_none=True, what="null (all examples) or an integer >= 1")


def _subsample(n: int, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a random subset of ``min(cap, n)`` of ``n`` rows (all rows when cap is None)."""
    if cap is None or cap >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=cap, replace=False))


def _normalise(x_uint8: np.ndarray, norm: tuple[tuple[float, ...], tuple[float, ...]]) -> np.ndarray:
    """(n, C, H, W) uint8 -> float32 scaled to [0, 1], then standardised per channel."""
    mean = np.asarray(norm[0], dtype=np.float32)[None, :, None, None]
    std = np.asarray(norm[1], dtype=np.float32)[None, :, None, None]
    return (x_uint8.astype(np.float32) / 255.0 - mean) / std


def _find_idx(root: Path, subdir: str) -> dict[str, Path] | None:
    """Locate the four IDX files (raw or .gz) in ``root``, ``root/raw`` or ``root/<subdir>/raw``."""
    for folder in (root, root / "raw", root / subdir / "raw"):
        found = {}
        for name in _IDX_FILES:
            for candidate in (folder / name, folder / f"{name}.gz"):
                if candidate.is_file():
                    found[name] = candidate
                    break
        if len(found) == len(_IDX_FILES):
            return found
    return None


def _load_idx_set(name, root, seed, max_train, max_test, subdir, norm, how) -> Dataset:
    folder = _root(root)
    caps = _check_cap("max_train", max_train), _check_cap("max_test", max_test)
    files = _find_idx(folder, subdir)
    if files is None:
        expected = (
            ", ".join(f"{f}[.gz]" for f in _IDX_FILES) + f" (directly in {folder} or in its raw/ folder)"
        )
        raise DataNotFoundError("root", str(folder), expected, how)
    rng = np.random.default_rng(seed)
    out = {}
    for split, cap in zip(("train", "t10k"), caps):
        images = read_idx(files[f"{split}-images-idx3-ubyte"])
        labels = read_idx(files[f"{split}-labels-idx1-ubyte"])
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ConfigError(
                "root",
                str(folder),
                "matching image (n, 28, 28) and label (n,) IDX files",
                f"Check the {split} files.",
            )
        label_file = files[f"{split}-labels-idx1-ubyte"]
        check_labels(labels, 10, "root", str(folder), label_file.name)
        keep = _subsample(len(labels), cap, rng)
        out[split] = (_normalise(images[keep][:, None], norm), labels[keep].astype(np.int64))
    return Dataset(
        name=name,
        x_train=out["train"][0],
        y_train=out["train"][1],
        x_test=out["t10k"][0],
        y_test=out["t10k"][1],
        num_classes=10,
        input_shape=tuple(out["train"][0].shape[1:]),
    )


def load_mnist(root: str, seed: int, max_train: int | None = None, max_test: int | None = None) -> Dataset:
    """Load MNIST from the four IDX files (raw or ``.gz``) in ``root``.

    Parameters
    ----------
    root : str
        Folder holding ``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
        ``t10k-images-idx3-ubyte[.gz]`` and ``t10k-labels-idx1-ubyte[.gz]`` (also looked for in
        ``root/raw`` and torchvision's ``root/MNIST/raw``); ``~`` is expanded.
    seed : int
        Seed of the subsampling when ``max_train`` / ``max_test`` are set.
    max_train, max_test : int, optional
        Keep a random subset of at most this many training / test examples (None keeps all).

    Returns
    -------
    Dataset
        ``x`` of shape ``(n, 1, 28, 28)``, scaled to [0, 1] then normalised with MNIST's mean and std.
    """
    how = (
        "Download the four MNIST files (e.g. from a mirror of yann.lecun.com/exdb/mnist) into that folder, "
        "or point dataset.root (or the FEDSIM_DATA environment variable) at a folder that has them."
    )
    return _load_idx_set("mnist", root, seed, max_train, max_test, "MNIST", _MNIST_NORM, how)


def load_fashion_mnist(
    root: str, seed: int, max_train: int | None = None, max_test: int | None = None
) -> Dataset:
    """Load Fashion-MNIST from the four IDX files (raw or ``.gz``) in ``root``.

    Parameters
    ----------
    root : str
        Folder holding the IDX files, as for :func:`load_mnist` (torchvision's ``root/FashionMNIST/raw``
        works too). The Debian package ``dataset-fashion-mnist`` installs them in
        ``/usr/share/datasets/fashion-mnist``.
    seed : int
        Seed of the subsampling when ``max_train`` / ``max_test`` are set.
    max_train, max_test : int, optional
        Keep a random subset of at most this many training / test examples (None keeps all).

    Returns
    -------
    Dataset
        ``x`` of shape ``(n, 1, 28, 28)``, scaled to [0, 1] then normalised with Fashion-MNIST's mean and std.
    """
    how = (
        "Install the Debian package with `apt-get install dataset-fashion-mnist` (it puts the files in "
        f"{FASHION_MNIST_ROOT}/), or download the four files from github.com/zalandoresearch/fashion-mnist "
        "into that folder."
    )
    return _load_idx_set("fashion_mnist", root, seed, max_train, max_test, "FashionMNIST", _FASHION_NORM, how)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from fedsim.safe_pickle import SafeUnpickler, UnsafePickle

    try:
        with open(path, "rb") as f:  # pickles: read by an unpickler that rebuilds data only (never runs code)
            batch = SafeUnpickler(f, encoding="latin1").load()
        data = np.asarray(batch["data"], dtype=np.uint8)
        labels = np.asarray(batch["labels"], dtype=np.int64)
    except UnsafePickle as e:
        raise ConfigError(
            "root",
            str(path.parent),
            "CIFAR-10 batches holding plain data",
            f"{path.name} holds a pickled {e}, which fedsim does not load; download the batches again.",
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        OSError,
    ):
        data, labels = np.zeros((0, 0), np.uint8), np.zeros(1, np.int64)  # reported below as not a batch
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ConfigError(
            "root",
            str(path.parent),
            "CIFAR-10 batches with data of shape (n, 3072)",
            f"{path.name} is truncated or not one; download it again.",
        )
    check_labels(labels, 10, "root", str(path.parent), path.name)
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(root: str, seed: int, max_train: int | None = None, max_test: int | None = None) -> Dataset:
    """Load CIFAR-10 from the python-pickle batches (the ``cifar-10-batches-py`` folder).

    Parameters
    ----------
    root : str
        Folder holding ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, or its parent holding
        ``cifar-10-batches-py/``; ``~`` is expanded. Only use files from a source you trust: they are pickles.
    seed : int
        Seed of the subsampling when ``max_train`` / ``max_test`` are set.
    max_train, max_test : int, optional
        Keep a random subset of at most this many training / test examples (None keeps all).

    Returns
    -------
    Dataset
        ``x`` of shape ``(n, 3, 32, 32)``, scaled to [0, 1] then normalised per channel.
    """
    base = _root(root)
    caps = _check_cap("max_train", max_train), _check_cap("max_test", max_test)
    folder = next(
        (f for f in (base, base / "cifar-10-batches-py") if all((f / n).is_file() for n in _CIFAR_FILES)),
        None,
    )
    if folder is None:
        expected = ", ".join(_CIFAR_FILES) + f" (in {base} or in {base / 'cifar-10-batches-py'})"
        how = (
            "Download cifar-10-python.tar.gz from www.cs.toronto.edu/~kriz/cifar.html and unpack it there with "
            f"`tar xzf cifar-10-python.tar.gz -C {base}`, or point dataset.root (or FEDSIM_DATA) at it."
        )
        raise DataNotFoundError("root", str(base), expected, how)
    train = [_read_cifar_batch(folder / n) for n in _CIFAR_FILES[:-1]]
    x_test, y_test = _read_cifar_batch(folder / "test_batch")
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    rng = np.random.default_rng(seed)
    tr = _subsample(len(y_train), caps[0], rng)
    te = _subsample(len(y_test), caps[1], rng)
    return Dataset(
        name="cifar10",
        x_train=_normalise(x_train[tr], _CIFAR_NORM),
        y_train=y_train[tr],
        x_test=_normalise(x_test[te], _CIFAR_NORM),
        y_test=y_test[te],
        num_classes=10,
        input_shape=(3, 32, 32),
    )

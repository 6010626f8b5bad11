"""The in-memory data set every builder returns, and the BLAS limit data builders run under."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from fedsim.errors import ConfigError

# The most classes a data set may ask for: the model's last layer has one output per class, so a damaged label
# (10^6) would build a model of hundreds of megabytes before anything else could object.
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class Dataset:
    """Arrays of one data set, ready for partitioning.

    ``x_*`` are float32 of shape ``(n, *input_shape)``, already normalised; ``y_*`` are int64 class ids in
    ``[0, num_classes)`` (checked: a label outside is a ``ConfigError`` on ``dataset``), or, with
    ``targets="values"`` (a regression data set), finite float32 targets and ``num_classes`` the number of model
    outputs (1). ``groups`` holds each training example's natural owner (a user or writer id) when the data set
    has one, for the ``natural`` partitioner.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    groups: np.ndarray | None = None
    targets: str = "classes"  # what y holds: "classes" (int64 ids) or "values" (float32, regression)

    def __post_init__(self) -> None:
        if self.targets != "values" and (
            isinstance(self.num_classes, bool)
            or not isinstance(self.num_classes, (int, np.integer))
            or not 1 <= self.num_classes <= MAX_CLASSES
        ):
            raise ConfigError(
                "dataset",
                self.name,
                f"a data set of 1 to {MAX_CLASSES} classes (it declares {self.num_classes!r})",
                "A label far above the others (a damaged file?) makes that many classes; check the labels.",
            )
        for split in ("x_train", "x_test"):
            check_features(getattr(self, split), getattr(self, "y" + split[1:]), self.name, split)
        for split in ("y_train", "y_test"):
            if self.targets == "values":
                check_values(getattr(self, split), "dataset", self.name, f"its {split}")
            else:
                check_labels(getattr(self, split), self.num_classes, "dataset", self.name, f"its {split}")

    def partition_labels(self, bins: int = 10) -> np.ndarray:
        """Labels the label-skew partitioners split by: the class ids, or for real-valued targets their
        quantile bin (``bins`` bins of about equal size), so that Dirichlet or shards skew the target range."""
        if self.targets != "values":
            return self.y_train
        return value_bins(self.y_train, bins)


def check_features(x: object, y: object, name: str, split: str) -> None:
    """Refuse features a model cannot take as they are: none at all, complex numbers (casting drops the
    imaginary part), non-numbers, or a length other than the labels'."""
    x = np.asarray(x) if not hasattr(x, "shape") else x
    n = x.shape[0] if len(x.shape) else 0
    if n == 0:
        raise ConfigError("dataset", name, f"a data set with examples in {split}", f"Its {split} holds 0.")
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and (
        np.iscomplexobj(x) or not (np.issubdtype(dtype, np.number) or dtype.kind == "b")
    ):
        raise ConfigError(
            "dataset",
            name,
            f"real-valued features (float or int) in {split}",
            f"Got {dtype}: convert them first.",
        )
    if len(y) != n:
        raise ConfigError(
            "dataset", name, f"one label per example in {split}", f"Got {n} examples, {len(y)} labels."
        )


def value_bins(values: np.ndarray, bins: int = 10) -> np.ndarray:
    """The quantile bin (0 .. bins-1, about equally full) of each real value, as int64."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return np.zeros(0, dtype=np.int64)
    edges = np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1])
    return np.searchsorted(edges, values, side="right").astype(np.int64)


def check_values(values: np.ndarray, key: str, value: object, source: str) -> None:
    """Raise ``ConfigError(key, value, ...)`` when regression targets read from ``source`` are not finite
    floats."""
    values = np.asarray(values)
    if values.size == 0:
        return
    if not np.issubdtype(values.dtype, np.floating):
        raise ConfigError(
            key, value, f"real-valued (float) regression targets (got {values.dtype} in {source})"
        )
    if not np.isfinite(values).all():
        raise ConfigError(key, value, f"finite regression targets ({source} holds NaN or Inf)")


def check_labels(labels: np.ndarray, num_classes: int, key: str, value: object, source: str) -> None:
    """Raise ``ConfigError(key, value, ...)`` when ``labels`` (read from ``source``, e.g. a file name) hold a
    value outside ``[0, num_classes)``."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return
    if not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(key, value, f"integer class labels (got {labels.dtype} in {source})")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        count = int(((labels < 0) | (labels >= num_classes)).sum())
        raise ConfigError(
            key,
            value,
            f"class labels in [0, {num_classes})",
            f"{source} holds label {hi if hi >= num_classes else lo} ({count} label(s) out of range): "
            "the file is damaged or belongs to another data set.",
        )


def free_ram() -> int | None:
    """Bytes of RAM free now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(needs: dict[tuple[str, object], int], what: str) -> None:
    """Refuse a data set whose arrays would not fit in free RAM, before allocating them.

    ``needs`` maps ``(key, value)`` of the parameter behind each big array to its bytes; the largest one is
    named in the ``ConfigError`` (the process would otherwise be killed by the kernel's out-of-memory killer).
    """
    total, avail = sum(needs.values()), free_ram()
    if avail is None or total <= avail:
        return
    (key, value), _ = max(needs.items(), key=lambda kv: kv[1])
    raise ConfigError(
        key,
        value,
        f"a value for which the {what} fit in memory: about {total / 2**30:.1f} GiB needed, {avail / 2**30:.1f} GiB free",
    )


def single_threaded_blas():
    """Context manager: BLAS (OpenBLAS, MKL, BLIS) limited to one thread, where threadpoolctl is installed.

    Data builders run under it. A process that forks while OpenBLAS's thread pool is busy (a ServerApp building
    its data while Ray starts workers) can deadlock the child inside OpenBLAS; with one thread the pool is not
    used. The data do not change: OpenBLAS splits work over threads, not the order of its sums.
    """
    limits = _threadpool_limits()
    return limits(limits=1, user_api="blas") if limits is not None else contextlib.nullcontext()


@functools.cache
def _threadpool_limits():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover  (scikit-learn depends on it)
        return None
    return threadpool_limits


def sklearn_bundled(filename: str, delimiter: str | None = ",") -> np.ndarray | None:
    """One of the small tables scikit-learn ships in ``sklearn/datasets/data``, read with numpy.

    The file is found without importing scikit-learn (about 1-2 s of every process's start-up, paid by each
    fresh ``flwr-clientapp`` process in deployment); ``None`` when scikit-learn or the file is missing, so
    the caller can fall back to scikit-learn's own loader. The values equal scikit-learn's (tested).
    """
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "datasets", "data", filename)
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=delimiter, dtype=np.float64)
    return None

"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes): works offline, trains in seconds."""

from __future__ import annotations

import math

import numpy as np

from fedsim.data.base import Dataset, sklearn_bundled
from fedsim.errors import ConfigError

__all__ = ["load_digits", "stratified_split"]


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into train and test so that each class keeps its share in both.

    Each class ``c`` with ``n_c`` examples puts ``round(test_fraction * n_c)`` of them (at least one when
    ``n_c >= 2``, never all) into the test part.

    Parameters
    ----------
    labels : np.ndarray
        Class id of each example, shape ``(n,)``.
    test_fraction : float
        Share of each class for testing, in ``(0, 1)``.
    rng : np.random.Generator
        Source of the shuffle.

    Returns
    -------
    (np.ndarray, np.ndarray)
        Sorted ``int64`` train and test indices.
    """
    labels = np.asarray(labels)
    ok = isinstance(test_fraction, (int, float, np.integer, np.floating)) and not isinstance(
        test_fraction, bool
    )
    if not ok or not 0 < test_fraction < 1:
        raise ConfigError("test_fraction", test_fraction, "a number in (0, 1)")
    test = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(max(math.floor(test_fraction * idx.size + 0.5), 1), idx.size - 1)
        test.append(idx[:n_test])
    test_idx = np.sort(np.concatenate(test)).astype(np.int64)
    train_mask = np.ones(labels.size, dtype=bool)
    train_mask[test_idx] = False
    return np.flatnonzero(train_mask).astype(np.int64), test_idx


def load_digits(seed: int, test_fraction: float = 0.2) -> Dataset:
    """Load the 8x8 digits bundled with scikit-learn, scaled to [0, 1], with a seeded stratified split.

    Parameters
    ----------
    seed : int
        Seed of the train/test split.
    test_fraction : float
        Share of each class held out for testing, in ``(0, 1)``.

    Returns
    -------
    Dataset
        ``x`` of shape ``(n, 1, 8, 8)`` in ``[0, 1]`` (raw pixel values 0..16 divided by 16), 10 classes,
        no groups.
    """
    table = sklearn_bundled("digits.csv.gz")  # (n, 65): 64 pixels, then the label
    if table is None:
        from sklearn.datasets import load_digits as _sklearn_digits

        bunch = _sklearn_digits()
        table = np.column_stack([bunch.data, bunch.target])
    x = (table[:, :64].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)  # (n, 1, 8, 8)
    y = table[:, 64].astype(np.int64)
    train, test = stratified_split(y, test_fraction, np.random.default_rng(seed))
    return Dataset(
        name="digits",
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=10,
        input_shape=(1, 8, 8),
    )

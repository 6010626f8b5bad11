"""The in-memory data set every builder returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dataset:
    """Arrays of one data set, ready for partitioning.

    ``x_*`` are float32 of shape ``(n, *input_shape)``, already normalised; ``y_*`` are int64 class ids in
    ``[0, num_classes)``. ``groups`` holds each training example's natural owner (a user or writer id) when the
    data set has one, for the ``natural`` partitioner.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    groups: np.ndarray | None = None

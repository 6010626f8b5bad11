"""scikit-learn's bundled diabetes regression set (442 patients, 10 features, a disease-progression score).

Works offline and trains in seconds: fedsim's regression example (``task=regression dataset=diabetes``).
"""

from __future__ import annotations

import numpy as np

from fedsim.data.base import Dataset, sklearn_bundled, value_bins
from fedsim.data.digits import stratified_split

__all__ = ["load_diabetes"]


def load_diabetes(seed: int, test_fraction: float = 0.2) -> Dataset:
    """Load scikit-learn's diabetes set with standardised features and target, and a seeded split.

    The split is stratified by the target's quantile decile, so train and test cover the same range. Features
    and the target are standardised with the *training* part's mean and standard deviation (the target in
    standard units: an MSE of 1 is what predicting the mean gives).

    Parameters
    ----------
    seed : int
        Seed of the train/test split.
    test_fraction : float
        Share held out for the server's test set, in ``(0, 1)``.

    Returns
    -------
    Dataset
        ``x`` of shape ``(n, 10)``, float32 targets (``targets="values"``), one model output.
    """
    x, y = sklearn_bundled("diabetes_data_raw.csv.gz", None), sklearn_bundled("diabetes_target.csv.gz", None)
    if x is None or y is None:
        from sklearn.datasets import load_diabetes as _sklearn_diabetes

        x, y = _sklearn_diabetes(return_X_y=True, scaled=False)
    train, test = stratified_split(value_bins(y, 10), test_fraction, np.random.default_rng(seed))
    mu, sd = x[train].mean(axis=0), x[train].std(axis=0)
    ymu, ysd = y[train].mean(), y[train].std()

    def xs(idx: np.ndarray) -> np.ndarray:
        return ((x[idx] - mu) / sd).astype(np.float32)  # (n, 10)

    def ys(idx: np.ndarray) -> np.ndarray:
        return ((y[idx] - ymu) / ysd).astype(np.float32)  # (n,)

    return Dataset(
        name="diabetes",
        x_train=xs(train),
        y_train=ys(train),
        x_test=xs(test),
        y_test=ys(test),
        num_classes=1,
        input_shape=(10,),
        targets="values",
    )

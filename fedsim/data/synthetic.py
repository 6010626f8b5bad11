"""FedProx's Synthetic(alpha, beta) benchmark (Li et al. 2020, arXiv 1812.06127), drawn from a seeded Generator.

The generative process and the order of the random draws follow the authors' ``generate_synthetic.py`` and
``generate_iid.py``; only the source of randomness differs (``np.random.default_rng(seed)`` instead of the
unseeded legacy global RNG, and the same Generator for the per-user shuffle instead of ``random.shuffle``).
"""

from __future__ import annotations

import math

import numpy as np

from fedsim.checks import is_integer, is_number
from fedsim.data.base import Dataset, single_threaded_blas
from fedsim.errors import ConfigError

__all__ = ["synthetic"]


def _check(key: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


_is_num = is_number


_is_int = is_integer


def synthetic(
    seed: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    num_users: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    iid: bool = False,
    test_fraction: float = 0.1,
) -> Dataset:
    """Generate FedProx Synthetic(alpha, beta), or Synthetic-IID, with one natural group per user.

    For users ``k = 1..K`` the draws are, in this order::

        n_k  = int(lognormal(4, 2)) + 50              all users at once
        u_k ~ N(0, alpha),  B_k ~ N(0, beta)          all users at once (alpha, beta are std devs)
        v_k ~ N(B_k, 1)^dim                           user by user
        W_k ~ N(u_k, 1)^(dim x C), b_k ~ N(u_k, 1)^C,
        x ~ N(v_k, diag(j^-1.2, j = 1..dim)), n_k rows  user by user
        y = argmax(x W_k + b_k)                       (the argmax of the softmax)

    Synthetic-IID (``iid=True``) draws ``n_k``, then one shared ``W, b ~ N(0, 1)``, then
    ``x ~ N(0, Sigma)`` for every user; ``alpha`` and ``beta`` are then unused. Finally each user's
    examples are shuffled (one permutation per user, in user order) and the first
    ``int((1 - test_fraction) * n_k)`` go to training, the rest to the pooled test set.

    Parameters
    ----------
    seed : int
        Seed of ``np.random.default_rng``; the same seed gives the same data set.
    alpha : float
        Std of the per-user model mean ``u_k`` (model heterogeneity), >= 0.
    beta : float
        Std of the per-user feature mean ``B_k`` (feature heterogeneity), >= 0.
    num_users : int
        Number of users ``K`` (30 in the paper).
    dim : int
        Feature dimension (60 in the paper).
    num_classes : int
        Number of classes (10 in the paper).
    iid : bool
        Generate Synthetic-IID instead.
    test_fraction : float
        Per-user share held out for testing, in ``[0, 1)`` (0.1 in the paper).

    Returns
    -------
    Dataset
        ``x`` float32 of shape ``(n, dim)``, not rescaled (the features are already on a unit scale);
        ``groups`` holds the user id (0..K-1) of every training example.
    """
    _check("alpha", alpha, _is_num(alpha) and math.isfinite(alpha) and alpha >= 0, "a finite number >= 0")
    _check("beta", beta, _is_num(beta) and math.isfinite(beta) and beta >= 0, "a finite number >= 0")
    _check("num_users", num_users, _is_int(num_users) and num_users >= 1, "an integer >= 1")
    _check("dim", dim, _is_int(dim) and dim >= 1, "an integer >= 1")
    _check("num_classes", num_classes, _is_int(num_classes) and num_classes >= 2, "an integer >= 2")
    _check(
        "test_fraction",
        test_fraction,
        _is_num(test_fraction) and 0 <= test_fraction < 1,
        "a number in [0, 1)",
    )

    with single_threaded_blas():  # built on the server too, which may fork (Ray): see single_threaded_blas
        return _generate(seed, alpha, beta, int(num_users), int(dim), int(num_classes), iid, test_fraction)


def _generate(seed, alpha, beta, k: int, d: int, c: int, iid: bool, test_fraction: float) -> Dataset:
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, k).astype(np.int64) + 50
    cov = np.diag(np.arange(1, d + 1, dtype=np.float64) ** -1.2)
    xs, ys = [], []
    if iid:
        w = rng.normal(0, 1, (d, c))
        b = rng.normal(0, 1, c)
        for n_k in sizes:
            x = rng.multivariate_normal(np.zeros(d), cov, n_k)
            xs.append(x)
            ys.append(np.argmax(x @ w + b, axis=1))
    else:
        u = rng.normal(0, alpha, k)  # mean of W_k and of b_k
        big_b = rng.normal(0, beta, k)
        v = np.stack([rng.normal(big_b[i], 1, d) for i in range(k)])  # (users, dim) feature means
        for i, n_k in enumerate(sizes):
            w = rng.normal(u[i], 1, (d, c))
            b = rng.normal(u[i], 1, c)
            x = rng.multivariate_normal(v[i], cov, n_k)
            xs.append(x)
            ys.append(np.argmax(x @ w + b, axis=1))

    parts = {"x_train": [], "y_train": [], "groups": [], "x_test": [], "y_test": []}
    for i, (x, y) in enumerate(zip(xs, ys)):
        perm = rng.permutation(len(y))
        n_train = int((1 - test_fraction) * len(y))
        tr, te = perm[:n_train], perm[n_train:]
        parts["x_train"].append(x[tr])
        parts["y_train"].append(y[tr])
        parts["groups"].append(np.full(n_train, i, dtype=np.int64))
        parts["x_test"].append(x[te])
        parts["y_test"].append(y[te])
    cat = {key: np.concatenate(val) for key, val in parts.items()}
    name = "synthetic_iid" if iid else f"synthetic_{alpha:g}_{beta:g}"
    return Dataset(
        name=name,
        x_train=cat["x_train"].astype(np.float32),
        y_train=cat["y_train"].astype(np.int64),
        x_test=cat["x_test"].astype(np.float32),
        y_test=cat["y_test"].astype(np.int64),
        num_classes=c,
        input_shape=(d,),
        groups=cat["groups"],
    )

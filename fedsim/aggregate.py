"""Pure numpy math of the server strategies: averaging, server optimisers, robust aggregation, clipping, DP.

Every function takes plain arrays (a model is a ``dict[str, np.ndarray]`` keyed like a ``state_dict``) and
returns new arrays; nothing here mutates its inputs or touches Flower messages. Arithmetic is done in
float64; callers cast results back to the model's dtypes (``cast_like``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]


# ---------------------------------------------------------------- helpers on dicts of arrays
def is_float(a: np.ndarray) -> bool:
    """True for floating-point arrays (the ones that are averaged, clipped and noised like weights)."""
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def cast_like(arrays: Arrays, like: Arrays) -> dict[str, np.ndarray]:
    """``arrays`` cast to the dtypes of ``like`` (integers are rounded first, e.g. BatchNorm step counters)."""
    out = {}
    for k, a in arrays.items():
        dt = np.asarray(like[k]).dtype
        a = np.asarray(a)
        out[k] = (np.rint(a) if not is_float(like[k]) and is_float(a) else a).astype(dt, copy=False)
    return out


def subtract(a: Arrays, b: Arrays) -> dict[str, np.ndarray]:
    """``a - b`` per key, in float64."""
    return {k: np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64) for k in a}


def add(a: Arrays, b: Arrays, scale: float = 1.0) -> dict[str, np.ndarray]:
    """``a + scale * b`` per key, in float64."""
    return {k: np.asarray(a[k], np.float64) + scale * np.asarray(b[k], np.float64) for k in a}


def flatten(arrays: Arrays) -> np.ndarray:
    """All arrays concatenated into one float64 vector, in key order. Shape: (total size,)."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays.values()])


def unflatten(vector: np.ndarray, like: Arrays) -> dict[str, np.ndarray]:
    """Inverse of ``flatten``: split ``vector`` into arrays shaped (not typed) like ``like``."""
    sizes = [int(np.asarray(a).size) for a in like.values()]
    if int(np.sum(sizes)) != vector.size:
        raise ValueError(f"vector has {vector.size} entries, the arrays {int(np.sum(sizes))}")
    parts = np.split(np.asarray(vector, np.float64), np.cumsum(sizes)[:-1])
    return {k: p.reshape(np.shape(a)) for (k, a), p in zip(like.items(), parts)}


def l2_norm(arrays: Arrays) -> float:
    """L2 norm of all arrays taken together as one flat vector."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays.values()))


# ---------------------------------------------------------------- averaging
def weighted_mean(models: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Key-wise ``sum_k w_k x_k / sum_k w_k`` (float64).

    Raises ``ValueError`` for no models, a length mismatch, a negative weight or a zero total weight.
    """
    if not models or len(models) != len(weights):
        raise ValueError(f"need one weight per model, got {len(models)} models and {len(weights)} weights")
    w = normalised_weights(weights)
    return {k: sum(wi * np.asarray(m[k], np.float64) for wi, m in zip(w, models)) for k in models[0]}


def normalised_weights(weights: Sequence[float]) -> np.ndarray:
    """``w / sum(w)`` in float64, as :func:`weighted_mean` weights its models (``ValueError`` for a negative,
    non-finite or all-zero weight)."""
    w = np.asarray(weights, np.float64)
    if np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return w / w.sum()


def _stack(models: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """The models stacked per parameter, ``(n, *shape)`` in float64: what the ``*_stacked`` functions take."""
    return {k: np.stack([np.asarray(m[k], np.float64) for m in models]) for k in models[0]}


def coordinate_median(models: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """Coordinate-wise median (Yin et al. 2018); with an even count, the mean of the two middle values."""
    return coordinate_median_stacked(_stack(models))


def coordinate_median_stacked(stacks: Arrays) -> dict[str, np.ndarray]:
    """:func:`coordinate_median` of models given stacked, ``(n, *shape)`` per parameter: the same numbers."""
    return {k: np.median(np.asarray(a, np.float64), axis=0) for k, a in stacks.items()}


def trimmed_mean(models: Sequence[Arrays], beta: float) -> dict[str, np.ndarray]:
    """Coordinate-wise beta-trimmed mean: drop the ``floor(beta * n)`` smallest and largest values, average.

    Same convention as ``scipy.stats.trim_mean``; ``beta`` must lie in [0, 0.5).
    """
    return trimmed_mean_stacked(_stack(models), beta)


def trimmed_mean_stacked(stacks: Arrays, beta: float) -> dict[str, np.ndarray]:
    """:func:`trimmed_mean` of models given stacked, ``(n, *shape)`` per parameter."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"beta must be in [0, 0.5), got {beta}")
    out = {}
    for k, a in stacks.items():
        n = len(a)
        cut = int(beta * n)
        out[k] = np.sort(np.asarray(a, np.float64), axis=0)[cut : n - cut].mean(axis=0)
    return out


# ---------------------------------------------------------------- Krum (Blanchard et al. 2017)
def pairwise_sq_distances(flat: np.ndarray) -> np.ndarray:
    """Squared L2 distances between rows of ``flat`` (n, d) -> (n, n), by direct differences (no cancellation).

    Each pair once: ``(a - b)^2 == (b - a)^2`` exactly, so the lower triangle is the upper one mirrored."""
    flat = np.asarray(flat, np.float64)
    n = len(flat)
    d = np.zeros((n, n))
    for i in range(n - 1):
        d[i, i + 1 :] = np.sum(np.square(flat[i + 1 :] - flat[i]), axis=1)
        d[i + 1 :, i] = d[i, i + 1 :]
    return d


def krum_scores(flat: np.ndarray, num_malicious: int) -> np.ndarray:
    """Krum score of each row: the sum of squared distances to its ``n - f - 2`` nearest other rows. Shape (n,).

    Requires ``n >= 2f + 3`` (Blanchard et al.'s condition ``n > 2f + 2``); raises ``ValueError`` otherwise.
    """
    n = flat.shape[0]
    if n < 2 * num_malicious + 3:
        raise ValueError(f"Krum needs n >= 2f + 3 updates, got n={n}, f={num_malicious}")
    d = pairwise_sq_distances(flat)
    k = n - num_malicious - 2
    scores = np.empty(n)
    for i in range(n):
        others = np.delete(d[i], i)
        scores[i] = np.sort(others)[:k].sum()
    return scores


def krum_select(flat: np.ndarray, num_malicious: int, num_selected: int = 1) -> list[int]:
    """Indices of the ``num_selected`` rows with the lowest Krum scores (ties: lowest index first)."""
    scores = krum_scores(flat, num_malicious)
    if not 1 <= num_selected <= flat.shape[0]:
        raise ValueError(f"num_selected must be in [1, {flat.shape[0]}], got {num_selected}")
    return [int(i) for i in np.argsort(scores, kind="stable")[:num_selected]]


# ---------------------------------------------------------------- server optimisers
def momentum_step(
    x: Arrays, avg: Arrays, velocity: Arrays | None, lr: float, momentum: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One FedAvgM server step (Hsu et al. 2019, PyTorch SGD convention).

    ``g = x - avg`` (pseudo-gradient), ``v = momentum * v + g`` (``v = g`` in the first round),
    ``x' = x - lr * v``. Returns ``(x', v)``.
    """
    g = subtract(x, avg)
    v = g if velocity is None else {k: momentum * np.asarray(velocity[k], np.float64) + g[k] for k in g}
    return {k: np.asarray(x[k], np.float64) - lr * v[k] for k in g}, v


def adam_second_moment(v: np.ndarray, delta: np.ndarray, beta_2: float) -> np.ndarray:
    """FedAdam: ``v = beta_2 v + (1 - beta_2) delta^2``."""
    return beta_2 * v + (1.0 - beta_2) * np.square(delta)


def yogi_second_moment(v: np.ndarray, delta: np.ndarray, beta_2: float) -> np.ndarray:
    """FedYogi: ``v = v - (1 - beta_2) delta^2 sign(v - delta^2)``."""
    d2 = np.square(delta)
    return v - (1.0 - beta_2) * d2 * np.sign(v - d2)


def adagrad_second_moment(v: np.ndarray, delta: np.ndarray, beta_2: float = 0.0) -> np.ndarray:
    """FedAdagrad: ``v = v + delta^2`` (``beta_2`` is unused)."""
    return v + np.square(delta)


SecondMoment = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def fedopt_step(
    x: Arrays,
    delta: Arrays,
    m: Arrays | None,
    v: Arrays | None,
    *,
    second_moment: SecondMoment,
    eta: float,
    beta_1: float,
    beta_2: float,
    tau: float,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One adaptive server step of Reddi et al. 2021 (Algorithm 2), no bias correction.

    ``delta`` is the averaged client update ``avg - x``. With ``m = 0`` and ``v = tau^2`` when ``None``
    (the paper's ``m_{-1} = 0``, ``v_{-1} >= tau^2``)::

        m = beta_1 m + (1 - beta_1) delta
        v = second_moment(v, delta, beta_2)      # Adam, Yogi or Adagrad rule
        x = x + eta m / (sqrt(v) + tau)

    Returns ``(x', m', v')``.
    """
    x_new, m_new, v_new = {}, {}, {}
    for k in delta:
        d = np.asarray(delta[k], np.float64)
        mk = np.zeros_like(d) if m is None else np.asarray(m[k], np.float64)
        vk = np.full_like(d, tau**2) if v is None else np.asarray(v[k], np.float64)
        m_new[k] = beta_1 * mk + (1.0 - beta_1) * d
        v_new[k] = second_moment(vk, d, beta_2)
        x_new[k] = np.asarray(x[k], np.float64) + eta * m_new[k] / (np.sqrt(v_new[k]) + tau)
    return x_new, m_new, v_new


# ---------------------------------------------------------------- clipping and DP
def clip(update: Arrays, clip_norm: float) -> tuple[dict[str, np.ndarray], float, bool]:
    """FlatClip (McMahan et al. 2018): scale the whole update to L2 norm at most ``clip_norm``.

    Returns ``(clipped update, norm before clipping, whether it was scaled down)``. A zero update comes back
    unchanged (no division by zero). NaN or Inf anywhere raises ``ValueError``: such an update has no
    meaningful norm and scaling it would spread the NaN; callers drop it instead.
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    norm = l2_norm(update)
    if not math.isfinite(norm):
        raise ValueError("update holds NaN or Inf; refusing to clip it")
    scale = 1.0 if norm <= clip_norm else clip_norm / norm
    return {k: np.asarray(a, np.float64) * scale for k, a in update.items()}, norm, scale < 1.0


def noise_std(noise_multiplier: float, clip_norm: float, denominator: int) -> float:
    """Standard deviation ``z * C / m`` of the Gaussian noise on a mean of ``m`` updates clipped to ``C``."""
    return noise_multiplier * clip_norm / denominator


def split_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """Noise multiplier left for the update when the clipped-count query takes std ``count_stddev``.

    Andrew et al. 2021: ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so that the two Gaussian queries together
    cost as much privacy as one with multiplier ``z``. Needs ``z < 2 sigma_b``; raises ``ValueError`` otherwise.
    """
    if noise_multiplier == 0:
        return 0.0
    if count_stddev <= 0 or noise_multiplier >= 2 * count_stddev:
        raise ValueError(
            f"need noise_multiplier < 2 * clipped_count_stddev, got {noise_multiplier} and {count_stddev}"
        )
    return (noise_multiplier**-2 - (2 * count_stddev) ** -2) ** -0.5


def noisy_unclipped_fraction(
    unclipped: Sequence[bool], denominator: float, count_noise: float = 0.0
) -> float:
    """Estimate of the fraction of updates that were NOT clipped: ``(sum_k (b_k - 1/2) + noise) / m + 1/2``.

    Centring the bits (as TF-Privacy's quantile estimator does) gives the count query sensitivity 1/2 under
    add/remove-one; with ``denominator = len(unclipped)`` and no noise this is exactly the unclipped fraction.
    """
    b = np.asarray(unclipped, np.float64)
    return float((np.sum(b - 0.5) + count_noise) / denominator + 0.5)


def adaptive_clip_norm(
    clip_norm: float, unclipped_fraction: float, target_quantile: float, lr: float
) -> float:
    """Geometric update of Andrew et al. 2021: ``C * exp(-lr * (unclipped_fraction - target_quantile))``.

    More updates unclipped than the target quantile -> C shrinks; fewer (most clipped) -> C grows.
    """
    return clip_norm * math.exp(-lr * (unclipped_fraction - target_quantile))

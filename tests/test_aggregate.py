"""Hand-computed checks of the pure math in fedsim.aggregate."""

import math

import numpy as np
import pytest

from fedsim import aggregate as agg


def _a(*xs):
    return np.array(xs, dtype=np.float64)


# ---------------------------------------------------------------- averaging and flat vectors
def test_weighted_mean_by_hand():
    w0, w1 = {"w": _a(1.0, 2.0), "b": _a(0.0)}, {"w": _a(3.0, 4.0), "b": _a(3.0)}
    out = agg.weighted_mean([w0, w1], [1, 2])
    np.testing.assert_allclose(out["w"], (w0["w"] * 1 + w1["w"] * 2) / 3)
    np.testing.assert_allclose(out["b"], [2.0])


@pytest.mark.parametrize("weights", [[0, 0], [1, -1], [1]])
def test_weighted_mean_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        agg.weighted_mean([{"w": _a(1)}, {"w": _a(2)}], weights)


def test_flatten_unflatten_roundtrip_and_norm():
    arrays = {"a": np.array([[3.0, 0.0]], np.float32), "b": np.array([4.0], np.float32)}
    flat = agg.flatten(arrays)
    np.testing.assert_array_equal(flat, [3.0, 0.0, 4.0])
    back = agg.unflatten(flat, arrays)
    assert back["a"].shape == (1, 2) and np.array_equal(back["b"], [4.0])
    assert agg.l2_norm(arrays) == 5.0
    with pytest.raises(ValueError):
        agg.unflatten(flat[:2], arrays)


def test_cast_like_rounds_integers_and_keeps_float_dtype():
    out = agg.cast_like(
        {"n": _a(2.6), "w": _a(0.5)}, {"n": np.array([0], np.int64), "w": np.zeros(1, np.float32)}
    )
    assert out["n"].dtype == np.int64 and out["n"][0] == 3
    assert out["w"].dtype == np.float32


# ---------------------------------------------------------------- clipping
def test_clip_scales_to_the_norm_and_keeps_direction():
    clipped, norm, was = agg.clip({"a": _a(3.0), "b": _a(4.0)}, 1.0)
    assert norm == 5.0 and was
    np.testing.assert_allclose([clipped["a"][0], clipped["b"][0]], [0.6, 0.8])


def test_clip_leaves_small_and_zero_updates_alone():
    small, norm, was = agg.clip({"a": _a(0.3, 0.4)}, 1.0)
    assert not was and norm == pytest.approx(0.5)
    np.testing.assert_array_equal(small["a"], [0.3, 0.4])
    zero, norm, was = agg.clip({"a": np.zeros(3)}, 1.0)  # no ZeroDivisionError (Flower's crashes here)
    assert norm == 0.0 and not was and not zero["a"].any()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_refuses_nonfinite(bad):
    with pytest.raises(ValueError, match="NaN or Inf"):
        agg.clip({"a": _a(1.0, bad)}, 1.0)


def test_clip_never_increases_a_norm():
    rng = np.random.default_rng(0)
    for _ in range(200):
        upd = {"a": rng.normal(size=5) * rng.exponential(3), "b": rng.normal(size=(2, 2))}
        c = float(rng.exponential(2)) + 1e-3
        clipped, norm, _ = agg.clip(upd, c)
        assert agg.l2_norm(clipped) <= min(norm, c) * (1 + 1e-12)


# ---------------------------------------------------------------- server optimisers
def test_momentum_step_by_hand():
    x, avg = {"w": _a(1.0)}, {"w": _a(0.5)}
    x1, v1 = agg.momentum_step(x, avg, None, lr=0.5, momentum=0.9)  # g = 0.5, v = 0.5, x = 1 - 0.25
    assert v1["w"][0] == 0.5 and x1["w"][0] == 0.75
    x2, v2 = agg.momentum_step(x1, {"w": _a(0.5)}, v1, lr=0.5, momentum=0.9)  # g = 0.25, v = 0.45 + 0.25
    assert v2["w"][0] == pytest.approx(0.7) and x2["w"][0] == pytest.approx(0.75 - 0.35)


def test_momentum_zero_lr_one_is_fedavg():
    x, _ = agg.momentum_step({"w": _a(3.0, -1.0)}, {"w": _a(2.0, 5.0)}, None, lr=1.0, momentum=0.0)
    np.testing.assert_allclose(x["w"], [2.0, 5.0])


def _step(rule, beta_2=0.99, beta_1=0.9, tau=0.01, eta=1.0):
    return agg.fedopt_step(
        {"w": _a(0.0)},
        {"w": _a(0.1)},
        None,
        None,
        second_moment=rule,
        eta=eta,
        beta_1=beta_1,
        beta_2=beta_2,
        tau=tau,
    )


def test_fedadam_single_step_by_hand():
    x, m, v = _step(agg.adam_second_moment)
    # m = 0.1 * 0.1 = 0.01; v = 0.99 * tau^2 + 0.01 * 0.1^2 = 0.000099 + 0.0001
    assert m["w"][0] == pytest.approx(0.01)
    assert v["w"][0] == pytest.approx(0.000199)
    assert x["w"][0] == pytest.approx(0.01 / (math.sqrt(0.000199) + 0.01))


def test_fedyogi_single_step_by_hand():
    x, _, v = _step(agg.yogi_second_moment)
    # v0 = 1e-4 < delta^2 = 0.01, so sign = -1: v = 1e-4 + 0.01 * 0.01 = 2e-4
    assert v["w"][0] == pytest.approx(2e-4)
    assert x["w"][0] == pytest.approx(0.01 / (math.sqrt(2e-4) + 0.01))
    # and when v is already above delta^2 it decreases: v = 1 - 0.01 * 0.01
    assert agg.yogi_second_moment(_a(1.0), _a(0.1), 0.99)[0] == pytest.approx(1 - 1e-4)


def test_fedadagrad_single_step_by_hand():
    x, m, v = _step(agg.adagrad_second_moment, beta_1=0.0)
    assert m["w"][0] == pytest.approx(0.1)
    assert v["w"][0] == pytest.approx(1e-4 + 0.01)
    assert x["w"][0] == pytest.approx(0.1 / (math.sqrt(0.0101) + 0.01))


def test_fedopt_two_steps_carry_state():
    x, m, v = _step(agg.adagrad_second_moment, beta_1=0.0)
    x2, _, v2 = agg.fedopt_step(
        x,
        {"w": _a(0.1)},
        m,
        v,
        second_moment=agg.adagrad_second_moment,
        eta=1.0,
        beta_1=0.0,
        beta_2=0.0,
        tau=0.01,
    )
    assert v2["w"][0] == pytest.approx(0.0201)
    assert x2["w"][0] == pytest.approx(x["w"][0] + 0.1 / (math.sqrt(0.0201) + 0.01))


# ---------------------------------------------------------------- robust aggregation
def test_median_by_hand():
    models = [{"w": _a(v, -v)} for v in (1.0, 2.0, 3.0, 100.0)]
    np.testing.assert_allclose(agg.coordinate_median(models)["w"], [2.5, -2.5])
    np.testing.assert_allclose(agg.coordinate_median(models[:3])["w"], [2.0, -2.0])


def test_trimmed_mean_by_hand():
    five = [{"w": _a(v)} for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
    assert agg.trimmed_mean(five, 0.2)["w"][0] == 3.0  # floor(0.2 * 5) = 1 cut at each end: mean(2, 3, 4)
    assert agg.trimmed_mean(five, 0.0)["w"][0] == 22.0  # plain mean
    assert agg.trimmed_mean(five, 0.19)["w"][0] == 22.0  # floor(0.95) = 0: nothing cut
    with pytest.raises(ValueError):
        agg.trimmed_mean(five, 0.5)


def test_krum_scores_and_selection_by_hand():
    flat = _a(0.0, 1.0, 2.0, 10.0).reshape(4, 1)
    # f = 0: each point sums its n - f - 2 = 2 nearest squared distances
    np.testing.assert_allclose(agg.krum_scores(flat, 0), [1 + 4, 1 + 1, 1 + 4, 64 + 81])
    assert agg.krum_select(flat, 0, 1) == [1]
    assert agg.krum_select(flat, 0, 3) == [1, 0, 2]  # ties broken by index
    with pytest.raises(ValueError, match="2f \\+ 3"):
        agg.krum_scores(flat, 1)


def test_pairwise_distances_are_exact_on_large_weights():
    # |x|^2 + |y|^2 - 2xy loses these differences at 1e8; direct differences do not
    flat = np.array([[1e8, 0.0], [1e8 + 1.0, 0.0], [1e8, 2.0]])
    np.testing.assert_allclose(agg.pairwise_sq_distances(flat), [[0, 1, 4], [1, 0, 5], [4, 5, 0]])


# ---------------------------------------------------------------- adaptive clipping and noise
def test_adaptive_clip_norm_direction_and_size():
    c, lr, gamma = 0.5, 0.2, 0.5
    all_clipped = agg.adaptive_clip_norm(c, 0.0, gamma, lr)  # nothing unclipped: grow
    none_clipped = agg.adaptive_clip_norm(c, 1.0, gamma, lr)  # everything unclipped: shrink
    assert all_clipped == pytest.approx(c * math.exp(lr * gamma))
    assert none_clipped == pytest.approx(c * math.exp(-lr * (1 - gamma)))
    assert agg.adaptive_clip_norm(c, gamma, gamma, lr) == c


def test_noisy_unclipped_fraction():
    assert agg.noisy_unclipped_fraction([True, False, True, True], 4) == 0.75
    # fixed denominator m = 8 with 4 replies, centred bits: (3 - 2) / 8 + 1/2
    assert agg.noisy_unclipped_fraction([True, False, True, True], 8) == pytest.approx(0.625)
    assert agg.noisy_unclipped_fraction([True, False], 2, count_noise=0.5) == pytest.approx(0.75)


def test_noise_std_and_split():
    assert agg.noise_std(1.5, 2.0, 10) == pytest.approx(0.3)
    # z = 0.5, sigma_b = 0.5: z_delta = (4 - 1)^(-1/2)
    assert agg.split_noise_multiplier(0.5, 0.5) == pytest.approx(3**-0.5)
    assert agg.split_noise_multiplier(0.0, 0.0) == 0.0
    with pytest.raises(ValueError):
        agg.split_noise_multiplier(1.0, 0.5)

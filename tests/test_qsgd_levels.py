"""QSGD at s = 127 cannot overflow its int8 levels (issue: level 128 wrapped to -128 and flipped a sign)."""

from __future__ import annotations

import numpy as np

from fedsim.features.compression.server import qsgd, qsgd_decode


class _AlwaysRoundUp:
    """A generator whose uniforms are all 0: stochastic rounding then always rounds a fraction > 0 up."""

    def random(self, shape):
        return np.zeros(shape)


def test_the_contrived_case_where_the_float32_norm_rounds_below_the_largest_entry():
    v = np.array([1 + 2**-30, 0.0, -(2**-40)])  # float64: float32(|v|) rounds down to 1.0 < v[0]
    assert np.float32(np.linalg.norm(v)) < v[0]  # the case exists (rounded to nearest)
    norm, levels = qsgd(v, 127, _AlwaysRoundUp())
    assert levels.dtype == np.int8 and levels[0] == 127  # not 128 wrapped to -128
    assert np.float64(norm) >= np.linalg.norm(v)  # the norm is rounded up instead
    np.testing.assert_allclose(qsgd_decode(norm, levels, 127)[0], v[0], rtol=1e-6)
    assert np.all(np.abs(levels.astype(int)) <= 127)


def test_levels_stay_in_range_and_keep_their_sign_over_many_draws():
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.normal(size=50) * 10.0 ** rng.integers(-20, 20)
        v[rng.integers(50)] *= 1e6  # one dominant entry: |v_i| / |v| close to 1
        norm, levels = qsgd(v, 127, rng)
        lv = levels.astype(int)
        assert np.all(np.abs(lv) <= 127)
        assert np.all((lv == 0) | (np.sign(lv) == np.sign(v)))

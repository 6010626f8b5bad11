"""Clipping and DP wrappers: norms, adaptive direction, noise calibration, accounting, budget, checkpoints."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.serverapp import strategy as flwr_strategies
from strategy_helpers import configure, flower_kwargs, make_replies, make_reply, run_round, snapshot

from fedsim import keys
from fedsim.errors import ConfigError, StopRun
from fedsim.strategies.accounting import RoundAccountant
from fedsim.strategies.aggregate import l2_norm, subtract
from fedsim.strategies.clipping import AdaptiveClipping, FixedClipping
from fedsim.strategies.fedavg import FedAvg
from fedsim.strategies.fedavgm import FedAvgM
from fedsim.strategies.fedmedian import FedMedian

KW = flower_kwargs()
G = {"w": np.full((3, 4), 0.5, np.float32), "b": np.zeros(4, np.float32), "n": np.array(7, np.int64)}


def _updates(n, scale, seed=0):
    """Models ``G + scale * random direction`` (floating arrays only; the int buffer is copied)."""
    rng = np.random.default_rng(seed)
    return [
        {
            k: (a + scale * rng.normal(size=a.shape)).astype(a.dtype) if a.dtype.kind == "f" else a.copy()
            for k, a in G.items()
        }
        for _ in range(n)
    ]


def _floats(arrays):
    return {k: a for k, a in arrays.items() if a.dtype.kind == "f"}


def _move(out):
    """L2 distance of ``out`` from the global model ``G`` over G's floating-point arrays."""
    return l2_norm(subtract({k: out[k] for k in _floats(G)}, _floats(G)))


def fixed(**kw):
    args = {"strategy": FedAvg(**KW), "num_clients": 20, "clients_per_round": 4, "clip_norm": 1.0}
    return FixedClipping(**{**args, **kw})


def adaptive(**kw):
    args = {"strategy": FedAvg(**KW), "num_clients": 20, "clients_per_round": 4, "initial_clip_norm": 1.0}
    return AdaptiveClipping(**{**args, **kw})


# ---------------------------------------------------------------- clipping without noise
def test_fixed_clipping_moves_fedavg_by_at_most_the_clip_norm():
    s = fixed(clip_norm=0.3)
    replies = make_replies(_updates(4, 5.0), [1, 5, 2, 9])
    before = snapshot(replies)
    out, metrics = run_round(s, 1, G, replies)
    assert 0 < _move(out) <= 0.3 + 1e-6
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64 and int(out["n"]) == 7
    assert metrics[keys.AGG_CLIP_NORM] == 0.3 and metrics[keys.AGG_CLIPPED_FRACTION] == 1.0
    assert metrics[keys.AGG_NOISE_STD] == 0.0 and keys.AGG_EPSILON not in metrics
    # the given replies are not mutated
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(before, snapshot(replies)) for k in a)


def test_small_updates_pass_unchanged_with_their_weights():
    models = _updates(3, 0.01, seed=1)
    out, metrics = run_round(fixed(clip_norm=10.0), 1, G, make_replies(models, [1, 2, 3]))
    ref, _ = run_round(FedAvg(**KW), 1, G, make_replies(models, [1, 2, 3]))
    for k in G:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-6)
    assert metrics[keys.AGG_CLIPPED_FRACTION] == 0.0


def test_zero_and_nonfinite_updates_neither_crash_nor_poison():
    bad = {k: a.copy() for k, a in G.items()}
    bad["w"][0, 0] = np.nan
    replies = make_replies([dict(G), bad, _updates(1, 3.0)[0]])
    out, metrics = run_round(adaptive(), 1, G, replies)
    assert all(np.isfinite(out[k]).all() for k in out)
    assert _move(out) <= 1.0 + 1e-6
    assert metrics[keys.AGG_CLIPPED_FRACTION] == 0.5  # the zero update is unclipped, the NaN one dropped


def test_wraps_any_flower_strategy():
    for inner in (flwr_strategies.FedAvg(**KW), FedMedian(**KW), FedAvgM(**KW)):
        out, _ = run_round(FixedClipping(inner, 20, 4, clip_norm=0.2), 1, G, make_replies(_updates(3, 2.0)))
        assert _move(out) <= 0.2 * (1 + 0.9 + 1e-6)  # FedAvgM's first step is the mean itself


# ---------------------------------------------------------------- client side
def test_client_side_sends_clip_norm_and_uses_the_reported_bits():
    s = adaptive(side="client", initial_clip_norm=0.5, target_quantile=0.5, clip_norm_lr=0.2)
    msgs = configure(s, 1, G)
    assert msgs[0].content[keys.CONFIG][keys.CLIP_NORM] == 0.5
    # the clients clipped (they say so) and sent updates of norm exactly 0.5
    rng = np.random.default_rng(2)
    models = []
    for _ in range(4):
        d = {k: rng.normal(size=a.shape) for k, a in _floats(G).items()}
        scale = 0.5 / l2_norm(d)
        models.append({**G, **{k: (G[k] + scale * d[k]).astype(np.float32) for k in d}})
    _, metrics = s.aggregate_train(1, make_replies(models, clipped=1.0, update_norm=3.0))
    assert metrics[keys.AGG_CLIPPED_FRACTION] == 1.0
    assert s.clip_norm == pytest.approx(0.5 * math.exp(0.2 * 0.5))


def test_client_side_reclips_a_client_that_did_not_clip(caplog):
    s = fixed(side="client", clip_norm=0.1)
    configure(s, 1, G)
    out, metrics = s.aggregate_train(1, make_replies(_updates(2, 4.0), clipped=0.0))
    assert _move({k: v.numpy() for k, v in out.items()}) <= 0.1 + 1e-6
    assert metrics[keys.AGG_CLIPPED_FRACTION] == 1.0
    assert "above clip-norm" in caplog.text


# ---------------------------------------------------------------- adaptive clip norm
@pytest.mark.parametrize("scale, expected", [(50.0, math.exp(0.2 * 0.3)), (1e-4, math.exp(-0.2 * 0.7))])
def test_adaptive_direction_and_size_without_count_noise(scale, expected):
    s = adaptive(initial_clip_norm=1.0, target_quantile=0.3, clip_norm_lr=0.2)
    _, metrics = run_round(s, 1, G, make_replies(_updates(4, scale)))
    assert metrics[keys.AGG_CLIP_NORM] == 1.0  # the value used this round
    assert s.clip_norm == pytest.approx(expected)  # all clipped: grows; none clipped: shrinks


def test_adaptive_noise_split_and_its_limit():
    s = adaptive(num_clients=100, clients_per_round=10, noise_multiplier=0.5, initial_clip_norm=2.0)
    assert s.clipped_count_stddev == 0.5  # m / 20
    assert s.update_noise_multiplier == pytest.approx(3**-0.5)  # (0.5^-2 - 1^-2)^(-1/2)
    _, metrics = run_round(s, 1, G, make_replies(_updates(10, 0.0)))
    assert metrics[keys.AGG_NOISE_STD] == pytest.approx(3**-0.5 * 2.0 / 10)
    # small cohort: the default count noise is raised to z, so the split stays possible
    s = adaptive(num_clients=100, clients_per_round=10, noise_multiplier=1.0)
    assert s.clipped_count_stddev == 1.0
    assert s.update_noise_multiplier == pytest.approx((1.0 - 0.25) ** -0.5)
    with pytest.raises(ConfigError, match="noise_multiplier"):  # an explicit sigma_b too small for z
        adaptive(num_clients=100, clients_per_round=10, noise_multiplier=1.0, clipped_count_stddev=0.5)


# ---------------------------------------------------------------- noise
def test_noise_std_is_z_c_over_m_empirically():
    big = {"w": np.zeros(200_000, np.float32)}
    z, c, m = 1.5, 2.0, 10
    s = FixedClipping(
        FedAvg(**KW), num_clients=100, clients_per_round=m, clip_norm=c, noise_multiplier=z, seed=3
    )
    stds = []
    for rnd in (1, 2, 3):
        out, metrics = run_round(s, rnd, big, make_replies([big] * m))
        stds.append(float(np.std(out["w"].astype(np.float64))))
        assert abs(float(np.mean(out["w"]))) < 0.01
    assert metrics[keys.AGG_NOISE_STD] == pytest.approx(z * c / m)
    np.testing.assert_allclose(stds, z * c / m, rtol=0.01)  # 200k draws each: relative error ~0.2 %


def test_noise_is_seeded():
    def out(seed):
        s = fixed(noise_multiplier=1.0, seed=seed)
        return run_round(s, 1, G, make_replies(_updates(4, 0.1)))[0]["w"]

    assert np.array_equal(out(1), out(1)) and not np.array_equal(out(1), out(2))


def test_dp_mode_uses_the_fixed_denominator_and_uniform_weights():
    # 2 of m = 4 replies, updates u and 3u below C: mean over m = (u + 3u) / 4 regardless of num-examples
    u = {k: (0.01 * np.ones_like(a)) if a.dtype.kind == "f" else a for k, a in G.items()}
    models = [
        {k: G[k] + u[k] if G[k].dtype.kind == "f" else G[k] for k in G},
        {k: G[k] + 3 * u[k] if G[k].dtype.kind == "f" else G[k] for k in G},
    ]
    s = fixed(clip_norm=10.0, noise_multiplier=1e-5, num_clients=4, clients_per_round=4)
    out, _ = run_round(s, 1, G, make_replies(models, [1, 100]))
    np.testing.assert_allclose(out["w"] - G["w"], 0.01, atol=5e-4)


@pytest.mark.parametrize("z", [0.0, 1.0])
def test_train_metrics_keep_their_example_weights_with_and_without_noise(z):
    """Uniform weights are for the models only: train_loss is the example-weighted mean either way."""
    models = [{k: G[k] + 0.01 if G[k].dtype.kind == "f" else G[k] for k in G}] * 2
    replies = [make_reply(models[0], 1, 0, train_loss=1.0), make_reply(models[1], 3, 1, train_loss=3.0)]
    s = fixed(clip_norm=10.0, noise_multiplier=z, num_clients=4, clients_per_round=2)
    _, metrics = run_round(s, 1, G, replies)
    assert metrics[keys.TRAIN_LOSS] == pytest.approx((1.0 * 1 + 3.0 * 3) / 4)


# ---------------------------------------------------------------- accounting and budget
def test_round_accountant_matches_the_reference_table_and_dp_accounting():
    table = [
        (0.01, 1.0, 1000, 1e-5, 2.101),
        (0.01, 0.5, 1000, 1e-5, 15.472),
        (0.1, 1.0, 100, 1e-5, 7.904),
        (0.05, 1.0, 1500, 1e-5, 15.143),
        (0.05, 1.0, 1500, 1e-3, 11.771),
        (100 / 3400, 1.0, 1500, 1e-5, 8.159),
    ]
    for q, z, t, delta, eps in table:
        assert RoundAccountant(q, z, delta).epsilon(t) == pytest.approx(eps, abs=1e-3)


def test_reported_epsilon_matches_dp_accounting_directly():
    s = fixed(num_clients=40, clients_per_round=4, noise_multiplier=1.1, delta=1e-5)
    for rnd in (1, 2, 3):
        _, metrics = run_round(s, rnd, G, make_replies(_updates(4, 0.5, rnd)))
        event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1))
        direct = RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(event, rnd)).get_epsilon(1e-5)
        assert metrics[keys.AGG_EPSILON] == pytest.approx(direct, rel=1e-9)
    assert s.rounds_accounted == 3


def test_stop_run_before_the_round_that_would_exceed_the_budget():
    acc = RoundAccountant(4 / 40, 1.0, 1e-5)
    budget = (acc.epsilon(2) + acc.epsilon(3)) / 2
    s = fixed(num_clients=40, clients_per_round=4, noise_multiplier=1.0, max_epsilon=budget)
    for rnd in (1, 2):
        _, metrics = run_round(s, rnd, G, make_replies(_updates(4, 0.5, rnd)))
        assert metrics[keys.AGG_EPSILON] <= budget
    with pytest.raises(StopRun, match="max_epsilon"):
        configure(s, 3, G)
    assert s.rounds_accounted == 2


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: fixed(clip_norm=0.0), "clip_norm"),
        (lambda: fixed(clip_norm=-1.0), "clip_norm"),
        (lambda: fixed(noise_multiplier=-0.1), "noise_multiplier"),
        (lambda: fixed(side="both"), "side"),
        (lambda: fixed(delta=0.0), "delta"),
        (lambda: fixed(max_epsilon=5.0), "max_epsilon"),  # no noise, nothing to budget
        (lambda: fixed(noise_multiplier=0.3, max_epsilon=0.01), "max_epsilon"),  # one round costs more
        (lambda: adaptive(initial_clip_norm=0.0), "initial_clip_norm"),
        (lambda: adaptive(target_quantile=0.0), "target_quantile"),
        (lambda: adaptive(target_quantile=1.0), "target_quantile"),
        (lambda: adaptive(clip_norm_lr=0.0), "clip_norm_lr"),
        (lambda: adaptive(clipped_count_stddev=-1.0), "clipped_count_stddev"),
        (lambda: adaptive(noise_multiplier=0.5, clipped_count_stddev=0.0), "noise_multiplier"),
        (lambda: fixed(clients_per_round=30), "clients_per_round"),
    ],
)
def test_bad_parameters_raise_config_error_naming_the_key(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.key == key and key in str(err.value)


# ---------------------------------------------------------------- checkpoints
def test_state_dict_resumes_clip_norm_accounting_and_inner_state():
    def go(s, rounds, g):
        outs = []
        for rnd in rounds:
            out, metrics = run_round(s, rnd, g, make_replies(_updates(4, 0.3, rnd)))
            outs.append((out, metrics))
            g = out
        return outs

    def make():
        return adaptive(strategy=FedAvgM(**KW), noise_multiplier=0.1, clipped_count_stddev=1.0, seed=7)

    a = make()
    g2 = go(a, (1, 2), G)[-1][0]
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.clip_norm == a.clip_norm != 1.0 and b.rounds_accounted == 2
    ((out_a, m_a),) = go(a, (3,), g2)
    ((out_b, m_b),) = go(b, (3,), g2)
    assert m_a == m_b
    assert all(np.array_equal(out_a[k], out_b[k]) for k in out_a)

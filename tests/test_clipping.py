"""Clipping and DP wrappers: norms, adaptive direction, noise calibration, accounting, budget, checkpoints."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from flwr.serverapp import strategy as flwr_strategies
from strategy_helpers import configure, flower_kwargs, make_replies, make_reply, run_round, snapshot

from fedsim import keys
from fedsim.aggregate import l2_norm, subtract
from fedsim.errors import ConfigError, StopRun
from fedsim.features.clipping.accounting import RoundAccountant
from fedsim.features.clipping.server import AdaptiveClipping, FixedClipping
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


# Short noise seeds keep these tests readable: debug_noise_seed accepts them (the 64-bit rule is tested in
# test_privacy.py).
def fixed(**kw):
    args = {"strategy": FedAvg(**KW), "num_clients": 20, "clients_per_round": 4, "clip_norm": 1.0}
    return FixedClipping(**{**args, "debug_noise_seed": True, **kw})


def adaptive(**kw):
    args = {"strategy": FedAvg(**KW), "num_clients": 20, "clients_per_round": 4, "initial_clip_norm": 1.0}
    return AdaptiveClipping(**{**args, "debug_noise_seed": True, **kw})


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


def test_error_replies_are_logged_and_counted_not_dropped_silently(caplog):
    from flwr.app import Error, Message

    s = fixed(clip_norm=0.3)
    replies = make_replies(_updates(2, 1.0))
    failed = Message(Error(2, "<class 'ValueError'>:<'client broke'>"), reply_to=_instruction(replies[0]))
    with caplog.at_level("WARNING", logger="fedsim"):
        out, _ = run_round(s, 1, G, [*replies, failed])
        run_round(s, 2, G, [failed])
    assert out is not None and s.error_replies == 2
    assert "round 1: 1 error repl(ies) not aggregated (1 in this run)" in caplog.text
    assert (
        "client broke" in caplog.text
        and "round 2: 1 error repl(ies) not aggregated (2 in this run)" in caplog.text
    )


def _instruction(reply):
    """A train instruction to reply to, addressed like ``reply``'s."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from strategy_helpers import server_identity

    with server_identity():
        ins = Message(RecordDict({keys.CONFIG: ConfigRecord({})}), dst_node_id=999, message_type="train")
    ins.metadata.__dict__["_message_id"] = "error-instruction"
    return ins


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


@pytest.mark.slow
def test_noise_comes_from_the_server_only_noise_seed_not_the_run_seed():
    def out(seed, noise_seed):
        s = fixed(noise_multiplier=1.0, seed=seed, noise_seed=noise_seed)
        return run_round(s, 1, G, make_replies(_updates(4, 0.1)))[0]["w"]

    assert np.array_equal(out(1, 11), out(1, 11))
    assert np.array_equal(out(1, 11), out(2, 11))  # the run seed (sent to clients) plays no part
    assert not np.array_equal(out(1, 11), out(1, 12))
    assert not np.array_equal(out(1, None), out(1, None))  # null: fresh OS entropy every time
    drawn = fixed(noise_multiplier=1.0, seed=1)
    assert drawn.noise_seed is not None and drawn.noise_seed >= 2**64  # 128 bits of entropy (almost surely)
    assert drawn.state_dict()["noise_seed"] == drawn.noise_seed  # checkpointed, so a resumed run keeps it
    assert "noise_seed" not in drawn.summary_fields() and str(drawn.noise_seed) not in str(
        drawn.summary_fields()
    )
    assert drawn.summary_fields()["noise_seed_source"] == "entropy"


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
@pytest.mark.slow
def test_round_accountant_matches_the_reference_table_and_dp_accounting():
    # ../ALGORITHMS.md "computed here" table: (N, m) with q = m / N, z, T, delta, epsilon (RDP), epsilon (PLD)
    table = [
        (1000, 10, 1.0, 1000, 1e-5, 2.101, 1.828),
        (1000, 10, 0.5, 1000, 1e-5, 15.472, 13.361),
        (1000, 100, 1.0, 100, 1e-5, 7.904, 7.047),
        (1000, 50, 1.0, 1500, 1e-5, 15.143, 13.885),
        (1000, 50, 1.0, 1500, 1e-3, 11.771, 10.441),
        (3400, 100, 1.0, 1500, 1e-5, 8.159, 7.459),
    ]
    for n, m, z, t, delta, rdp, pld in table:
        assert RoundAccountant(n, m, z, delta).epsilon(t) == pytest.approx(rdp, abs=1e-3)
        assert RoundAccountant(n, m, z, delta, accountant="pld").epsilon(t) == pytest.approx(pld, abs=1e-3)


def test_fixed_size_sampling_is_accounted_without_replacement_under_replace_one():
    """The reviewer's figure: 100 of 1000 without replacement, z = 1, 100 rounds, delta = 1e-5 gives 83.9."""
    acc = RoundAccountant(1000, 100, 1.0, 1e-5, sampling="fixed")
    assert acc.epsilon(100) == pytest.approx(83.937, abs=1e-3)
    assert acc.relation == dp_accounting.NeighboringRelation.REPLACE_ONE
    event = dp_accounting.SampledWithoutReplacementDpEvent(1000, 100, dp_accounting.GaussianDpEvent(0.5))
    direct = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    assert acc.epsilon(7) == pytest.approx(
        direct.compose(dp_accounting.SelfComposedDpEvent(event, 7)).get_epsilon(1e-5), rel=1e-12
    )
    with pytest.raises(ValueError, match="PLD"):
        RoundAccountant(1000, 100, 1.0, 1e-5, sampling="fixed", accountant="pld")


@pytest.mark.slow
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_max_rounds_is_the_last_round_within_the_budget(accountant):
    acc = RoundAccountant(40, 4, 1.0, 1e-5, accountant=accountant)
    budget = (acc.epsilon(5) + acc.epsilon(6)) / 2
    assert acc.max_rounds(budget) == 5 and acc.max_rounds(acc.epsilon(1) / 2) == 0


def test_reported_epsilon_matches_dp_accounting_directly():
    s = fixed(num_clients=40, clients_per_round=4, noise_multiplier=1.1, delta=1e-5)
    for rnd in (1, 2, 3):
        _, metrics = run_round(s, rnd, G, make_replies(_updates(4, 0.5, rnd)))
        event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1))
        direct = RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(event, rnd)).get_epsilon(1e-5)
        assert metrics[keys.AGG_EPSILON] == pytest.approx(direct, rel=1e-9)
    assert s.rounds_accounted == 3


def test_stop_run_before_the_round_that_would_exceed_the_budget():
    acc = RoundAccountant(40, 4, 1.0, 1e-5)
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
        (lambda: fixed(clients_per_round=30), "clients_per_round"),  # q = 30 / 20 > 1
        (lambda: fixed(sampling="bogus"), "sampling"),
        (lambda: fixed(accountant="bogus"), "accountant"),
        (lambda: fixed(noise_multiplier=1.0, sampling="fixed", accountant="pld"), "accountant"),
        (lambda: fixed(noise_multiplier=1.0, seed=3, noise_seed=3), "noise_seed"),  # clients know the seed
        (lambda: fixed(noise_seed=-1), "noise_seed"),
        (lambda: fixed(debug_metrics="yes"), "debug_metrics"),
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


# ---------------------------------------------------------------- sampling (the hook of fedsim's loop)
def _loop_draw(seed, rnd, n, m):
    """The synchronous loop's own cohort: m of n without replacement, from (seed, 1, round)."""
    return sorted(int(p) for p in np.random.default_rng([seed, 1, rnd]).choice(n, size=m, replace=False))


def test_without_noise_the_cohort_is_the_loops_own_uniform_draw():
    s = fixed(num_clients=20, clients_per_round=4, seed=5)
    for rnd in (1, 2, 7):
        assert s.sample_cohort(rnd, 20, 4) == _loop_draw(5, rnd, 20, 4)  # z = 0 runs stay bit-identical
    assert s.rounds_accounted == 0


def test_poisson_cohorts_vary_in_size_with_inclusion_rate_q():
    s = fixed(num_clients=50, clients_per_round=10, noise_multiplier=5.0, noise_seed=42)
    cohorts = [s.sample_cohort(rnd, 50, 10) for rnd in range(1, 401)]
    sizes = [len(c) for c in cohorts]
    assert len(set(sizes)) > 5 and min(sizes) < 10 < max(sizes)
    assert np.mean(sizes) == pytest.approx(10, rel=0.05)  # E|cohort| = qN = m; sd of the mean ~ 0.14
    assert all(c == sorted(set(c)) and all(0 <= p < 50 for p in c) for c in cohorts)
    counts = np.bincount(np.concatenate(cohorts), minlength=50) / 400
    assert counts.mean() == pytest.approx(0.2, rel=0.05) and counts.min() > 0.1  # every client at rate q
    assert s.rounds_accounted == 400  # every drawn round is charged
    again = fixed(num_clients=50, clients_per_round=10, noise_multiplier=5.0, noise_seed=42, seed=9)
    assert again.sample_cohort(3, 50, 10) == cohorts[2]  # from the noise seed only, not the run seed


def test_fixed_sampling_draws_exactly_m_from_the_secret_seed():
    s = fixed(num_clients=50, clients_per_round=10, noise_multiplier=1.0, sampling="fixed", noise_seed=4)
    cohorts = [s.sample_cohort(rnd, 50, 10) for rnd in range(1, 21)]
    assert all(len(c) == len(set(c)) == 10 for c in cohorts)
    assert all(c != _loop_draw(0, rnd, 50, 10) for rnd, c in enumerate(cohorts, 1))


def test_a_round_is_charged_once_when_its_cohort_is_drawn_skipped_or_not():
    s = fixed(num_clients=40, clients_per_round=4, noise_multiplier=1.0, noise_seed=1)
    s.sample_cohort(1, 40, 4)
    assert s.rounds_accounted == 1
    _, metrics = run_round(s, 1, G, make_replies(_updates(4, 0.5)))  # configure_train: same round, no charge
    assert s.rounds_accounted == 1 and metrics[keys.AGG_EPSILON] == s.accountant.epsilon(1)
    s.sample_cohort(2, 40, 4)  # round 2 is skipped by the loop: no configure/aggregate, still charged
    s.sample_cohort(3, 40, 4)
    _, metrics = run_round(s, 3, G, make_replies(_updates(4, 0.5)))
    assert s.rounds_accounted == 3 and metrics[keys.AGG_EPSILON] == s.accountant.epsilon(3)
    assert s.summary_fields()["epsilon"] == s.summary_fields()["final_epsilon"] == s.accountant.epsilon(3)


def test_an_exhausted_budget_charges_nothing_and_stops_in_configure_train():
    acc = RoundAccountant(40, 4, 1.0, 1e-5)
    s = fixed(num_clients=40, clients_per_round=4, noise_multiplier=1.0, max_epsilon=acc.epsilon(2) + 1e-9)
    s.sample_cohort(1, 40, 4)
    s.sample_cohort(2, 40, 4)
    assert s.sample_cohort(3, 40, 4) == list(range(40))  # non-empty, so the loop reaches configure_train
    with pytest.raises(StopRun, match="max_epsilon"):
        configure(s, 3, G)
    assert s.rounds_accounted == 2 and s.epsilon() == acc.epsilon(2)


def test_q_above_one_names_clients_per_round_and_q():
    with pytest.raises(ConfigError, match=r"q = clients_per_round / num_clients = 1\.5") as err:
        fixed(num_clients=20, clients_per_round=30, noise_multiplier=1.0)
    assert err.value.key == "clients_per_round"


def test_delta_at_least_one_over_n_warns(caplog):
    fixed(num_clients=20, clients_per_round=4, noise_multiplier=1.0, delta=0.05)
    assert "delta=0.05 >= 1/num_clients=0.05" in caplog.text
    caplog.clear()
    fixed(num_clients=20, clients_per_round=4, noise_multiplier=1.0, delta=0.01)
    assert "delta" not in caplog.text


# ---------------------------------------------------------------- only private releases in DP mode
def test_dp_metrics_hold_no_exact_client_statistic_unless_debug_metrics():
    models = _updates(4, 3.0)

    def metrics(**kw):
        s = fixed(noise_multiplier=1.0, side="client", clip_norm=0.5, noise_seed=1, **kw)
        replies = make_replies(models, clipped=1.0, update_norm=3.0)
        return run_round(s, 1, G, replies)[1]

    private = metrics()
    assert set(private) == {keys.TRAIN_LOSS, keys.AGG_CLIP_NORM, keys.AGG_NOISE_STD, keys.AGG_EPSILON} | (
        set(private) & {keys.NUM_EXAMPLES, keys.PARTITION_ID, keys.NUM_STEPS}  # skipped by the loop
    )
    debug = metrics(debug_metrics=True)
    assert debug[keys.AGG_CLIPPED_FRACTION] == 1.0 and debug[keys.UPDATE_NORM] == 3.0
    assert debug[keys.CLIPPED] == 1.0
    # without noise there is nothing to protect: the exact fraction is reported as before
    plain = run_round(fixed(clip_norm=0.5), 1, G, make_replies(models))[1]
    assert plain[keys.AGG_CLIPPED_FRACTION] == 1.0


def test_adaptive_dp_reports_the_noised_unclipped_fraction_it_moves_c_with():
    s = adaptive(num_clients=40, clients_per_round=4, noise_multiplier=1.0, noise_seed=3, clip_norm_lr=0.2)
    c0 = s.clip_norm
    _, metrics = run_round(s, 1, G, make_replies(_updates(4, 50.0)))  # every update clipped: exact b = 0
    assert keys.AGG_CLIPPED_FRACTION not in metrics
    b = metrics[keys.AGG_NOISY_UNCLIPPED_FRACTION]
    assert b != 0.0  # noised
    assert s.clip_norm == pytest.approx(c0 * math.exp(-0.2 * (b - 0.5)))


def test_clipping_replaces_only_the_model_record_of_a_reply():
    """SCAFFOLD's control-variate delta (``scaffold-dc``) travels in its own ArrayRecord: clipping rebuilt every
    ArrayRecord of a reply with the clipped model, so SCAFFOLD under clipping=... lost it."""
    from flwr.app import Message, MetricRecord, RecordDict
    from strategy_helpers import server_identity

    from fedsim.records import rebuild_reply, to_record

    dc = {"w": np.full(3, 7.0, dtype=np.float32)}
    content = RecordDict(
        {
            "arrays": to_record({"w": np.ones(3, dtype=np.float32)}),
            "scaffold-dc": to_record(dc),
            "metrics": MetricRecord({"num-examples": 5}),
        }
    )
    with server_identity():
        msg = Message(content, 1, "train")
    new = rebuild_reply(msg, {"w": np.zeros(3, dtype=np.float32)}, {"num-examples": 1})
    assert np.array_equal(new.content["arrays"]["w"].numpy(), np.zeros(3))
    assert np.array_equal(new.content["scaffold-dc"]["w"].numpy(), dc["w"])
    assert new.content["metrics"]["num-examples"] == 1


def _rows_of(updates, bound):
    """A batched cohort's rows (``fedsim.algorithms.halves.Rows``) that start from 0 and trained to ``updates``,
    every row asked to clip at ``bound``."""
    import torch

    from fedsim.algorithms.halves import Rows
    from fedsim.messages import TrainInstruction

    model = {"w": torch.tensor(updates, dtype=torch.float32)}
    k = len(updates)
    ins = TrainInstruction(spec="", clip_norm=bound)
    return Rows(
        model, lambda: {"w": torch.zeros_like(model["w"])}, [ins] * k, list(range(k)), [0] * k, [None] * k
    )


def test_client_clipping_on_rows_clips_each_row_as_its_reply_would_be():
    """One definition for both forms: each row clipped to ``start + d * C / ||d||`` (the oracle written here),
    its norm and flag reported; the per-client form (one row) gives the same bits."""
    import torch

    from fedsim.algorithms.halves import Reply, run_on_rows
    from fedsim.features.clipping.client import ClientClipping
    from fedsim.messages import TrainInstruction

    rows = _rows_of([[3.0, 4.0], [0.3, 0.4]], 1.0)
    run_on_rows(ClientClipping(), rows)
    assert torch.allclose(rows.model["w"][0], torch.tensor([0.6, 0.8])) and torch.equal(
        rows.model["w"][1], torch.tensor([0.3, 0.4])
    )
    assert [m[keys.CLIPPED] for m in rows.metrics] == [1.0, 0.0]
    assert math.isclose(rows.metrics[0][keys.UPDATE_NORM], 5.0) and math.isclose(
        rows.metrics[1][keys.UPDATE_NORM], 0.5, rel_tol=1e-6
    )
    ins = TrainInstruction(spec="", clip_norm=1.0)
    reply = Reply({"w": torch.tensor([3.0, 4.0])}, {"w": torch.zeros(2)}, ins, 0, 0)
    ClientClipping().on_reply(reply)
    assert torch.equal(reply.model["w"], rows.model["w"][0]) and reply.metrics == rows.metrics[0]


def test_a_subclass_overriding_on_reply_of_a_shipped_half_is_honoured_on_rows():
    """A user's subclass of ClientClipping that overrides the per-client ``on_reply`` runs that override on
    every row (the shipped ``on_rows`` would skip it)."""
    import torch

    from fedsim.algorithms.halves import run_on_rows
    from fedsim.features.clipping.client import ClientClipping

    class Halving(ClientClipping):
        def on_reply(self, reply):
            super().on_reply(reply)
            reply.model["w"] = reply.model["w"] / 2
            reply.metrics["halved"] = 1.0

    rows = _rows_of([[3.0, 4.0], [0.3, 0.4]], 1.0)
    run_on_rows(Halving(), rows)
    assert torch.allclose(rows.model["w"], torch.tensor([[0.3, 0.4], [0.15, 0.2]]))
    assert [m["halved"] for m in rows.metrics] == [1.0, 1.0]

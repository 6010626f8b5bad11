"""fedsim's strategies on fabricated replies: by hand, against Flower's own classes as oracles, and robustness."""

import logging

import numpy as np
import pytest
from flwr.serverapp import strategy as flwr_strategies
from strategy_helpers import configure, flower_kwargs, make_replies, run_round, snapshot

from fedsim import keys
from fedsim.errors import ConfigError
from fedsim.strategies.fedadagrad import FedAdagrad
from fedsim.strategies.fedadam import FedAdam
from fedsim.strategies.fedavg import FedAvg
from fedsim.strategies.fedavgm import FedAvgM
from fedsim.strategies.fedmedian import FedMedian
from fedsim.strategies.fedprox import FedProx
from fedsim.strategies.fedtrimmedavg import FedTrimmedAvg
from fedsim.strategies.fedyogi import FedYogi
from fedsim.strategies.krum import Krum

KW = flower_kwargs()
GLOBAL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}


def _models(n, seed=0, scale=1.0, like=GLOBAL):
    rng = np.random.default_rng(seed)
    return [
        {k: (a + scale * rng.normal(size=a.shape)).astype(a.dtype) for k, a in like.items()} for _ in range(n)
    ]


def _oracle_round(ours, theirs, rnd, global_arrays, models, weights=None):
    """Run both strategies on identical replies (Flower's get their own copies: some mutate them)."""
    out, _ = run_round(ours, rnd, global_arrays, make_replies(models, weights))
    ref, _ = run_round(theirs, rnd, global_arrays, make_replies(models, weights))
    return out, ref


# ---------------------------------------------------------------- FedAvg family
def test_fedavg_of_one_client_returns_its_weights():
    (model,) = _models(1)
    out, metrics = run_round(FedAvg(**KW), 1, GLOBAL, make_replies([model], [7]))
    for k in model:
        assert out[k].dtype == model[k].dtype
        np.testing.assert_array_equal(out[k], model[k])
    assert metrics[keys.TRAIN_LOSS] == 1.0


def test_fedavg_weighted_mean_by_hand():
    w0, w1 = {"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([3.0, 5.0], np.float32)}
    out, _ = run_round(FedAvg(**KW), 1, {"w": np.zeros(2, np.float32)}, make_replies([w0, w1], [1, 2]))
    np.testing.assert_allclose(out["w"], (w0["w"] * 1 + w1["w"] * 2) / 3, rtol=1e-6)


def test_fedavg_matches_flower_and_leaves_replies_alone():
    models = _models(5, seed=1)
    replies = make_replies(models, [3, 1, 4, 1, 5])
    before = snapshot(replies)
    out, _ = run_round(FedAvg(**KW), 1, GLOBAL, replies)
    ref, _ = run_round(flwr_strategies.FedAvg(**KW), 1, GLOBAL, make_replies(models, [3, 1, 4, 1, 5]))
    for k in GLOBAL:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-6, atol=1e-7)
    for a, b in zip(before, snapshot(replies)):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_fedavg_keeps_integer_buffers_integer():
    like = {"w": np.zeros(2, np.float32), "n": np.array(4, np.int64)}
    models = [
        {"w": np.ones(2, np.float32), "n": np.array(4, np.int64)},
        {"w": np.zeros(2, np.float32), "n": np.array(6, np.int64)},
    ]
    out, _ = run_round(FedAvg(**KW), 1, like, make_replies(models))
    assert out["n"].dtype == np.int64 and int(out["n"]) == 5
    ref, _ = run_round(flwr_strategies.FedAvg(**KW), 1, like, make_replies(models))
    assert ref["n"].dtype == np.float64  # Flower's changes the dtype; fedsim would reject the next replies


def test_fedprox_sends_mu_and_validates():
    msgs = configure(FedProx(proximal_mu=0.3, **KW), 1, GLOBAL)
    assert len(msgs) == 3 and msgs[0].content[keys.CONFIG][keys.PROXIMAL_MU] == 0.3
    with pytest.raises(ConfigError, match="proximal_mu"):
        FedProx(proximal_mu=-0.1, **KW)


def test_fedavgm_step_by_hand_from_the_given_global_model():
    s = FedAvgM(server_learning_rate=0.5, server_momentum=0.5, **KW)
    g = {"w": np.array([0.0], np.float32)}
    out, _ = run_round(s, 1, g, make_replies([{"w": np.array([1.0], np.float32)}]))
    assert out["w"][0] == pytest.approx(0.5)  # pseudo-gradient -1, v = -1, x = 0 + 0.5
    # round 2 starts from a global model the strategy did not produce (e.g. a DP wrapper added noise):
    # v = 0.5 * (-1) + (5 - 5) = -0.5, x = 5 + 0.25. (Flower's FedAvgM steps from its own last output
    # 0.5 instead and returns 0.5 + 0.5 * 5 = 3.)
    five = {"w": np.array([5.0], np.float32)}
    out, _ = run_round(s, 2, five, make_replies([five]))
    assert out["w"][0] == pytest.approx(5.25)
    flower = flwr_strategies.FedAvgM(server_learning_rate=0.5, server_momentum=0.5, **KW)
    run_round(flower, 1, g, make_replies([{"w": np.array([1.0], np.float32)}]))
    assert run_round(flower, 2, five, make_replies([five]))[0]["w"][0] == pytest.approx(3.0)


def test_fedavgm_matches_flower_when_it_owns_the_global_model():
    ours = FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **KW)
    theirs = flwr_strategies.FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **KW)
    g = GLOBAL
    for rnd in (1, 2, 3):
        models = [{k: g[k] + d[k] for k in g} for d in _models(3, seed=rnd)]
        out, ref = _oracle_round(ours, theirs, rnd, g, models, [1, 2, 3])
        for k in g:
            np.testing.assert_allclose(out[k], ref[k], rtol=1e-5, atol=1e-6)
        g = out


def _flower_adam_eta(eta, beta_1, beta_2, rnd):
    """Flower's FedAdam scales eta by sqrt(1 - b2^(r+1)) / (1 - b1^(r+1)); undo it to compare Algorithm 2."""
    return eta * (1 - beta_1 ** (rnd + 1)) / np.sqrt(1 - beta_2 ** (rnd + 1))


@pytest.mark.parametrize("name", ["adam", "yogi", "adagrad"])
def test_fedopt_matches_flower(name):
    tau = 1e-9  # our v starts at tau^2 (paper), Flower's at 0: negligible here
    if name == "adam":
        ours, theirs = FedAdam(eta=0.1, tau=tau, **KW), flwr_strategies.FedAdam(eta=0.1, tau=tau, **KW)
    elif name == "yogi":
        ours, theirs = FedYogi(eta=0.1, tau=tau, **KW), flwr_strategies.FedYogi(eta=0.1, tau=tau, **KW)
    else:
        ours, theirs = FedAdagrad(eta=0.1, tau=tau, **KW), flwr_strategies.FedAdagrad(eta=0.1, tau=tau, **KW)
    g = GLOBAL
    for rnd in (1, 2, 3):
        if name == "adam":
            theirs.eta = _flower_adam_eta(0.1, 0.9, 0.99, rnd)
        models = [{k: g[k] + d[k] for k in g} for d in _models(3, seed=10 + rnd)]
        out, ref = _oracle_round(ours, theirs, rnd, g, models, [2, 1, 1])
        for k in g:
            assert out[k].dtype == np.float32
            np.testing.assert_allclose(out[k], ref[k], rtol=1e-5, atol=1e-6)
        g = out


def test_flower_fedadam_returns_float64_for_a_float32_model():
    _, ref = _oracle_round(FedAdam(**KW), flwr_strategies.FedAdam(**KW), 1, GLOBAL, _models(2))
    assert ref["w"].dtype == np.float64


def test_fedadam_single_step_through_messages_by_hand():
    s = FedAdam(eta=1.0, beta_1=0.9, beta_2=0.99, tau=0.01, **KW)
    out, _ = run_round(
        s, 1, {"w": np.array([0.0], np.float32)}, make_replies([{"w": np.array([0.1], np.float32)}])
    )
    assert out["w"][0] == pytest.approx(0.01 / (np.sqrt(0.000199) + 0.01), rel=1e-6)


def test_fedopt_state_dict_resumes_exactly():
    def rounds(strategy, start, g):
        for rnd in range(start, start + 2):
            out, _ = run_round(
                strategy, rnd, g, make_replies([{k: g[k] + d[k] for k in g} for d in _models(2, rnd)])
            )
            g = out
        return g

    a = FedYogi(**KW)
    g2 = rounds(a, 1, GLOBAL)
    b = FedYogi(**KW)
    b.load_state_dict(a.state_dict())
    end_a, end_b = rounds(a, 3, g2), rounds(b, 3, g2)
    for k in GLOBAL:
        np.testing.assert_array_equal(end_a[k], end_b[k])


# ---------------------------------------------------------------- robust aggregation
def test_median_and_trimmed_mean_by_hand():
    models = [{"w": np.array([v], np.float32)} for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
    g = {"w": np.zeros(1, np.float32)}
    assert run_round(FedMedian(**KW), 1, g, make_replies(models))[0]["w"][0] == 3.0
    assert run_round(FedTrimmedAvg(beta=0.2, **KW), 1, g, make_replies(models))[0]["w"][0] == 3.0
    assert run_round(FedTrimmedAvg(beta=0.0, **KW), 1, g, make_replies(models))[0]["w"][0] == 22.0


@pytest.mark.parametrize("kind", ["median", "trimmed"])
def test_robust_means_match_flower_without_mutating(kind):
    ours = FedMedian(**KW) if kind == "median" else FedTrimmedAvg(beta=0.25, **KW)
    theirs = (
        flwr_strategies.FedMedian(**KW)
        if kind == "median"
        else flwr_strategies.FedTrimmedAvg(beta=0.25, **KW)
    )
    models = _models(8, seed=3)
    replies = make_replies(models)
    before = snapshot(replies)
    out, _ = run_round(ours, 1, GLOBAL, replies)
    ref_replies = make_replies(models)
    ref, _ = run_round(theirs, 1, GLOBAL, ref_replies)
    for k in GLOBAL:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-6, atol=1e-7)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(before, snapshot(replies)) for k in a)
    assert not any(len(r.content[keys.ARRAYS]) for r in ref_replies)  # Flower's emptied its replies


def test_krum_by_hand_and_against_flower():
    points = [0.0, 1.0, 2.0, 10.0]
    models = [{"w": np.array([p], np.float32)} for p in points]
    g = {"w": np.zeros(1, np.float32)}
    assert run_round(Krum(**KW), 1, g, make_replies(models))[0]["w"][0] == 1.0
    # multi-Krum: uniform mean of the 3 best (1, 0, 2); Flower's MultiKrum agrees with equal weights
    out, ref = _oracle_round(
        Krum(num_selected=3, **KW), flwr_strategies.MultiKrum(num_nodes_to_select=3, **KW), 1, g, models
    )
    assert out["w"][0] == pytest.approx(1.0) and ref["w"][0] == pytest.approx(1.0)
    out, ref = _oracle_round(
        Krum(num_malicious=2, **KW),
        flwr_strategies.Krum(num_malicious_nodes=2, **KW),
        1,
        GLOBAL,
        _models(9, seed=4),
    )
    for k in GLOBAL:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-6)


def _krum_oracle(rows, f):
    """Krum by its definition: the row whose n - f - 2 nearest others are closest (sum of squared L2)."""
    d = ((rows[:, None, :] - rows[None, :, :]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d[i], i))[: len(rows) - f - 2].sum() for i in range(len(rows))]
    return rows[int(np.argmin(scores))]


@pytest.mark.parametrize("kind", ["median", "trimmed", "krum"])
def test_robust_rules_with_server_momentum_are_the_papers_distributed_sgd(kind):
    # Baruch et al.'s (and Yin et al.'s) server: v = beta v - eta agg(g), w = w + v, over the workers'
    # gradients g. A client that takes one SGD step at lr eta sends w - eta g, so the rule's pseudo-gradient
    # x - agg(models) is eta agg(g) for the median, the trimmed mean and Krum alike.
    eta, beta, n = 0.1, 0.9, 9
    make = {
        "median": lambda: FedMedian(server_momentum=beta, **KW),
        "trimmed": lambda: FedTrimmedAvg(beta=0.2, server_momentum=beta, **KW),
        "krum": lambda: Krum(num_malicious=2, server_momentum=beta, **KW),
    }[kind]
    agg = {
        "median": lambda g: np.median(g, axis=0),
        "trimmed": lambda g: np.sort(g, axis=0)[1:-1].mean(axis=0),  # floor(0.2 * 9) = 1 cut at each end
        "krum": lambda g: _krum_oracle(g, 2),
    }[kind]
    ours, rng = make(), np.random.default_rng(11)
    w = rng.normal(size=6)
    x, v = {"w": w.astype(np.float32)}, np.zeros(6)
    for rnd in (1, 2, 3):
        g = (
            rng.normal(size=(n, 6)) + np.array([5.0] + [0.0] * 5) * (np.arange(n) == 0)[:, None]
        )  # one outlier
        models = [{"w": (x["w"].astype(np.float64) - eta * gi).astype(np.float32)} for gi in g]
        sent = np.stack([m["w"].astype(np.float64) for m in models])
        g_seen = (x["w"].astype(np.float64) - sent) / eta  # the gradients as the float32 models carry them
        v = beta * v - eta * agg(g_seen)
        want = x["w"].astype(np.float64) + v
        x, _ = run_round(ours, rnd, x, make_replies(models))
        np.testing.assert_allclose(x["w"], want, rtol=1e-5, atol=1e-6)
    # the velocity is the strategy's state: a fresh one given it continues identically
    again = make()
    again.load_state_dict(ours.state_dict())
    models = [{"w": (x["w"] + 0.1 * rng.normal(size=6)).astype(np.float32)} for _ in range(n)]
    a, _ = run_round(ours, 4, x, make_replies(models))
    b, _ = run_round(again, 4, x, make_replies(models))
    np.testing.assert_array_equal(a["w"], b["w"])


def test_robust_rules_without_server_momentum_return_the_aggregate_itself():
    models = _models(7, seed=8)
    for s in (FedMedian(**KW), FedTrimmedAvg(beta=0.2, **KW), Krum(num_malicious=1, **KW)):
        assert s.server_momentum == 0.0 and s.server_learning_rate == 1.0
        x = {k: a + 100.0 for k, a in GLOBAL.items()}  # far from every model: a step from x would show
        out, _ = run_round(s, 1, x, make_replies(models))
        stacked = np.stack([m["w"] for m in models])
        if isinstance(s, FedMedian):
            np.testing.assert_array_equal(out["w"], np.median(stacked, axis=0).astype(np.float32))
        else:
            assert np.abs(out["w"]).max() < 10  # within the models, not near x
        assert s.state_dict() == {"velocity": None}


def test_planted_outliers_move_fedavg_but_not_robust_rules():
    rng = np.random.default_rng(5)
    w = {"w": rng.normal(size=20).astype(np.float32)}
    honest = [{"w": (w["w"] + 0.01 * rng.normal(size=20)).astype(np.float32)} for _ in range(7)]
    evil = [{"w": w["w"] + np.float32(1e3)} for _ in range(2)]
    models = honest + evil

    def dist(strategy):
        out, _ = run_round(strategy, 1, w, make_replies(models))
        return float(np.abs(out["w"] - w["w"]).max())

    assert dist(FedAvg(**KW)) > 100
    for robust in (
        FedMedian(**KW),
        FedTrimmedAvg(beta=0.25, **KW),
        Krum(num_malicious=2, **KW),
        Krum(num_malicious=2, num_selected=5, **KW),
    ):
        assert dist(robust) < 0.1, type(robust).__name__


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: FedTrimmedAvg(beta=0.5, **KW), "beta"),
        (lambda: FedTrimmedAvg(beta=-0.1, **KW), "beta"),
        (lambda: FedAdam(eta=0.0, **KW), "eta"),
        (lambda: FedYogi(beta_1=1.0, **KW), "beta_1"),
        (lambda: FedAdam(beta_2=-0.5, **KW), "beta_2"),
        (lambda: FedAdagrad(tau=0.0, **KW), "tau"),
        (lambda: FedAvgM(server_learning_rate=0.0, **KW), "server_learning_rate"),
        (lambda: FedAvgM(server_momentum=1.0, **KW), "server_momentum"),
        (lambda: FedMedian(server_momentum=-0.1, **KW), "server_momentum"),
        (lambda: Krum(server_learning_rate=0.0, **KW), "server_learning_rate"),
        (lambda: Krum(num_malicious=-1, **KW), "num_malicious"),
        (lambda: Krum(num_selected=0, **KW), "num_selected"),
        (lambda: Krum(num_malicious=1.5, **KW), "num_malicious"),
    ],
)
def test_bad_parameters_raise_config_error_naming_the_key(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.key == key and key in str(err.value)


def test_krum_cohort_checks():
    k = Krum(num_malicious=2, num_selected=3, **KW)
    k.check_cohort(7)  # 2f + 3 = 7
    with pytest.raises(ConfigError, match="num_malicious"):
        k.check_cohort(6)
    with pytest.raises(ConfigError, match="num_selected"):
        Krum(num_malicious=1, num_selected=5, **KW).check_cohort(5)
    with pytest.raises(ConfigError, match="min_replies"):  # too few valid replies at aggregation time
        run_round(k, 1, GLOBAL, make_replies(_models(6)))
    with pytest.raises(ConfigError, match=r"^clients_per_round=2 .* >= 2 \* num_malicious \+ 3 = 3"):
        Krum(num_malicious=0, **KW).check_cohort(2)  # no num_malicious could help: name the cohort


def test_trimmed_cohort_check_warns_when_nothing_is_trimmed(caplog):
    s = FedTrimmedAvg(beta=0.2, **KW)
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        s.check_cohort(10)
        assert not [r for r in caplog.records if r.name == "fedsim"]
        s.check_cohort(3)
    assert "trims nothing" in caplog.text


def test_no_replies_keep_the_model():
    for s in (FedAvg(**KW), FedAdam(**KW), FedMedian(**KW), Krum(**KW)):
        assert run_round(s, 1, GLOBAL, []) == (None, None)


def test_strategies_leave_the_given_global_arrays_alone():
    s = FedAdam(**KW)
    g = {k: a.copy() for k, a in GLOBAL.items()}
    run_round(s, 1, g, make_replies(_models(3)))
    assert all(np.array_equal(g[k], GLOBAL[k]) for k in g)

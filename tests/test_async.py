"""The asynchronous loop and its strategies: staleness bookkeeping, FedAsync/FedBuff rules, drops, determinism."""

import numpy as np
import pytest
import torch
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim.errors import ConfigError
from fedsim.records import to_numpy, to_record
from fedsim.run import run_experiment
from fedsim.strategies.fedasync import FedAsync
from fedsim.strategies.fedbuff import FedBuff
from fedsim.strategies.staleness import hinge, polynomial, staleness_fn

# Two clients whose tasks do identical work (2 steps of 16 examples); client 1 is 1/0.3 = 3.33x slower.
TWO_SPEEDS = [
    "num_clients=2",
    "clients_per_round=2",
    "partitioner=iid",
    "client.local_steps=2",
    "client.batch_size=16",
    "heterogeneity=none",
    "heterogeneity.speed=list",
    "+heterogeneity.speeds=[1.0,0.3]",
]


def _records(tmp_path, name, *over):
    run_tiny(tmp_path / name, *over)
    return [r for r in read_metrics(tmp_path / name) if r["round"] > 0]


def test_staleness_bookkeeping_on_a_known_event_sequence(tmp_path):
    # Client 0 (duration d) and client 1 (3.33 d), both started at version 0. Events in simulated time:
    # d, 2d, 3d: client 0, fresh (staleness 0) -> versions 1, 2, 3;  3.33d: client 1 from v0 -> staleness 3, v4;
    # 4d: client 0 from v3 -> staleness 1, v5;  5d, 6d: fresh -> v6, v7;  6.67d: client 1 from v4 -> 3, v8.
    recs = _records(tmp_path, "run", *TWO_SPEEDS, "strategy=fedasync", "num_rounds=8")
    assert [r["staleness_max"] for r in recs] == [0, 0, 0, 3, 1, 0, 0, 3]
    d = 32 * 1e-3  # examples x time_per_example at speed 1 (no network delay)
    expected = [d, 2 * d, 3 * d, d / 0.3, 4 * d, 5 * d, 6 * d, 2 * d / 0.3]
    assert [r["sim_time"] for r in recs] == pytest.approx(expected)
    assert all(r["num_clients"] == 1 and r["dropped_stale"] == 0 for r in recs)


def test_max_staleness_drops_and_counts_stale_updates(tmp_path):
    recs = _records(
        tmp_path, "run", *TWO_SPEEDS, "strategy=fedasync", "num_rounds=8", "strategy.max_staleness=2"
    )
    assert max(r["staleness_max"] for r in recs) <= 2
    # client 1's first update (staleness 3) arrives while version 3 is current and is dropped: no version
    # comes from it, so the next version (4) is client 0's at 4d and records the dropped update
    assert sum(r["dropped_stale"] for r in recs) >= 1
    assert recs[3]["dropped_stale"] == 1 and recs[3]["sim_time"] == pytest.approx(4 * 32e-3)


def test_fedbuff_k1_without_staleness_equals_fedasync_with_alpha_eta():
    rng = np.random.default_rng(0)
    x = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    xc = {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in x.items()}
    buff = FedBuff(buffer_size=1, server_lr=0.3, staleness="constant", concurrency=1)
    fasync = FedAsync(alpha=0.3, staleness="constant", concurrency=1)
    a = to_numpy(buff.on_update(to_record(x), to_record(xc), to_record(x), 0, 10))
    b = to_numpy(fasync.on_update(to_record(x), to_record(xc), to_record(x), 0, 10))
    assert a.keys() == b.keys() == x.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6)
        np.testing.assert_allclose(b[k], x[k] + 0.3 * (xc[k] - x[k]), rtol=1e-6)


@pytest.mark.slow
def test_fedbuff_k1_and_fedasync_runs_coincide_when_nothing_is_stale(tmp_path):
    common = [
        "num_rounds=6",
        "heterogeneity=lognormal",
        "strategy.concurrency=1",
        "strategy.staleness=constant",
    ]
    a = _records(
        tmp_path, "buff", "strategy=fedbuff", "strategy.buffer_size=1", "strategy.server_lr=0.5", *common
    )
    b = _records(tmp_path, "async", "strategy=fedasync", "strategy.alpha=0.5", *common)
    assert [r["staleness_max"] for r in a] == [0] * 6
    for ra, rb in zip(without_wall_time(a), without_wall_time(b), strict=True):
        assert ra["eval_accuracy"] == pytest.approx(rb["eval_accuracy"], abs=1e-6)
        assert ra["eval_loss"] == pytest.approx(rb["eval_loss"], rel=1e-5)
        assert ra["sim_time"] == rb["sim_time"]


@pytest.mark.slow
def test_async_proximal_term_matches_fedprox_on_one_full_batch_client(tmp_path):
    """FedAsync's rho: alpha=1 with one client (full batch, no shuffling) is FedProx with mu=rho, round for round."""
    common = [
        "num_clients=1",
        "clients_per_round=1",
        "num_rounds=3",
        "client.batch_size=0",
        "client.local_steps=5",
    ]
    prox = _records(tmp_path, "prox", *common, "strategy=fedprox", "strategy.proximal_mu=0.5")
    fasync = _records(
        tmp_path,
        "async",
        *common,
        "strategy=fedasync",
        "strategy.alpha=1.0",
        "strategy.staleness=constant",
        "strategy.proximal_mu=0.5",
    )
    plain = _records(
        tmp_path, "plain", *common, "strategy=fedasync", "strategy.alpha=1.0", "strategy.staleness=constant"
    )
    assert [r["eval_loss"] for r in fasync] == pytest.approx([r["eval_loss"] for r in prox], rel=1e-6)
    assert [r["train_loss"] for r in fasync] == pytest.approx([r["train_loss"] for r in prox], rel=1e-6)
    assert abs(plain[-1]["eval_loss"] - fasync[-1]["eval_loss"]) > 1e-3  # the term does change training


def test_fedbuff_waits_for_k_updates_and_weights_them_by_staleness():
    def rec(v):
        return to_record({"w": np.asarray(v, np.float32)})

    s = FedBuff(buffer_size=2, server_lr=1.0, concurrency=2)
    assert (
        s.on_update(rec([0, 0, 0]), rec([1, 1, 1]), rec([0, 0, 0]), 0, 5) is None
    )  # buffered, no new version
    new = s.on_update(rec([0, 0, 0]), rec([3, 3, 3]), rec([0, 0, 0]), 3, 5)  # staleness 3: weight 1/2
    np.testing.assert_allclose(to_numpy(new)["w"], [(1 + 3 / 2) / 2] * 3, rtol=1e-6)
    assert s.count == 0 and s.steps == 1


def test_staleness_weights_by_hand():
    assert polynomial(0) == 1.0 and polynomial(3, a=0.5) == pytest.approx(0.5)
    assert polynomial(7, a=1.0) == pytest.approx(1 / 8)
    assert hinge(4, a=10, b=4) == 1.0 and hinge(5, a=10, b=4) == pytest.approx(1 / 11)
    assert hinge(6, a=0.5, b=2) == pytest.approx(1 / 3)
    assert staleness_fn("constant")(100) == 1.0
    assert FedAsync(alpha=0.8, staleness="hinge", hinge_a=1.0, staleness_b=1.0).mixing_weight(3) == (
        pytest.approx(0.8 / 3)
    )


def test_hinge_defaults_to_the_papers_slope_not_the_polynomials_exponent():
    # Xie et al. 2019: a = 10, b = 4; at staleness 6 the weight is 1 / (10 * 2 + 1) = 1/21
    fa = FedAsync(alpha=1.0, staleness="hinge", staleness_a=0.5)
    assert fa.mixing_weight(6) == pytest.approx(1 / 21)
    assert fa.mixing_weight(4) == 1.0
    assert FedAsync(alpha=1.0, staleness="polynomial", hinge_a=3.0).mixing_weight(3) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"^hinge_a=-1"):
        FedAsync(staleness="hinge", hinge_a=-1)


@pytest.mark.slow
def test_same_seed_same_metrics_and_vectorized_engine_agrees(tmp_path):
    over = ["strategy=fedbuff", "strategy.buffer_size=2", "heterogeneity=lognormal", "num_rounds=4", "seed=3"]
    a = without_wall_time(_records(tmp_path, "a", *over))
    b = without_wall_time(_records(tmp_path, "b", *over))
    assert a == b
    v = without_wall_time(_records(tmp_path, "v", *over, "engine=vectorized"))
    for ra, rv in zip(a, v, strict=True):
        assert ra.keys() == rv.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rv[k], rel=1e-4, abs=1e-5), k


def test_dropouts_and_raising_clients_never_stall_the_loop(tmp_path):
    recs = _records(
        tmp_path,
        "run",
        "strategy=fedasync",
        "num_rounds=10",
        "heterogeneity=lognormal",
        "heterogeneity.dropout_prob=0.3",
        "heterogeneity.deadline=2.0",
        "faults=mixed",
    )
    assert [r["round"] for r in recs] == list(range(1, 11))
    assert sum(r.get("dropped_out", 0) for r in recs) > 0
    assert sum(r["failures"] for r in recs) > 0


def test_a_population_that_never_answers_fails_clearly(tmp_path):
    with pytest.raises(RuntimeError, match="gave no usable update"):
        run_tiny(
            tmp_path / "run", "strategy=fedasync", "heterogeneity=lognormal", "heterogeneity.dropout_prob=1.0"
        )


@pytest.mark.slow
def test_resume_fedbuff_is_bit_identical(tmp_path):
    over = [
        "strategy=fedbuff",
        "strategy.buffer_size=2",
        "strategy.server_momentum=0.5",
        "heterogeneity=lognormal",
        "checkpoint_every=3",
    ]
    run_tiny(tmp_path / "full", *over, "num_rounds=6")
    run_tiny(tmp_path / "part", *over, "num_rounds=3")
    run_tiny(tmp_path / "resumed", *over, "num_rounds=6", f"resume={tmp_path / 'part'}")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    ma, mb = torch.load(tmp_path / "full" / "model.pt"), torch.load(tmp_path / "resumed" / "model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


BAD = [
    (["strategy=fedbuff", "strategy.concurrency=0"], "strategy.concurrency=0"),
    (["strategy=fedbuff", "strategy.concurrency=7"], "strategy.concurrency=7"),  # 6 clients in TINY
    (["strategy=fedbuff", "strategy.buffer_size=0"], "strategy.buffer_size=0"),
    (["strategy=fedasync", "strategy.alpha=0"], "strategy.alpha=0"),
    (["strategy=fedasync", "strategy.alpha=1.5"], "strategy.alpha=1.5"),
    (["strategy=fedasync", "strategy.staleness=cubic"], "strategy.staleness='cubic'"),
    (["heterogeneity=uniform", "heterogeneity.low=-1"], "heterogeneity.low=-1"),
    (["heterogeneity=lognormal", "heterogeneity.network_delay=-0.5"], "heterogeneity.network_delay=-0.5"),
    (["heterogeneity.speed=list", "+heterogeneity.speeds=[1.0,-2.0]"], "heterogeneity.speeds"),
    (["heterogeneity=lognormal", "heterogeneity.dropout_prob=1.5"], "heterogeneity.dropout_prob=1.5"),
    (["strategy=fedasync", "clipping=fixed"], "clipping="),
    (["strategy=fedbuff", "strategy.proximal_mu=-0.1"], "strategy.proximal_mu=-0.1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, needle", BAD, ids=[b[1] for b in BAD])
def test_bad_async_and_heterogeneity_input_is_refused_before_training(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        run_experiment(
            compose_cfg("num_clients=6", "clients_per_round=3", "quiet=true", *overrides), tmp_path
        )
    assert needle in str(err.value) and "expected" in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()

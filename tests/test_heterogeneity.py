"""The heterogeneity model (virtual clock) and its effect on synchronous rounds: stragglers, dropouts, deadlines."""

import numpy as np
import pytest
from helpers import read_metrics, run_tiny

from fedsim.clock import Heterogeneity
from fedsim.errors import ConfigError
from fedsim.server import Plan, Workload, plan_round
from fedsim.training import LocalTraining, examples_processed, steps_within, train_local


@pytest.mark.parametrize(
    "speed, kw",
    [
        ("constant", {}),
        ("uniform", {"low": 0.2, "high": 0.8}),
        ("lognormal", {"sigma": 1.0}),
        ("exponential", {"low": 0.05}),
        ("list", {"speeds": [1.0, 0.5, 0.25]}),
    ],
)
def test_speeds_are_seeded_positive_and_follow_the_distribution(speed, kw):
    a = Heterogeneity(200, seed=4, speed=speed, **kw).speeds
    assert np.array_equal(a, Heterogeneity(200, seed=4, speed=speed, **kw).speeds)
    assert a.shape == (200,) and (a > 0).all()
    if speed == "uniform":
        assert a.min() >= 0.2 and a.max() <= 0.8
    if speed == "lognormal":
        assert abs(np.median(np.log(a))) < 0.25 and 0.8 < np.log(a).std() < 1.2
    if speed == "list":
        assert list(a[:6]) == [1.0, 0.5, 0.25, 1.0, 0.5, 0.25]


def test_duration_is_work_over_speed_plus_delay_and_stragglers_slow_down():
    h = Heterogeneity(
        3, seed=0, speed="list", speeds=[1.0, 0.5, 2.0], time_per_example=0.01, network_delay=0.3
    )
    assert [h.duration(k, 100) for k in range(3)] == pytest.approx([1.3, 2.3, 0.8])
    s = Heterogeneity(
        50, seed=0, speed="constant", time_per_example=0.01, straggler_prob=0.5, straggler_slowdown=4.0
    )
    slow = [s.is_straggler(k, 1) for k in range(50)]
    assert 10 < sum(slow) < 40
    assert all(s.duration(k, 100, task=1) == pytest.approx(4.0 if slow[k] else 1.0) for k in range(50))
    assert s.duration(0, 100) == pytest.approx(1.0)  # no task: the plain speed model


def test_deadline_partial_work_and_round_time():
    h = Heterogeneity(
        2, seed=0, speed="list", speeds=[1.0, 0.25], time_per_example=0.01, network_delay=0.5, deadline=2.0
    )
    assert not h.late(0, 100) and h.late(1, 100)  # 1.5 s vs 4.5 s
    assert h.partial_examples(1, 100) == 37  # (2.0 - 0.5) / 0.04 = 37.5
    assert h.partial_examples(0, 100) == 100
    assert h.round_time([1.5, 1.9]) == pytest.approx(1.9)
    assert h.round_time([1.5], waited=True) == pytest.approx(2.0)
    assert Heterogeneity(2, seed=0).round_time([0.7, 0.2], waited=True) == pytest.approx(0.7)


def test_examples_processed_predicts_what_training_reports():
    import torch

    for n, cfg in [
        (50, LocalTraining(batch_size=16, local_epochs=2)),
        (50, LocalTraining(batch_size=16, local_steps=7)),
        (9, LocalTraining(batch_size=0, local_epochs=1)),
        (30, LocalTraining(batch_size=64, local_steps=3)),
    ]:
        model = torch.nn.Linear(4, 3)
        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
        for cap in (None, 2):
            _, steps, seen = train_local(model, x, y, cfg, torch.Generator().manual_seed(0), max_steps=cap)
            assert seen == examples_processed(n, cfg, cap)
            assert cap is None or steps == min(cap, steps)
    cfg = LocalTraining(batch_size=16, local_epochs=2)
    # one pass is 4 steps of 16, 16, 16 and 2 examples
    assert [examples_processed(50, cfg, s) for s in (1, 3, 4, 5, 8)] == [16, 48, 50, 66, 100]
    assert (
        steps_within(50, cfg, 60) == 4 and steps_within(50, cfg, 47) == 2 and steps_within(50, cfg, 10) == 0
    )


def test_plan_round_decides_each_fate():
    h = Heterogeneity(
        4,
        seed=0,
        speed="list",
        speeds=[1.0, 0.1, 1.0, 0.1],
        time_per_example=0.01,
        deadline=1.0,
        partial_work=True,
        dropout_prob=0.0,
    )
    work = Workload('{"client": {"batch_size": 10, "local_epochs": 1}}', {0: 50, 1: 50, 2: 50, 3: 5})
    plans = {p.pid: p for p in plan_round(h, work, [0, 1, 2, 3], rnd=1)}
    assert plans[0] == Plan(0, "train", pytest.approx(0.5))
    # client 1 needs 5 s; in 1 s it processes 10 examples = 1 step of 10
    assert plans[1].fate == "partial" and plans[1].max_steps == 1 and plans[1].duration == pytest.approx(1.0)
    assert plans[3].fate == "train"  # 5 examples at speed 0.1: 0.5 s
    strict = Heterogeneity(4, seed=0, speed="list", speeds=[1.0, 0.1], time_per_example=0.01, deadline=1.0)
    assert [p.fate for p in plan_round(strict, work, [0, 1], rnd=1)] == ["train", "late"]


@pytest.mark.slow
def test_sync_deadline_drops_late_clients_or_keeps_their_partial_work(tmp_path):
    over = [
        "num_clients=6",
        "clients_per_round=6",
        "num_rounds=2",
        "partitioner=iid",
        "heterogeneity=none",
        "heterogeneity.speed=list",
        "+heterogeneity.speeds=[1.0,1.0,1.0,1.0,0.2,0.2]",
        "heterogeneity.deadline=1.0",
    ]  # ~190 examples x 2 epochs: 0.38 s at speed 1, 1.9 s at 0.2
    run_tiny(tmp_path / "drop", *over)
    recs = read_metrics(tmp_path / "drop")[1:]
    assert [r["num_clients"] for r in recs] == [4, 4]
    assert [r["dropped_late"] for r in recs] == [2, 2]
    assert recs[-1]["sim_time"] == pytest.approx(
        2.0
    )  # the server waited for the late ones until the deadline
    run_tiny(tmp_path / "partial", *over, "heterogeneity.partial_work=true")
    recs = read_metrics(tmp_path / "partial")[1:]
    assert [r["num_clients"] for r in recs] == [6, 6]
    assert [r["partial_work"] for r in recs] == [2, 2]
    assert recs[0]["sim_time"] <= 1.0


@pytest.mark.slow
def test_sync_dropouts_are_counted_and_the_run_goes_on(tmp_path):
    run_tiny(
        tmp_path,
        "num_clients=10",
        "clients_per_round=10",
        "num_rounds=3",
        "heterogeneity=lognormal",
        "heterogeneity.dropout_prob=0.3",
    )
    recs = read_metrics(tmp_path)[1:]
    h = Heterogeneity(10, seed=0, speed="lognormal", dropout_prob=0.3)
    for r in recs:
        expected = sum(h.drops(k, r["round"]) for k in range(10))
        assert r.get("dropped_out", 0) == expected and r["num_clients"] == 10 - expected


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"sigma": -1.0, "speed": "lognormal"}, "sigma"),
        ({"time_per_example": -0.1}, "time_per_example"),
        ({"straggler_slowdown": 0.5}, "straggler_slowdown"),
        ({"deadline": 0}, "deadline"),
        ({"straggler_prob": 2}, "straggler_prob"),
    ],
)
def test_bad_heterogeneity_values_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        Heterogeneity(5, seed=0, **kw)


def test_partial_work_limit_reaches_only_the_late_client():
    # Flower's strategies send one shared RecordDict to every node of a round
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
    from strategy_helpers import server_identity

    from fedsim import keys
    from fedsim.server import _limit_partial

    shared = RecordDict(
        {keys.ARRAYS: ArrayRecord([np.zeros(2, np.float32)]), keys.CONFIG: ConfigRecord({"a": 1})}
    )
    with server_identity():
        msgs = [Message(shared, node, MessageType.TRAIN) for node in (1, 2, 3)]
    plans = {0: Plan(0, "train", 1.0), 1: Plan(1, "partial", 1.0, max_steps=4), 2: Plan(2, "train", 1.0)}
    _limit_partial(msgs, plans, {1: 0, 2: 1, 3: 2})
    assert [keys.MAX_STEPS in m.content[keys.CONFIG] for m in msgs] == [False, True, False]
    assert msgs[1].content[keys.CONFIG][keys.MAX_STEPS] == 4 and msgs[1].content[keys.CONFIG]["a"] == 1
    assert msgs[1].content[keys.ARRAYS] is shared[keys.ARRAYS]  # the weights are not copied


@pytest.mark.slow
def test_partial_work_gives_the_same_result_on_the_vectorized_engine(tmp_path):
    over = [
        "num_rounds=3",
        "heterogeneity=lognormal",
        "heterogeneity.deadline=0.25",
        "heterogeneity.partial_work=true",
    ]
    run_tiny(tmp_path / "seq", *over)
    run_tiny(tmp_path / "vec", *over, "engine=vectorized")
    a, b = read_metrics(tmp_path / "seq")[1:], read_metrics(tmp_path / "vec")[1:]
    assert sum(r.get("partial_work", 0) for r in a) > 0
    for ra, rb in zip(a, b, strict=True):
        assert ra["eval_loss"] == pytest.approx(rb["eval_loss"], rel=1e-5)

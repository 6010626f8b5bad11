"""Byzantine attacks (fedsim.attacks): hand-computed updates, the fixed attacker set, the wrapper, the config."""

from __future__ import annotations

import json
from statistics import NormalDist

import numpy as np
import pytest
import torch
from helpers import TINY, compose_cfg, read_metrics, run_tiny
from strategy_helpers import make_reply, numpy_of, run_round

from fedsim.errors import ConfigError
from fedsim.experiment import build_experiment
from fedsim.features.attacks import server as attacks
from fedsim.server import sample_cohort
from fedsim.strategies.fedavg import FedAvg

X = {"w": np.array([1.0, 1.0], np.float32), "step": np.array(5, np.int64)}  # global model
# client updates d_k (partition ids 0..3); clients 0 and 1 are the attackers in the wrapper tests
D = [np.array([1.0, 2.0]), np.array([3.0, 6.0]), np.array([2.0, 0.0]), np.array([4.0, 4.0])]


class Capture(FedAvg):
    """FedAvg that keeps the replies it was asked to aggregate (as numpy), by partition id."""

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.seen = {
            int(m.content["metrics"]["partition-id"]): numpy_of(m.content["arrays"]) for m in replies
        }
        return super().aggregate_train(server_round, replies)


def _wrapped(cls, **params):
    inner = Capture()
    attack = cls(strategy=inner, fraction=0.5, num_clients=4, clients_per_round=4, seed=0, **params)
    attack.malicious = frozenset({0, 1})  # fixed by hand: the oracles below name them
    return attack, inner


def _round(attack, inner) -> dict[int, np.ndarray]:
    replies = [
        make_reply({"w": X["w"] + d.astype(np.float32), "step": X["step"]}, 1, p) for p, d in enumerate(D)
    ]
    run_round(attack, 1, X, replies)
    for arrays in inner.seen.values():  # non-float arrays are the client's own, dtypes kept
        assert arrays["step"] == 5 and arrays["w"].dtype == np.float32
    return {p: arrays["w"] - X["w"] for p, arrays in inner.seen.items()}  # the updates the inner strategy saw


# ---------------------------------------------------------------- pure functions
def test_alie_is_mean_minus_z_std_per_coordinate():
    updates = np.array([[1.0, 2.0], [3.0, 6.0]])  # mean (2, 4), population std (1, 2)
    np.testing.assert_allclose(attacks.alie(updates, 0.5), [1.5, 3.0])
    np.testing.assert_allclose(attacks.alie(updates, 0.0), [2.0, 4.0])


def test_alie_z_follows_the_paper():
    # n = 10, m = 2: s = floor(6) - 2 = 4, z = Phi^-1(6 / 10)
    assert attacks.alie_z(10, 2) == pytest.approx(NormalDist().inv_cdf(0.6))
    assert attacks.alie_z(10, 2) == pytest.approx(0.2533471, abs=1e-6)
    # the paper's n = 50, m = 12 (24 %): s = 14, z = Phi^-1(36 / 50)
    assert attacks.alie_z(50, 12) == pytest.approx(NormalDist().inv_cdf(0.72))
    with pytest.raises(ValueError):
        attacks.alie_z(10, 6)  # s = 0: a majority of attackers


def test_ipm_is_minus_epsilon_mean():
    updates = np.array([[1.0, 2.0], [3.0, 6.0]])
    np.testing.assert_allclose(attacks.ipm(updates, 0.5), [-1.0, -2.0])


def test_flip_labels_maps_c_minus_one_minus_y():
    y = torch.tensor([0, 1, 9, 4])
    assert attacks.flip_labels(y, 10).tolist() == [9, 8, 0, 5]
    assert y.tolist() == [0, 1, 9, 4]  # not modified


def test_malicious_clients_are_a_fixed_seeded_subset():
    a = attacks.malicious_clients(3, 20, 0.2)
    assert len(a) == 4 and a == sorted(set(a)) and all(0 <= p < 20 for p in a)
    assert attacks.malicious_clients(3, 20, 0.2) == a
    assert attacks.malicious_clients(4, 20, 0.2) != a
    assert attacks.malicious_clients(3, 20, 0.0) == []


# ---------------------------------------------------------------- the wrapper
def test_sign_flip_reverses_only_the_attackers_updates():
    seen = _round(*_wrapped(attacks.SignFlip))
    np.testing.assert_allclose(seen[0], -D[0])
    np.testing.assert_allclose(seen[1], -D[1])
    np.testing.assert_allclose(seen[2], D[2])
    np.testing.assert_allclose(seen[3], D[3])


def test_scale_boosts_only_the_attackers_updates():
    seen = _round(*_wrapped(attacks.Scale, factor=10.0))
    np.testing.assert_allclose(seen[1], 10 * D[1])
    np.testing.assert_allclose(seen[3], D[3])


def test_alie_uses_the_honest_updates_only():
    seen = _round(*_wrapped(attacks.ALIE, z=1.0))
    honest = np.stack([D[2], D[3]])  # mean (3, 2), std (1, 2)
    expected = honest.mean(0) - honest.std(0)
    np.testing.assert_allclose(expected, [2.0, 0.0])
    np.testing.assert_allclose(seen[0], expected, atol=1e-6)
    np.testing.assert_allclose(seen[1], expected, atol=1e-6)
    np.testing.assert_allclose(seen[2], D[2])


def test_alie_with_own_knowledge_uses_the_attackers_updates():
    seen = _round(*_wrapped(attacks.ALIE, z=1.0, knowledge="own"))
    np.testing.assert_allclose(seen[0], [2.0 - 1.0, 4.0 - 2.0], atol=1e-6)  # mean - std of D[0], D[1]


def test_ipm_sends_minus_epsilon_honest_mean():
    seen = _round(*_wrapped(attacks.IPM, epsilon=0.5))
    np.testing.assert_allclose(seen[0], [-1.5, -1.0], atol=1e-6)
    np.testing.assert_allclose(seen[1], [-1.5, -1.0], atol=1e-6)


def test_gaussian_is_seeded_per_client_and_round():
    first = _round(*_wrapped(attacks.Gaussian, std=2.0))
    again = _round(*_wrapped(attacks.Gaussian, std=2.0))
    np.testing.assert_array_equal(first[0], again[0])
    assert not np.allclose(first[0], first[1])
    np.testing.assert_allclose(first[2], D[2])


def test_attack_counts_malicious_replies_and_aggregates_after_the_attack():
    attack, inner = _wrapped(attacks.SignFlip)
    assert attack.malicious_among([0, 2, 3]) == 1
    replies = [
        make_reply({"w": X["w"] + d.astype(np.float32), "step": X["step"]}, 1, p) for p, d in enumerate(D)
    ]
    arrays, _ = run_round(attack, 1, X, replies)
    np.testing.assert_allclose(arrays["w"] - X["w"], (-D[0] - D[1] + D[2] + D[3]) / 4, atol=1e-6)


def test_label_flip_names_the_attackers_in_the_train_config():
    from strategy_helpers import configure

    attack, _ = _wrapped(attacks.LabelFlip)
    messages = configure(attack, 1, X, num_nodes=2)
    assert all(list(m.content["config"][attacks.LABEL_FLIP]) == [0, 1] for m in messages)


# ---------------------------------------------------------------- config and runs
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["attack=sign_flip", "attack.fraction=1.0"], "attack.fraction"),
        (["attack=ipm", "attack.fraction=-0.1"], "attack.fraction"),
        (["attack=alie", "attack.fraction=0.6"], "attack.fraction"),  # attackers a majority: z undefined
        (["attack=gaussian", "attack.std=0"], "attack.std"),
        (["attack=alie", "attack.knowledge=all"], "attack.knowledge"),
        (["attack=sign_flip", "strategy=fedbuff"], "attack"),
    ],
)
@pytest.mark.slow
def test_bad_attack_config_is_one_config_error(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_experiment(compose_cfg("num_clients=10", "clients_per_round=10", *overrides))
    assert err.value.key == key


@pytest.mark.slow
def test_run_records_the_malicious_replies_of_each_round(tmp_path):
    summary = run_tiny(tmp_path, "attack=sign_flip", "attack.fraction=0.5", "num_rounds=3")
    bad = set(summary["malicious_clients"])
    assert len(bad) == 3 and summary["attack"] == "sign_flip"
    n, m = (int(o.split("=")[1]) for o in TINY[:2])
    for r in read_metrics(tmp_path)[1:]:
        assert r["malicious"] == len(bad & set(sample_cohort(0, r["round"], n, m)))


@pytest.mark.slow
def test_label_flip_trains_the_attackers_on_flipped_labels(tmp_path):
    from fedsim.build import client_spec, client_task
    from fedsim.features.attacks.client import FlipLabels
    from fedsim.messages import TrainInstruction

    cfg = compose_cfg(*TINY)
    spec = client_spec(cfg, "cpu")
    task = client_task(spec, 2)
    half = FlipLabels()  # attack=label_flip's client half, as fedsim's ClientApp applies it
    assert attacks.LabelFlip.client_half is FlipLabels
    flipping = TrainInstruction(spec, unhandled={attacks.LABEL_FLIP: [2, 4]})
    assert half.active(flipping) and torch.equal(half.labels(flipping, 2, task.y_train, 10), 9 - task.y_train)
    other = TrainInstruction(spec, unhandled={attacks.LABEL_FLIP: [4]})
    assert half.labels(other, 2, task.y_train, 10) is task.y_train
    summary = run_tiny(tmp_path, "attack=label_flip", "attack.fraction=0.5")
    assert summary["status"] == "completed" and json.loads(json.dumps(summary["malicious_clients"]))


def test_a_config_without_the_optional_groups_has_no_attack():
    from omegaconf import OmegaConf

    cfg = compose_cfg(*TINY)
    OmegaConf.set_struct(cfg, False)
    for group in ("attack", "selection", "compression"):  # as in a primary config without fedsim's `config`
        cfg.pop(group)
    exp = build_experiment(cfg)
    assert type(exp.strategy) is FedAvg


def test_a_poisoned_reply_keeps_its_other_records():
    from flwr.app import Array, ArrayRecord

    reply = make_reply({"w": X["w"], "step": X["step"]}, 1, 0)
    reply.content["scaffold-dc"] = ArrayRecord({"w": Array(np.array([0.5, 0.5], np.float32))})
    new = attacks.with_model(reply, {"w": np.array([9.0, 9.0], np.float32), "step": X["step"]})
    assert numpy_of(new.content["arrays"])["w"].tolist() == [9.0, 9.0]
    assert numpy_of(new.content["scaffold-dc"])["w"].tolist() == [0.5, 0.5]
    assert numpy_of(reply.content["arrays"])["w"].tolist() == [1.0, 1.0]  # the reply given is untouched


def test_label_flip_trains_batched_on_the_default_engine_and_agrees_with_inprocess(tmp_path, caplog):
    """Label flipping's client half gives each client's labels to the batched engine (``ClientHalf.labels``)
    and claims its train-config key: the default engine trains the attackers batched (no ClientApp line), and
    the run agrees with ``engine=inprocess`` (``test_matrix``'s tolerance) and differs from the run without
    the attack."""
    from test_matrix import _assert_agree, _tolerance

    from fedsim.run import run_experiment

    over = [*TINY, "attack=label_flip", "attack.fraction=0.5", "client.optimizer=sgd"]
    cfgs = {}
    for engine in ("inprocess", "auto"):
        caplog.clear()
        cfgs[engine] = compose_cfg(*over, f"engine={engine}")
        with caplog.at_level("INFO", logger="fedsim"):
            assert run_experiment(cfgs[engine], tmp_path / engine)["status"] == "completed"
    assert not [r for r in caplog.records if "through the ClientApp" in r.getMessage()]
    _assert_agree(
        tmp_path / "inprocess", tmp_path / "auto", _tolerance(cfgs["inprocess"], tmp_path / "inprocess")
    )
    run_experiment(compose_cfg(*TINY, "client.optimizer=sgd", "engine=auto"), tmp_path / "honest")
    a, b = torch.load(tmp_path / "auto" / "model.pt"), torch.load(tmp_path / "honest" / "model.pt")
    assert any(not torch.equal(a[k], b[k]) for k in a), "flipping the labels changed nothing"

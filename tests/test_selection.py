"""Client selection (fedsim.selection): seeded candidates, the highest-loss rule, the probe, the config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TINY, compose_cfg, read_metrics, run_tiny, without_wall_time
from strategy_helpers import server_identity

from fedsim import keys
from fedsim.comm import message_bytes
from fedsim.errors import ConfigError
from fedsim.experiment import build_experiment
from fedsim.features.selection import server as selection
from fedsim.strategies.fedavg import FedAvg


def test_candidates_are_distinct_seeded_and_sorted():
    a = selection.draw_candidates(0, 3, 20, 8)
    assert len(a) == 8 == len(set(a)) and a == sorted(a) and all(0 <= k < 20 for k in a)
    assert selection.draw_candidates(0, 3, 20, 8) == a
    assert selection.draw_candidates(0, 4, 20, 8) != a  # another round, other candidates


def test_candidates_by_size_never_draw_an_empty_client():
    sizes = {k: (0 if k % 2 else 10) for k in range(10)}  # odd ids hold no data
    for rnd in range(1, 20):
        assert all(k % 2 == 0 for k in selection.draw_candidates(1, rnd, 10, 5, sizes))


def test_highest_loss_by_hand():
    losses = {0: 0.5, 3: 2.0, 5: 1.0, 7: 2.0, 9: -np.inf, 11: float("nan")}
    assert selection.highest_loss(losses, 2) == [3, 7]
    assert selection.highest_loss(losses, 3) == [3, 5, 7]
    assert selection.highest_loss({4: 1.0, 2: 1.0, 8: 1.0}, 2) == [2, 4]  # ties: lower ids first
    assert selection.highest_loss(losses, 5) == [0, 3, 5, 7, 9]  # unanswered and NaN last


def test_power_of_choice_probes_its_candidates_and_keeps_the_worst():
    pick = selection.PowerOfChoice(FedAvg(), d=6, num_clients=12, clients_per_round=2, seed=0, by_size=False)
    probed = []

    def losses(pids):
        probed.append(list(pids))
        return {p: float(p % 5) for p in pids}  # a known loss per client

    cohort = pick.select_cohort(1, 12, 2, losses)
    candidates = selection.draw_candidates(0, 1, 12, 6)
    assert probed == [candidates]
    assert cohort == selection.highest_loss({p: float(p % 5) for p in candidates}, 2)
    assert set(cohort) <= set(candidates) and len(cohort) == 2


def test_d_equal_to_the_cohort_needs_no_probe():
    pick = selection.PowerOfChoice(FedAvg(), d=3, num_clients=12, clients_per_round=3, seed=0)
    cohort = pick.select_cohort(1, 12, 3, lambda pids: pytest.fail("probed"))
    assert cohort == selection.draw_candidates(0, 1, 12, 3)


def test_default_d_is_twice_the_cohort_capped_at_the_population():
    assert selection.PowerOfChoice(FedAvg(), None, num_clients=20, clients_per_round=4, seed=0).d == 8
    assert selection.PowerOfChoice(FedAvg(), None, num_clients=6, clients_per_round=4, seed=0).d == 6


class _Grid:
    """Answers evaluate messages with a loss of 10 * partition id (node id = 100 + partition id)."""

    def __init__(self, silent=()):
        self.sent, self.silent = [], set(silent)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Message, MetricRecord, RecordDict

        out = []
        for m in messages:
            self.sent.append(m)
            pid = m.metadata.dst_node_id - 100
            if pid in self.silent:
                continue
            reply = Message(
                RecordDict({keys.METRICS: MetricRecord({keys.EVAL_LOSS: 10.0 * pid})}), reply_to=m
            )
            reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
            out.append(reply)
        return out


def test_probe_asks_for_the_training_loss_and_ranks_silent_clients_last():
    from flwr.app import Array, ArrayRecord

    grid, tally = _Grid(silent={2}), {"down": 0, "up": 0}
    with server_identity():
        losses = selection.probe_losses(
            grid,
            {p: 100 + p for p in range(4)},
            [1, 2, 3],
            ArrayRecord({"w": Array(np.zeros(2))}),
            "{}",
            5,
            1.0,
            tally,
        )
    assert losses == {1: 10.0, 2: -np.inf, 3: 30.0}
    assert tally["down"] == message_bytes(grid.sent) > 0 and tally["up"] > 0  # the probes count as traffic
    assert all(m.content[keys.CONFIG][selection.PROBE_TRAIN] for m in grid.sent)
    assert all(m.metadata.message_type == "evaluate" for m in grid.sent)


def test_the_client_probe_evaluates_on_the_training_split():
    from flwr.app import ConfigRecord

    from fedsim.algorithms import halves
    from fedsim.build import client_spec, client_task

    spec = client_spec(compose_cfg(*TINY, "selection=power_of_choice"), "cpu")
    assert "fedsim.features.selection.client.ProbeTrain" in json.loads(spec)["halves"]  # named by the wrapper
    task = client_task(spec, 1)

    def split(config):  # as fedsim's ClientApp picks an evaluation's split: the first half that chooses one
        chosen = [
            h.eval_data(config, task.x_train, task.y_train, task.x_val, task.y_val)
            for h in halves.chain(spec)
        ]
        return next((c for c in chosen if c is not None), (task.x_val, task.y_val))

    x, y = split(ConfigRecord({selection.PROBE_TRAIN: True}))
    assert x is task.x_train and torch.equal(y, task.y_train)
    x, _ = split(ConfigRecord({}))
    assert x is task.x_val


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["selection=power_of_choice", "selection.d=2"], "selection.d"),  # d < clients_per_round = 3
        (["selection=power_of_choice", "selection.d=7"], "selection.d"),  # d > num_clients = 6
        (["selection=power_of_choice", "clipping=fixed"], "selection"),
        (["selection=power_of_choice", "strategy=fedbuff"], "selection"),
    ],
)
def test_bad_selection_config_is_one_config_error(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_experiment(compose_cfg(*TINY, *overrides))
    assert err.value.key == key


@pytest.mark.slow
def test_power_of_choice_runs_with_an_attack(tmp_path):
    summary = run_tiny(tmp_path, "selection=power_of_choice", "attack=sign_flip", "attack.fraction=0.5")
    assert summary["status"] == "completed" and summary["rounds_done"] == 2
    assert summary["selection"] == "power_of_choice(d=6)" and summary["attack"] == "sign_flip"
    for r in read_metrics(tmp_path)[1:]:  # 6 probes with the model and 3 train messages, against 3 replies
        assert r["bytes_down"] > 2.5 * r["bytes_up"]


@pytest.mark.slow
def test_power_of_choice_is_reproducible(tmp_path):
    a = run_tiny(tmp_path / "a", "selection=power_of_choice", "selection.d=5", "num_rounds=3")
    b = run_tiny(tmp_path / "b", "selection=power_of_choice", "selection.d=5", "num_rounds=3")
    assert without_wall_time(read_metrics(tmp_path / "a")) == without_wall_time(read_metrics(tmp_path / "b"))
    assert a["final_eval_accuracy"] == b["final_eval_accuracy"]

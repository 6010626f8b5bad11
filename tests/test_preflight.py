"""Pre-flight checks of a run: memory from the engine's own estimate, and placement=auto's device rule."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import compose_cfg

from fedsim import experiment
from fedsim.engines.vectorized import client_bytes
from fedsim.errors import ConfigError
from fedsim.models import cnn, mlp
from fedsim.training import LocalTraining


def test_memory_check_uses_the_engines_estimate_and_splits_a_cohort_that_does_not_fit(monkeypatch):
    model = cnn((3, 32, 32), 10)
    local = LocalTraining(batch_size=16)
    example = torch.zeros(1, 3, 32, 32)
    per_client = client_bytes(model, example[0], local, 16, 0.0)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert per_client > 10 * model_bytes  # activations included: far more than the model copies
    need = model_bytes * 104
    pages = (need + 20 * per_client) // 4096  # room for about 16 clients per batched step (0.8 of it)
    monkeypatch.setattr(experiment.os, "sysconf", lambda name: pages if name == "SC_AVPHYS_PAGES" else 4096)
    fit = experiment.check_memory(model, 100, 0, "cpu", batched=(local, example, 0.0))
    assert 10 <= fit < 100
    assert experiment.check_memory(model, 100, 0, "cpu") == 100  # per client: replies only
    monkeypatch.setattr(experiment.os, "sysconf", lambda name: 1 if name == "SC_AVPHYS_PAGES" else 4096)
    with pytest.raises(ConfigError, match="clients_per_round"):
        experiment.check_memory(model, 100, 0, "cpu", batched=(local, example, 0.0))


def test_a_cohort_that_cannot_fit_is_split_before_the_first_round(monkeypatch, caplog):
    monkeypatch.setattr(experiment, "check_memory", lambda *a, **k: 2)
    with caplog.at_level(logging.INFO, logger="fedsim"):
        exp = experiment.build_experiment(compose_cfg("num_clients=6", "clients_per_round=4"))
    assert exp.engine.max_cohort == 2
    assert "2 clients per batched step" in caplog.text


def test_auto_placement_rule(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from fedsim.groups import Placement

    auto = Placement(device="auto", server_device="auto")

    class Data:
        def __init__(self, n, shape):
            self.x_train = torch.zeros(n, *shape).numpy()

    local = LocalTraining(batch_size=16, local_epochs=2)
    with caplog.at_level(logging.INFO, logger="fedsim"):
        small = experiment.auto_placement(auto, mlp((8, 8), 10), Data(1437, (8, 8)), local, 10, 20)
    assert (small.device, small.server_device) == ("cpu", "cpu")  # the default experiment: the CPU
    assert "placement=auto: cpu" in caplog.text
    big = experiment.auto_placement(auto, cnn((3, 32, 32), 10), Data(50000, (3, 32, 32)), local, 100, 1000)
    assert (big.device, big.server_device) == ("cuda", "cuda")
    fixed = experiment.auto_placement(
        Placement(device="auto", server_device="cpu"), mlp((8, 8), 10), Data(1437, (8, 8)), local, 10, 20
    )
    assert fixed.server_device == "cpu"

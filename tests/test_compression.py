"""Compression of client updates (fedsim.compression): top-k with error feedback, QSGD, bytes_up, the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from helpers import compose_cfg, read_metrics, run_tiny

from fedsim.errors import ConfigError
from fedsim.experiment import build_experiment
from fedsim.features.compression import server as compression


def test_topk_keeps_the_largest_magnitudes_by_hand():
    idx, val = compression.topk(np.array([0.1, -3.0, 2.0, 0.5]), 2)
    assert idx.tolist() == [1, 2] and val.tolist() == [-3.0, 2.0]
    np.testing.assert_array_equal(compression.topk_decode(idx, val, 4), [0.0, -3.0, 2.0, 0.0])


def _encode(after: list[float], state: dict, ratio: float = 0.5):
    model = {"w": torch.tensor(after, dtype=torch.float32), "n": torch.tensor(7)}
    start = ArrayRecord({"w": Array(np.zeros(len(after), np.float32)), "n": Array(np.array(7))})
    config = {compression.KIND: "topk", compression.RATIO: ratio}
    return compression.encode_reply(model, start, config, state, seed=0, index=1, partition_id=0)


def test_error_feedback_carries_the_unsent_part_to_the_next_round():
    sent, kept = _encode([4.0, -1.0, 0.5, 2.0], {})  # k = 2: sends 4 and 2, keeps (0, -1, 0.5, 0)
    assert sent["topk/idx"].tolist() == [0, 3] and sent["topk/val"].tolist() == [4.0, 2.0]
    assert int(sent["raw/n"]) == 7  # non-float arrays travel as they are
    np.testing.assert_allclose(kept[compression.RESIDUAL], [0.0, -1.0, 0.5, 0.0])
    # next round's update (0.1, 0.1, 0.1, 0.1) plus the residual: -0.9 and 0.6 are now the largest
    sent, kept = _encode([0.1, 0.1, 0.1, 0.1], kept)
    assert sent["topk/idx"].tolist() == [1, 2]
    np.testing.assert_allclose(sent["topk/val"], [-0.9, 0.6], rtol=1e-6)
    np.testing.assert_allclose(kept[compression.RESIDUAL], [0.1, 0.0, 0.0, 0.1], atol=1e-7)


def test_qsgd_is_unbiased_and_bounded():
    v = np.array([0.3, -1.2, 0.0, 2.5, -0.05])
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(4000):
        norm, levels = compression.qsgd(v, 4, rng)
        assert np.all(np.abs(levels) <= 4) and levels[2] == 0
        draws.append(compression.qsgd_decode(norm, levels, 4))
    draws = np.array(draws)
    np.testing.assert_allclose(draws.mean(0), v, atol=4 * draws.std(0).max() / np.sqrt(len(draws)) + 1e-9)
    norm, levels = compression.qsgd(v, 1, np.random.default_rng(1))  # s = 1: each entry 0 or +-|v|
    assert set(np.unique(levels)) <= {-1, 0, 1} and norm == pytest.approx(np.linalg.norm(v))


@pytest.mark.slow
def test_topk_cuts_bytes_up_by_the_expected_amount(tmp_path):
    run_tiny(tmp_path / "none", "model=logreg", "num_rounds=1")
    run_tiny(tmp_path / "topk", "model=logreg", "num_rounds=1", "compression=topk", "compression.ratio=0.1")
    d, k = 64 * 10 + 10, 65  # digits' logistic regression: 650 weights, ceil(0.1 * 650) entries sent
    for full, sparse in zip(read_metrics(tmp_path / "none")[1:], read_metrics(tmp_path / "topk")[1:]):
        m = full["num_clients"]
        saved = full["bytes_up"] - sparse["bytes_up"]
        assert abs(saved - m * (4 * d - 8 * k)) <= m * 100  # 4 bytes a weight against 8 a sent entry


@pytest.mark.slow
def test_topk_with_every_entry_is_no_compression(tmp_path):
    run_tiny(tmp_path / "none", "num_rounds=3")
    run_tiny(tmp_path / "all", "num_rounds=3", "compression=topk", "compression.ratio=1.0")
    for a, b in zip(read_metrics(tmp_path / "none"), read_metrics(tmp_path / "all")):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_the_residual_survives_a_resume(tmp_path):
    args = ("compression=topk", "compression.ratio=0.05", "checkpoint_every=2")
    straight = run_tiny(tmp_path / "straight", *args, "num_rounds=4")
    run_tiny(tmp_path / "half", *args, "num_rounds=2")
    resumed = run_tiny(tmp_path / "resumed", *args, "num_rounds=4", f"resume={tmp_path / 'half'}")
    assert resumed["final_eval_accuracy"] == straight["final_eval_accuracy"]
    assert (
        read_metrics(tmp_path / "resumed")[-1]["eval_loss"]
        == read_metrics(tmp_path / "straight")[-1]["eval_loss"]
    )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["compression=topk", "compression.ratio=0"], "compression.ratio"),
        (["compression=topk", "compression.ratio=1.5"], "compression.ratio"),
        (["compression=qsgd", "compression.levels=0"], "compression.levels"),
        (["compression=qsgd", "strategy=fedbuff"], "compression"),
    ],
)
@pytest.mark.slow
def test_bad_compression_config_is_one_config_error(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_experiment(compose_cfg("num_clients=6", "clients_per_round=3", *overrides))
    assert err.value.key == key


@pytest.mark.slow
def test_compression_leaves_a_client_algorithms_extra_records_alone(tmp_path):
    run_tiny(tmp_path / "plain", "strategy=scaffold")
    run_tiny(tmp_path / "topk", "strategy=scaffold", "compression=topk", "compression.ratio=1.0")
    for a, b in zip(read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "topk")):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6, abs=1e-7)

"""Checkpoints: a run stopped after round k and resumed ends exactly like an uninterrupted one."""

import json

import pytest
import torch
from conftest import read_metrics, run_tiny, without_wall_time


def _same_models(a, b):
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam"])
def test_resume_is_bit_identical(tmp_path, strategy):
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    over = [f"strategy={strategy}", "checkpoint_every=2"]
    run_tiny(full, *over, "num_rounds=4")
    run_tiny(part, *over, "num_rounds=2")
    assert (part / "checkpoint.pt").exists()
    summary = run_tiny(resumed, *over, "num_rounds=4", f"resume={part / 'checkpoint.pt'}")
    assert summary["rounds_done"] == 4
    assert without_wall_time(read_metrics(resumed)) == without_wall_time(read_metrics(full))
    assert _same_models(resumed, full)


def test_resume_with_adaptive_clipping_and_accountant_is_bit_identical(tmp_path):
    # the clip norm, the noise stream and the privacy accountant all continue where they stopped
    over = ["clipping=adaptive", "clipping.noise_multiplier=0.5", "num_rounds=4", "checkpoint_every=2"]
    run_tiny(tmp_path / "full", *over)
    run_tiny(tmp_path / "part", *over[:-2], "num_rounds=2", "checkpoint_every=2")
    run_tiny(tmp_path / "resumed", *over, f"resume={tmp_path / 'part'}")
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert without_wall_time(resumed) == without_wall_time(full)
    eps = [r["epsilon"] for r in full[1:]]
    assert eps == sorted(eps) and eps[0] > 0  # the accountant kept counting across the restart
    assert len({r["clip_norm"] for r in full[1:]}) > 1  # the adaptive norm moved
    assert _same_models(tmp_path / "resumed", tmp_path / "full")


def test_ctrl_c_leaves_checkpoint_and_outputs(tmp_path, monkeypatch):
    import fedsim.server as server

    original = server.screen_replies
    calls = {"n": 0}

    def interrupt_in_round_3(replies, reference):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(replies, reference)

    monkeypatch.setattr(server, "screen_replies", interrupt_in_round_3)
    summary = run_tiny(tmp_path / "run", "num_rounds=5", "checkpoint_every=0")
    assert summary["status"] == "interrupted" and summary["rounds_done"] == 2
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["status"] == "interrupted"
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2 and len(ckpt["records"]) == 3
    assert (tmp_path / "run" / "model.pt").exists() and (tmp_path / "run" / "curves.png").exists()
    monkeypatch.setattr(server, "screen_replies", original)
    resumed = run_tiny(tmp_path / "resumed", "num_rounds=5", f"resume={tmp_path / 'run'}")
    assert resumed["rounds_done"] == 5 and resumed["status"] == "completed"
    assert [r["round"] for r in read_metrics(tmp_path / "resumed")] == [0, 1, 2, 3, 4, 5]


def test_resume_from_missing_file_is_a_config_error(tmp_path):
    from fedsim.errors import ConfigError

    with pytest.raises(ConfigError, match="resume"):
        run_tiny(tmp_path, f"resume={tmp_path / 'nope.pt'}")

"""Checkpoints: a run stopped after round k and resumed ends exactly like an uninterrupted one."""

import hashlib
import json

import numpy as np
import pytest
import torch
from helpers import TINY, compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim import checkpoint
from fedsim.errors import ConfigError


def _same_models(a, b):
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_with_adaptive_clipping_and_accountant_is_bit_identical(tmp_path):
    # the clip norm, the noise stream and the privacy accountant all continue where they stopped; the full run
    # draws the same noise and Poisson cohorts (every round non-empty) because its noise seed is set
    # (test_privacy.py: a drawn noise seed is checkpointed too)
    over = [
        "clipping=adaptive",
        "clipping.noise_multiplier=0.5",
        "clipping.noise_seed=1",
        "clipping.debug_noise_seed=true",
    ]
    over += ["num_rounds=4", "checkpoint_every=2"]
    run_tiny(tmp_path / "full", *over)
    run_tiny(tmp_path / "part", *over[:-2], "num_rounds=2", "checkpoint_every=2")
    run_tiny(tmp_path / "resumed", *over, f"resume={tmp_path / 'part'}")
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert without_wall_time(resumed) == without_wall_time(full)
    eps = [r["epsilon"] for r in full[1:]]
    assert eps == sorted(eps) and eps[0] > 0  # the accountant kept counting across the restart
    assert len({r["clip_norm"] for r in full[1:]}) > 1  # the adaptive norm moved
    assert _same_models(tmp_path / "resumed", tmp_path / "full")


@pytest.mark.pictures  # looks at the run's pictures
@pytest.mark.slow
def test_ctrl_c_leaves_checkpoint_and_outputs(tmp_path, monkeypatch):
    import fedsim.server as server

    original = server._train_replies  # a round's replies, as Messages or stacked
    calls = {"n": 0}

    def interrupt_in_round_3(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(server, "_train_replies", interrupt_in_round_3)
    summary = run_tiny(tmp_path / "run", "num_rounds=5", "checkpoint_every=0")
    assert summary["status"] == "interrupted" and summary["rounds_done"] == 2
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["status"] == "interrupted"
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2 and ckpt["history"]["count"] == 3 and "records" not in ckpt
    assert (tmp_path / "run" / "model.pt").exists() and (tmp_path / "run" / "curves.png").exists()
    monkeypatch.setattr(server, "_train_replies", original)
    resumed = run_tiny(tmp_path / "resumed", "num_rounds=5", f"resume={tmp_path / 'run'}")
    assert resumed["rounds_done"] == 5 and resumed["status"] == "completed"
    assert [r["round"] for r in read_metrics(tmp_path / "resumed")] == [0, 1, 2, 3, 4, 5]


def test_resume_from_missing_file_is_a_config_error(tmp_path):
    from fedsim.errors import ConfigError

    with pytest.raises(ConfigError, match="resume"):
        run_tiny(tmp_path, f"resume={tmp_path / 'nope.pt'}")


def _interrupt_at(monkeypatch, owner, name: str, call: int) -> None:
    """Make the ``call``-th call of ``owner.name`` raise KeyboardInterrupt (what Ctrl-C raises there)."""
    original = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def _evaluator_interrupted_at(monkeypatch, call: int) -> None:
    import fedsim.experiment as run

    make = run.make_evaluator

    def make_interrupting(*args, **kwargs):
        fn = make(*args, **kwargs)
        calls = {"n": 0}

        def evaluate_fn(arrays):
            calls["n"] += 1
            if calls["n"] == call:
                raise KeyboardInterrupt
            return fn(arrays)

        return evaluate_fn

    monkeypatch.setattr(run, "make_evaluator", make_interrupting)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["federated_eval", "server_eval", "round_1"])
def test_ctrl_c_anywhere_in_a_round_resumes_bit_identical(tmp_path, monkeypatch, where):
    """Ctrl-C after a round's aggregation (during its evaluations) or in round 1: the checkpoint is the end of
    the last completed round, and the resumed run equals an uninterrupted one (no round trained twice, no
    second round 0)."""
    import fedsim.server as server

    over = ["strategy=fedadam", "federated_eval=true", "num_rounds=4", "checkpoint_every=0"]
    run_tiny(tmp_path / "full", *over)
    with monkeypatch.context() as m:
        if where == "federated_eval":
            _interrupt_at(m, server, "_federated_eval", 3)  # round 3, after its aggregation
        elif where == "server_eval":
            _evaluator_interrupted_at(m, 4)  # round 0, 1, 2 evaluated; round 3's evaluation interrupted
        else:
            _interrupt_at(m, server, "_train_replies", 1)
        summary = run_tiny(tmp_path / "part", *over)
    done = 0 if where == "round_1" else 2
    assert summary["status"] == "interrupted"
    ckpt = checkpoint.load(tmp_path / "part")  # its records: the first lines of metrics.jsonl, checked
    assert ckpt["round"] == done and [r["round"] for r in ckpt["records"]] == list(range(done + 1))
    run_tiny(tmp_path / "resumed", *over, f"resume={tmp_path / 'part'}")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    assert _same_models(tmp_path / "resumed", tmp_path / "full")


@pytest.mark.slow
def test_ctrl_c_in_an_async_run_resumes_bit_identical(tmp_path, monkeypatch):
    """FedBuff interrupted while clients train (tasks in flight, updates buffered): nothing is lost or repeated."""
    from fedsim.async_server import AsyncLoop

    over = [
        "strategy=fedbuff",
        "strategy.buffer_size=2",
        "heterogeneity=lognormal",
        "num_rounds=6",
        "checkpoint_every=0",
    ]
    run_tiny(tmp_path / "full", *over)
    with monkeypatch.context() as m:
        _interrupt_at(m, AsyncLoop, "wait_for", 7)
        assert run_tiny(tmp_path / "part", *over)["status"] == "interrupted"
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)
    assert 1 <= ckpt["round"] < 6 and ckpt["extra"]["async"]["inflight"]
    run_tiny(tmp_path / "resumed", *over, f"resume={tmp_path / 'part'}")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    assert _same_models(tmp_path / "resumed", tmp_path / "full")


@pytest.mark.slow
def test_resume_does_not_inherit_the_stop_or_a_target_reached_for_another_target(tmp_path):
    first = run_tiny(
        tmp_path / "a", "num_rounds=6", "target_accuracy=0.3", "stop_at_target=true", "checkpoint_every=1"
    )
    assert first["status"] == "stopped" and first["target_round"] is not None and first["rounds_done"] < 6
    resumed = run_tiny(tmp_path / "b", "num_rounds=6", "checkpoint_every=1", f"resume={tmp_path / 'a'}")
    assert resumed["status"] == "completed" and resumed["rounds_done"] == 6
    assert resumed["target_accuracy"] is None and resumed["target_round"] is None
    again = run_tiny(tmp_path / "c", "num_rounds=7", "target_accuracy=0.99", f"resume={tmp_path / 'b'}")
    assert again["target_round"] is None  # 0.3 was reached, 0.99 was not


@pytest.mark.slow
def test_resume_with_another_experiment_is_a_config_error(tmp_path):
    from fedsim.errors import ConfigError

    run_tiny(tmp_path / "a", "num_rounds=2", "strategy=fedbuff", "checkpoint_every=1")
    with pytest.raises(
        ConfigError,
        match=r"^resume=.*strategy\._target_ \(checkpoint: 'fedsim\.strategies\.fedbuff\.FedBuff'",
    ):
        run_tiny(tmp_path / "b", "num_rounds=4", f"resume={tmp_path / 'a'}")
    with pytest.raises(ConfigError, match=r"client\.lr \(checkpoint: 0\.1, now: 0\.3\)"):
        run_tiny(
            tmp_path / "c", "num_rounds=4", "strategy=fedbuff", "client.lr=0.3", f"resume={tmp_path / 'a'}"
        )
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    # how long, where and how loudly it runs may change
    ok = run_tiny(
        tmp_path / "d",
        "num_rounds=3",
        "strategy=fedbuff",
        "engine=vectorized",
        "eval_every=2",
        f"resume={tmp_path / 'a'}",
    )
    assert ok["rounds_done"] == 3


@pytest.mark.slow
def test_a_stopped_run_evaluates_and_checkpoints_its_final_model(tmp_path):
    """An epsilon budget stops the run between evaluations: the last round is evaluated and checkpointed anyway."""
    s = run_tiny(
        tmp_path,
        "num_rounds=30",
        "eval_every=4",
        "checkpoint_every=4",
        "clipping=fixed",
        "clipping.noise_multiplier=1.0",
        "clipping.max_epsilon=10",
    )
    recs = read_metrics(tmp_path)
    assert s["status"] == "stopped" and s["rounds_done"] % 4 != 0  # not a round eval_every would evaluate
    assert recs[-1]["eval_accuracy"] is not None and s["final_eval_accuracy"] == recs[-1]["eval_accuracy"]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["round"] == s["rounds_done"]


def test_a_checkpoint_older_than_new_groups_resumes_and_a_real_change_is_named_first():
    """Keys added to fedsim after a checkpoint was written (task, attack, selection, compression at their
    neutral options; logger, callbacks, progress, optimize_metric) do not block its resume."""
    from omegaconf import OmegaConf

    from fedsim.checkpoint import check_config

    now = OmegaConf.to_container(compose_cfg(), resolve=True)
    old = {k: v for k, v in now.items() if k not in NEW_KEYS}
    check_config({"config": old}, now, "old")  # no error
    changed = OmegaConf.to_container(compose_cfg("dataset=synthetic", "num_clients=30"), resolve=True)
    with pytest.raises(ConfigError) as e:
        check_config({"config": old}, changed, "old")
    assert str(e.value).split("these keys differ: ")[1].startswith("dataset.")
    attacked = OmegaConf.to_container(compose_cfg("attack=sign_flip"), resolve=True)
    with pytest.raises(ConfigError, match="attack"):  # an attack the old run did not have is a change
        check_config({"config": old}, attacked, "old")


NEW_KEYS = (
    "task",
    "attack",
    "selection",
    "compression",
    "logger",
    "callbacks",
    "progress",
    "optimize_metric",
    "target_r2",
)


# ----------------------------------------------- checkpoint.pt and the clients' state are one unit (issue 28)
def _client_files(root, names):
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        np.savez(root / name, c=np.full(2, float(name.split("-")[1].split(".")[0])))


def test_the_old_snapshot_stays_until_the_new_checkpoint_is_in_place(tmp_path):
    from fedsim.algorithms import state as cs

    run = tmp_path / "run"
    _client_files(run / cs.STATE_DIR, ["0-1.npz", "1-1.npz"])
    first = cs.checkpoint(run, 1)
    snap = run / cs.CHECKPOINT_DIR / "round-1"
    digests = {f: hashlib.sha256((snap / f).read_bytes()).hexdigest() for f in ["0-1.npz", "1-1.npz"]}
    assert first == {"round": 1, "files": ["0-1.npz", "1-1.npz"], "sha256": digests}
    cs.prune(run, 1)
    _client_files(run / cs.STATE_DIR, ["0-4.npz", "1-4.npz"])
    cs.checkpoint(run, 4)  # killed here: checkpoint.pt of round 4 was never written
    assert sorted(p.name for p in (run / cs.CHECKPOINT_DIR).iterdir()) == ["round-1", "round-4"]
    cs.resume(run, 1, tmp_path / "resumed", first)  # the round-1 checkpoint still finds its own snapshot
    assert sorted(p.name for p in (tmp_path / "resumed" / cs.STATE_DIR).iterdir()) == ["0-1.npz", "1-1.npz"]
    cs.prune(run, 4)  # once round 4's checkpoint.pt is in place
    assert [p.name for p in (run / cs.CHECKPOINT_DIR).iterdir()] == ["round-4"]


def test_a_missing_or_mismatched_client_snapshot_is_refused(tmp_path):
    from fedsim.algorithms import state as cs

    run = tmp_path / "run"
    _client_files(run / cs.STATE_DIR, ["0-2.npz", "1-2.npz"])
    rec = cs.checkpoint(run, 2)
    (run / cs.CHECKPOINT_DIR / "round-2" / "1-2.npz").unlink()
    with pytest.raises(
        cs.MissingState, match=r"round 2 .* does not match the checkpoint \(missing 1-2\.npz\)"
    ):
        cs.resume(run, 2, tmp_path / "b", rec)
    with pytest.raises(cs.MissingState, match="round 3 .* is missing"):
        cs.resume(run, 3, tmp_path / "b", {"round": 3, "files": ["0-3.npz"]})
    with pytest.raises(cs.MissingState, match="is missing"):  # an older checkpoint, stateful clients
        cs.resume(tmp_path / "elsewhere", 2, tmp_path / "b", None, recorded=False, stateful=True)
    assert not (tmp_path / "b" / cs.STATE_DIR).exists()  # nothing started from zero
    cs.resume(tmp_path / "elsewhere", 2, tmp_path / "b", None, recorded=False, stateful=False)  # stateless


_KILL_IN_THE_WINDOW = """
import os, signal, sys, torch
from fedsim.config import compose
from fedsim.run import run_experiment

real, n = torch.save, [0]


def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and "format" in obj:
        n[0] += 1
        if n[0] == int(sys.argv[2]):  # the snapshot of this round is written, checkpoint.pt half-written
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *args, **kwargs)


torch.save = save
run_experiment(compose(*sys.argv[3:]), sys.argv[1])
"""


@pytest.mark.slow
def test_a_kill_inside_the_checkpoint_window_resumes_every_clients_state(tmp_path):
    """SCAFFOLD (stateful clients), SIGKILL while checkpoint.pt of round 4 is written, its clients' snapshot
    already there: checkpoint.pt stays at round 2 with its own snapshot, the resume removes the half-written
    temporary and ends bit-identical to an uninterrupted run; a checkpoint.pt without its snapshot is refused."""
    import subprocess
    import sys

    from fedsim.algorithms import state as cs

    over = ["strategy=scaffold", "num_rounds=6", "checkpoint_every=2"]
    run_tiny(tmp_path / "full", *over)
    args = [str(tmp_path / "part"), "2", *TINY, *over]
    res = subprocess.run([sys.executable, "-c", _KILL_IN_THE_WINDOW, *args], capture_output=True, text=True)
    assert res.returncode == -9, res.stderr[-2000:]
    part = tmp_path / "part"
    assert torch.load(part / "checkpoint.pt", weights_only=False)["round"] == 2
    assert (part / cs.CHECKPOINT_DIR / "round-2").is_dir() and (part / cs.CHECKPOINT_DIR / "round-4").is_dir()
    assert [p.name for p in part.glob(".checkpoint.pt.*.tmp")]  # what the kill left
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "checkpoint.pt").write_bytes((part / "checkpoint.pt").read_bytes())
    (lonely / "metrics.jsonl").write_bytes(
        (part / "metrics.jsonl").read_bytes()
    )  # its records, not its state
    with pytest.raises(ConfigError, match=r"^resume=.*clients' state of round 2 .* is missing") as e:
        run_tiny(tmp_path / "refused", *over, f"resume={lonely / 'checkpoint.pt'}")
    assert "\n" not in str(e.value)
    run_tiny(part, *over, f"resume={part}")  # in place
    assert not list(part.glob(".checkpoint.pt.*.tmp"))
    assert [p.name for p in (part / cs.CHECKPOINT_DIR).iterdir()] == ["round-6"]
    assert without_wall_time(read_metrics(part)) == without_wall_time(read_metrics(tmp_path / "full"))
    assert _same_models(part, tmp_path / "full")


def test_strategy_attributes_a_resume_may_change_come_from_the_config():
    """The strategy keys a resumed run may change (FREE_KEYS) are the attributes a checkpoint never restores."""
    from fedsim.checkpoint import FREE_KEYS
    from fedsim.strategies import base

    assert {k.split(".", 1)[1] for k in FREE_KEYS if k.startswith("strategy.")} == base.CONFIG_ONLY

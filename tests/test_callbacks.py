"""Per-round callbacks and live trackers, each read back with the tracker's own reader."""

import json
import os
import sys
import time

import pytest
from helpers import TINY, compose_cfg, fedsim_cli, read_metrics, run_tiny

from fedsim.callbacks import Callback, scalars
from fedsim.config import FLOWER_ENV
from fedsim.errors import ConfigError


class Collect(Callback):
    """A user's own callback: keeps what it is given."""

    seen: list = []

    def __init__(self, tag: str = "x") -> None:
        self.tag = tag
        Collect.seen = []

    def on_run_start(self, out_dir, config, records):
        Collect.seen.append(("start", config["num_rounds"], len(records)))

    def on_round(self, record):
        Collect.seen.append(("round", record["round"]))

    def on_run_end(self, summary):
        Collect.seen.append(("end", summary["status"]))


class Broken(Callback):
    def on_round(self, record):
        raise RuntimeError("tracker down")


@pytest.mark.slow
def test_a_users_callback_sees_the_start_every_record_and_the_end(tmp_path):
    summary = run_tiny(tmp_path, "callbacks=[{_target_: test_callbacks.Collect, tag: mine}]")
    rounds = [r["round"] for r in read_metrics(tmp_path)]
    assert Collect.seen == [("start", 2, 0), *[("round", r) for r in rounds], ("end", summary["status"])]


@pytest.mark.slow
def test_a_failing_callback_is_warned_about_once_and_the_run_goes_on(tmp_path, caplog):
    summary = run_tiny(tmp_path, "callbacks=[{_target_: test_callbacks.Broken}]")
    assert summary["status"] == "completed" and summary["rounds_done"] == 2
    warnings = [r for r in caplog.records if "callback Broken failed" in r.getMessage()]
    assert len(warnings) == 1 and "tracker down" in warnings[0].getMessage()
    written = json.loads((tmp_path / "summary.json").read_text())  # kept for the command's exit status
    assert written["callback_errors"] == ["Broken.on_round: RuntimeError: tracker down"]


@pytest.mark.slow
def test_callbacks_and_loggers_that_cannot_be_built_are_one_line(monkeypatch):
    from fedsim.experiment import build_experiment

    for over, key in [
        (["callbacks=[{tag: 1}]"], "callbacks[0]"),
        (["callbacks=3"], "callbacks"),
        (["callbacks=[{_target_: no.such.Thing}]"], "callbacks[0]._target_"),
    ]:
        with pytest.raises(ConfigError) as e:
            build_experiment(compose_cfg(*TINY, *over))
        assert e.value.key == key and "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    with pytest.raises(ConfigError) as e:
        build_experiment(compose_cfg(*TINY, "logger=wandb"))
    assert e.value.key == "logger" and 'pip install -e ".[wandb]"' in str(e.value)


def test_scalars_flatten_nested_fields_and_keep_booleans_as_numbers():
    record = {"round": 3, "skipped": True, "failure_kinds": {"error": 2}, "note": "x", "epsilon": None}
    assert scalars(record) == {"round": 3.0, "skipped": 1.0, "failure_kinds/error": 2.0}


# ------------------------------------------------------------------------------------------- the trackers
@pytest.mark.slow
def test_tensorboard_event_files_hold_every_metrics_field_and_the_hyperparameters(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_tiny(tmp_path, "logger=tensorboard", "federated_eval=true", "num_rounds=3")
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    recs = read_metrics(tmp_path)
    fields = {k for r in recs for k, v in scalars(r).items()} - {"round"}
    assert fields <= set(ea.Tags()["scalars"]), fields - set(ea.Tags()["scalars"])
    for field in ("eval_accuracy", "train_loss", "fed_eval_accuracy"):
        logged = {e.step: e.value for e in ea.Scalars(field)}
        expected = {r["round"]: r[field] for r in recs if r.get(field) is not None}
        assert logged == pytest.approx(expected, rel=1e-6)
    assert "_hparams_/session_start_info" in ea.PluginTagToContent("hparams")


@pytest.mark.slow
def test_mlflow_store_holds_the_params_every_round_and_the_final_metrics(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    summary = run_tiny(tmp_path, "logger=mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.data.params["num_rounds"] == "2" and run.data.params["strategy._target_"].endswith("FedAvg")
    history = client.get_metric_history(run.info.run_id, "eval_accuracy")
    assert {m.step: m.value for m in history} == pytest.approx(
        {r["round"]: r["eval_accuracy"] for r in read_metrics(tmp_path)}
    )
    assert run.data.metrics["final.final_eval_accuracy"] == pytest.approx(summary["final_eval_accuracy"])


@pytest.mark.slow
def test_wandb_offline_run_is_written_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = run_tiny(tmp_path, "logger=wandb")
    (store,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's own record file: the logged keys and values are in it as JSON text. wandb's service process writes
    # it, and a second wandb run in a process (another test's) can return from finish() before the service has
    # (seen once on a loaded machine: the file still held only its 7-byte header)
    final = json.dumps(summary["final_eval_accuracy"]).encode()
    end = time.monotonic() + 60
    while final not in (data := store.read_bytes()) and time.monotonic() < end:
        time.sleep(0.2)
    assert b"eval_accuracy" in data and b"train_loss" in data
    assert final in data


# ---------------------------------------------------------------------------------------------- progress
@pytest.mark.slow
def test_a_progress_bar_with_eta_on_request_and_one_line_per_round_in_logs(tmp_path, capsys):
    from fedsim.run import run_experiment

    over = [*TINY, "num_rounds=3", "quiet=false"]
    run_experiment(compose_cfg(*over, "progress=bar"), tmp_path / "bar")
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "3/3 [" in err and "<" in err and "round/s" in err  # done/total [elapsed<remaining, rate]
    assert "[round 1/3]" not in err
    run_experiment(compose_cfg(*over, "progress=auto"), tmp_path / "auto")  # stderr is no terminal here
    err = capsys.readouterr().err
    assert [ln.split("]")[0] for ln in err.splitlines() if ln.startswith("[round")] == [
        f"[round {r}/3" for r in range(4)
    ]
    with pytest.raises(ConfigError, match="progress='barz'"):
        run_experiment(compose_cfg(*over, "progress=barz"), tmp_path / "bad")


@pytest.mark.slow
def test_a_sweep_shows_a_bar_over_its_runs_above_each_runs_bar(tmp_path):
    res = fedsim_cli(
        "-m", "seed=0,1", "progress=bar", "quiet=false", "hydra.sweep.dir=sweep", *TINY[:3], cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    err = res.stderr.replace("\r", "\n")
    assert "sweep: 100%" in err and "2/2 [" in err  # the sweep's bar: runs done, elapsed<remaining
    assert "round/s" in err or "s/round" in err  # and each run's own bar


def test_without_tqdm_the_bar_becomes_one_line_per_round(tmp_path, capsys, monkeypatch, caplog):
    from fedsim.recorder import Recorder

    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if it could not be imported
    rec = Recorder(tmp_path, num_rounds=2, progress="bar")
    assert rec.bar is None and "no progress bar (tqdm cannot be imported)" in caplog.text
    rec.log({"round": 1, "eval_accuracy": 0.5, "eval_loss": 1.0, "num_clients": 3})
    assert "[round 1/2]  acc 0.5000" in capsys.readouterr().err


@pytest.mark.slow
def test_on_a_terminal_the_command_draws_its_bar_says_where_outputs_are_and_cli_log_keeps_the_lines(tmp_path):
    """The README's first command as a user types it: a pseudo-terminal (util-linux `script`, which gives it no
    window size, the case where tqdm drew nothing)."""
    import shutil
    import subprocess

    if shutil.which("script") is None:
        pytest.skip("needs util-linux script for a pseudo-terminal")
    cmd = f"{sys.executable} -m fedsim num_clients=6 clients_per_round=3 num_rounds=3 hydra.run.dir=run"
    env = {**os.environ, **FLOWER_ENV}
    res = subprocess.run(
        ["script", "-qec", cmd, "/dev/null"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    screen = res.stdout.replace("\r", "\n")
    assert res.returncode == 0, screen[-3000:]
    assert "3/3 [" in screen and "round/s" in screen and "[round 1/3]" not in screen  # the bar, not lines
    last = [ln for ln in screen.splitlines() if ln.strip()][-1]
    assert last.startswith("fedsim: completed after 3 rounds, accuracy ") and "outputs in run/ (" in last
    log = (tmp_path / "run" / "cli.log").read_text()
    assert [ln.split("]  ")[0].split("- ")[-1] for ln in log.splitlines() if "[round" in ln] == [
        f"[round {r}/3" for r in range(4)
    ]
    assert "outputs in run/" in log.splitlines()[-1]

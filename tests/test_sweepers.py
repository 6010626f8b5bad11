"""Hydra's sweepers: a job returns a float objective, so ``hydra/sweeper=optuna`` searches over fedsim's keys."""

import csv
import json
from pathlib import Path

import pytest
import yaml
from helpers import TINY, compose_cfg, fedsim_cli

from fedsim.cli import objective
from fedsim.errors import ConfigError


def test_the_objective_is_the_tasks_final_metric_unless_optimize_metric_names_another():
    summary = {
        "status": "completed",
        "final_eval_accuracy": 0.8,
        "final_eval_loss": 0.5,
        "final_eval_r2": 0.3,
    }
    assert objective(summary, compose_cfg()) == 0.8
    assert objective(summary, compose_cfg("optimize_metric=final_eval_loss")) == 0.5
    assert objective(summary, compose_cfg("task=regression", "dataset=diabetes")) == 0.3
    assert objective({**summary, "status": "failed"}, compose_cfg()) is None  # a failed trial, not a value
    assert (
        objective({"status": "completed", "target_round": None}, compose_cfg("optimize_metric=target_round"))
        is None
    )


def test_an_objective_that_is_not_a_summary_number_is_one_line():
    from fedsim.experiment import build_experiment

    with pytest.raises(ConfigError) as e:
        build_experiment(compose_cfg(*TINY, "optimize_metric=final_accuracy"))
    assert (
        e.value.key == "optimize_metric"
        and "final_eval_accuracy" in str(e.value)
        and "\n" not in str(e.value)
    )


@pytest.mark.slow
def test_optuna_searches_the_learning_rate_and_reports_the_best_run(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    res = fedsim_cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler.seed=0",
        "client.lr=interval(0.01,0.5)",
        "hydra.sweep.dir=sweep",
        *TINY,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    accs = [
        json.loads((tmp_path / "sweep" / str(j) / "summary.json").read_text())["final_eval_accuracy"]
        for j in range(3)
    ]
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(accs)  # what Optuna saw is what each job's summary says
    rows = (tmp_path / "sweep" / "sweep_summary.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("job,client.lr,overrides,status,final_eval_accuracy")
    lrs = [float(r.split(",")[1]) for r in rows[1:]]  # the swept key's column holds each trial's value
    assert all(0.01 <= lr <= 0.5 for lr in lrs) and len(set(lrs)) == 3
    assert "will minimize" not in res.stderr  # direction=maximize: no warning


@pytest.mark.slow
def test_a_submitit_sweep_is_summarised_like_any_other(tmp_path):
    """hydra/launcher=submitit_local (Slurm's launcher, run locally) runs each job in its own process."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    res = fedsim_cli(
        "-m", "hydra/launcher=submitit_local", "seed=0,1", "hydra.sweep.dir=sweep", *TINY, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = (tmp_path / "sweep" / "sweep_summary.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",completed," in r for r in rows[1:])


@pytest.mark.slow
def test_the_robustness_bundle_carries_its_strategy_by_attack_grid():
    from pathlib import Path

    bundle = yaml.safe_load(
        (Path(__file__).parents[1] / "conf" / "experiment" / "robustness.yaml").read_text()
    )
    params = bundle["hydra"]["sweeper"]["params"]
    grid = [(s, a) for s in params["strategy"].split(",") for a in params["attack"].split(",")]
    assert len(grid) == 16
    for group, option in {("strategy", s) for s, _ in grid} | {("attack", a) for _, a in grid}:
        assert compose_cfg(f"{group}={option}")[group] is not None  # every option of the grid exists


TRACKER = """
from fedsim.callbacks import Callback


class FailsForSeedOne(Callback):
    def on_run_start(self, out_dir, config, records):
        if config["seed"] == 1:
            raise RuntimeError("tracking server unreachable")
"""


@pytest.mark.slow
def test_parallel_jobs_share_one_mlflow_store_and_a_failed_tracker_fails_the_sweep(tmp_path):
    """Two joblib workers, four jobs, one MLflow store in the sweep folder: every job is logged whole; the job
    whose own tracker failed keeps its results, is named in the summary, and the sweep exits 1."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    (tmp_path / "tracker.py").write_text(TRACKER)
    res = fedsim_cli(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "logger=mlflow",
        "callbacks=[{_target_: tracker.FailsForSeedOne}]",
        "seed=0,1,2,3",
        "hydra.sweep.dir=sweep",
        *TINY,
        cwd=tmp_path,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert "tracking (logger= or callbacks=) failed for 1 run(s)" in res.stderr
    sweep = tmp_path / "sweep"
    client = MlflowClient(tracking_uri=f"sqlite:///{sweep / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert sorted(r.data.params["seed"] for r in runs) == ["0", "1", "2", "3"]
    for run in runs:
        job = json.loads((sweep / run.info.run_name / "summary.json").read_text())
        assert run.data.metrics["final.final_eval_accuracy"] == pytest.approx(job["final_eval_accuracy"])
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [r["seed"] for r in rows] == ["0", "1", "2", "3"] and {r["status"] for r in rows} == {"completed"}
    failed = [r["seed"] for r in rows if r["callback_errors"]]
    assert failed == ["1"] and "tracking server unreachable" in rows[1]["callback_errors"]


def _fake_job(sweep: Path, num: int, overrides: list[str], accs: list[float]) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    records = [{"round": i, "sim_time": float(i), "eval_accuracy": a} for i, a in enumerate(accs)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": "completed", "final_eval_accuracy": accs[-1], "rounds_done": len(accs) - 1}
    (job / "summary.json").write_text(json.dumps(summary))


def test_sweep_summary_has_a_column_per_swept_key_and_curves_named_by_their_values(tmp_path):
    from fedsim.sweep import write_summary

    grid = [(s, lr) for s in ("fedavg", "fedprox") for lr in ("0.1", "0.01")]
    for i, (strategy, lr) in enumerate(grid):
        _fake_job(
            tmp_path,
            i,
            [f"strategy={strategy}", f"client.lr={lr}", "num_rounds=2", "clipping.noise_seed=98765432109876"],
            [0.1, 0.5, 0.7 + i / 100],
        )
    rows = write_summary(tmp_path)
    table = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert list(table[0])[:4] == ["job", "strategy", "client.lr", "overrides"]  # num_rounds is not swept
    assert [(r["strategy"], r["client.lr"]) for r in table] == grid
    text = (tmp_path / "sweep_summary.csv").read_text()  # a DP run's noise seed is never shown
    assert "98765432109876" not in text and "clipping.noise_seed=<secret>" in table[0]["overrides"]
    assert len(rows) == 4 and (tmp_path / "sweep.png").stat().st_size > 0
    from fedsim.sweep import plot_sweep, swept_keys

    labels = plot_sweep(tmp_path, rows, swept_keys(rows))
    assert labels == [f"strategy={s} client.lr={lr}" for s, lr in grid]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_sigterm_to_a_sweep_launchers_parent_stops_its_jobs_with_their_outputs(tmp_path, launcher):
    """The jobs run in other processes: the signal reaches each running job, which writes its outputs as a
    single run does; queued jobs never start; nothing outlives the command, which exits 143."""
    import signal
    import time

    from fedsim.sweep import descendants

    pytest.importorskip(f"hydra_plugins.hydra_{launcher.split('_')[0]}_launcher")
    proc = fedsim_cli(
        "-m",
        f"hydra/launcher={launcher}",
        *(["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []),
        "seed=0,1",
        "num_rounds=5000",
        "checkpoint_every=0",
        "hydra.sweep.dir=sweep",
        *TINY[:2],
        "quiet=true",
        cwd=tmp_path,
        background=True,
    )
    sweep = tmp_path / "sweep"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        done = [len(p.read_text().splitlines()) for p in sweep.glob("*/metrics.jsonl")]
        if len(done) == 2 and min(done) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-4000:]
    for job in (sweep / "0", sweep / "1"):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
        assert summary["rounds_done"] == len((job / "metrics.jsonl").read_text().splitlines()) - 1
    assert (sweep / "sweep_summary.csv").exists()
    time.sleep(1.0)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
    assert not alive, alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0].lower()
    except (OSError, IndexError):
        return "zombie"


@pytest.mark.slow
@pytest.mark.parametrize("target, status", [("job", 1), ("group", 143)])
def test_sigterm_while_a_submitit_job_still_imports_is_one_line(tmp_path, target, status):
    """SIGTERM to a submitit_local job process (or to the whole process group) before the job has imported
    fedsim: the job ends without a result, and the command says so in one line instead of submitit's traceback."""
    import os
    import signal
    import time

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = fedsim_cli(
        "-m", "hydra/launcher=submitit_local", "seed=0,1", "hydra.sweep.dir=sweep", *TINY[:2], "quiet=true",
        cwd=tmp_path, background=True, start_new_session=True,
    )  # fmt: skip
    job = None
    deadline = time.monotonic() + 120
    while job is None and time.monotonic() < deadline and proc.poll() is None:
        for entry in Path("/proc").iterdir():  # the job process, as soon as it exists: it is still importing
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"submitit.core._submit" in cmd and str(tmp_path).encode() in cmd:
                job = int(entry.name)
                break
        time.sleep(0.02)
    assert job is not None, proc.communicate()[1][-3000:]
    if target == "job":
        os.kill(job, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == status and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("fedsim: "), err[-3000:]

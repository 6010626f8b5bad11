"""Hydra's sweepers: a job returns a float objective, so ``hydra/sweeper=optuna`` searches over fedsim's keys."""

import json

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
    assert len(rows) == 4 and rows[0].startswith("job,overrides,status,final_eval_accuracy")
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

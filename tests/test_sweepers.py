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

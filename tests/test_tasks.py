"""The task plugin (``task=``): the loss every client minimises and the metric every evaluation reports."""

import json

import numpy as np
import pytest
import torch
from helpers import TINY, compose_cfg, read_metrics, run_tiny

from fedsim import build, schema
from fedsim.data.base import value_bins
from fedsim.errors import ConfigError
from fedsim.tasks import Classification, Regression, Task
from fedsim.training import evaluate

REGRESSION = ["task=regression", "dataset=diabetes"]


class MeanAbsoluteError(Task):
    """A user's own task whose metric is lower-is-better (mean absolute error of one output)."""

    name = "mae-regression"
    metric = "mae"
    higher_is_better = False
    targets = "values"

    def loss(self, out, y, reduction="mean"):
        return torch.nn.functional.l1_loss(out.squeeze(-1), y, reduction=reduction)

    def score(self, out, y):
        return float((out.squeeze(-1) - y).abs().sum())

    def finish(self, total, y):
        return total / y.shape[0]


class LossNamedTask(MeanAbsoluteError):
    """A metric named like the loss field would overwrite eval_loss."""

    metric = "loss"


# ----------------------------------------------------------------------------------------- metrics vs oracles
def test_regression_evaluation_matches_scikit_learns_mse_and_r2():
    from sklearn.metrics import mean_squared_error, r2_score

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 4, generator=g), torch.randn(300, generator=g)
    model = torch.nn.Linear(4, 1)
    loss, r2 = evaluate(model, x, y, batch_size=64, task=Regression())  # several batches
    pred = model(x).detach().squeeze(-1).numpy()
    assert loss == pytest.approx(mean_squared_error(y.numpy(), pred), rel=1e-5)
    assert r2 == pytest.approx(r2_score(y.numpy(), pred), rel=1e-5)


def test_classification_evaluation_is_cross_entropy_and_accuracy():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    model = torch.nn.Linear(5, 3)
    loss, acc = evaluate(model, x, y, batch_size=37, task=Classification())
    out = model(x).detach()
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-5)
    assert acc == int((out.argmax(1) == y).sum()) / 200


def test_r2_is_undefined_for_constant_targets_and_zero_for_the_mean():
    y = torch.full((10,), 3.0)
    assert np.isnan(Regression().finish(1.0, y))
    y = torch.arange(10.0)
    sse = float(((y - y.mean()) ** 2).sum())  # predicting the mean
    assert Regression().finish(sse, y) == pytest.approx(0.0)


def test_value_bins_split_real_targets_into_equally_full_quantile_bins():
    values = np.random.default_rng(0).normal(size=1000)
    bins = value_bins(values, 10)
    assert bins.dtype == np.int64 and set(np.unique(bins)) == set(range(10))
    assert np.bincount(bins).min() >= 95 and np.bincount(bins).max() <= 105
    order = np.argsort(values)  # bins follow the values' order
    assert (np.diff(bins[order]) >= 0).all()


# --------------------------------------------------------------------------------- FedSGD = centralised GD
def test_federated_regression_equals_centralised_gradient_descent(tmp_path):
    """FedSGD with the whole population each round is full-batch gradient descent on the union of the
    clients' training data: checked against that descent written in numpy, from the same initial model."""
    from fedsim.experiment import build_experiment
    from fedsim.run import run_experiment

    rounds, lr = 15, 0.1
    over = [*REGRESSION, "model=logreg", "client=fedsgd", f"client.lr={lr}", "num_clients=8"]
    over += ["clients_per_round=8", f"num_rounds={rounds}", "quiet=true", "engine=inprocess"]
    cfg = compose_cfg(*over)
    exp = build_experiment(cfg)
    idx = np.concatenate(list(build.build_partitions(json.loads(exp.spec_json))[0]))  # training parts
    x = exp.dataset.x_train[idx].astype(np.float64)
    y = exp.dataset.y_train[idx].astype(np.float64)
    w0 = {k: v.double().numpy() for k, v in exp.initial_model.state_dict().items()}
    w, b = w0["1.weight"][0], w0["1.bias"][0]
    for _ in range(rounds):  # d/dw mean((xw + b - y)^2)
        r = x @ w + b - y
        w, b = w - lr * 2 * x.T @ r / len(y), b - lr * 2 * r.mean()
    summary = run_experiment(cfg, tmp_path)
    model = torch.load(tmp_path / "model.pt")
    assert np.allclose(model["1.weight"][0].double().numpy(), w, atol=1e-5)
    assert model["1.bias"].item() == pytest.approx(b, abs=1e-5)
    assert summary["status"] == "completed" and summary["final_eval_r2"] > 0.2


# ------------------------------------------------------------------------------------------ a regression run
@pytest.mark.pictures  # looks at the run's pictures
@pytest.mark.slow
def test_a_regression_run_names_every_output_after_r2(tmp_path):
    summary = run_tiny(tmp_path, *REGRESSION, "num_rounds=3", "federated_eval=true", "target_r2=-100")
    recs = read_metrics(tmp_path)
    seen = {k for r in recs for k in r}
    assert {"eval_r2", "fed_eval_r2", "personal_eval_r2", "personal_eval_r2_p10"} <= seen
    assert not any("accuracy" in k for k in seen)
    assert seen <= set(schema.fields("r2")), seen - set(schema.fields("r2"))
    assert summary["final_eval_r2"] == recs[-1]["eval_r2"]
    assert summary["best_eval_r2"] == max(r["eval_r2"] for r in recs)
    assert "final_eval_accuracy" not in summary
    assert summary["target_r2"] == -100 and summary["target_round"] == 0  # any model beats R² = -100
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["final_eval_r2"] == summary["final_eval_r2"]
    assert (tmp_path / "curves.png").stat().st_size > 0
    parts = json.loads((tmp_path / "partitions.json").read_text())  # counted by target decile
    assert parts["num_classes"] == 10 and sum(map(sum, parts["label_counts"])) == sum(parts["sizes"])


@pytest.mark.slow
def test_stop_at_target_follows_the_tasks_direction(tmp_path):
    """A lower-is-better metric (a user's own task) reaches its target by going below it."""
    task = ["task._target_=test_tasks.MeanAbsoluteError", "dataset=diabetes", "num_rounds=30"]
    summary = run_tiny(tmp_path / "a", *task, "+target_mae=100", "stop_at_target=true")
    assert summary["status"] == "stopped" and summary["rounds_done"] == 0  # any MAE is below 100
    summary = run_tiny(tmp_path / "b", *task, "+target_mae=0.0001", "stop_at_target=true")
    assert summary["rounds_done"] == 30 and summary["target_round"] is None
    recs = read_metrics(tmp_path / "b")
    assert summary["best_eval_mae"] == min(r["eval_mae"] for r in recs)


@pytest.mark.slow
def test_the_vectorized_engine_trains_regression_like_the_client_app(tmp_path):
    a = run_tiny(tmp_path / "a", *REGRESSION, "engine=inprocess")
    b = run_tiny(tmp_path / "b", *REGRESSION, "engine=vectorized")
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["eval_r2"] for r in ra] == pytest.approx([r["eval_r2"] for r in rb], abs=1e-4)
    assert a["final_eval_loss"] == pytest.approx(b["final_eval_loss"], rel=1e-4)


# -------------------------------------------------------------------------------------------- bad pairings
@pytest.mark.parametrize(
    "over, key, says",
    [
        (["dataset=diabetes"], "task", "use task=regression"),
        (["task=regression"], "task", "use task=classification"),
        ([*REGRESSION, "target_accuracy=0.9"], "target_accuracy", "Set target_r2"),
        (["target_r2=0.5"], "target_r2", "Set target_accuracy"),
        ([*REGRESSION, "target_r2=1.5"], "target_r2", "(-inf, 1]"),
        (["task._target_=fedsim.tasks.Task"], "task._target_", "loss, score, finish missing"),
        (["task._target_=no.such.Task"], "task._target_", "PYTHONPATH"),
        (
            ["task._target_=test_tasks.LossNamedTask", "dataset=diabetes"],
            "task._target_",
            "other than 'loss'",
        ),
    ],
)
@pytest.mark.slow
def test_a_task_that_does_not_fit_is_one_line_naming_the_key(over, key, says):
    from fedsim.experiment import build_experiment

    with pytest.raises(ConfigError) as e:
        build_experiment(compose_cfg(*TINY, *over))
    assert e.value.key == key and says in str(e.value) and "\n" not in str(e.value)


def test_the_sweep_summary_has_columns_for_each_tasks_metric():
    from fedsim.sweep import columns_for

    rows = [
        {"final_eval_accuracy": 0.9, "best_eval_accuracy": 0.9},
        {"final_eval_r2": 0.4, "best_eval_r2": 0.5},
    ]
    cols = columns_for(rows)
    assert cols[3:7] == ["final_eval_accuracy", "best_eval_accuracy", "final_eval_r2", "best_eval_r2"]
    assert columns_for([])[3:5] == ["final_eval_accuracy", "best_eval_accuracy"]


def test_a_config_without_task_or_logger_groups_means_classification_and_no_tracker():
    """A user's own primary config that does not start from fedsim's ``config`` may leave the groups out."""
    from omegaconf import open_dict

    from fedsim.experiment import build_experiment

    cfg = compose_cfg(*TINY)
    with open_dict(cfg):
        del cfg["task"], cfg["logger"]
    exp = build_experiment(cfg)
    assert exp.task == Classification() and exp.callbacks == []

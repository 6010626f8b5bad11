"""Flower interoperability: a stock Flower ClientApp under fedsim's server, fedsim's ClientApp under Flower's
own strategies (FedAvg, client-side DP clipping, Krum), node discovery of foreign clients, Flower's keyword
names on fedsim's strategies."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp import strategy as flwr_strategies
from helpers import TINY, compose_cfg, read_metrics
from strategy_helpers import server_identity
from torch import nn

from fedsim import keys
from fedsim.config import FLOWER_ENV
from fedsim.engines.pool import PoolGrid
from fedsim.errors import ConfigError, RunError
from fedsim.grid_utils import GridView, discover

# ------------------------------------------------------------------------------------------------------------
# A stock, quickstart-style ClientApp: its own model and data, `arrays` + `metrics` with `num-examples`,
# no query handler, no fedsim keys.
stock_app = ClientApp()
STOCK_HIDDEN = 64  # fedsim's model=mlp on digits is Flatten, Linear(64, 64), ReLU, Linear(64, 10)


def _stock_net(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _stock_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x = torch.tensor(d.images[pid::n] / 16.0, dtype=torch.float32)
    return x, torch.tensor(d.target[pid::n])


@stock_app.train()
def stock_train(msg: Message, context: Context) -> Message:
    net = _stock_net(int(context.run_config.get("hidden", STOCK_HIDDEN)))
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _stock_data(context)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    metrics = MetricRecord({"train_loss": loss.item(), "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)


@stock_app.evaluate()
def stock_evaluate(msg: Message, context: Context) -> Message:
    net = _stock_net(STOCK_HIDDEN)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _stock_data(context)
    with torch.no_grad():
        acc = float((net(x).argmax(1) == y).float().mean())
    return Message(
        RecordDict({"metrics": MetricRecord({"eval_acc": acc, "num-examples": len(y)})}), reply_to=msg
    )


own_model_app = ClientApp()


@own_model_app.train()
def own_model_train(msg: Message, context: Context) -> Message:
    """A client that replies its own model whatever the server sent (here: another model than fedsim's)."""
    metrics = MetricRecord({"num-examples": 10})
    arrays = ArrayRecord(_stock_net(STOCK_HIDDEN).state_dict())
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


class _WithoutPartitionOf(GridView):
    """The pool grid seen as a deployment's grid: the server must ask the nodes who they are."""


def _stock_grid(n: int, app: str = "stock_app") -> GridView:
    return _WithoutPartitionOf(PoolGrid(n, app_ref=f"test_interop:{app}"))


@pytest.mark.slow
def test_stock_clientapp_trains_under_fedsim_server(tmp_path, caplog):
    from fedsim.run import run_experiment

    cfg = compose_cfg(*TINY, "federated_eval=true")
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        summary = run_experiment(cfg, tmp_path, grid=_stock_grid(6))
    assert summary["status"] == "completed", summary
    rounds = [r for r in read_metrics(tmp_path) if r["round"] > 0]
    assert [r["num_clients"] for r in rounds] == [3, 3]
    assert all(r["failures"] == 0 for r in rounds)
    assert all("train_loss" in r and "fed_eval_acc" in r for r in rounds)  # the stock client's own names
    assert rounds[-1]["eval_accuracy"] > read_metrics(tmp_path)[0]["eval_accuracy"]
    assert "6 node(s) run a ClientApp that is not fedsim's, identified by node id" in caplog.text


@pytest.mark.slow
def test_stock_clientapp_under_fedsims_async_loop(tmp_path):
    from fedsim.run import run_experiment

    cfg = compose_cfg(*TINY, "strategy=fedbuff", "strategy.buffer_size=2", "strategy.concurrency=3")
    summary = run_experiment(cfg, tmp_path, grid=_stock_grid(6))
    assert summary["status"] == "completed" and summary["rounds_done"] == 2
    assert all(r.get("failures", 0) == 0 for r in read_metrics(tmp_path))


@pytest.mark.slow
def test_stock_client_with_another_model_is_one_line_naming_the_mismatch(tmp_path):
    from fedsim.run import run_experiment

    cfg = compose_cfg(*TINY, "model.hidden=[32]")  # the stock client trains 64 hidden units
    with pytest.raises(RunError) as err:
        run_experiment(cfg, tmp_path, grid=_stock_grid(6, "own_model_app"))
    msg = str(err.value)
    assert "\n" not in msg and "'1.weight' has shape (64, 64), the global model's (32, 64)" in msg
    assert "not fedsim's" in msg and "model=" in msg


# ------------------------------------------------------------------------------------------------------------
class _Replies(GridView):
    """A grid whose nodes answer the discovery query with canned replies (by node id)."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def send_and_receive(self, messages, *, timeout=None):
        return [self.answer(m) for m in messages]


def _reply(msg: Message, metrics: dict) -> Message:
    msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


def test_discover_counts_a_foreign_query_reply_instead_of_raising(caplog):
    def answer(msg):
        nid = msg.metadata.dst_node_id
        own = {keys.PARTITION_ID: 0, keys.NUM_EXAMPLES: 7} if nid == 10 else {"foo": 1.0}
        return _reply(msg, own)

    with caplog.at_level(logging.WARNING, logger="fedsim"), server_identity():
        found = discover(_Replies(answer), [11, 10, 12], "{}", 1.0, num_partitions=3)
    # the fedsim node keeps its claim; the others take the free partitions in the order asked
    assert found == {0: (10, 7), 1: (11, 0), 2: (12, 0)}
    assert caplog.text.count("not fedsim's") == 1 and "no 'partition-id'" in caplog.text


def test_discover_gives_a_foreign_node_no_work_when_no_partition_is_left(caplog):
    with caplog.at_level(logging.WARNING, logger="fedsim"), server_identity():
        found = discover(_Replies(lambda m: _reply(m, {})), [5, 6], "{}", 1.0, num_partitions=1)
    assert found == {0: (5, 0)} and "no partition left" in caplog.text


# ------------------------------------------------------------------------------------------------------------
class _ConfiguredPool(PoolGrid):
    """fedsim's ClientApp on a pool grid whose nodes have a ``run_config`` (as under ``flwr run``)."""

    def __init__(self, n: int, run_config: dict) -> None:
        super().__init__(n)
        self._run_config = run_config

    def _context(self, node_id: int) -> Context:
        ctx = super()._context(node_id)
        ctx.run_config = dict(self._run_config)
        return ctx


FLOWER_KW = dict(min_train_nodes=3, min_evaluate_nodes=3, min_available_nodes=3)


def _initial(overrides: str) -> ArrayRecord:
    from fedsim import build
    from fedsim.client_app import spec_from_overrides

    return ArrayRecord(build.build_initial_model(json.loads(spec_from_overrides(overrides))).state_dict())


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([a.numpy().ravel() for a in arrays.values()])


OVERRIDES = "num_clients=3"


def test_fedsim_clientapp_under_flower_fedavg_from_its_run_config():
    initial = _initial(OVERRIDES)
    with _ConfiguredPool(3, {"overrides": OVERRIDES}) as grid:
        result = flwr_strategies.FedAvg(**FLOWER_KW).start(
            grid=grid, initial_arrays=initial, num_rounds=1, timeout=60
        )
    assert not np.allclose(_flat(result.arrays), _flat(initial))
    assert result.train_metrics_clientapp[1][keys.TRAIN_LOSS] > 0


# A ServerApp written as Flower's PyTorch quickstart writes it: its own model, FedAvg, `lr` in the train config,
# the numbers from its run_config.
quickstart_server = ServerApp()


@quickstart_server.main()
def quickstart_main(grid, context: Context) -> None:
    net = _stock_net(STOCK_HIDDEN)
    torch.manual_seed(0)
    net.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    strategy = flwr_strategies.FedAvg(fraction_train=float(context.run_config["fraction-train"]), **FLOWER_KW)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        train_config=ConfigRecord({k: float(v) for k, v in context.run_config.items() if k == "lr"}),
        num_rounds=int(context.run_config["num-server-rounds"]),
        timeout=60,
    )
    context.state["result"] = result.arrays


def _quickstart(run_config: dict, client_run_config: dict) -> np.ndarray:
    """Run the quickstart ServerApp's main against fedsim's ClientApp on 3 nodes; the final model, flat."""
    from flwr.app import RecordDict

    ctx = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with _ConfiguredPool(3, client_run_config) as grid:
        quickstart_main(grid, ctx)
    return _flat(ctx.state["result"])


QUICKSTART = {"fraction-train": 1.0, "num-server-rounds": 2}


def test_fedsim_clientapp_under_a_quickstart_serverapp_honours_lr_and_local_epochs(caplog):
    """Flower's `lr` (train config) and `local-epochs` (run config, as the quickstart's ClientApp reads it) mean
    what fedsim's client.lr and client.local_epochs mean: the same final model, to float rounding."""
    flower = _quickstart({**QUICKSTART, "lr": 0.02}, {"overrides": OVERRIDES, "local-epochs": 2})
    fedsim_keys = _quickstart(QUICKSTART, {"overrides": f"{OVERRIDES} client.lr=0.02 client.local_epochs=2"})
    default = _quickstart({**QUICKSTART, "lr": 0.05}, {"overrides": OVERRIDES})  # 0.05: fedsim's client.lr
    np.testing.assert_allclose(flower, fedsim_keys, rtol=0, atol=1e-6)
    assert np.abs(flower - default).max() > 1e-3  # the keys changed the training


def test_fedsim_clientapp_names_the_train_config_keys_it_ignores(caplog):
    initial = _initial(OVERRIDES)
    cfg = ConfigRecord({"lr": 0.05, "momentum-boost": 3.0})
    with (
        caplog.at_level(logging.WARNING, logger="fedsim"),
        _ConfiguredPool(3, {"overrides": OVERRIDES}) as grid,
    ):
        flwr_strategies.FedAvg(**FLOWER_KW).start(
            grid=grid, initial_arrays=initial, train_config=cfg, num_rounds=1, timeout=60
        )
    warned = [r.getMessage() for r in caplog.records if "ignores train-config" in r.getMessage()]
    assert warned and "'momentum-boost'" in warned[0] and "'lr'" not in warned[0].split("(")[0]


def test_a_bad_flower_lr_is_one_line_in_the_reply():
    initial = _initial(OVERRIDES)
    with _ConfiguredPool(3, {"overrides": OVERRIDES}) as grid:
        msgs = list(
            flwr_strategies.FedAvg(**FLOWER_KW).configure_train(1, initial, ConfigRecord({"lr": 0.0}), grid)
        )
        replies = list(grid.send_and_receive(msgs))
    reasons = [str(r.error.reason) for r in replies if r.has_error()]
    assert len(reasons) == 3 and "lr=0.0 is not allowed" in reasons[0]


def test_fedsim_clientapp_without_spec_or_run_config_fails_with_one_line():
    initial = _initial(OVERRIDES)
    with PoolGrid(3) as grid:
        msgs = list(flwr_strategies.FedAvg(**FLOWER_KW).configure_train(1, initial, ConfigRecord(), grid))
        replies = list(grid.send_and_receive(msgs))
    assert len(replies) == 3 and all(r.has_error() for r in replies)
    last = str(replies[0].error.reason).strip().splitlines()
    assert any("needs its run's config" in ln and "[tool.flwr.app.config]" in ln for ln in last)


def test_fedsim_clientapp_honours_flowers_clipping_norm():
    initial = _initial(OVERRIDES)
    inner = flwr_strategies.FedAvg(**FLOWER_KW)
    dp = flwr_strategies.DifferentialPrivacyClientSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=0.01, num_sampled_clients=3
    )
    with _ConfiguredPool(3, {"overrides": OVERRIDES}) as grid:
        result = dp.start(grid=grid, initial_arrays=initial, num_rounds=1, timeout=60)
    moved = float(np.linalg.norm(_flat(result.arrays) - _flat(initial)))
    assert 0 < moved <= 0.01 + 1e-6  # each client clipped its update (Flower's mod is not attached)
    assert result.train_metrics_clientapp[1][keys.CLIPPED] == 1.0


def test_krum_in_a_plain_flower_app_skips_a_short_round_with_a_warning(caplog):
    from fedsim.strategies.krum import Krum

    initial = _initial(OVERRIDES)
    with caplog.at_level(logging.WARNING), _ConfiguredPool(3, {"overrides": OVERRIDES}) as grid:
        result = Krum(num_malicious_nodes=1, **FLOWER_KW).start(
            grid=grid, initial_arrays=initial, num_rounds=1, timeout=60
        )
    assert len(result.arrays) == 0  # nothing aggregated (Flower's Result keeps only aggregated arrays)
    assert 1 in result.evaluate_metrics_clientapp  # the run went on: the clients evaluated the kept model
    assert "round 1 skipped" in caplog.text and "at least 5" in caplog.text


# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, kwargs, attr, value",
    [
        ("krum.Krum", {"num_malicious_nodes": 2}, "num_malicious", 2),
        ("krum.Krum", {"num_nodes_to_select": 3}, "num_selected", 3),
        ("fedadam.FedAdam", {"eta_l": 0.5}, "eta_l", 0.5),
        ("fedyogi.FedYogi", {"eta_l": 0.5}, "eta_l", 0.5),
        ("fedadagrad.FedAdagrad", {"eta_l": 0.5}, "eta_l", 0.5),
    ],
)
def test_strategies_accept_flowers_keyword_names(target, kwargs, attr, value):
    from hydra.utils import get_class

    assert getattr(get_class(f"fedsim.strategies.{target}")(**kwargs), attr) == value


def test_clipping_accepts_flowers_names():
    from fedsim.features.clipping.server import AdaptiveClipping, FixedClipping

    inner = flwr_strategies.FedAvg()
    fixed = FixedClipping(inner, num_clients=10, num_sampled_clients=4, clipping_norm=0.5)
    assert (fixed.clip_norm, fixed.clients_per_round) == (0.5, 4)
    ada = AdaptiveClipping(
        inner, num_clients=10, clients_per_round=4, initial_clipping_norm=0.3, target_clipped_quantile=0.2
    )
    assert (ada.clip_norm, ada.target_quantile) == (0.3, 0.2)


def test_a_flower_name_contradicting_fedsims_is_one_config_error():
    from fedsim.strategies.krum import Krum

    with pytest.raises(ConfigError, match=r"num_malicious_nodes=1 .* num_malicious=2"):
        Krum(num_malicious=2, num_malicious_nodes=1)


@pytest.mark.slow
def test_stock_clientapp_under_fedsims_serverapp_in_flowers_simulation(tmp_path, monkeypatch):
    """fedsim's ServerApp, given its overrides through ``server_app(...)``, and the stock ClientApp on Flower's
    own public ``run_simulation`` (Ray), as a Flower user writes it."""
    import os

    from flwr.simulation import run_simulation

    from fedsim.server_app import server_app

    here = os.path.dirname(__file__)  # the Ray actors import this module to unpickle the ClientApp
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    run_simulation(
        server_app=server_app("num_clients=4 clients_per_round=4 num_rounds=2 quiet=true", out_dir=tmp_path),
        client_app=stock_app,
        num_supernodes=4,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    rounds = [r for r in read_metrics(tmp_path) if r["round"] > 0]
    assert [r["num_clients"] for r in rounds] == [4, 4] and all(r["failures"] == 0 for r in rounds)
    replies = [json.loads(ln) for ln in (tmp_path / "replies.jsonl").read_text().splitlines()]
    assert {r["type"] for r in replies} >= {"query", "train"}  # asked, then trained without a partition-id
    assert all(r["partition_id"] is None for r in replies if r["type"] == "train")


def test_fedsim_clientapp_names_a_bad_run_config_override_in_one_line():
    initial = _initial(OVERRIDES)
    with _ConfiguredPool(3, {"overrides": "num_clients=3 strategy.nope=1"}) as grid:
        msgs = list(flwr_strategies.FedAvg(**FLOWER_KW).configure_train(1, initial, ConfigRecord(), grid))
        replies = list(grid.send_and_receive(msgs))
    reasons = [str(r.error.reason) for r in replies if r.has_error()]
    assert len(reasons) == 3 and all("cannot build its task from run_config overrides" in r for r in reasons)
    assert "strategy.nope" in reasons[0]


@pytest.mark.parametrize("key", [b"ssh-foo AAAA", b"\x01\x02abc def", b"not a key"])
def test_a_key_that_is_no_public_key_is_a_value_error_for_the_node_gate(key):
    """Flower's simulation gives its nodes random bytes as public keys: the node gate reads them as unreadable
    (cryptography raises UnsupportedAlgorithm for an unknown key type, which stopped fedsim's ServerApp)."""
    from fedsim.node_binding import canonical_key

    with pytest.raises(ValueError):
        canonical_key(key)


# ------------------------------------------------------------------------------------------------------------
# Flower's own apps, verbatim except their data loading (tests/flower_apps): a quickstart-pytorch-style app and
# the PyTorch app `flwr new` generates, each with its pyproject pointing `serverapp` at fedsim's ServerApp.
FLOWER_APPS = Path(__file__).resolve().parent / "flower_apps"


def _app_config(app: str) -> dict:
    import tomllib

    return tomllib.loads((FLOWER_APPS / app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]


class _RunConfigPool(PoolGrid):
    """Nodes running a Flower App's ClientApp with the app's run_config (as under ``flwr run``), seen as a
    deployment's grid by the server (it asks them who they are)."""

    def __init__(self, n: int, app: str, run_config: dict) -> None:
        super().__init__(n, app_ref=_app_config(app)["components"]["clientapp"])
        self._run_config = run_config

    def _context(self, node_id: int) -> Context:
        ctx = super()._context(node_id)
        ctx.run_config = dict(self._run_config)
        return ctx


@pytest.fixture
def app_on_path(monkeypatch):
    """Put a Flower App's folder on sys.path (as Flower does for the app it runs); forget its modules after."""
    import sys

    def add(app: str) -> None:
        monkeypatch.syspath_prepend(str(FLOWER_APPS / app))

    yield add
    for name in [m for m in sys.modules if m.split(".")[0] in ("quickstart", "pytorchapp")]:
        del sys.modules[name]


def _serve_app(app: str, out: Path, extra: str, nodes: int) -> list[dict]:
    """fedsim's ServerApp (``serve``, what ``fedsim.server_app:app`` runs) on nodes running ``app``'s ClientApp,
    with the app's own run_config plus ``extra`` overrides; the run's metrics."""
    from fedsim.server_app import serve

    run_config = {**_app_config(app)["config"], "out-dir": str(out)}
    run_config["overrides"] = f"{run_config['overrides']} {extra}"
    with _RunConfigPool(nodes, app, run_config) as pool:
        serve(_WithoutPartitionOf(pool), run_config)
    return read_metrics(out)


def _check_trained(
    out: Path, metrics: list[dict], rounds: int, per_round: int, lr: float, epochs: int
) -> None:
    """Every round aggregated ``per_round`` replies of the stock client (its own ``train_loss``), none failed,
    and the server's accuracy on its own test split rose well above chance (10 classes)."""
    trained = [r for r in metrics if r["round"] > 0]
    assert [r["num_clients"] for r in trained] == [per_round] * rounds
    assert all(r["failures"] == 0 and "train_loss" in r for r in trained)
    assert metrics[0]["eval_accuracy"] < 0.2 < 0.5 < trained[-1]["eval_accuracy"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    client = summary["config"]["client"]  # the app's own lr and local-epochs became fedsim's config
    assert (client["lr"], client["local_epochs"]) == (lr, epochs)


def test_the_quickstart_app_trains_under_fedsims_serverapp(tmp_path, app_on_path):
    """The quickstart app reads `lr` from the train config and `local-epochs` from the run config, and builds its
    own Net(): fedsim sends `lr`, reads the app's run_config, and builds the initial model as Net()."""
    app_on_path("quickstart")
    metrics = _serve_app("quickstart", tmp_path, "num_clients=3 clients_per_round=3 quiet=true", 3)
    _check_trained(tmp_path, metrics, rounds=2, per_round=3, lr=0.01, epochs=1)  # num-server-rounds = 2


@pytest.mark.slow
def test_the_flwr_new_pytorch_app_trains_under_fedsims_serverapp(tmp_path, app_on_path):
    app_on_path("pytorchapp")
    metrics = _serve_app("pytorchapp", tmp_path, "num_clients=4 quiet=true", 4)
    # num-server-rounds = 3, fraction-train = 0.5: 2 of the 4 clients a round
    _check_trained(tmp_path, metrics, rounds=3, per_round=2, lr=0.01, epochs=1)


def test_a_model_factory_gets_only_the_arguments_it_takes(app_on_path):
    from fedsim import build
    from fedsim.client_app import spec_from_overrides

    app_on_path("quickstart")
    from quickstart.task import Net

    spec = json.loads(spec_from_overrides("model._target_=quickstart.task.Net ~model.hidden"))
    model = build.build_initial_model(spec)
    assert type(model) is Net
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in Net().state_dict().items()
    }
    from fedsim.models import factory_arguments

    def only_classes(num_classes):
        return num_classes

    assert factory_arguments(only_classes, input_shape=(1,), num_classes=3) == {"num_classes": 3}
    assert factory_arguments(lambda **kw: kw, input_shape=(1,), num_classes=3) == {
        "input_shape": (1,),
        "num_classes": 3,
    }


def test_a_hyperparameter_the_users_net_does_not_take_is_one_config_error(app_on_path):
    from fedsim import build
    from fedsim.client_app import spec_from_overrides

    app_on_path("quickstart")
    spec = json.loads(spec_from_overrides("model._target_=quickstart.task.Net"))  # model=mlp's hidden stays
    with pytest.raises(ConfigError) as err:
        build.build_initial_model(spec)
    assert str(err.value).startswith("model.hidden=[64] is not allowed") and "~model.hidden" in str(err.value)


def test_flowers_run_config_keys_set_fedsims_and_overrides_win():
    from fedsim.run_config import experiment_from

    run_config = {"num-server-rounds": 3, "fraction-train": 0.5, "local-epochs": 4, "lr": 0.02}
    cfg, _, _ = experiment_from(run_config)
    assert (cfg.num_rounds, cfg.clients_per_round, cfg.client_fraction) == (3, None, 0.5)
    assert (cfg.client.lr, cfg.client.local_epochs) == (0.02, 4)
    cfg, _, _ = experiment_from({**run_config, "overrides": "num_rounds=7 clients_per_round=2 client.lr=0.1"})
    assert (cfg.num_rounds, cfg.clients_per_round, cfg.client.lr, cfg.client.local_epochs) == (7, 2, 0.1, 4)


def _train_message(spec: str, kind: str = "train", **config) -> Message:
    content = RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec, **config})})
    return Message(content, 1, kind)


def test_train_messages_carry_flowers_lr_and_local_epochs_from_the_run_spec():
    from fedsim.build import local_training
    from fedsim.client_app import spec_from_overrides
    from fedsim.server_app import FlowerTrainKeys

    spec = spec_from_overrides("client.lr=0.03 client.local_epochs=3")
    local = local_training(json.loads(spec))
    add = FlowerTrainKeys(None).add_keys
    msgs = [_train_message(spec), _train_message(spec, lr=0.5), _train_message(spec, "evaluate")]
    add(msgs)
    configs = [m.content[keys.CONFIG] for m in msgs]
    assert (configs[0]["lr"], configs[0]["local-epochs"]) == (local.lr, local.local_epochs) == (0.03, 3)
    assert configs[1]["lr"] == 0.5  # the strategy's own value stays
    assert "lr" not in configs[2] and "local-epochs" not in configs[2]  # evaluate messages are left alone
    steps = [_train_message(spec_from_overrides("client.local_steps=5"))]
    add(steps)
    assert "local-epochs" not in steps[0].content[keys.CONFIG]  # fedsim counts steps: no epochs to name


def test_fedsims_clientapp_derives_the_servers_spec_with_flowers_keys_in_the_run_config():
    """A pyproject declaring `lr` and `local-epochs` beside `overrides`: fedsim's ClientApp composes the same spec
    as fedsim's ServerApp sends (else it would refuse every message)."""
    from fedsim.build import client_spec
    from fedsim.build_server import bind_client_algorithm, build_strategy
    from fedsim.client_app import run_spec
    from fedsim.run_config import experiment_from

    run_config = {"overrides": "num_clients=3", "lr": 0.02, "local-epochs": 3}
    cfg, _, _ = experiment_from(run_config)
    sent = json.loads(client_spec(cfg, device=str(cfg.placement.device)))
    bind_client_algorithm(sent, build_strategy(cfg, int(cfg.num_clients)))
    sent = json.dumps(sent, sort_keys=True)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
    assert run_spec(_train_message(sent), ctx) == sent
    assert json.loads(sent)["client"]["lr"] == 0.02


# ------------------------------------------------------------------------------------------------------------
# A failing reply, reported whole
RAY_REASON = (  # the shape of a ClientApp's exception under Flower's Ray simulation (colours and paths cut)
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
    '(pid=1, ip=127.0.0.1)\n  File "client_app.py", line 13, in train\n'
    "    model.load_state_dict(state)\nRuntimeError: Error(s) in loading state_dict for Net:\n"
    '\tMissing key(s) in state_dict: "fc1.weight", "fc1.bias". \n\tUnexpected key(s) in state_dict: "0.weight". '
    "\n\nThe above exception was the direct cause of the following exception:\n\n"
    '\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1, ip=127.0.0.1)\n  File "ray_actor.py", line 65, in run\n'
    "    raise ClientAppException(str(ex)) from ex\nflwr.clientapp.client_app.ClientAppException: \n"
    "Exception ClientAppException occurred. Message: Error(s) in loading state_dict for Net:\n"
    '\tMissing key(s) in state_dict: "fc1.weight", "fc1.bias". \n\tUnexpected key(s) in state_dict: "0.weight".\'>'
)
WHOLE = (
    'RuntimeError: Error(s) in loading state_dict for Net: Missing key(s) in state_dict: "fc1.weight", '
    '"fc1.bias". Unexpected key(s) in state_dict: "0.weight".'
)


@pytest.mark.parametrize(
    "reason, want",
    [
        (RAY_REASON, WHOLE),  # Ray: the original exception, not Flower's wrapper
        (  # a deployed SuperNode's form
            "<class 'RuntimeError'>:<'Error(s) in loading state_dict for Net:\n\tMissing key(s) in state_dict: "
            '"fc1.weight", "fc1.bias". \n\tUnexpected key(s) in state_dict: "0.weight".\'>',
            WHOLE,
        ),
        ("<class 'KeyError'>:<''lr''>", "KeyError: 'lr'"),
        (  # fedsim's pool engine: Flower's form, then the traceback's end
            "<class 'KeyError'>:<''lr''>\nTraceback (most recent call last):\n  File \"c.py\", line 3, in train\n"
            "KeyError: 'lr'\n",
            "KeyError: 'lr'",
        ),
    ],
)
def test_a_failing_reply_is_its_exception_type_and_whole_message(reason, want):
    from fedsim.errors import reply_error

    assert reply_error(reason) == want


def test_a_long_error_message_keeps_its_first_300_characters():
    from fedsim.errors import reply_error

    line = reply_error("<class 'ValueError'>:<'" + "k" * 500 + "'>")
    assert line == "ValueError: " + "k" * 300 + " ..."


strict_app = ClientApp()


@strict_app.train()
def strict_train(msg: Message, context: Context) -> Message:
    """A stock client whose own Net is not the server's model: load_state_dict fails, listing the keys."""
    net = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 10)
    )
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_a_failing_clients_warning_names_the_exception_and_every_key_once_per_round(tmp_path, caplog):
    from fedsim.run import run_experiment

    cfg = compose_cfg(*TINY)
    with caplog.at_level(logging.WARNING, logger="fedsim"), pytest.raises(RunError):
        run_experiment(cfg, tmp_path, grid=_stock_grid(6, "strict_app"))
    warned = [r.getMessage() for r in caplog.records if "client(s) failed (error)" in r.getMessage()]
    assert len(warned) == 2 and all("\n" not in w for w in warned)  # one line per kind, in each of 2 rounds
    assert (
        "RuntimeError: Error(s) in loading state_dict for Sequential: Missing key(s) in state_dict:"
        in warned[0]
    )
    assert 'Missing key(s) in state_dict: "5.weight", "5.bias".' in warned[0]  # the keys, cut before


def test_flowers_client_tracebacks_go_to_the_log_file_not_the_console(tmp_path, caplog):
    from flwr.common.logger import log as flwr_log

    from fedsim.errors import client_tracebacks_to

    console: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: console.append(record.getMessage())
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(handler)
    level, flwr_logger.level = flwr_logger.level, logging.INFO  # other tests quiet Flower to ERROR
    path = tmp_path / "client_errors.log"
    try:
        with caplog.at_level(logging.WARNING, logger="fedsim"), client_tracebacks_to(path):
            flwr_log(logging.ERROR, "An exception was raised when processing a message by RayBackend")
            flwr_log(logging.ERROR, RAY_REASON)
            flwr_log(logging.ERROR, "Traceback (most recent call last):\n  File ...\nKeyError: 'lr'")
            flwr_log(logging.ERROR, "ServerApp thread raised an exception")  # not a client's: stays
            flwr_log(logging.INFO, "configure_train: Sampled 3 nodes (out of 3)")
        flwr_log(logging.ERROR, "Traceback (most recent call last): after the run")  # filter gone
    finally:
        flwr_logger.removeHandler(handler)
        flwr_logger.setLevel(level)
    assert console == [
        "ServerApp thread raised an exception",
        "configure_train: Sampled 3 nodes (out of 3)",
        "Traceback (most recent call last): after the run",
    ]
    text = path.read_text()
    assert "RayBackend" in text and "Missing key(s)" in text and "KeyError: 'lr'" in text
    assert f"3 log record(s) of client exceptions (tracebacks) are in {path}" in caplog.text


# ---- the same apps through `flwr run`: a SuperLink and SuperNodes, or Flower's simulation runtime -----------
FLOWER_COMMANDS = (
    "flwr",
    "flower-superlink",
    "flower-supernode",
    "flower-superexec",
    "flwr-serverapp",
    "flwr-clientapp",
    "flwr-simulation",
)


def _flower_script(name: str) -> Path | None:
    """Flower's console script ``name``: beside this interpreter, else beside the one it was made from."""
    import shutil
    import sys

    for folder in (Path(sys.executable).parent, Path(sys.base_prefix) / "bin"):
        if (folder / name).is_file():
            return folder / name
    found = shutil.which(name)
    return Path(found) if found else None


@pytest.fixture
def flower_here(tmp_path, monkeypatch):
    """Flower's commands on this interpreter (where fedsim is installed), first on PATH: the environment of a
    user who installed fedsim beside Flower, whatever interpreter Flower's own scripts name."""
    import sys

    folder = tmp_path / "bin"
    folder.mkdir()
    for name in FLOWER_COMMANDS:
        script = _flower_script(name)
        if script is None:
            pytest.skip(f"Flower's {name} command is not installed")
        head, _, body = script.read_text().partition("\n")
        if not head.startswith("#!") or "python" not in head:
            pytest.skip(f"{script} is not a Python console script")
        (folder / name).write_text(f"#!{sys.executable}\n{body}")
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    for key, value in FLOWER_ENV.items():
        monkeypatch.setenv(key, value)
    return folder


def _run_overrides(app: str, extra: str) -> str:
    """The app's own ``overrides`` plus ``extra`` (``--run-config overrides=...`` replaces the pyproject's)."""
    return f"{_app_config(app)['config']['overrides']} {extra}"


@pytest.mark.slow  # starts Flower's SuperLink, SuperExec and SuperNodes
@pytest.mark.parametrize("app, nodes, rounds, per_round", [("quickstart", 2, 2, 2), ("pytorchapp", 4, 3, 2)])
def test_the_stock_apps_train_under_fedsims_serverapp_through_flwr_run(
    app, nodes, rounds, per_round, tmp_path, flower_here
):
    """`flwr run <app> <connection>` on a local SuperLink with SuperNodes that run Flower's own
    ``flower-supernode``: the app's ClientApp, verbatim, and fedsim's ServerApp, with no glue module."""
    from fedsim.deploy.launch import Federation, Security

    out = tmp_path / "run"
    extra = f"num_clients={nodes} quiet=true checkpoint_every=0 round_timeout=120" + (
        f" clients_per_round={nodes}" if app == "quickstart" else ""
    )
    fed = Federation(
        tmp_path / "work", Security(tls=False, auth=False), front="none", cwd=tmp_path, echo=lambda _: None
    )
    try:
        fed.start_superlink(timeout=120)
        for i in range(nodes):
            fed.start_supernode(i, nodes, poll=0.25)
        fed.wait_nodes_online(nodes, timeout=180)
        run_id = fed.submit(FLOWER_APPS / app, {"overrides": _run_overrides(app, extra), "out-dir": str(out)})
        status = fed.wait_run(run_id, 500, poll=1.0, done=(out / "summary.json").exists)
        log_text = fed.run_log(run_id)
    finally:
        fed.stop()
    assert status["status"] == "finished:completed", log_text[-3000:]
    _check_trained(out, read_metrics(out), rounds=rounds, per_round=per_round, lr=0.01, epochs=1)
    assert f"{nodes} node(s) run a ClientApp that is not fedsim's" in log_text
    assert "Traceback" not in log_text  # the query the stock clients cannot answer is one warning line


@pytest.mark.slow  # starts Flower's simulation SuperLink and Ray
def test_the_quickstart_app_trains_under_fedsims_serverapp_in_flowers_simulation_runtime(
    tmp_path, flower_here
):
    """`flwr run` on a SuperLink started with ``--simulation``: Flower's Simulation Runtime (Ray) runs the
    quickstart app's ClientApp and fedsim's ServerApp, both with the app's run_config."""
    from fedsim.deploy.launch import free_port, terminate, wait_for_superlink

    port, home, out = free_port(), tmp_path / "flwr-home", tmp_path / "run"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = {**os.environ, "FLWR_HOME": str(home)}
    cmd = ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess"]
    cmd += ["--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)]
    log_file = open(tmp_path / "superlink.log", "wb")
    link = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_for_superlink(f"127.0.0.1:{port}", 60, None, alive=lambda: link.poll() is None)
        extra = "num_clients=3 clients_per_round=3 quiet=true checkpoint_every=0"
        rc = f"overrides={json.dumps(_run_overrides('quickstart', extra))} out-dir={json.dumps(str(out))}"
        fc = "num-supernodes=3 client-resources-num-cpus=1"
        res = _flwr(
            env, "run", str(FLOWER_APPS / "quickstart"), "sim", "--run-config", rc, "--federation-config", fc
        )
        run_id = int(res["run-id"])
        status = {}
        for _ in range(600):
            status = _flwr(env, "ls", "sim", "--run-id", str(run_id))["runs"][0]
            if status["status"].startswith("finished"):
                break
            time.sleep(1.0)
    finally:
        terminate([link.pid])
        log_file.close()
    assert status.get("status") == "finished:completed", status
    _check_trained(out, read_metrics(out), rounds=2, per_round=3, lr=0.01, epochs=1)


def _flwr(env: dict, *args: str) -> dict:
    res = subprocess.run(
        ["flwr", *args, "--format", "json"], env=env, capture_output=True, text=True, timeout=120
    )
    out = json.loads(res.stdout[res.stdout.find("{") :])
    assert out.get("success", False), out
    return out

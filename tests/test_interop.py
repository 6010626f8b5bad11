"""Flower interoperability: a stock Flower ClientApp under fedsim's server, fedsim's ClientApp under Flower's
own strategies (FedAvg, client-side DP clipping, Krum), node discovery of foreign clients, Flower's keyword
names on fedsim's strategies."""

from __future__ import annotations

import json
import logging

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
    from fedsim.strategies.clipping import AdaptiveClipping, FixedClipping

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
    from fedsim.deploy.nodes import canonical_key

    with pytest.raises(ValueError):
        canonical_key(key)

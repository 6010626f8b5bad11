"""A hand-written Flower 1.42 app equivalent to fedsim's default experiment, for the benchmark.

Plain Flower usage: a ClientApp that builds its model per message and loads its partition from a per-process
cache (``functools.lru_cache``, as Flower's quickstart caches its ``FederatedDataset``: each Ray actor builds
the data set and the split once), Flower's FedAvg with ``strategy.start`` and a centralised ``evaluate_fn``,
run by ``run_simulation`` (Ray backend).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.nn import functional as F

NUM_CLIENTS, ROUNDS, PER_ROUND, EPOCHS, BATCH, LR, SEED = 20, 60, 10, 2, 16, 0.1, 0


@functools.lru_cache(maxsize=1)
def load_data():
    """The digits set and its Dirichlet split, built once per process (every actor reuses them)."""
    from fedsim.data.digits import load_digits
    from fedsim.data.partition import dirichlet

    ds = load_digits(seed=SEED)
    return ds, dirichlet(ds.y_train, NUM_CLIENTS, np.random.default_rng([SEED, 7]), alpha=0.5)


@functools.lru_cache(maxsize=NUM_CLIENTS)
def load_partition(pid: int):
    """Partition ``pid``'s tensors (cached per process, like the quickstart's partition cache)."""
    ds, parts = load_data()
    idx = parts[pid]
    return ds, torch.as_tensor(ds.x_train[idx]), torch.as_tensor(ds.y_train[idx])


def net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    _, x, y = load_partition(int(context.node_config["partition-id"]))
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    total, steps = 0.0, 0
    for _ in range(EPOCHS):
        for idx in torch.randperm(len(y)).split(BATCH):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + float(loss), steps + 1
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(y), "train-loss": total / steps}),
        }
    )
    return Message(content, reply_to=msg)


def make_server_app(sink: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        ds, _, _ = load_partition(0)
        xt, yt = torch.as_tensor(ds.x_test), torch.as_tensor(ds.y_test)
        model = net()

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            with torch.no_grad():
                acc = float((model(xt).argmax(1) == yt).float().mean())
            sink["accuracy"] = acc
            return MetricRecord({"accuracy": acc})

        strategy = FedAvg(
            fraction_train=PER_ROUND / NUM_CLIENTS,
            fraction_evaluate=0.0,
            min_available_nodes=NUM_CLIENTS,
            min_train_nodes=PER_ROUND,
        )
        with torch.random.fork_rng():
            torch.manual_seed(SEED)
            init = ArrayRecord(net().state_dict())
        strategy.start(
            grid=grid,
            initial_arrays=init,
            num_rounds=ROUNDS,
            train_config=ConfigRecord({}),
            evaluate_fn=evaluate_fn,
        )

    return app

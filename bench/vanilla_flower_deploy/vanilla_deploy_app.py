"""Plain Flower 1.42: FedAvg over the digits MLP, written as a Flower user would (no fedsim on the path but
the data loader, so both sides read the same data the same way).

Each ClientApp call runs in a fresh process on a SuperNode (Flower 1.42's process isolation), so it loads
the data set and its partition per message. With ``noop=true`` the clients return the received arrays and
nothing imports torch: what Flower itself costs per round.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

EPOCHS, BATCH, LR, SEED = 2, 16, 0.1, 0

client_app = ClientApp()
server_app = ServerApp()


def net():
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def load_partition(pid: int, num_partitions: int):
    from fedsim.data.digits import load_digits
    from fedsim.data.partition import dirichlet

    ds = load_digits(seed=SEED)
    parts = dirichlet(ds.y_train, num_partitions, np.random.default_rng([SEED, 7]), alpha=0.5)
    return ds, parts[pid]


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    if context.run_config["noop"]:
        return Message(
            RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg
        )
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    ds, idx = load_partition(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    x, y = torch.as_tensor(ds.x_train[idx]), torch.as_tensor(ds.y_train[idx])
    model = net()
    model.load_state_dict(arrays.to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for b in torch.randperm(len(y)).split(BATCH):
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    content = {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
    return Message(RecordDict(content), reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    noop, times = bool(cfg["noop"]), str(cfg["times-file"])

    def mark() -> None:
        if times:
            with open(times, "a") as f:
                f.write(f"{time.time()}\n")

    if noop:
        init = ArrayRecord([np.zeros((64, 64), np.float32), np.zeros(64, np.float32)])

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            mark()
            return MetricRecord({})
    else:
        import torch

        from fedsim.data.digits import load_digits

        ds = load_digits(seed=SEED)
        xt, yt = torch.as_tensor(ds.x_test), torch.as_tensor(ds.y_test)
        model = net()
        torch.manual_seed(SEED)
        init = ArrayRecord(net().state_dict())

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            with torch.no_grad():
                acc = float((model(xt).argmax(1) == yt).float().mean())
            mark()
            return MetricRecord({"accuracy": acc})

    n = int(cfg["num-partitions"])
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    strategy.start(
        grid=grid,
        initial_arrays=init,
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord({}),
        evaluate_fn=evaluate_fn,
    )

"""Agreement that means something: batched and per-client training compared from the same start.

A whole run compares models that went through many rounds of rounding amplified by ReLU sign flips (on the
CNN the paths drift past any fixed bound after a few dozen steps, without any wrong formula). Here every
comparison starts both paths from the same model: one round at a time (each round's aggregate, then both
continue from the per-client path's), and, for the CNN, one local step at a time for 40 steps.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from helpers import compose_cfg

from fedsim import build, keys
from fedsim.engines import vectorized
from fedsim.engines.pool import PoolGrid
from fedsim.engines.vectorized import VectorizedGrid, _Client, schedule, train_stacked
from fedsim.training import LocalTraining

SMALL_CNN = ["model=cnn", "model.channels=[4,6]", "model.hidden=16"]


def _aggregate(replies) -> dict[str, np.ndarray]:
    """The example-weighted mean of the replies' models, in float64 (FedAvg's)."""
    total, acc = 0.0, {}
    for rep in replies:
        assert not rep.has_error(), rep.error
        w = float(rep.content[keys.METRICS][keys.NUM_EXAMPLES])
        for name, arr in rep.content[keys.ARRAYS].items():
            acc[name] = acc.get(name, 0.0) + w * arr.numpy().astype(np.float64)
        total += w
    return {name: v / total for name, v in acc.items()}


def _round(grid, spec: str, arrays: ArrayRecord, nodes: list[int], rnd: int) -> dict[str, np.ndarray]:
    msgs = [
        grid.create_message(
            RecordDict(
                {
                    keys.ARRAYS: arrays,
                    keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec, keys.SERVER_ROUND: rnd}),
                }
            ),
            MessageType.TRAIN,
            nid,
            str(rnd),
        )
        for nid in nodes
    ]
    return _aggregate(grid.send_and_receive(msgs))


def _rounds_agree(overrides: list[str], rounds: int, rtol: float) -> float:
    """Both engines run ``rounds`` rounds, each from the per-client path's previous aggregate; the largest
    difference of the round's aggregates relative to the largest weight."""
    cfg = compose_cfg("num_clients=6", *overrides)
    spec = build.client_spec(cfg, "cpu")
    model = build.build_initial_model(json.loads(spec))
    arrays = ArrayRecord(model.state_dict())
    seen = []
    original = vectorized._train_bucket

    def counting(members, *args):
        seen.extend(members)
        return original(members, *args)

    worst = 0.0
    vectorized._train_bucket = counting
    try:
        with PoolGrid(6) as seq, VectorizedGrid(6, threads=1) as vec:
            nodes = sorted(seq.get_node_ids())[:4]
            assert sorted(vec.get_node_ids())[:4] == nodes
            for rnd in range(1, rounds + 1):
                a = _round(seq, spec, arrays, nodes, rnd)
                b = _round(vec, spec, arrays, nodes, rnd)
                scale = max(float(np.abs(v).max()) for v in a.values())
                diff = max(float(np.abs(a[n] - b[n]).max()) for n in a) / scale
                assert diff <= rtol, (rnd, diff)
                worst = max(worst, diff)
                arrays = ArrayRecord({n: torch.from_numpy(v.astype(np.float32)) for n, v in a.items()})
    finally:
        vectorized._train_bucket = original
    assert len(seen) == 4 * rounds  # every client trained batched
    return worst


def test_each_round_agrees_from_the_same_start_mlp():
    # the default MLP (hand-written batched step), momentum and weight decay
    assert _rounds_agree([], rounds=4, rtol=1e-6) < 1e-6
    assert _rounds_agree(["client=momentum", "client.weight_decay=0.01"], rounds=3, rtol=1e-6) < 1e-6


def test_each_round_agrees_from_the_same_start_cnn_36_local_steps():
    assert _rounds_agree([*SMALL_CNN, "client.local_steps=36"], rounds=2, rtol=1e-6) < 1e-6


def test_cnn_agrees_step_by_step_for_40_local_steps():
    """40 local steps of the CNN, each from the per-client path's parameters (teacher forcing): the batched
    step (grouped convolutions) equals each client's own SGD step to float rounding at every step."""
    spec = build.client_spec(compose_cfg("num_clients=6", *SMALL_CNN), "cpu")
    local = LocalTraining(optimizer="sgd", lr=0.1, batch_size=8, local_steps=40)
    tasks = [build.client_task(spec, pid) for pid in range(4)]
    model = tasks[0].model
    own = [{n: p.detach().clone() for n, p in model.named_parameters()} for _ in tasks]
    plans = [
        schedule(int(t.x_train.shape[0]), local, torch.Generator().manual_seed(pid))
        for pid, t in enumerate(tasks)
    ]
    ref = build.client_task(spec, 5).model  # a model object of the same architecture for the per-client steps
    worst = 0.0
    for step in range(40):
        members = [_Client(None, t, own[i], [plans[i][step]]) for i, t in enumerate(tasks)]
        stacked, _ = train_stacked(members, local, "cpu", 0.0)
        for i, t in enumerate(tasks):
            ref.load_state_dict(own[i])
            opt = torch.optim.SGD(ref.parameters(), lr=local.lr)
            opt.zero_grad(set_to_none=True)
            idx = plans[i][step]
            t.task.loss(ref(t.x_train[idx]), t.y_train[idx]).backward()
            opt.step()
            for n, p in ref.named_parameters():
                scale = float(p.detach().abs().max())
                worst = max(worst, float((stacked[n][i] - p.detach()).abs().max()) / scale)
            own[i] = {n: p.detach().clone() for n, p in ref.named_parameters()}
        assert worst < 1e-6, (step, worst)

"""Fabricated Flower messages and a fake grid for strategy tests (no Flower runtime, no network)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from uuid import uuid4

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedsim import keys


@contextlib.contextmanager
def server_identity() -> Iterator[None]:
    """Let instruction messages be built outside a running ServerApp (Flower reads the run id from here)."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    if saved[0] is None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of numpy arrays."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def numpy_of(rec: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of a record."""
    return {k: a.numpy() for k, a in rec.items()}


def make_reply(
    arrays: Mapping[str, np.ndarray], num_examples: int = 1, partition_id: int = 0, **metrics: float
) -> Message:
    """A train reply as fedsim's client sends it; ``metrics`` (``_`` -> ``-``) are added to its MetricRecord."""
    with server_identity():
        ins = Message(
            RecordDict({keys.CONFIG: ConfigRecord({})}), dst_node_id=100 + partition_id, message_type="train"
        )
    ins.metadata.__dict__["_message_id"] = str(uuid4())  # as Flower's in-memory grid does
    m = {
        keys.NUM_EXAMPLES: num_examples,
        keys.TRAIN_LOSS: 1.0,
        keys.PARTITION_ID: partition_id,
        keys.NUM_STEPS: 1,
    }
    m.update({k.replace("_", "-"): v for k, v in metrics.items()})
    return Message(RecordDict({keys.ARRAYS: record(arrays), keys.METRICS: MetricRecord(m)}), reply_to=ins)


def make_replies(
    models: list[Mapping[str, np.ndarray]], weights: list[int] | None = None, **metrics
) -> list[Message]:
    """One reply per model, partition ids 0..n-1."""
    weights = weights or [1] * len(models)
    return [make_reply(a, w, p, **metrics) for p, (a, w) in enumerate(zip(models, weights))]


class FakeGrid(Grid):
    """A grid that only knows its node ids; enough for ``configure_train``/``configure_evaluate``."""

    def __init__(self, node_ids: list[int]) -> None:
        self._nodes = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._nodes)

    def set_run(self, run_id):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError


def configure(
    strategy,
    rnd: int,
    global_arrays: Mapping[str, np.ndarray],
    num_nodes: int = 3,
    config: dict | None = None,
) -> list[Message]:
    """Call ``strategy.configure_train`` as fedsim's loop does; return the messages."""
    with server_identity():
        return list(
            strategy.configure_train(
                rnd,
                record(global_arrays),
                ConfigRecord(config or {}),
                FakeGrid(list(range(100, 100 + num_nodes))),
            )
        )


def run_round(strategy, rnd: int, global_arrays: Mapping[str, np.ndarray], replies: list[Message]):
    """configure_train then aggregate_train; return ``(arrays as numpy or None, metrics dict or None)``."""
    configure(strategy, rnd, global_arrays, num_nodes=max(1, len(replies)))
    arrays, metrics = strategy.aggregate_train(rnd, replies)
    return (None if arrays is None else numpy_of(arrays)), (None if metrics is None else dict(metrics))


def snapshot(replies: list[Message]) -> list[dict[str, np.ndarray]]:
    """Copies of the replies' arrays, to check later that nobody mutated them."""
    return [numpy_of(next(iter(r.content.array_records.values()))) for r in replies]


def flower_kwargs() -> dict:
    """The sampling kwargs fedsim passes every strategy."""
    return {
        "fraction_train": 1.0,
        "fraction_evaluate": 0.0,
        "min_train_nodes": 1,
        "min_available_nodes": 1,
        "min_evaluate_nodes": 1,
    }

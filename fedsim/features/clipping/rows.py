"""The clipping wrapper's work on a cohort's rows (``fedsim.features.clipping.wrapper``): each row's update and its
norm in float64 where the rows sit, and the stand-in reply of a DP round without a valid one."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

from fedsim import keys
from fedsim.aggregate import is_float
from fedsim.records import to_record

STAND_IN_NODE = 0  # a node id that no real node has (Flower draws node ids at random, never 0)


def noise_reply(server_round: int, arrays: dict[str, np.ndarray], metrics: dict[str, Any]) -> Message:
    """A stand-in train reply carrying ``arrays`` with ``metrics``: what the inner strategy aggregates in a DP
    round without a valid reply (the global model plus the round's noise, weight 1)."""
    meta = Metadata(
        run_id=0,
        message_id="",
        src_node_id=STAND_IN_NODE,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    content = RecordDict({keys.ARRAYS: to_record(arrays), keys.METRICS: MetricRecord(dict(metrics))})
    return Message(content=content, metadata=meta)


def row_norms(cohort: Any, update: Any, floats: list[str]) -> Any:
    """The L2 norm of each row's update over every floating-point parameter (float64, where the rows are)."""
    squares = torch.zeros(
        len(cohort), dtype=torch.float64, device=update.x[floats[0]].device if floats else "cpu"
    )
    for k in floats:
        squares += update(k).reshape(len(cohort), -1).square().sum(1)
    return squares.sqrt()


def row_updates(current: dict[str, np.ndarray], cohort: Any, device: Any, per_step: bool = False) -> Any:
    """``update(k)``: the rows' updates ``y - x`` of floating-point parameter ``k`` in float64, divided by each
    row's ``num-steps`` when ``per_step`` (FedNova); ``update.x`` holds ``x`` on the rows' device."""
    x = {
        k: torch.as_tensor(np.asarray(a, np.float64), device=device)
        for k, a in current.items()
        if is_float(a)
    }
    steps = None
    if per_step:  # FedNova: the update per local step, (y_k - x) / tau_k
        taus = [max(float(mt.get(keys.NUM_STEPS, 1)), 1.0) for mt in cohort.metrics]
        steps = torch.tensor(taus, dtype=torch.float64, device=device)

    def update(k: str) -> torch.Tensor:
        d = cohort.arrays[k].detach().double() - x[k]
        return d if steps is None else d / steps.view(-1, *([1] * (d.dim() - 1)))

    update.x = x
    return update

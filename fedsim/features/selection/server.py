"""Client selection: which clients a synchronous round trains (``selection=``).

``selection=uniform`` (the default) is the loop's own draw: ``clients_per_round`` of the population without
replacement, seeded by ``(seed, round)``. ``selection=power_of_choice`` wraps the strategy in
:class:`PowerOfChoice` (Cho, Wang, Joshi, "Towards understanding biased client selection in federated
learning", AISTATS 2022, arXiv 2010.01243, the "pow-d" rule):

1. draw ``d`` candidates without replacement (seeded by ``(seed, round)``), uniformly or, with
   ``by_size=true`` as in the paper, with probability proportional to their training-set sizes;
2. send each candidate the current global model and ask for its loss on its own training data (an
   evaluate message with ``probe-train-loss``; the ClientApp then evaluates on the training split);
3. train the ``clients_per_round`` candidates with the highest loss (ties: the lower partition id).

The probes cost one extra round trip to ``d`` clients per round; the simulated clock does not count it. A
candidate that does not answer in time is ranked last. ``d = clients_per_round`` is the uniform draw again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim import keys
from fedsim.checks import integer
from fedsim.comm import message_bytes
from fedsim.errors import ConfigError
from fedsim.features.selection.client import ProbeTrain
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng
from fedsim.strategies.wrapper import Wrapper

log = logging.getLogger("fedsim")

PROBE_TRAIN = keys.PROBE_TRAIN  # evaluate-config key: report the loss on the training split

Losses = Callable[[list[int]], dict[int, float]]  # partition ids -> their local losses under the global model


# ---------------------------------------------------------------- pure functions
def draw_candidates(
    seed: int, server_round: int, num_clients: int, d: int, sizes: Mapping[int, int] | None = None
) -> list[int]:
    """``d`` distinct partition ids for round ``server_round``: uniform, or proportional to ``sizes``, sorted."""
    rng = seeded_rng(seed, Purpose.SELECTION, server_round)
    p = None
    if sizes is not None:
        w = np.array([max(0, int(sizes.get(k, 0))) for k in range(num_clients)], np.float64)
        if np.count_nonzero(w) >= d:  # enough clients with data to draw d of them by size
            p = w / w.sum()
    return sorted(int(k) for k in rng.choice(num_clients, size=d, replace=False, p=p))


def highest_loss(losses: Mapping[int, float], m: int) -> list[int]:
    """The ``m`` partition ids with the highest loss (ties and NaN: lower id first, NaN last), sorted."""
    ranked = sorted(losses, key=lambda k: (-losses[k] if np.isfinite(losses[k]) else np.inf, k))
    return sorted(ranked[:m])


# ---------------------------------------------------------------- the loop's probe
def probe_losses(
    grid: Grid,
    node_of: Mapping[int, int],
    partition_ids: list[int],
    arrays: ArrayRecord,
    spec: str,
    server_round: int,
    timeout: float,
    tally: dict[str, int] | None = None,
) -> dict[int, float]:
    """Ask ``partition_ids`` for their training loss under ``arrays``; ``-inf`` for those that do not answer.

    ``tally["down"]`` and ``tally["up"]`` grow by the serialised sizes of the probes and their replies.
    """
    config = ConfigRecord({keys.RUN_SPEC: spec, keys.SERVER_ROUND: server_round, PROBE_TRAIN: True})
    content = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
    messages = [Message(content, node_of[p], MessageType.EVALUATE) for p in partition_ids]
    pid_of = {node_of[p]: p for p in partition_ids}
    losses = {p: -np.inf for p in partition_ids}
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    if tally is not None:
        tally["down"] += message_bytes(messages)
        tally["up"] += message_bytes(replies)
    for reply in replies:
        pid = pid_of.get(reply.metadata.src_node_id)
        if pid is None or reply.has_error() or not reply.has_content():
            continue
        metrics = reply.content.get(keys.METRICS)
        if isinstance(metrics, MetricRecord) and keys.EVAL_LOSS in metrics:
            losses[pid] = float(metrics[keys.EVAL_LOSS])
    return losses


# ---------------------------------------------------------------- the wrapper
class PowerOfChoice(Wrapper):
    """Train the ``clients_per_round`` of ``d`` candidates with the highest local loss (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The strategy that trains and aggregates (possibly wrapped by ``attack=``).
    d : int or None
        Candidates per round, in ``[clients_per_round, num_clients]``; None: ``min(2 m, num_clients)``.
    by_size : bool
        Draw candidates with probability proportional to their training-set sizes (the paper) or uniformly.
    num_clients, clients_per_round, seed : int
        Filled in by fedsim.
    """

    option_name = "power_of_choice"
    draws_cohort = "the cohort by probing candidates' losses"  # fedsim.strategies.composition
    async_reason = "an asynchronous strategy picks each next client itself"
    client_half = ProbeTrain  # a loss probe is answered on the training split
    fold_order = 40  # outermost: asked first for the cohort
    touches_replies = (
        False  # it picks the cohort and leaves the replies alone: the stacked path passes through
    )

    def __init__(
        self,
        strategy: Strategy,
        d: int | None,
        num_clients: int,
        clients_per_round: int,
        seed: int,
        by_size: bool = True,
    ) -> None:
        super().__init__(strategy)
        self.num_clients = integer("num_clients", num_clients, 1)
        self.clients_per_round = integer("clients_per_round", clients_per_round, 1, self.num_clients)
        self.d = integer(
            "d",
            min(2 * self.clients_per_round, self.num_clients) if d is None else d,
            self.clients_per_round,
            self.num_clients,
            what=f"an integer in [clients_per_round={self.clients_per_round}, num_clients={self.num_clients}]",
        )
        if not isinstance(by_size, bool):
            raise ConfigError("by_size", by_size, "true or false")
        self.by_size = by_size
        self.seed = integer("seed", seed, 0)

    def select_cohort(
        self,
        server_round: int,
        num_clients: int,
        clients_per_round: int,
        losses: Losses,
        sizes: Mapping[int, int] | None = None,
    ) -> list[int]:
        """Round ``server_round``'s cohort: the highest-loss ``clients_per_round`` of ``d`` candidates."""
        candidates = draw_candidates(
            self.seed, server_round, num_clients, self.d, sizes if self.by_size else None
        )
        if self.d == clients_per_round:
            return candidates
        return highest_loss(losses(candidates), clients_per_round)

    def summary(self) -> None:
        """Log the selection rule, then the inner strategy's summary."""
        log.info("power-of-choice selection: d=%d candidates per round, by_size=%s", self.d, self.by_size)
        self.strategy.summary()

    def own_summary_fields(self) -> dict[str, Any]:
        """summary.json entries: the selection rule."""
        return {"selection": f"power_of_choice(d={self.d})"}

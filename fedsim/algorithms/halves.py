"""Client halves: what a feature does on the client, around local training, beside the client algorithm.

This module is the framework only; the halves themselves live with their features (``fedsim.features``: each
feature's folder holds its client and server halves). A server-side feature
(``fedsim.strategies.wrapper.Wrapper``) names its client half in ``client_half`` (the class, or a class path),
the way a strategy names its client algorithm; ``fedsim.build`` writes the run's list into the client spec
(``halves``: class paths, client-side clipping and injected faults first), and fedsim's ClientApp builds each
the way a ``_target_`` is built and applies them in order around every local training:

1. :meth:`ClientHalf.labels`: the labels the client trains on (label flipping);
2. local training (the client algorithm's hooks, ``fedsim.algorithms.base``);
3. :meth:`ClientHalf.on_reply`: what is sent back (client-side clipping, injected faults, compression), with
   the client's persistent state (:attr:`Reply.state`) when :meth:`ClientHalf.keeps_state` says so;
4. for an evaluation message, :meth:`ClientHalf.eval_data` may choose the split (selection's loss probe).

A batched engine (``fedsim.engines.vectorized``) trains a cohort as rows of stacked tensors and asks each half
for its batched form: :meth:`ClientHalf.batched` (whether it runs on rows for this client), the train-config
keys it reads (``keys``), :meth:`ClientHalf.labels` per client and :meth:`ClientHalf.on_rows` after training,
whose default runs :meth:`ClientHalf.on_reply` on each row. A new half needs no edit to any engine.

Each half acts only on messages that ask for it (their train-config keys). This module names no feature and
imports no server-side module: the client layer knows the contract, the spec names the halves.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsim.algorithms.base import LocalRun
from fedsim.algorithms.state import ClientState, store_for


@dataclass
class Reply:
    """A train reply being made: the model to send (``model``, edited in place by the halves), the global model
    it started from, the instruction, who sends it, its extra metrics and the client's persistent state."""

    model: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    ins: Any  # fedsim.messages.TrainInstruction
    partition_id: int
    seed: int
    faults: Any = None  # fedsim.features.faults.client.FaultRates or None
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Rows:
    """The batched form of :class:`Reply`: a cohort's train replies being made, one row per client.

    ``model`` holds each trained parameter stacked ``(rows, *shape)`` on the cohort's device (edited in place);
    ``start()`` the rows' global models stacked alike (made when first asked); per row, its instruction,
    partition id, seed, fault rates and extra metrics (``metrics[i]``, as :attr:`Reply.metrics`).
    """

    model: dict[str, torch.Tensor]
    starts: Any  # () -> dict[str, torch.Tensor]: the rows' start models, stacked
    ins: list
    partition_ids: list[int]
    seeds: list[int]
    faults: list
    metrics: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.metrics = self.metrics or [{} for _ in self.ins]
        self._start: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.ins)

    def start(self) -> dict[str, torch.Tensor]:
        """The rows' start models, ``(rows, *shape)`` by name."""
        if self._start is None:
            self._start = self.starts()
        return self._start

    def reply(self, i: int, with_start: bool = True) -> Reply:
        """Row ``i`` as the :class:`Reply` the per-client path would make (its model a copy)."""
        start = {n: t[i] for n, t in self.start().items()} if with_start else {}
        model = {n: t[i].clone() for n, t in self.model.items()}
        return Reply(
            model, start, self.ins[i], self.partition_ids[i], self.seeds[i], self.faults[i], self.metrics[i]
        )

    def put(self, i: int, reply: Reply, half: object) -> None:
        """Write ``reply`` (row ``i`` after ``half``'s ``on_reply``) back into the rows; ``ValueError`` when the
        half changed the reply's form (names, shapes, dtypes), which rows cannot hold."""
        for n, t in self.model.items():
            got = reply.model.get(n)
            if not isinstance(got, torch.Tensor) or got.shape != t.shape[1:] or got.dtype != t.dtype:
                raise ValueError(f"client half {type(half).__name__} changed the reply's {n!r}: not batched")
        if set(reply.model) != set(self.model):
            raise ValueError(f"client half {type(half).__name__} changed the reply's arrays: not batched")
        for n, t in self.model.items():
            t[i].copy_(reply.model[n])
        self.metrics[i] = reply.metrics


class ClientHalf:
    """The client half of a feature; every hook leaves things as they are unless a subclass overrides it.

    Attributes
    ----------
    needs_start : bool
        ``on_reply`` reads :attr:`Reply.start` (the global model the update is taken from).
    keys : tuple of str
        The train-config keys it reads: a batched engine trains a message with them batched (calling this half's
        batched form) instead of sending it through the ClientApp as a key nobody claims.
    """

    needs_start = False
    keys: tuple[str, ...] = ()

    def active(self, ins: Any) -> bool:
        """True when the train instruction ``ins`` asks for this half (its keys are in it)."""
        return False

    def keeps_state(self, ins: Any) -> bool:
        """True when this half reads or writes the client's persistent state for ``ins``."""
        return False

    def labels(self, ins: Any, partition_id: int, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels the client trains on."""
        return y

    def on_reply(self, reply: Reply) -> None:
        """Change what is sent back (``reply.model``, ``reply.metrics``, ``reply.state``) in place."""

    def eval_data(self, config: Any, x_train, y_train, x_val, y_val) -> tuple | None:
        """The split an evaluation message is answered on, or None for the validation split."""
        return None

    def batched(self, ins: Any, task: Any) -> bool:
        """True when this half, active for ``ins``, runs on a batched cohort's rows for the client of ``task``
        (a ``fedsim.build.ClientTask``); otherwise the client trains through the ClientApp. Default: unless it
        keeps the client's persistent state (rows carry none)."""
        return not self.keeps_state(ins)

    def on_rows(self, rows: Rows) -> None:
        """The batched form of :meth:`on_reply` over a cohort's rows (``rows.model`` edited in place). Default:
        :meth:`on_reply` on each row whose instruction asks for this half, written back; a half that changes the
        reply's form (its arrays' names, shapes or dtypes) gives ``ValueError`` (the engine then trains the
        clients one by one)."""
        if type(self).on_reply is ClientHalf.on_reply:
            return
        for i in range(len(rows)):
            if self.active(rows.ins[i]):
                reply = rows.reply(i, self.needs_start)
                self.on_reply(reply)
                rows.put(i, reply, self)


@functools.lru_cache(maxsize=16)
def _chain(paths: tuple[str, ...]) -> tuple[ClientHalf, ...]:
    from hydra.utils import get_object

    out = []
    for path in paths:
        try:
            cls = get_object(path)
        except Exception:  # noqa: BLE001  (any import failure is the same error)
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, ClientHalf)):
            raise ValueError(
                f"client half {path!r} in the run spec: expected a fedsim.algorithms.halves.ClientHalf"
            )
        out.append(cls())
    return tuple(out)


def chain(spec: str | dict) -> tuple[ClientHalf, ...]:
    """The client halves a run spec names, in the order they apply (``spec["halves"]``: ``fedsim.build``
    writes client-side clipping and injected faults, then the features' ``client_half``)."""
    if isinstance(spec, str):
        return _chain_of_json(spec)
    return _chain(tuple(spec.get("halves") or ()))


@functools.lru_cache(maxsize=64)
def _chain_of_json(spec: str) -> tuple[ClientHalf, ...]:
    """:func:`chain` of a JSON run spec, parsed once per spec (every message of a run carries the same)."""
    return chain(json.loads(spec))


def run_on_rows(half: ClientHalf, rows: Rows) -> None:
    """``half.on_rows(rows)``, unless a subclass overrides ``on_reply`` below the class whose ``on_rows`` it
    inherits (a user's subclass of a shipped half): then its ``on_reply`` on each row (the default form), so
    the override counts on every engine."""
    mro = type(half).__mro__
    rows_owner = next(c for c in mro if "on_rows" in vars(c))
    reply_owner = next(c for c in mro if "on_reply" in vars(c))
    if issubclass(rows_owner, reply_owner):
        half.on_rows(rows)
    else:
        ClientHalf.on_rows(half, rows)


@dataclass(frozen=True)
class RowHalves:
    """What a batched engine asks of the client halves one train instruction names: those it asks for
    (``active``, in order: their ``on_rows`` after training), those to ask per client (``ask``: their
    :meth:`ClientHalf.batched` reads the client's task), those that give labels (``relabel``), and the first
    that runs on no row of this instruction (``refused``: the clients train through the ClientApp)."""

    active: tuple[ClientHalf, ...] = ()
    ask: tuple[ClientHalf, ...] = ()
    relabel: tuple[ClientHalf, ...] = ()
    refused: str | None = None


def row_halves(spec: str, ins: Any) -> RowHalves:
    """The :class:`RowHalves` of the halves of ``spec`` that ``ins`` asks for; a half that keeps ``batched``'s
    default (it does not read the task) is asked once, here."""
    active = tuple(h for h in chain(spec) if h.active(ins))
    ask = tuple(h for h in active if type(h).batched is not ClientHalf.batched)
    refused = next((type(h).__name__ for h in active if h not in ask and not h.batched(ins, None)), None)
    relabel = tuple(h for h in active if type(h).labels is not ClientHalf.labels)
    return RowHalves(active, ask, relabel, refused)


@dataclass
class ClientChain:
    """One train task's client side beside the training loop: the client algorithm, the client halves the
    instruction asks for (in order), and the client's persistent state they keep (``fedsim.algorithms.state``:
    the run folder in simulation, the SuperNode's ``Context.state`` in deployment)."""

    algorithm: Any  # fedsim.algorithms.base.ClientAlgorithm
    halves: list[ClientHalf]
    store: ClientState | None

    @classmethod
    def build(cls, spec: str, task: Any, ins: Any, node_config: Any, context_state: Any) -> ClientChain:
        """The chain of ``task`` (a ``fedsim.build.ClientTask``) for the instruction ``ins``."""
        active = [h for h in chain(spec) if h.active(ins)]
        keeps = task.algorithm.stateful or any(h.keeps_state(ins) for h in active)
        store = store_for(node_config, context_state, task.partition_id, ins.draw_index) if keeps else None
        return cls(task.algorithm, active, store)

    def local_run(self, task: Any, ins: Any, local: Any, incoming: dict) -> LocalRun:
        """The client algorithm's view of the task (the model holds the global weights), with its state."""
        start = {n: p.detach().clone() for n, p in task.model.named_parameters() if p.requires_grad}
        run = LocalRun(
            task.model, ins, local, task.partition_id, start=start, incoming=incoming, task=task.task
        )
        if self.store is not None:
            run.state = self.store.load()
        self._global = (
            {k: v.detach().clone().cpu() for k, v in task.model.state_dict().items()}
            if any(h.needs_start for h in self.halves)
            else {}
        )
        return run

    def labels(self, task: Any, ins: Any) -> torch.Tensor:
        """The labels the client trains on."""
        y = task.y_train
        for half in self.halves:
            y = half.labels(ins, task.partition_id, y, task.num_classes)
        return y

    def reply(self, task: Any, run: LocalRun) -> Reply:
        """After training: the state kept, then the model to send as the halves make it."""
        if self.store is not None:
            self.store.save(run.state)
        model = {k: v.detach().cpu() for k, v in task.model.state_dict().items()}
        reply = Reply(
            model, self._global, run.instruction, task.partition_id, task.seed, task.faults, dict(run.metrics)
        )
        reply.state = dict(run.state)
        for half in self.halves:
            half.on_reply(reply)
        if self.store is not None and any(h.keeps_state(run.instruction) for h in self.halves):
            self.store.save(reply.state)
        return reply


def saved_state(
    node_config: Any, context_state: Any, partition_id: int, version: int
) -> dict[str, np.ndarray]:
    """The persistent arrays the client saved as ``version`` (its state before task ``version``), e.g. Ditto's
    personal model for an evaluation."""
    return store_for(node_config, context_state, partition_id, version).load()

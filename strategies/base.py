"""What a strategy may offer fedsim's loops: the contract, written down once.

A **synchronous** strategy is a Flower ``flwr.serverapp.strategy.Strategy``: the loop calls
``configure_train`` / ``aggregate_train`` every round and ``configure_evaluate`` / ``aggregate_evaluate`` when
``federated_eval`` is on. fedsim samples the cohort itself and hands ``configure_*`` a grid view holding only
the sampled nodes, so a strategy sends to every node it is given.

An **asynchronous** strategy subclasses :class:`fedsim.strategies.async_base.AsyncStrategy`.

Either kind may also offer these optional capabilities; the loops, the builder and the checkpoints ask for them
only through the functions below (never by probing attributes elsewhere):

============================  ===============================================================================
capability                    meaning
============================  ===============================================================================
:class:`Stateful`             ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint keeps. Without
                              them the strategy object is pickled into the checkpoint.
:class:`ChecksCohort`         ``check_cohort(clients_per_round)`` raises ``ConfigError`` before any work when
                              the cohort is too small for it (e.g. Krum's ``2f + 3``).
:class:`SamplesCohort`        ``sample_cohort(server_round, num_clients, clients_per_round)`` returns the
                              round's partition ids, replacing the loop's uniform draw (e.g. DP's Poisson
                              sampling, which the privacy accountant must match).
:class:`ReportsSummary`       ``summary_fields()`` returns entries for summary.json (e.g. the privacy
                              guarantee: epsilon, delta, accountant, sampling).
:class:`SelectsCohort`       ``select_cohort(server_round, num_clients, clients_per_round, losses, sizes)``:
                              a selection rule (``fedsim.selection``, e.g. power of choice) picks the
                              cohort, asking candidates for their loss through ``losses(partition_ids)``.
:class:`DecodesReplies`      ``decode_replies(replies, current)``: replies carry compressed updates
                              (``fedsim.compression``); the loop decodes them before screening.
:class:`CountsMalicious`     ``malicious_among(partition_ids)``: how many of a round's replies came from
                              attackers (``fedsim.attacks``; metrics.jsonl field ``malicious``).
``client_algorithm``          a class attribute naming the client algorithm (``fedsim.algorithms``) the
                              strategy's clients must run, e.g. SCAFFOLD's; fedsim gives it to the clients.
``releases``                  class attribute: what the strategy sends its clients and how it is computed
                              from the replies (``fedsim.strategies.composition.Release``; default: a mean
                              global model). DP refuses what its wrapper does not privatise.
``needs_local``               class attribute: the local optimiser the server rule assumes (FedNova: sgd).
``privatises``,               wrapper class attributes: what a DP wrapper clips and noises; that it draws the
``draws_cohort``              cohort itself. ``composition.check`` derives every refusal from these.
============================  ===============================================================================
"""

from __future__ import annotations

import io
import pickle as _pickle
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from flwr.app import Message, MetricRecord

from fedsim import keys
from fedsim.strategies.async_base import AsyncStrategy


@runtime_checkable
class Stateful(Protocol):
    """A strategy whose checkpoint is its ``state_dict()`` (plain values and numpy arrays)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ChecksCohort(Protocol):
    """A strategy that needs a minimum cohort (checked once, before any work)."""

    def check_cohort(self, clients_per_round: int) -> None: ...


@runtime_checkable
class SamplesCohort(Protocol):
    """A strategy that draws each round's cohort itself (sorted partition ids)."""

    def sample_cohort(self, server_round: int, num_clients: int, clients_per_round: int) -> list[int]: ...


@runtime_checkable
class SelectsCohort(Protocol):
    """A client-selection rule (``fedsim.selection``) that may probe clients before choosing the cohort."""

    def select_cohort(
        self,
        server_round: int,
        num_clients: int,
        clients_per_round: int,
        losses: Callable[[list[int]], dict[int, float]],
        sizes: dict[int, int] | None = None,
    ) -> list[int]: ...


@runtime_checkable
class DecodesReplies(Protocol):
    """A compression wrapper (``fedsim.compression``): replies carry encoded updates the loop decodes first."""

    def decode_replies(self, replies: Iterable[Message], current: Any) -> list[Message]: ...


@runtime_checkable
class CountsMalicious(Protocol):
    """A strategy that knows which clients attack (``fedsim.attacks``)."""

    def malicious_among(self, partition_ids: Iterable[int]) -> int: ...


@runtime_checkable
class ReportsSummary(Protocol):
    """A strategy with something to say in summary.json."""

    def summary_fields(self) -> dict[str, Any]: ...


def unwrap(strategy: object) -> object:
    """The strategy inside wrappers (a wrapper keeps the strategy it wraps as ``.strategy``)."""
    from flwr.serverapp.strategy import Strategy

    while isinstance(getattr(strategy, "strategy", None), (Strategy, AsyncStrategy)):
        strategy = strategy.strategy
    return strategy


def client_algorithm(strategy: object) -> str | None:
    """The client algorithm (class path) the strategy's clients must run, or None for any."""
    return getattr(unwrap(strategy), "client_algorithm", None)


def is_async(strategy: object) -> bool:
    """True for an asynchronous strategy (run by ``fedsim.async_server``)."""
    return isinstance(strategy, AsyncStrategy)


def state_dict(strategy: object) -> dict[str, Any] | None:
    """The strategy's ``state_dict()``, or None when it has none (checkpoints then pickle the object)."""
    return strategy.state_dict() if isinstance(strategy, Stateful) else None


def check_cohort(strategy: object, clients_per_round: int) -> None:
    """Let a strategy that needs a minimum cohort refuse ``clients_per_round`` (``ConfigError``)."""
    if isinstance(strategy, ChecksCohort):
        strategy.check_cohort(clients_per_round)


def sample_cohort(
    strategy: object, server_round: int, num_clients: int, clients_per_round: int
) -> list[int] | None:
    """The strategy's own cohort for ``server_round`` (sorted partition ids), or None to let the loop draw it."""
    if isinstance(strategy, SamplesCohort):  # a wrapper may answer None: its inner strategy draws none either
        cohort = strategy.sample_cohort(server_round, num_clients, clients_per_round)
        return None if cohort is None else sorted(int(p) for p in cohort)
    return None


def decode_replies(strategy: object, replies: list[Message], current: Any) -> list[Message]:
    """The replies with compressed updates decoded into models (``compression=``), by the first wrapper in the
    chain that decodes; the replies themselves when none does."""
    from flwr.serverapp.strategy import Strategy

    while strategy is not None:
        if isinstance(strategy, DecodesReplies):
            return strategy.decode_replies(replies, current)
        inner = getattr(strategy, "strategy", None)
        strategy = inner if isinstance(inner, (Strategy, AsyncStrategy)) else None
    return replies


def malicious_count(strategy: object, partition_ids: Iterable[int]) -> int | None:
    """How many of ``partition_ids`` are attackers, or None when the run has no attack."""
    count = strategy.malicious_among(partition_ids) if isinstance(strategy, CountsMalicious) else None
    return None if count is None else int(count)


def select_cohort(
    strategy: object,
    server_round: int,
    num_clients: int,
    clients_per_round: int,
    losses: Callable[[list[int]], dict[int, float]],
    sizes: dict[int, int] | None = None,
) -> list[int] | None:
    """The cohort a selection rule (``selection=``) picks, or None to let the loop draw it uniformly.

    ``losses(partition_ids)`` asks those clients for their local loss under the current global model.
    """
    if isinstance(strategy, SelectsCohort):
        cohort = strategy.select_cohort(server_round, num_clients, clients_per_round, losses, sizes)
        return sorted(int(p) for p in cohort)
    return None


def summary_fields(strategy: object) -> dict[str, Any]:
    """The strategy's entries for summary.json (empty when it has none)."""
    return dict(strategy.summary_fields()) if isinstance(strategy, ReportsSummary) else {}


def weight_key(strategy: object) -> str:
    """The reply metric a Flower strategy weights by (``num-examples`` unless it says otherwise)."""
    return str(getattr(strategy, "weighted_by_key", keys.NUM_EXAMPLES))


def train_metrics(strategy: object, replies: Iterable[Message], key: str) -> MetricRecord | None:
    """The strategy's own aggregation of train metrics (Flower's ``train_metrics_aggr_fn``), weighted by ``key``.

    None when the strategy has no such function.
    """
    aggr = getattr(strategy, "train_metrics_aggr_fn", None)
    return aggr([m.content for m in replies], key) if callable(aggr) else None


class _Unpickler(_pickle.Unpickler):
    """Reads strategies pickled by checkpoint format 1, when they were a top-level ``strategies`` package."""

    def find_class(self, module: str, name: str):
        if module == "strategies" or module.startswith("strategies."):
            module = "fedsim." + module
        return super().find_class(module, name)


def inner_state(inner: object) -> dict[str, Any]:
    """A wrapper's checkpoint entries for the strategy it wraps: its ``state_dict()``, or the object pickled when
    it has none (``inner_state`` / ``inner_pickle``)."""
    state = state_dict(inner)
    return {"inner_state": state, "inner_pickle": None if state is not None else pickle(inner)}


def load_inner_state(inner: object, state: dict[str, Any]) -> object:
    """The wrapped strategy after restoring what :func:`inner_state` wrote (loaded in place, or unpickled)."""
    if state.get("inner_state") is not None:
        inner.load_state_dict(state["inner_state"])
    elif state.get("inner_pickle") is not None:
        return unpickle(state["inner_pickle"])
    return inner


def pickle(strategy: object) -> bytes:
    """A strategy without ``state_dict`` as checkpoints keep it."""
    return _pickle.dumps(strategy)


def unpickle(data: bytes) -> Any:
    """The strategy :func:`pickle` wrote (also one written before strategies moved into ``fedsim``)."""
    return _Unpickler(io.BytesIO(data)).load()

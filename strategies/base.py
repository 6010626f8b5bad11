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
                              them (and besides them) a checkpoint keeps the strategy's attributes that
                              hold plain data (:func:`plain_state`); nothing is pickled.
:class:`ChecksCohort`         ``check_cohort(clients_per_round)`` raises ``ConfigError`` before any work when
                              the cohort is too small for it (e.g. Krum's ``2f + 3``).
:class:`SamplesCohort`        ``sample_cohort(server_round, num_clients, clients_per_round)`` returns the
                              round's partition ids, replacing the loop's uniform draw (e.g. DP's Poisson
                              sampling, which the privacy accountant must match).
:class:`ReportsSummary`       ``summary_fields()`` returns entries for summary.json (e.g. the privacy
                              guarantee: epsilon, delta, accountant, sampling).
:class:`SelectsCohort`       ``select_cohort(server_round, num_clients, clients_per_round, losses, sizes)``:
                              a selection rule (``fedsim.features.selection``, e.g. power of choice) picks the
                              cohort, asking candidates for their loss through ``losses(partition_ids)``.
:class:`DecodesReplies`      ``decode_replies(replies, current)``: replies carry compressed updates
                              (``fedsim.features.compression``); the loop decodes them before screening.
:class:`ReportsRound`       ``round_fields(partition_ids)``: metrics.jsonl fields about a round's valid
                              replies, by their partition ids (e.g. ``fedsim.features.attacks``'
                              ``malicious``, the attackers among them); a wrapper adds its own to the inner
                              strategy's.
:class:`ReleasesEveryRound`  ``releases_every_round`` (a property, True for DP's wrapper with noise, found
                              through the wrapper chain): every sampled round releases a model. The loop
                              never skips such a round: it calls ``configure_train`` even for an empty
                              cohort (a grid view without nodes: nothing is sent) and ``aggregate_train``
                              with the valid replies however few (``min_replies`` does not apply), none
                              included.
:class:`AggregatesCohort`    ``aggregate_cohort(server_round, cohort)``: ``aggregate_train`` written against the
                              round's cohort (``fedsim.messages.Cohort``: rows = clients, models stacked where
                              they sit, ids, example counts and metrics), the one form of every fedsim
                              aggregator and wrapper. Their ``aggregate_train`` (Flower's, on Messages) is one
                              adapter: stack the replies, call ``aggregate_cohort``. The loop hands a strategy
                              the cohort when it :func:`takes_cohort`, else ``cohort.replies()`` through
                              ``aggregate_train`` (a user's strategy, or a subclass that overrides
                              ``aggregate_train``: honoured on every engine).
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

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from flwr.app import Message, MetricRecord

from fedsim import keys
from fedsim.safe_pickle import is_plain
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
    """A client-selection rule (``fedsim.features.selection``) that may probe clients before choosing the
    cohort."""

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
    """A compression wrapper (``fedsim.features.compression``): replies carry encoded updates the loop decodes
    first."""

    def decode_replies(self, replies: Iterable[Message], current: Any) -> list[Message]: ...


@runtime_checkable
class ReportsRound(Protocol):
    """A strategy (or wrapper) with metrics.jsonl fields about each round's valid replies."""

    def round_fields(self, partition_ids: Iterable[int]) -> dict[str, Any]: ...


@runtime_checkable
class ReleasesEveryRound(Protocol):
    """A strategy (DP's wrapper) whose every sampled round releases a model, with or without valid replies."""

    @property
    def releases_every_round(self) -> bool: ...


@runtime_checkable
class AggregatesCohort(Protocol):
    """A strategy whose aggregation is written against the round's cohort (``fedsim.messages.Cohort``)."""

    def aggregate_cohort(self, server_round: int, cohort: Any) -> tuple[Any, MetricRecord | None]: ...


@runtime_checkable
class ReportsSummary(Protocol):
    """A strategy with something to say in summary.json."""

    def summary_fields(self) -> dict[str, Any]: ...


_CONFORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is(strategy: object, protocol: type) -> bool:
    """``isinstance(strategy, protocol)``, remembered per strategy object: a runtime-checkable Protocol's check
    looks up every member each time, and the loop asks a few of them every round."""
    try:
        known = _CONFORMS.get(strategy)
        if known is None:
            known = _CONFORMS[strategy] = {}
    except TypeError:  # not weakly referable or not hashable
        return isinstance(strategy, protocol)
    hit = known.get(protocol)
    if hit is None:
        hit = known[protocol] = isinstance(strategy, protocol)
    return hit


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
    """The strategy's ``state_dict()``, or None when it has none (checkpoints then keep its plain-data
    attributes: :func:`plain_state`)."""
    return strategy.state_dict() if isinstance(strategy, Stateful) else None


def check_cohort(strategy: object, clients_per_round: int) -> None:
    """Let a strategy that needs a minimum cohort refuse ``clients_per_round`` (``ConfigError``)."""
    if _is(strategy, ChecksCohort):
        strategy.check_cohort(clients_per_round)


def sample_cohort(
    strategy: object, server_round: int, num_clients: int, clients_per_round: int
) -> list[int] | None:
    """The strategy's own cohort for ``server_round`` (sorted partition ids), or None to let the loop draw it."""
    if _is(strategy, SamplesCohort):  # a wrapper may answer None: its inner strategy draws none either
        cohort = strategy.sample_cohort(server_round, num_clients, clients_per_round)
        return None if cohort is None else sorted(int(p) for p in cohort)
    return None


def decode_replies(strategy: object, replies: list[Message], current: Any) -> list[Message]:
    """The replies with compressed updates decoded into models (``compression=``), by the first wrapper in the
    chain that decodes; the replies themselves when none does."""
    from flwr.serverapp.strategy import Strategy

    while strategy is not None:
        if _is(strategy, DecodesReplies):
            return strategy.decode_replies(replies, current)
        inner = getattr(strategy, "strategy", None)
        strategy = inner if isinstance(inner, (Strategy, AsyncStrategy)) else None
    return replies


def releases_every_round(strategy: object) -> bool:
    """True when a wrapper in the chain (DP's, with noise) releases a model every sampled round, however few its
    valid replies (none included): the loop then neither skips the round nor leaves out ``configure_train`` for
    an empty cohort. Wrappers outside it (compression, attack) pass both calls on."""
    from flwr.serverapp.strategy import Strategy

    while strategy is not None:
        if _is(strategy, ReleasesEveryRound):
            return bool(strategy.releases_every_round)
        inner = getattr(strategy, "strategy", None)
        strategy = inner if isinstance(inner, (Strategy, AsyncStrategy)) else None
    return False


def takes_cohort(strategy: object) -> bool:
    """True when the loop hands ``strategy`` the round's cohort (:class:`AggregatesCohort`): the class that gives
    ``aggregate_cohort`` is (or derives from) the one that gives ``aggregate_train``. A subclass that overrides
    Flower's ``aggregate_train`` below it gets the Messages the cohort stands for, on every engine."""
    cls = type(strategy)
    known = _TAKES.get(cls)
    if known is None:
        known = _TAKES[cls] = _is(strategy, AggregatesCohort) and issubclass(
            _defined_in(cls, "aggregate_cohort"), _defined_in(cls, "aggregate_train")
        )
    return known


_TAKES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body defines ``name`` (``object`` when none does)."""
    return next((k for k in cls.__mro__ if name in vars(k)), object)


def round_fields(strategy: object, partition_ids: Iterable[int]) -> dict[str, Any]:
    """The strategy's metrics.jsonl fields about a round whose valid replies came from ``partition_ids``."""
    return dict(strategy.round_fields(list(partition_ids))) if _is(strategy, ReportsRound) else {}


def choose_cohort(
    strategy: object,
    server_round: int,
    num_clients: int,
    clients_per_round: int,
    losses: Callable[[list[int]], dict[int, float]],
    sizes: dict[int, int] | None = None,
) -> list[int] | None:
    """The round's cohort as the strategy chooses it: drawn by itself (:class:`SamplesCohort`, e.g. DP's
    sampler), else picked by a selection rule (:class:`SelectsCohort`, which may ask candidates for their
    ``losses``); None to let the loop draw it uniformly."""
    cohort = sample_cohort(strategy, server_round, num_clients, clients_per_round)
    if cohort is None:
        cohort = select_cohort(strategy, server_round, num_clients, clients_per_round, losses, sizes)
    return cohort


def aggregate(strategy: object, server_round: int, cohort: Any) -> tuple[Any, MetricRecord | None]:
    """``strategy``'s aggregation of a round's valid replies, the cohort ``cohort``: its cohort form when it
    :func:`takes_cohort`, else Flower's ``aggregate_train`` of the Messages the cohort stands for."""
    if takes_cohort(strategy):
        return strategy.aggregate_cohort(server_round, cohort)
    return strategy.aggregate_train(server_round, cohort.replies())


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
    if _is(strategy, SelectsCohort):  # a wrapper may answer None: no rule inside it selects either
        cohort = strategy.select_cohort(server_round, num_clients, clients_per_round, losses, sizes)
        return None if cohort is None else sorted(int(p) for p in cohort)
    return None


def summary_fields(strategy: object) -> dict[str, Any]:
    """The strategy's entries for summary.json (empty when it has none)."""
    return dict(strategy.summary_fields()) if _is(strategy, ReportsSummary) else {}


def weight_key(strategy: object) -> str:
    """The reply metric a Flower strategy weights by (``num-examples`` unless it says otherwise)."""
    return str(getattr(strategy, "weighted_by_key", keys.NUM_EXAMPLES))


def train_metrics(strategy: object, cohort: Any, key: str) -> MetricRecord | None:
    """The strategy's own aggregation of the cohort's train metrics (Flower's ``train_metrics_aggr_fn``),
    weighted by ``key``; None when the strategy has no such function."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedsim.records import average_metrics

    aggr = getattr(strategy, "train_metrics_aggr_fn", None)
    if not callable(aggr):
        return None
    if aggr is aggregate_metricrecords:  # Flower's default, over plain dicts
        return average_metrics(cohort.metrics, key)
    return aggr(cohort.metric_contents(), key)


def inner_state(inner: object) -> dict[str, Any]:
    """A wrapper's checkpoint entries for the strategy it wraps: its ``state_dict()`` (``inner_state``) and its
    plain-data attributes (``inner_attrs``, see :func:`plain_state`). Nothing is pickled."""
    return {"inner_state": state_dict(inner), "inner_attrs": plain_state(inner)}


def load_inner_state(inner: object, state: dict[str, Any]) -> object:
    """The wrapped strategy after restoring, in place, what :func:`inner_state` wrote."""
    if state.get("inner_attrs") is not None:
        load_plain_state(inner, state["inner_attrs"])
    if state.get("inner_state") is not None:
        inner.load_state_dict(state["inner_state"])
    return inner


# ------------------------------------------------------------------------------ plain-data attributes
# Attributes set from the keys a resumed run may change (``fedsim.checkpoint.FREE_KEYS``' ``strategy.*``):
# the resumed run's config gives them, never the checkpoint.
CONFIG_ONLY = frozenset({"default_num_rounds", "wall_clock"})
_KINDS = ("plain", "arrays", "metrics", "config", "strategy")
_WARNED: set[str] = set()


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# Modules whose classes moved (old -> new): a checkpoint written before the move names a class by its old
# module.
MOVED_MODULES = {
    "fedsim.attacks": "fedsim.features.attacks.server",
    "fedsim.compression": "fedsim.features.compression.server",
    "fedsim.selection": "fedsim.features.selection.server",
    **{f"fedsim.strategies.{f}": f"fedsim.features.{f}.server" for f in ("scaffold", "feddyn", "personal")},
    **{f"fedsim.algorithms.{f}": f"fedsim.features.{f}.client" for f in ("scaffold", "feddyn", "personal")},
    "fedsim.strategies.clipping": "fedsim.features.clipping.server",
    "fedsim.strategies.clip_wrapper": "fedsim.features.clipping.wrapper",
}


def current_name(name: str) -> str:
    """A class path as a checkpoint stored it, under the module its class lives in now."""
    module, _, cls = name.rpartition(".")
    return f"{MOVED_MODULES.get(module, module)}.{cls}"


def _leaves(node: object, out: set[int]) -> set[int]:
    out.add(id(node))
    if isinstance(node, dict):
        for v in node.values():
            _leaves(v, out)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _leaves(v, out)
    return out


def _inherits_state_dict(strategy: object) -> bool:
    """A user's class (not fedsim's or Flower's) whose ``state_dict()`` is its parent's: the attributes it added
    are kept too."""
    cls = type(strategy)
    own = cls.__module__.split(".")[0] in ("fedsim", "flwr")
    return not own and "state_dict" not in vars(cls)


def plain_state(strategy: object) -> dict[str, Any]:
    """The strategy's instance attributes that hold data, as a checkpoint keeps them (no pickle).

    ``{"class": "module.Class", "attrs": {name: [kind, value]}}``: ``kind`` is ``plain`` (see
    :func:`is_plain`), ``arrays`` / ``metrics`` / ``config`` (a Flower ArrayRecord / MetricRecord /
    ConfigRecord, kept as a dict), or ``strategy`` (a strategy it holds, kept the same way, recursively).
    Functions and other callables are configuration (rebuilt from the config); any other object cannot be
    kept, and a warning names it once. A class that defines ``state_dict()`` itself says what it keeps: nothing
    is added for it; a user's subclass that inherits ``state_dict()`` gets its other plain attributes kept too
    (not those ``state_dict()`` returns, nor strategies it wraps).
    """
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
    from flwr.serverapp.strategy import Strategy

    from fedsim.records import to_numpy

    stateful = isinstance(strategy, Stateful)
    attrs: dict[str, list] = {}
    if stateful and not _inherits_state_dict(strategy):
        return {"class": _class_name(strategy), "attrs": attrs}
    declared = _leaves(strategy.state_dict(), set()) if stateful else set()
    lost = []
    for name, value in vars(strategy).items() if hasattr(strategy, "__dict__") else ():
        if name.startswith("__") or id(value) in declared:
            continue
        if isinstance(value, (Strategy, AsyncStrategy)):
            if not stateful:
                attrs[name] = ["strategy", plain_state(value)]
        elif isinstance(value, ArrayRecord):
            attrs[name] = ["arrays", to_numpy(value)]
        elif isinstance(value, (MetricRecord, ConfigRecord)):
            kind = "metrics" if isinstance(value, MetricRecord) else "config"
            attrs[name] = [kind, dict(value.items())]
        elif is_plain(value):
            attrs[name] = ["plain", value]
        elif not callable(value):
            lost.append(name)
    cls = _class_name(strategy)
    if lost and not stateful and cls not in _WARNED:
        _WARNED.add(cls)
        import logging

        logging.getLogger("fedsim").warning(
            "strategy %s: attribute(s) %s hold objects that are not plain data; a checkpoint keeps its other "
            "attributes, and a resumed run rebuilds these from the config (give the class state_dict() and "
            "load_state_dict() to keep them)",
            cls,
            ", ".join(sorted(lost)[:5]),
        )
    return {"class": cls, "attrs": attrs}


def check_plain_state(saved: object, where: str = "strategy") -> None:
    """Raise ``ValueError`` naming what does not fit when ``saved`` is not what :func:`plain_state` writes."""
    if not isinstance(saved, dict) or not isinstance(saved.get("class"), str):
        raise ValueError(f"{where}: expected {{'class': str, 'attrs': dict}}")
    attrs = saved.get("attrs")
    if not isinstance(attrs, dict):
        raise ValueError(f"{where}: 'attrs' is not a dict")
    for name, entry in attrs.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
            raise ValueError(f"{where}: attribute name {name!r}")
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] not in _KINDS:
            raise ValueError(f"{where}.{name}: expected [kind, value] with kind one of {', '.join(_KINDS)}")
        kind, value = entry
        if kind == "strategy":
            check_plain_state(value, f"{where}.{name}")
        elif kind in ("arrays", "metrics", "config"):
            if not isinstance(value, dict) or not is_plain(value):
                raise ValueError(f"{where}.{name}: a {kind} record that is not a dict of plain data")
        elif not is_plain(value):
            raise ValueError(f"{where}.{name}: a value that is not plain data ({type(value).__name__})")


def load_plain_state(strategy: object, saved: dict[str, Any]) -> None:
    """Set the attributes :func:`plain_state` kept on ``strategy`` (built from the run's config), in place.

    Raises
    ------
    ConfigError
        On ``resume`` when the checkpoint's strategy is of another class than the configured one.
    """
    from flwr.app import ConfigRecord, MetricRecord

    from fedsim.errors import ConfigError
    from fedsim.records import to_record

    check_plain_state(saved)
    here = _class_name(strategy)
    if current_name(saved["class"]) != here:
        raise ConfigError(
            "resume",
            saved["class"],
            f"a checkpoint whose strategy is the configured {here}",
            "Resume with the checkpointed run's overrides (its .hydra/overrides.yaml).",
        )
    for name, (kind, value) in saved["attrs"].items():
        if name in CONFIG_ONLY:
            continue
        if kind == "strategy":
            inner = getattr(strategy, name, None)
            if inner is not None:
                load_plain_state(inner, value)
            continue
        if kind == "arrays":
            value = to_record(value)
        elif kind == "metrics":
            value = MetricRecord(value)
        elif kind == "config":
            value = ConfigRecord(value)
        setattr(strategy, name, value)

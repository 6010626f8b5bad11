"""One base for every feature that acts on a strategy's updates: clipping and DP, compression, an attack,
client selection, or a user's own.

A wrapper holds the strategy it wraps (``self.strategy``) and forwards every Flower method and every optional
capability of :mod:`fedsim.strategies.base` to it; a feature overrides only what it changes. ``fedsim.build``
folds the wrappers a run's config names around its strategy: every config group whose ``_target_`` is a
:class:`Wrapper` subclass, innermost first by :attr:`Wrapper.fold_order`, so a new feature is a new class and a
new config group (``fedsim +myfeature=on``), with no edit to the builder, the loops or the engines.

A feature with a client half names it in :attr:`Wrapper.client_half` (the class, of
``fedsim.algorithms.halves``' contract, or its class path), the way a strategy names its client algorithm: the
run's client spec carries its path, and the ClientApp and the engines apply it around local training.
fedsim's own features keep both halves in one folder (``fedsim.features``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.errors import ConfigError
from fedsim.strategies import base

log = logging.getLogger("fedsim")


class Wrapper(Strategy):
    """A strategy around ``strategy``: everything forwarded, a subclass overrides what its feature changes.

    Class attributes (declarations, read by ``fedsim.build`` and ``fedsim.strategies.composition``):

    ``fold_order``
        Where the fold puts it: a lower number sits closer to the strategy (clipping 10, compression 20,
        attack 30, selection 40; a user's feature 50 unless it says otherwise).
    ``touches_replies``
        True (the default) when it reads or changes the replies before the strategy aggregates them (in
        :meth:`aggregate_cohort`, its one form); selection leaves them alone.
    ``client_half``
        Its client half (a ``fedsim.algorithms.halves.ClientHalf`` subclass, or its class path), or None.
    ``run_arguments``
        The run's values it is built with besides its config: any of ``num_clients``, ``clients_per_round``,
        ``seed`` (``fedsim.build`` passes those its constructor names).
    """

    fold_order: ClassVar[float] = 50
    touches_replies: ClassVar[bool] = True
    client_half: ClassVar[type | str | None] = None
    wraps: ClassVar[str] = "synchronous aggregation"
    async_reason: ClassVar[str] = (
        "it wraps synchronous aggregation"  # why an asynchronous strategy is refused
    )

    @classmethod
    def async_refusal(cls, section: str, node: Any, strategy: object) -> tuple[str, str]:
        """Why it does not wrap the asynchronous ``strategy``, and what to choose instead (one line each)."""
        from fedsim.strategies.composition import name_of, off_option, option_of

        why = (
            f"{section}={option_of(section, cls)} does not compose with strategy={name_of(strategy)}, an asynchronous "
            f"strategy: {cls.async_reason}"
        )
        return why, f"{section}={off_option(section)} with an asynchronous strategy"

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise ConfigError(
                "strategy",
                type(strategy).__name__,
                f"a synchronous strategy ({type(self).__name__} wraps {self.wraps})",
            )
        self.strategy = strategy

    # ------------------------------------------------------------ Flower's Strategy interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's form: the replies that are not errors, stacked, through :meth:`aggregate_cohort`."""
        from fedsim.messages import Cohort

        replies = list(replies)
        errors = [m for m in replies if m.has_error()]
        if errors:
            self.on_error_replies(server_round, errors)
        return self.aggregate_cohort(
            server_round, Cohort.from_replies([m for m in replies if not m.has_error()])
        )

    def aggregate_cohort(
        self, server_round: int, cohort: Any
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's aggregation on its cohort (``fedsim.messages.Cohort``); a feature that changes the
        replies overrides this, written once for every engine. Default: the inner strategy's."""
        return base.aggregate(self.strategy, server_round, cohort)

    def on_error_replies(self, server_round: int, errors: list[Message]) -> None:
        """Error replies handed to :meth:`aggregate_train` (by a Flower loop; fedsim's screens them out):
        not aggregated, logged."""
        log.warning(
            "round %d: %d error repl(ies) not aggregated, e.g. node %d",
            server_round,
            len(errors),
            errors[0].metadata.src_node_id,
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    # ------------------------------------------------------------ fedsim's capabilities (strategies.base)
    def check_cohort(self, clients_per_round: int) -> None:
        base.check_cohort(self.strategy, clients_per_round)

    def sample_cohort(self, server_round: int, num_clients: int, clients_per_round: int) -> list[int] | None:
        """The inner strategy's own cohort, or None to let the loop draw it."""
        return base.sample_cohort(self.strategy, server_round, num_clients, clients_per_round)

    def select_cohort(
        self, server_round, num_clients, clients_per_round, losses, sizes=None
    ) -> list[int] | None:
        """The inner selection rule's cohort, or None."""
        return base.select_cohort(self.strategy, server_round, num_clients, clients_per_round, losses, sizes)

    def decode_replies(self, replies: Iterable[Message], current: Any) -> list[Message]:
        return base.decode_replies(self.strategy, list(replies), current)

    def round_fields(self, partition_ids: Iterable[int]) -> dict[str, Any]:
        """The inner strategy's metrics.jsonl fields about the round (a feature adds its own)."""
        return base.round_fields(self.strategy, partition_ids)

    @property
    def releases_every_round(self) -> bool:
        return base.releases_every_round(self.strategy)

    def summary_fields(self) -> dict[str, Any]:
        """The inner strategy's summary.json entries and this feature's (:meth:`own_summary_fields`)."""
        return {**base.summary_fields(self.strategy), **self.own_summary_fields()}

    def own_summary_fields(self) -> dict[str, Any]:
        """This feature's summary.json entries (none by default)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's checkpoint entries (a feature with state of its own adds them)."""
        return base.inner_state(self.strategy)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy = base.load_inner_state(self.strategy, state)


def wrappers(strategy: object) -> list[Wrapper]:
    """The wrappers around a strategy, outermost first."""
    out = []
    while isinstance(strategy, Wrapper):
        out.append(strategy)
        strategy = strategy.strategy
    return out

"""The base of every asynchronous strategy (FedAsync, FedBuff, and a user's own).

fedsim's asynchronous loop (``fedsim.async_server.run_async``) keeps ``concurrency`` clients busy, drops updates
staler than ``max_staleness`` before they reach the strategy, and calls ``on_update`` for each valid one. A new
asynchronous strategy subclasses :class:`AsyncStrategy`, validates its own parameters, calls
``super().__init__`` and implements ``on_update``, ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord

from fedsim import keys
from fedsim.checks import integer, number
from fedsim.errors import ConfigError
from fedsim.strategies.staleness import staleness_fn

# Keyword arguments fedsim's composition root passes to every strategy; an async strategy has no use for them.
FLOWER_KWARGS = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)


def async_knobs(
    concurrency: Any, max_staleness: Any, flower_kwargs: Mapping[str, Any]
) -> tuple[int, int | None]:
    """Validate what every async strategy has: ``concurrency >= 1``, ``max_staleness`` None or ``>= 0``."""
    unknown = sorted(set(flower_kwargs) - set(FLOWER_KWARGS))
    if unknown:
        raise ConfigError(
            unknown[0],
            flower_kwargs[unknown[0]],
            "a parameter of this asynchronous strategy (the keys in its conf/strategy YAML)",
        )
    if concurrency is None:
        raise ConfigError(
            "concurrency",
            None,
            "an integer >= 1",
            "Set strategy.concurrency (it defaults to clients_per_round, which is null here).",
        )
    c = integer("concurrency", concurrency, 1)
    s = None if max_staleness is None else integer("max_staleness", max_staleness, 0)
    return c, s


class AsyncStrategy:
    """What every asynchronous strategy has: staleness weights, ``concurrency``, ``max_staleness``, ``wall_clock``.

    Subclasses validate their own parameters, call ``super().__init__`` and implement ``on_update``,
    ``state_dict`` and ``load_state_dict``.
    """

    def __init__(
        self,
        staleness: str,
        staleness_a: float,
        staleness_b: float,
        concurrency: int | None,
        max_staleness: int | None,
        wall_clock: bool,
        flower_kwargs: dict[str, Any],
        proximal_mu: float = 0.0,
        hinge_a: float | None = None,
    ) -> None:
        self.staleness = staleness
        self.weight = staleness_fn(staleness, staleness_a, staleness_b, hinge_a=hinge_a)
        self.concurrency, self.max_staleness = async_knobs(concurrency, max_staleness, flower_kwargs)
        self.wall_clock = bool(wall_clock)
        self.proximal_mu = number("proximal_mu", proximal_mu, 0.0)

    def train_config(self) -> dict[str, float]:
        """Entries for every train message's config: ``proximal-mu`` when the client's proximal term is on."""
        return {keys.PROXIMAL_MU: self.proximal_mu} if self.proximal_mu > 0 else {}

    def check_population(self, num_clients: int) -> None:
        """Raise ``ConfigError`` (key ``concurrency``) if more clients should be busy than the population holds."""
        if self.concurrency > num_clients:
            raise ConfigError(
                "concurrency",
                self.concurrency,
                f"an integer in [1, num_clients={num_clients}]",
                "At most one task is in flight per client.",
            )

    def on_update(
        self, current: ArrayRecord, update: ArrayRecord, start: ArrayRecord, staleness: int, num_examples: int
    ) -> ArrayRecord | None:
        """Take one client's model ``update`` (trained from ``start``, ``staleness`` versions ago).

        Return the new global model (a new server model version), or None to keep ``current`` (e.g. FedBuff
        while its buffer fills).
        """
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The strategy's state for checkpoints (plain values and numpy arrays)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        raise NotImplementedError

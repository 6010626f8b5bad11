"""Simulated time: how long each client's work takes on the virtual clock (seeded)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsim.errors import ConfigError

SPEED_DISTRIBUTIONS = ("constant", "uniform", "lognormal", "exponential", "list")


class Heterogeneity:
    """Per-client speeds and delays; ``duration`` gives a task's simulated seconds.

    A client's task takes ``examples * time_per_example / speed + network_delay`` simulated seconds, where
    ``speed`` is drawn once per client from ``speed`` (a distribution name) with ``seed``.

    Parameters
    ----------
    num_clients, seed : int
        Population size and the run's seed (filled in by fedsim).
    speed : str
        ``constant`` (1.0), ``uniform`` (U[low, high]), ``lognormal`` (exp N(0, sigma)), ``exponential``
        (mean 1, floored at ``low``), or ``list`` (``speeds`` given, cycled over clients).
    """

    def __init__(
        self,
        num_clients: int,
        seed: int,
        speed: str = "constant",
        low: float = 0.1,
        high: float = 1.0,
        sigma: float = 1.0,
        speeds: Sequence[float] | None = None,
        time_per_example: float = 1e-3,
        network_delay: float = 0.0,
    ) -> None:
        if speed not in SPEED_DISTRIBUTIONS:
            raise ConfigError("speed", speed, f"one of {SPEED_DISTRIBUTIONS}")
        for key, val in (("time_per_example", time_per_example), ("network_delay", network_delay)):
            if val < 0:
                raise ConfigError(key, val, "a number >= 0")
        rng = np.random.default_rng([seed, 11])
        if speed == "constant":
            s = np.ones(num_clients)
        elif speed == "uniform":
            if not 0 < low <= high:
                raise ConfigError("low", low, f"0 < low <= high (high={high})")
            s = rng.uniform(low, high, num_clients)
        elif speed == "lognormal":
            if sigma < 0:
                raise ConfigError("sigma", sigma, "a number >= 0")
            s = np.exp(rng.normal(0.0, sigma, num_clients))
        elif speed == "exponential":
            if low <= 0:
                raise ConfigError("low", low, "a number > 0 (the slowest allowed speed)")
            s = np.maximum(rng.exponential(1.0, num_clients), low)
        else:
            if not speeds or any(float(v) <= 0 for v in speeds):
                raise ConfigError("speeds", speeds, "a non-empty list of speeds > 0")
            s = np.resize(np.asarray(speeds, dtype=float), num_clients)
        self.speeds = s
        self.time_per_example = float(time_per_example)
        self.network_delay = float(network_delay)

    def duration(self, partition_id: int, examples: int) -> float:
        """Simulated seconds for ``partition_id`` to process ``examples`` and send its reply."""
        return examples * self.time_per_example / self.speeds[partition_id] + self.network_delay

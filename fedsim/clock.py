"""Simulated time: how long each client's task takes on the virtual clock, and whether it comes back at all.

Everything here is pure and seeded: a client's speed is drawn once from ``(seed, 11)``; whether task ``t`` of
client ``k`` straggles or drops out is drawn from ``(seed, 12 | 13, k, t)``, so any loop, engine or process
asking the same question gets the same answer. ``t`` is the round number in synchronous rounds and the
dispatch counter (task index) in the asynchronous loop.

What the loops call
-------------------
* ``duration(pid, examples, task)``: simulated seconds of a task that processes ``examples`` examples,
  straggler slowdown included when ``task`` is given.
* ``drops(pid, task)``: the client never replies to this task (dropout).
* ``is_straggler(pid, task)``: this task runs ``straggler_slowdown`` times slower.
* ``late(pid, examples, task)``: the task would finish after ``deadline``.
* ``partial_examples(pid, examples, task)``: how many of ``examples`` fit before the deadline (FedProx's
  partial work; equals ``examples`` when there is no deadline or the task fits).
* ``round_time(durations, waited)``: simulated length of a synchronous round from its kept clients'
  durations; ``waited`` says the server had to wait for someone who never came (dropout or late client),
  which costs the whole deadline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from fedsim.checks import is_number, number
from fedsim.errors import ConfigError
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng

SPEED_DISTRIBUTIONS = ("constant", "uniform", "lognormal", "exponential", "list")


def _nonneg(key: str, val: float) -> float:
    return number(key, val, 0.0, what="a finite number >= 0")


def _prob(key: str, val: float) -> float:
    return number(key, val, 0.0, 1.0, what="a probability in [0, 1]")


def draw_speeds(
    num_clients: int,
    seed: int,
    speed: str,
    low: float,
    high: float,
    sigma: float,
    speeds: Sequence[float] | None,
) -> np.ndarray:
    """Per-client speeds (work units per simulated second, relative to 1.0), seeded by ``(seed, 11)``."""
    if speed not in SPEED_DISTRIBUTIONS:
        raise ConfigError("speed", speed, f"one of {', '.join(SPEED_DISTRIBUTIONS)}")
    rng = seeded_rng(seed, Purpose.CLIENT_SPEED)
    if speed == "constant":
        return np.ones(num_clients)
    if speed == "uniform":
        if not 0 < low <= high:
            raise ConfigError("low", low, f"0 < low <= high (high={high})")
        return rng.uniform(low, high, num_clients)
    if speed == "lognormal":
        _nonneg("sigma", sigma)
        return np.exp(rng.normal(0.0, sigma, num_clients))
    if speed == "exponential":
        if not low > 0:
            raise ConfigError("low", low, "a number > 0 (the slowest allowed speed)")
        return np.maximum(rng.exponential(1.0, num_clients), low)
    vals = list(speeds or [])
    if not vals or not all(is_number(v) and 0 < v < math.inf for v in vals):
        raise ConfigError("speeds", vals or speeds, "a non-empty list of finite speeds > 0")
    return np.resize(np.asarray(vals, dtype=float), num_clients)


class Heterogeneity:
    """Per-client speeds, network delay, stragglers, dropouts and a deadline for the virtual clock.

    A task of client ``k`` that processes ``n`` examples takes
    ``n * time_per_example / speed[k] * (straggler_slowdown if it straggles else 1) + network_delay``
    simulated seconds.

    Parameters
    ----------
    num_clients, seed : int
        Population size and the run's seed (filled in by fedsim).
    speed : str
        ``constant`` (1.0), ``uniform`` (U[low, high]), ``lognormal`` (exp N(0, sigma)), ``exponential``
        (mean 1, floored at ``low``), or ``list`` (``speeds`` given, cycled over clients).
    low, high, sigma, speeds
        Parameters of the speed distribution.
    time_per_example : float
        Simulated seconds per training example at speed 1 (>= 0).
    network_delay : float
        Simulated seconds added to every task for sending the model and the reply (>= 0).
    straggler_prob : float
        Probability that a task straggles, i.e. takes ``straggler_slowdown`` times longer to compute.
    straggler_slowdown : float
        Slowdown factor of a straggling task (>= 1).
    dropout_prob : float
        Probability that a client never replies to a task.
    deadline : float or None
        Simulated seconds a server waits for one task (a round, in synchronous FL); ``None``: no deadline.
    partial_work : bool
        Synchronous rounds only: a client past the deadline sends the work it finished in time (FedProx)
        instead of being dropped (FedAvg). The asynchronous loop always abandons a task at the deadline.
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
        straggler_prob: float = 0.0,
        straggler_slowdown: float = 10.0,
        dropout_prob: float = 0.0,
        deadline: float | None = None,
        partial_work: bool = False,
    ) -> None:
        self.time_per_example = _nonneg("time_per_example", time_per_example)
        self.network_delay = _nonneg("network_delay", network_delay)
        self.straggler_prob = _prob("straggler_prob", straggler_prob)
        self.dropout_prob = _prob("dropout_prob", dropout_prob)
        self.straggler_slowdown = number(
            "straggler_slowdown", straggler_slowdown, 1.0, what="a finite number >= 1"
        )
        number(
            "deadline",
            deadline,
            0.0,
            lo_open=True,
            allow_none=True,
            what="null (no deadline) or a number of simulated seconds > 0",
        )
        self.deadline = None if deadline is None else float(deadline)
        self.partial_work = bool(partial_work)
        self.seed = int(seed)
        self.speeds = draw_speeds(int(num_clients), self.seed, speed, low, high, sigma, speeds)

    # ------------------------------------------------------------------ per-task draws
    def is_straggler(self, partition_id: int, task: int) -> bool:
        """Whether task ``task`` of client ``partition_id`` runs ``straggler_slowdown`` times slower."""
        if self.straggler_prob == 0.0:
            return False
        return bool(
            seeded_rng(self.seed, Purpose.STRAGGLER, partition_id, task).random() < self.straggler_prob
        )

    def drops(self, partition_id: int, task: int) -> bool:
        """Whether client ``partition_id`` never replies to task ``task``."""
        if self.dropout_prob == 0.0:
            return False
        return bool(seeded_rng(self.seed, Purpose.DROPOUT, partition_id, task).random() < self.dropout_prob)

    # ------------------------------------------------------------------ durations
    def compute_time(self, partition_id: int, examples: int, task: int | None = None) -> float:
        """Simulated seconds of local computation (no network delay); stragglers count when ``task`` is given."""
        t = examples * self.time_per_example / self.speeds[partition_id]
        if task is not None and self.is_straggler(partition_id, task):
            t *= self.straggler_slowdown
        return float(t)

    def duration(self, partition_id: int, examples: int, task: int | None = None) -> float:
        """Simulated seconds for ``partition_id`` to process ``examples`` and send its reply.

        Without ``task`` no straggler slowdown applies (the plain speed model).
        """
        return self.compute_time(partition_id, examples, task) + self.network_delay

    def late(self, partition_id: int, examples: int, task: int | None = None) -> bool:
        """Whether the task would finish after the deadline (never, without one)."""
        return self.deadline is not None and self.duration(partition_id, examples, task) > self.deadline

    def partial_examples(self, partition_id: int, examples: int, task: int | None = None) -> int:
        """Examples of ``examples`` the client processes before the deadline (all of them if it fits)."""
        if not self.late(partition_id, examples, task):
            return int(examples)
        per_example = self.compute_time(partition_id, 1, task)
        budget = self.deadline - self.network_delay
        if per_example == 0.0:
            return int(examples)
        return max(0, min(int(examples), math.floor(budget / per_example)))

    def round_time(self, durations: Iterable[float], waited: bool = False) -> float:
        """Simulated length of a synchronous round from its kept clients' task durations.

        ``waited``: some sampled client never answered in time (a dropout or a late client), so the server
        waited until the deadline; without a deadline that client is assumed noticed at once.
        """
        longest = max(durations, default=0.0)
        if self.deadline is None:
            return float(longest)
        return float(self.deadline if waited else min(longest, self.deadline))

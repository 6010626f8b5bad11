"""Seeded fault injection for clients (the ``faults=`` group): exercise fedsim's failure handling.

Each train task of client ``k`` in round ``r`` draws one uniform number from ``(seed, 9, r, k)``; the rates
partition [0, 1) into the fault kinds below (the rest is no fault), so the same seed injects the same faults
on every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedsim.algorithms.halves import ClientHalf, Reply, Rows
from fedsim.checks import number
from fedsim.errors import ConfigError
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng

KINDS = ("error", "timeout", "nan", "shape", "dtype")


class SimulatedTimeout(RuntimeError):
    """A client that did not answer in time (raised by the fault injector; counted as kind ``timeout``)."""


@dataclass(frozen=True)
class FaultRates:
    """Per-task probabilities of each fault kind."""

    error: float = 0.0  # the ClientApp raises
    timeout: float = 0.0  # the client never answers in time
    nan: float = 0.0  # the update holds NaN
    shape: float = 0.0  # one array comes back with the wrong shape
    dtype: float = 0.0  # the arrays come back as float64

    def __post_init__(self) -> None:
        for k in KINDS:
            number(f"faults.{k}", getattr(self, k), 0.0, 1.0, what="a probability in [0, 1]")
        if sum(getattr(self, k) for k in KINDS) > 1.0:
            raise ConfigError("faults", {k: getattr(self, k) for k in KINDS}, "rates that sum to at most 1")

    def draw(self, seed: int, rnd: int, partition_id: int) -> str | None:
        """The fault kind for this task, or None."""
        u = seeded_rng(seed, Purpose.FAULTS, rnd, partition_id).random()
        edge = 0.0
        for k in KINDS:
            edge += getattr(self, k)
            if u < edge:
                return k
        return None


class InjectedFaults(ClientHalf):
    """The run's seeded injected faults (``faults`` section, :class:`FaultRates`): an error, a timeout, or a
    corrupted reply (NaN, a wrong shape, a wrong dtype)."""

    def active(self, ins: Any) -> bool:
        return True

    def batched(self, ins: Any, task: Any) -> bool:
        """Batched only for a client without fault rates: a fault fails or garbles one client's reply."""
        return task.faults is None

    def on_rows(self, rows: Rows) -> None:
        """Nothing: rows are batched only without fault rates (:meth:`batched`)."""

    def on_reply(self, reply: Reply) -> None:
        if reply.faults is None:
            return
        rnd, pid = reply.ins.draw_index, reply.partition_id
        kind = reply.faults.draw(reply.seed, rnd, pid)
        if kind == "error":
            raise RuntimeError(f"injected client error (partition {pid}, round {rnd})")
        if kind == "timeout":
            raise SimulatedTimeout(f"injected timeout (partition {pid}, round {rnd})")
        first = next(iter(reply.model))
        if kind == "nan":
            reply.model[first] = torch.full_like(reply.model[first], float("nan"))
        elif kind == "shape":
            reply.model[first] = reply.model[first].reshape(-1)[:-1].clone()
        elif kind == "dtype":
            for k in list(reply.model):
                reply.model[k] = reply.model[k].double()

"""Byzantine clients for robustness experiments: a seeded, fixed set of attackers and what they send.

``attack=NAME`` wraps the run's strategy (outermost, around ``clipping=``) in one of the classes below. The
malicious clients are ``round(fraction * num_clients)`` partition ids drawn once from the run's seed
(:func:`malicious_clients`); they train like everyone else, and in every round the wrapper replaces the
updates ``d = reply - global`` of the attackers among the valid replies before the inner strategy (and its
clipping, if any) sees them:

============  ==========================================================================================
sign_flip     ``-d``: the attacker pushes the other way (reversed gradient)
scale         ``factor * d``: a boosted update (model replacement)
gaussian      ``N(0, std^2)`` per coordinate: a random update, seeded per (round, client)
alie          ``mean - z * std`` of the honest updates, per coordinate (Baruch, Baruch, Goldberg, "A Little
              Is Enough", NeurIPS 2019, https://arxiv.org/abs/1902.06156); ``z`` from the paper's
              ``s = floor(n / 2 + 1) - m``, ``z = Phi^-1((n - s) / n)`` unless set
ipm           ``-epsilon * mean`` of the honest updates (Xie, Koyejo, Gupta, inner-product manipulation,
              UAI 2020, https://arxiv.org/abs/1903.03936)
label_flip    data poisoning: attackers train on labels ``C - 1 - y`` (the wrapper marks their train
              messages with ``attack-label-flip``, the attackers' ids; their ClientApp flips the labels)
============  ==========================================================================================

**ALIE and IPM are omniscient here** (``knowledge="honest"``, the default): in simulation the server-side
wrapper hands the attackers the round's honest updates, the strongest attacker the papers analyse. With
``knowledge="own"`` they use only the attackers' own honestly trained updates (colluding attackers who see no
one else's; with one attacker in the round its std is 0), which is what malicious nodes could compute in a
deployment. In both cases the attack is simulated on the server: a deployed SuperNode does not attack.
The replies keep their ``num-examples``; metrics.jsonl counts the attackers' replies in ``malicious``.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim import keys
from fedsim.aggregate import flatten, is_float
from fedsim.checks import integer, number
from fedsim.errors import ConfigError
from fedsim.features.attacks.client import FlipLabels, flip_labels  # noqa: F401  (label_flip's client half)
from fedsim.records import to_numpy, to_record
from fedsim.schema import MALICIOUS
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng
from fedsim.strategies import base
from fedsim.strategies.wrapper import Wrapper

log = logging.getLogger("fedsim")

LABEL_FLIP = keys.LABEL_FLIP  # train-config key: the partition ids that train on flipped labels
KNOWLEDGE = ("honest", "own")


# ---------------------------------------------------------------- pure functions
def malicious_clients(seed: int, num_clients: int, fraction: float) -> list[int]:
    """The attackers' partition ids: ``round(fraction * num_clients)`` of them, drawn once from ``seed``, sorted."""
    k = int(round(fraction * num_clients))
    rng = seeded_rng(seed, Purpose.MALICIOUS)
    return sorted(int(p) for p in rng.choice(num_clients, size=k, replace=False))


def alie_z(n: int, m: int) -> float:
    """ALIE's ``z_max`` for ``m`` attackers among ``n`` updates: ``Phi^-1((n - s) / n)``, ``s = floor(n/2 + 1) - m``.

    Raises ``ValueError`` when ``s <= 0`` (the attackers are a majority: the paper's ``z`` is infinite).
    """
    s = math.floor(n / 2 + 1) - m
    if s <= 0 or n <= 0:
        raise ValueError(
            f"ALIE's z is undefined for {m} attackers among {n} (s = floor(n/2+1) - m = {s} <= 0)"
        )
    return NormalDist().inv_cdf((n - s) / n)


def alie(updates: np.ndarray, z: float) -> np.ndarray:
    """``mean - z * std`` per coordinate of ``updates`` ``(n, d)`` (population std); shape ``(d,)``."""
    return updates.mean(axis=0) - z * updates.std(axis=0)


def ipm(updates: np.ndarray, epsilon: float) -> np.ndarray:
    """``-epsilon * mean`` of ``updates`` ``(n, d)``; shape ``(d,)``."""
    return -epsilon * updates.mean(axis=0)


class Attack(Wrapper):
    """Wrap a strategy; replace the attackers' updates by :meth:`craft`'s before the inner strategy aggregates.

    Parameters
    ----------
    strategy : Strategy
        The strategy (possibly wrapped by ``clipping=``) that aggregates the replies.
    fraction : float
        Share of the population that is malicious, in [0, 1).
    num_clients, clients_per_round, seed : int
        The run's population, cohort size and seed (filled in by fedsim).
    """

    name = "none"
    async_reason = "attacks wrap synchronous aggregation"
    fold_order = 30  # outside clipping and compression: clipping sees the crafted updates

    def __init__(
        self, strategy: Strategy, fraction: float, num_clients: int, clients_per_round: int, seed: int
    ) -> None:
        super().__init__(strategy)
        self.fraction = number("fraction", fraction, 0.0, 1.0, hi_open=True)
        self.num_clients = integer("num_clients", num_clients, 1)
        self.clients_per_round = integer("clients_per_round", clients_per_round, 1)
        self.seed = integer("seed", seed, 0)
        self.malicious = frozenset(malicious_clients(self.seed, self.num_clients, self.fraction))
        if not self.malicious:
            log.warning(
                "attack %s: fraction=%g of %d clients is 0 attackers; the run is not attacked "
                "(an attack.fraction above %.3g gives one)",
                type(self).__name__,
                self.fraction,
                self.num_clients,
                0.5 / self.num_clients,
            )
        self.current: dict[str, np.ndarray] | None = None

    def expected_in_cohort(self) -> int:
        """Attackers in a cohort of ``clients_per_round`` when they are spread evenly (at least one)."""
        return max(1, round(self.fraction * self.clients_per_round))

    def craft(self, server_round: int, honest: np.ndarray, own: np.ndarray, pids: list[int]) -> np.ndarray:
        """The attackers' updates ``(k, d)`` from the honest ones ``(h, d)`` and their own ``(k, d)``."""
        return own

    def malicious_among(self, partition_ids: Iterable[int]) -> int:
        """How many of ``partition_ids`` are attackers."""
        return sum(int(p) in self.malicious for p in partition_ids)

    def round_fields(self, partition_ids: Iterable[int]) -> dict[str, Any]:
        """metrics.jsonl's ``malicious``: the attackers among the round's valid replies."""
        partition_ids = list(partition_ids)
        return {**super().round_fields(partition_ids), MALICIOUS: self.malicious_among(partition_ids)}

    # ------------------------------------------------------------ Strategy interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global model; the inner strategy's train messages."""
        self.current = to_numpy(arrays)
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_cohort(
        self, server_round: int, cohort: Any
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Replace the attackers' rows by :meth:`craft`'s updates (from the float64 updates ``y - x``, cast to the
        rows' dtype), then let the inner strategy aggregate."""
        if self.current is None:
            raise RuntimeError(f"{type(self).__name__}.aggregate_train called before configure_train")
        pids = cohort.partition_ids
        bad = [i for i, p in enumerate(pids) if p in self.malicious]
        if not bad:
            return base.aggregate(self.strategy, server_round, cohort)
        floats = {k: a for k, a in self.current.items() if is_float(a)}
        x = flatten(floats)  # (d,)
        n = len(cohort)
        host = cohort.host_arrays()
        deltas = np.concatenate([host[k].reshape(n, -1) for k in floats], axis=1) - x  # (n, d), floats' order
        good = [i for i in range(n) if i not in bad]
        crafted = x + self.craft(server_round, deltas[good], deltas[bad], [pids[i] for i in bad])  # (k, d)
        arrays = dict(cohort.arrays)
        index = torch.tensor(bad)
        offsets = np.cumsum([0] + [int(np.asarray(a).size) for a in floats.values()])
        for k, lo, hi in zip(floats, offsets[:-1], offsets[1:]):
            t = cohort.arrays[k]
            rows = torch.from_numpy(np.ascontiguousarray(crafted[:, lo:hi])).view(len(bad), *t.shape[1:])
            arrays[k] = t.index_copy(0, index.to(t.device), rows.to(device=t.device, dtype=t.dtype))
        return base.aggregate(self.strategy, server_round, cohort.replace(arrays=arrays))

    def summary(self) -> None:
        """Log the attack, then the inner strategy's summary."""
        log.info("attack %s: %d malicious clients %s", self.name, len(self.malicious), sorted(self.malicious))
        self.strategy.summary()

    def own_summary_fields(self) -> dict[str, Any]:
        """summary.json entries: the attack and its clients."""
        return {
            "attack": self.name,
            "malicious_clients": sorted(self.malicious),
        }


def with_model(msg: Message, arrays: dict[str, np.ndarray]) -> Message:
    """A copy of reply ``msg`` whose model record (``arrays``) holds ``arrays``; its other records (e.g. SCAFFOLD's
    ``scaffold-dc``) and metadata are kept."""
    content = RecordDict({k: (to_record(arrays) if k == keys.ARRAYS else r) for k, r in msg.content.items()})
    return Message(content=content, metadata=copy.deepcopy(msg.metadata))


class SignFlip(Attack):
    """Attackers send ``-d``, their own update reversed."""

    name = "sign_flip"

    def craft(self, server_round, honest, own, pids):
        return -own


class Scale(Attack):
    """Attackers send ``factor * d`` (a boosted update)."""

    name = "scale"

    def __init__(self, factor: float = 10.0, **kwargs: Any) -> None:
        self.factor = number("factor", factor)
        super().__init__(**kwargs)

    def craft(self, server_round, honest, own, pids):
        return self.factor * own


class Gaussian(Attack):
    """Attackers send ``N(0, std^2)`` per coordinate, drawn from ``(seed, round, partition)``."""

    name = "gaussian"

    def __init__(self, std: float = 1.0, **kwargs: Any) -> None:
        self.std = number("std", std, 0.0, lo_open=True)
        super().__init__(**kwargs)

    def craft(self, server_round, honest, own, pids):
        return np.stack(
            [
                seeded_rng(self.seed, Purpose.ATTACK_NOISE, server_round, p).normal(
                    0.0, self.std, own.shape[1]
                )
                for p in pids
            ]
        )


class _Knowing(Attack):
    """An attack computed from a reference set of updates: the round's honest ones, or the attackers' own."""

    def __init__(self, knowledge: str = "honest", **kwargs: Any) -> None:
        if knowledge not in KNOWLEDGE:
            raise ConfigError("knowledge", knowledge, " or ".join(KNOWLEDGE))
        self.knowledge = knowledge
        super().__init__(**kwargs)

    def reference(self, honest: np.ndarray, own: np.ndarray) -> np.ndarray:
        """The updates the attackers estimate from (their own when the round has no honest reply)."""
        return honest if self.knowledge == "honest" and len(honest) else own


class ALIE(_Knowing):
    """ALIE ("a little is enough"): every attacker sends ``mean - z * std`` of the reference updates."""

    name = "alie"

    def __init__(self, z: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if z is None and self.fraction > 0:
            n, m = self.clients_per_round, self.expected_in_cohort()
            try:
                z = alie_z(n, m)
            except ValueError:
                raise ConfigError(
                    "fraction",
                    self.fraction,
                    f"a fraction leaving attackers a minority of a cohort of {n} (about {m} now)",
                    "ALIE's z = Phi^-1((n - s)/n) with s = floor(n/2 + 1) - m is undefined when s <= 0; "
                    "lower attack.fraction or set attack.z.",
                ) from None
        self.z = number("z", z if z is not None else 0.0)

    def craft(self, server_round, honest, own, pids):
        return np.repeat(alie(self.reference(honest, own), self.z)[None], len(own), axis=0)


class IPM(_Knowing):
    """Inner-product manipulation: every attacker sends ``-epsilon * mean`` of the reference updates."""

    name = "ipm"

    def __init__(self, epsilon: float = 0.5, **kwargs: Any) -> None:
        self.epsilon = number("epsilon", epsilon, 0.0, lo_open=True)
        super().__init__(**kwargs)

    def craft(self, server_round, honest, own, pids):
        return np.repeat(ipm(self.reference(honest, own), self.epsilon)[None], len(own), axis=0)


class LabelFlip(Attack):
    """Data poisoning: attackers train on labels ``C - 1 - y`` and send what they trained.

    Every train message carries the attackers' partition ids (``attack-label-flip``, a list): a client flips
    its labels when its own id is in it (the strategy sees node ids only, not partitions).
    """

    name = "label_flip"
    client_half = FlipLabels

    def configure_train(self, server_round, arrays, config, grid):
        if self.malicious:
            config = ConfigRecord({**dict(config.items()), LABEL_FLIP: sorted(self.malicious)})
        return super().configure_train(server_round, arrays, config, grid)

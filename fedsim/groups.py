"""The config groups without a ``_target_``, as one typed object each: ``placement`` and ``engine``.

Groups that build objects (``dataset``, ``partitioner``, ``model``, ``strategy``, ``clipping``,
``heterogeneity``) go through ``hydra.utils.instantiate``; ``client`` and ``faults`` travel to the clients in
the run spec and become :class:`fedsim.training.LocalTraining` and
:class:`fedsim.features.faults.client.FaultRates`. Each
typed object checks its own values, and :func:`typed` turns an unknown key or a bad value into one
``ConfigError`` naming ``group.key``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedsim.checks import integer, number
from fedsim.errors import ConfigError

T = TypeVar("T")


def typed(group: str, cls: type[T], values: Mapping[str, Any], drop: tuple[str, ...] = ()) -> T:
    """``cls(**values)`` (minus the keys in ``drop``); errors name ``group.key``."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(fields) - set(drop))
    if unknown:
        raise ConfigError(
            f"{group}.{unknown[0]}", values[unknown[0]], f"a parameter of {group}: {', '.join(fields)}"
        )
    try:
        return cls(**{k: v for k, v in values.items() if k in fields})
    except ConfigError as e:
        raise e.with_prefix(group) from None


def check_device(key: str, name: Any) -> str:
    """``cpu``, ``auto``, ``cuda`` or ``cuda:N``."""
    head, _, index = str(name).partition(":")
    if str(name) not in ("cpu", "auto") and not (head == "cuda" and (index == "" or index.isdigit())):
        raise ConfigError(key, name, "cpu, cuda, cuda:N or auto")
    return str(name)


MAX_THREADS = 256  # torch threads per client: more than any machine's cores (1000 would only oversubscribe)


@dataclass(frozen=True)
class Placement:
    """Where clients and the server compute (the ``placement`` group)."""

    device: str = "cpu"  # where clients train: cpu | cuda | cuda:N | auto
    server_device: str = "cpu"  # where the server evaluates the global model
    num_cpus_per_client: float = 1.0  # Ray CPUs per ClientApp actor (engine=ray)
    num_gpus_per_client: float = 0.0  # Ray GPUs per ClientApp actor (engine=ray)
    threads_per_client: int = 1  # torch threads in each worker
    deterministic: bool = False  # cuDNN deterministic algorithms and no TF32: engines agree to fp32 rounding

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ConfigError("deterministic", self.deterministic, "true or false")
        check_device("device", self.device)
        check_device("server_device", self.server_device)
        number("num_cpus_per_client", self.num_cpus_per_client, 0.0, lo_open=True)
        number("num_gpus_per_client", self.num_gpus_per_client, 0.0)
        integer("threads_per_client", self.threads_per_client, 1, MAX_THREADS)


ENGINES = ("auto", "inprocess", "vectorized", "ray")


@dataclass(frozen=True)
class EngineSettings:
    """What runs the ClientApp (the ``engine`` group); each engine reads its own keys.

    ``auto`` is the vectorized engine, which batches every train message it can and runs the rest (other
    client algorithms, optimisers, faults, models) through the ClientApp, on ``workers`` processes if > 1.
    """

    name: str = "auto"
    workers: int = 1  # inprocess, auto: 1 sequential, N > 1 worker processes (auto: for unbatched clients)
    threads: int | None = None  # vectorized, auto: torch threads while a cohort trains (None: free_cores())
    max_cohort: int = 0  # vectorized, auto: at most this many clients per batched step (0: no limit)
    vmap_conv_cpu: bool = False  # vectorized, auto: batch non-Sequential conv nets on the CPU too (vmap)
    address: str | None = None  # ray: join a running cluster ("auto" or HOST:PORT)
    num_cpus: int | None = None  # ray: CPUs Ray may use locally
    num_gpus: int | None = None  # ray: GPUs Ray may use locally

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ConfigError("name", self.name, f"one of {', '.join(ENGINES)}")
        integer("workers", self.workers, 1, what="an integer >= 1 (1: sequential in this process)")
        integer("threads", self.threads, 1, allow_none=True)
        integer("max_cohort", self.max_cohort, 0, what="an integer >= 0 (0: the whole cohort)")
        integer("num_cpus", self.num_cpus, 1, allow_none=True)
        integer("num_gpus", self.num_gpus, 0, allow_none=True)


def usable_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity; every core where the OS has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _busy_now(cores: list[int], window: float) -> float | None:
    """How many of ``cores`` other processes kept busy over ``window`` seconds while this thread slept
    (``/proc/stat``'s per-core busy ticks), or None where there is no ``/proc/stat``."""

    def ticks() -> dict[str, tuple[int, int]]:  # core -> (busy, total)
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *vals = line.split()
                    v = [int(x) for x in vals[:8]]
                    out[name] = (sum(v) - v[3] - v[4], sum(v))  # all but idle and iowait
        return out

    try:
        before = ticks()
        time.sleep(window)
        after = ticks()
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for c in cores:
        a, b = before.get(f"cpu{c}"), after.get(f"cpu{c}")
        if a and b and b[1] > a[1]:
            busy += (b[0] - a[0]) / (b[1] - a[1])
    return busy


def free_cores(window: float = 0.1) -> int:
    """The usable cores other processes leave free (at least 1): what ``engine.threads=null`` takes.

    Other processes' load is the larger of the cores they kept busy over the last ``window`` seconds
    (``/proc/stat``, sampled while this thread sleeps; catches a neighbour that just started) and the 1-minute
    load average (``os.getloadavg``, scaled to the usable cores; catches a bursty one). A core counts as busy
    when more than half of it is. Resolved once, when the engine is made: a neighbour that starts later is not
    seen (``engine.threads=1`` is the setting that never oversubscribes).
    """
    cores = usable_cores()
    others = _busy_now(cores, window) or 0.0
    try:
        load = os.getloadavg()[0] * len(cores) / max(len(cores), os.cpu_count() or 1)
    except (OSError, AttributeError):
        load = 0.0
    return max(1, min(len(cores), round(len(cores) - max(others, load))))


def resolve_threads(threads: int | None) -> int:
    """``engine.threads``: the value set, or :func:`free_cores` for None."""
    return int(threads) if threads is not None else free_cores()

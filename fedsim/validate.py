"""Checks of the top-level run knobs and the ``client``/``placement``/``engine`` groups, before any work.

Group objects with constructors (strategies, partitioners, data sets, models) validate their own parameters
and raise ``ConfigError``; ``fedsim.build`` prefixes the group name.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from fedsim.engines import LOCAL_ENGINES
from fedsim.errors import ConfigError
from fedsim.training import OPTIMIZERS


def _int(cfg: DictConfig, key: str, lo: int, hi: int | None = None, what: str = "") -> int:
    val = cfg.get(key) if "." not in key else _dotted(cfg, key)
    ok = isinstance(val, int) and not isinstance(val, bool) and val >= lo and (hi is None or val <= hi)
    if not ok:
        rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ConfigError(key, val, what or rng)
    return val


def _num(
    cfg: DictConfig,
    key: str,
    lo: float,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    val = _dotted(cfg, key)
    ok = isinstance(val, (int, float)) and not isinstance(val, bool)
    if ok:
        ok = (val > lo if lo_open else val >= lo) and (hi is None or (val < hi if hi_open else val <= hi))
    if not ok:
        left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(key, val, f"a number in {left}{lo}, {'inf' if hi is None else hi}{right}")
    return float(val)


def _dotted(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if node is not None else None
    return node


def clients_per_round(cfg: DictConfig) -> int:
    """Cohort size from ``clients_per_round`` or, when that is null, ``client_fraction * num_clients``."""
    n = int(cfg.num_clients)
    if cfg.get("clients_per_round") is None:
        frac = _num(cfg, "client_fraction", 0.0, 1.0, lo_open=True)
        return max(1, round(frac * n))
    return _int(cfg, "clients_per_round", 1, n, what=f"an integer in [1, num_clients={n}]")


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first knob out of range."""
    if not isinstance(cfg.get("seed"), int) or isinstance(cfg.get("seed"), bool) or cfg.seed < 0:
        raise ConfigError("seed", cfg.get("seed"), "an integer >= 0")
    _int(cfg, "num_clients", 1)
    _int(cfg, "num_rounds", 1)
    m = clients_per_round(cfg)
    _int(cfg, "min_replies", 1, m, what=f"an integer in [1, clients_per_round={m}]")
    _num(cfg, "val_fraction", 0.0, 1.0, hi_open=True)
    _num(cfg, "round_timeout", 0.0, lo_open=True)
    if cfg.get("node_timeout") is not None:
        _num(cfg, "node_timeout", 0.0, lo_open=True)
    _int(cfg, "eval_every", 1)
    _int(cfg, "checkpoint_every", 0, what="an integer >= 0 (0: no periodic checkpoints)")
    if cfg.get("target_accuracy") is not None:
        _num(cfg, "target_accuracy", 0.0, 1.0, lo_open=True)
    if cfg.get("federated_eval") and cfg.strategy.get("fraction_evaluate") is not None:
        _num(cfg, "strategy.fraction_evaluate", 0.0, 1.0, lo_open=True)
    c = cfg.client
    if c.optimizer not in OPTIMIZERS:
        raise ConfigError("client.optimizer", c.optimizer, f"one of {', '.join(OPTIMIZERS)}")
    _num(cfg, "client.lr", 0.0, lo_open=True)
    _num(cfg, "client.momentum", 0.0, 1.0, hi_open=True)
    if c.optimizer == "nesterov" and not c.momentum > 0:
        raise ConfigError("client.momentum", c.momentum, "a number in (0, 1) with client.optimizer=nesterov")
    _num(cfg, "client.weight_decay", 0.0)
    _int(cfg, "client.batch_size", 0, what="an integer >= 1, or 0 for full batch")
    _int(cfg, "client.local_steps", 0)
    if c.local_steps == 0:
        _int(cfg, "client.local_epochs", 1, what="an integer >= 1 (or set client.local_steps)")
    engines = (*LOCAL_ENGINES, "ray")
    if cfg.engine.name not in engines:
        raise ConfigError("engine.name", cfg.engine.name, f"one of {', '.join(engines)}")
    p = cfg.placement
    for key in ("device", "server_device"):
        dev = str(p[key])
        head, _, index = dev.partition(":")
        if dev not in ("cpu", "auto") and not (head == "cuda" and (index == "" or index.isdigit())):
            raise ConfigError(f"placement.{key}", dev, "cpu, cuda, cuda:N or auto")
    _num(cfg, "placement.num_cpus_per_client", 0.0, lo_open=True)
    _num(cfg, "placement.num_gpus_per_client", 0.0)
    _int(cfg, "placement.threads_per_client", 1)

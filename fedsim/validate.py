"""Checks of the run's own top-level knobs, before any work.

Groups check themselves: objects built from a ``_target_`` (strategies, partitioners, data sets, models,
heterogeneity) in their constructors, ``client``/``placement``/``engine``/``faults`` as typed objects
(``fedsim.groups``); ``fedsim.build`` puts the group's name in front of the key.
"""

from __future__ import annotations

from omegaconf import DictConfig

from fedsim.checks import integer, number


def clients_per_round(cfg: DictConfig) -> int:
    """Cohort size from ``clients_per_round`` or, when that is null, ``client_fraction * num_clients``."""
    n = int(cfg.num_clients)
    if cfg.get("clients_per_round") is None:
        frac = number("client_fraction", cfg.get("client_fraction"), 0.0, 1.0, lo_open=True)
        return max(1, round(frac * n))
    return integer(
        "clients_per_round", cfg.clients_per_round, 1, n, what=f"an integer in [1, num_clients={n}]"
    )


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first top-level knob out of range."""
    integer("seed", cfg.get("seed"), 0)
    integer("num_clients", cfg.get("num_clients"), 1)
    integer("num_rounds", cfg.get("num_rounds"), 1)
    m = clients_per_round(cfg)
    integer("min_replies", cfg.get("min_replies"), 1, m, what=f"an integer in [1, clients_per_round={m}]")
    number("val_fraction", cfg.get("val_fraction"), 0.0, 1.0, hi_open=True)
    number("round_timeout", cfg.get("round_timeout"), 0.0, lo_open=True)
    number("node_timeout", cfg.get("node_timeout"), 0.0, lo_open=True, allow_none=True)
    integer("eval_every", cfg.get("eval_every"), 1)
    integer(
        "checkpoint_every",
        cfg.get("checkpoint_every"),
        0,
        what="an integer >= 0 (0: no periodic checkpoints)",
    )
    number("target_accuracy", cfg.get("target_accuracy"), 0.0, 1.0, lo_open=True, allow_none=True)
    if cfg.get("federated_eval"):
        number(
            "strategy.fraction_evaluate", cfg.strategy.get("fraction_evaluate", 1.0), 0.0, 1.0, lo_open=True
        )

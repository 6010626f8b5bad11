"""Checkpoints: everything needed to continue a run, written atomically.

A checkpoint holds the global model, the round (or server model version) and simulated clock, the loop's
extra state (e.g. the async loop's bookkeeping), the strategy's state (``state_dict()`` when the strategy has
one, else the pickled strategy object: server-optimiser moments, momentum, buffers, clip norm, accountant)
and the metrics recorded so far. Every random draw in fedsim is derived from ``(seed, purpose, round,
client)`` rather than from a running generator, so no RNG stream needs saving beyond what strategies keep.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from flwr.app import ArrayRecord

from fedsim.errors import ConfigError
from fedsim.recorder import atomic_torch_save

FORMAT = 1


def save(path: Path, state, strategy, records: list[dict]) -> None:
    """Write a checkpoint of ``state`` and ``strategy`` to ``path`` (temp file + rename)."""
    has_sd = callable(getattr(strategy, "state_dict", None))
    atomic_torch_save({
        "format": FORMAT,
        "round": state.round,
        "sim_time": state.sim_time,
        "extra": state.extra,
        "arrays": state.arrays.to_torch_state_dict(),
        "strategy_state": strategy.state_dict() if has_sd else None,
        "strategy_pickle": None if has_sd else pickle.dumps(strategy),
        "records": records,
    }, Path(path))


def load(path: str | Path) -> dict:
    """Read a checkpoint; a missing or foreign file is a config error on ``resume``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise ConfigError("resume", str(path), "a checkpoint.pt file (or a run folder holding one)")
    ckpt = torch.load(p, weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError("resume", str(path), f"a fedsim checkpoint of format {FORMAT}")
    return ckpt


def restore(ckpt: dict, state, strategy):
    """Put a checkpoint's content into ``state``; return the strategy to continue with."""
    state.arrays = ArrayRecord(ckpt["arrays"])
    state.round = int(ckpt["round"])
    state.sim_time = float(ckpt["sim_time"])
    state.extra = dict(ckpt.get("extra") or {})
    if ckpt.get("strategy_state") is not None:
        strategy.load_state_dict(ckpt["strategy_state"])
        return strategy
    return pickle.loads(ckpt["strategy_pickle"])

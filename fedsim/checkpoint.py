"""Checkpoints: everything needed to continue a run, written atomically.

A checkpoint holds the global model, the round (or server model version) and simulated clock, the loop's
extra state (e.g. the async loop's bookkeeping), the strategy's state (``state_dict()`` when the strategy has
one, else the pickled strategy object: server-optimiser moments, momentum, buffers, clip norm, accountant)
and the metrics recorded so far. Every random draw in fedsim is derived from ``(seed, purpose, round,
client)`` rather than from a running generator, so no RNG stream needs saving beyond what strategies keep.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from flwr.app import ArrayRecord

from fedsim.errors import ConfigError
from fedsim.recorder import atomic_torch_save
from fedsim.strategies import base

FORMAT = 2  # 2: strategies live in ``fedsim.strategies`` (format 1 named them ``strategies.*``)
READABLE = (1, 2)


def _upgrade(node):
    """Format 1 -> 2: ``_target_: strategies.X`` in a checkpointed config becomes ``fedsim.strategies.X``."""
    if isinstance(node, dict):
        return {k: _upgrade(v) for k, v in node.items()}
    if isinstance(node, str) and node.startswith("strategies."):
        return "fedsim." + node
    return node


# Keys a resumed run may change: how long it runs, what it logs and where it computes, not what it computes.
FREE_KEYS = (
    "num_rounds",
    "resume",
    "quiet",
    "checkpoint_every",
    "eval_every",
    "target_accuracy",
    "stop_at_target",
    "round_timeout",
    "node_timeout",
    "engine",
    "placement",
    "clipping.max_epsilon",
    "strategy.default_num_rounds",
    "strategy.wall_clock",
)


def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def check_config(ckpt: dict, config: dict, where: str) -> None:
    """Raise ``ConfigError`` on ``resume`` when ``config`` computes something else than the checkpointed run.

    Only the keys in ``FREE_KEYS`` (and those below them) may differ. Checkpoints without a config (older ones)
    are not checked.
    """
    saved = ckpt.get("config")
    if saved is None:
        return
    a, b = _flat(saved), _flat(config)
    free = lambda k: any(k == f or k.startswith(f + ".") for f in FREE_KEYS)
    diff = [k for k in sorted(set(a) | set(b)) if not free(k) and a.get(k, "<unset>") != b.get(k, "<unset>")]
    if diff:
        shown = ", ".join(
            f"{k} (checkpoint: {a.get(k, '<unset>')!r}, now: {b.get(k, '<unset>')!r})" for k in diff[:4]
        )
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise ConfigError(
            "resume",
            where,
            f"a checkpoint of this experiment, but these keys differ: {shown}{more}",
            "Resume with the checkpointed run's overrides (its .hydra/overrides.yaml); only "
            "num_rounds, logging, targets, timeouts, engine and placement may change.",
        )


def _strategy_fields(strategy, frozen: bool = False) -> dict:
    """The strategy as a checkpoint holds it: its ``state_dict()`` when it has one, else the pickled object.

    ``frozen``: a copy of the state dict, which later rounds cannot change in place.
    """
    sd = base.state_dict(strategy)
    if sd is not None:
        return {"strategy_state": copy.deepcopy(sd) if frozen else sd, "strategy_pickle": None}
    return {"strategy_state": None, "strategy_pickle": base.pickle(strategy)}


def save(path: Path, state, strategy, records: list[dict], config: dict | None = None) -> None:
    """Write a checkpoint of ``state``, ``strategy`` and the run's resolved ``config`` to ``path`` (temp + rename)."""
    atomic_torch_save(
        {
            "format": FORMAT,
            "round": state.round,
            "sim_time": state.sim_time,
            "extra": state.carried(),
            "arrays": state.arrays.to_torch_state_dict(),
            **_strategy_fields(strategy),
            "records": records,
            "config": config,
        },
        Path(path),
    )


def load(path: str | Path) -> dict:
    """Read a checkpoint; a missing or foreign file is a config error on ``resume``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise ConfigError("resume", str(path), "a checkpoint.pt file (or a run folder holding one)")
    ckpt = torch.load(p, weights_only=False)
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise ConfigError("resume", str(path), f"a fedsim checkpoint (format {FORMAT})")
    if ckpt["format"] not in READABLE:
        raise ConfigError(
            "resume",
            str(path),
            f"a fedsim checkpoint of format {', '.join(map(str, READABLE))}",
            f"This file has format {ckpt['format']!r}: it was written by another fedsim version.",
        )
    if ckpt["format"] == 1:
        ckpt["config"] = _upgrade(ckpt.get("config"))
    return ckpt


def restore(ckpt: dict, state, strategy):
    """Put a checkpoint's content (from :func:`load`, or a :func:`mark`) into ``state``; return the strategy."""
    arrays = ckpt["arrays"]
    state.arrays = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)
    state.round = int(ckpt["round"])
    state.sim_time = float(ckpt["sim_time"])
    state.carry(ckpt.get("extra") or {})
    if ckpt.get("strategy_state") is not None:
        strategy.load_state_dict(ckpt["strategy_state"])
        return strategy
    return base.unpickle(ckpt["strategy_pickle"])


def mark(state, strategy, loop_state=None) -> dict:
    """A checkpoint held in memory: where an interrupted run rolls back to (with :func:`restore`).

    Taken by the loops after every completed round (or server model version). ``loop_state`` is the loop's own
    continuation (the async loop's tasks in flight), kept as ``extra["async"]``. Cheap: the model is
    referenced (records are replaced, never changed in place), the strategy state copied.
    """
    extra = {**state.carried(), "async": loop_state}
    return {
        "round": state.round,
        "sim_time": state.sim_time,
        "arrays": state.arrays,
        "extra": extra,
        **_strategy_fields(strategy, frozen=True),
    }

"""Checkpoints: everything needed to continue a run, written atomically, read without running code.

A checkpoint holds the global model, the round (or server model version) and simulated clock, the loop's
extra state (e.g. the async loop's bookkeeping), the strategy's state (its ``state_dict()``: server-optimiser
moments, momentum, buffers, clip norm, accountant) and what it needs of the metrics recorded so far: their
count and sha256, the records being in ``metrics.jsonl`` beside it (so the file is O(model + state) however
long the run; :mod:`fedsim.checkpoint_fields`). Every random draw in fedsim
is derived from ``(seed, purpose, round, client)`` rather than from a running generator, so no RNG stream needs
saving beyond what strategies keep.

Everything in the file is plain data (numbers, strings, lists, dicts, tensors, numpy arrays), so it is read with
``torch.load(weights_only=True)``: a crafted file cannot run code. The strategy is rebuilt from the config
(which :func:`check_config` holds equal to the checkpointed one) and then given its state: its plain-data
attributes (:func:`fedsim.strategies.base.plain_state`, so a user's strategy that counts rounds in an
attribute keeps counting) and its ``state_dict()`` when it has one. Formats 1-3 pickled strategies without
``state_dict()``; those pickles are read by :class:`SafeUnpickler` as data (a class name and the attributes it
would have had), calling nothing but constructors of plain data and importing nothing
(:mod:`fedsim.safe_pickle`). :func:`load` checks every field before a resume adopts any of it.
"""

from __future__ import annotations

import copy
import logging
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsim import checkpoint_fields as fields
from fedsim.errors import ConfigError
from fedsim.messages import global_state
from fedsim.recorder import atomic_torch_save
from fedsim.safe_pickle import (  # noqa: F401  (the safe reader's names, as before it had a file of its own)
    _DTYPE_CODES,
    SafeUnpickler,
    UnsafePickle,
    _first,
    _multiarray,
    _Record,
    _Ref,
    _StrategyPickleReader,
    convert_inner_pickles,
    safe_loads,
    strategy_from_pickle,
)
from fedsim.strategies import base

log = logging.getLogger("fedsim")

# 5: no records, their count and digest (``history``) with the records in metrics.jsonl beside it;
# 4: a strategy's plain-data attributes (``strategy_attrs``) and the clients' state it needs (``client_state``);
# 3: plain data only (weights_only), a wrapped strategy without state_dict() pickled (``inner_pickle``);
# 2: the strategy pickled (``strategy_pickle``) in ``fedsim.strategies``; 1: named ``strategies.*``
# Pickles of formats 1-3 are read as data by SafeUnpickler (records=True), never as objects.
FORMAT = 5
READABLE = (1, 2, 3, 4, 5)


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
    "max_failed_rounds",
    "engine",
    "placement",
    "clipping.max_epsilon",
    "clipping.noise_seed",  # a secret kept by the checkpoint, which a resumed run takes its noise seed from
    "strategy.default_num_rounds",
    "strategy.wall_clock",
    "target_r2",
    "progress",
    "logger",
    "callbacks",
    "optimize_metric",
)

# Groups added after a checkpoint was written: missing from its config, they computed what these values compute.
NEUTRAL_WHEN_ABSENT = {
    "attack._target_": None,
    "selection._target_": None,
    "compression._target_": None,
    "task._target_": "fedsim.tasks.Classification",
}


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
    a = {
        k: base.current_name(v) if k.endswith("_target_") and isinstance(v, str) else v for k, v in a.items()
    }
    for key, value in NEUTRAL_WHEN_ABSENT.items():  # a group the checkpoint predates, at its neutral option
        group = key.split(".")[0] + "."
        if not any(k.startswith(group) for k in a) and b.get(key, value) == value:
            a.update({k: v for k, v in b.items() if k.startswith(group)})
    free = lambda k: any(k == f or k.startswith(f + ".") for f in FREE_KEYS) or k.startswith("target_")
    diff = [k for k in sorted(set(a) | set(b)) if not free(k) and a.get(k, "<unset>") != b.get(k, "<unset>")]
    diff.sort(key=lambda k: k not in a or k not in b)  # keys both have first: the likeliest real change
    if diff:
        shown = ", ".join(
            f"{k} (checkpoint: {a.get(k, '<unset>')!r}, now: {b.get(k, '<unset>')!r})" for k in diff[:4]
        )
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise ConfigError(
            "resume",
            where,
            f"a checkpoint of this experiment, but these keys differ: {shown}{more}",
            "Resume with the checkpointed run's overrides (its .hydra/overrides.yaml, less a <secret> noise seed: the checkpoint keeps it); only "
            "num_rounds, logging, targets, timeouts, engine and placement may change.",
        )


def check_rounds(ckpt: dict, num_rounds, where: str) -> None:
    """Raise ``ConfigError`` on ``num_rounds`` when it is below the round the checkpoint reached."""
    done = int(ckpt["round"])
    if isinstance(num_rounds, int) and not isinstance(num_rounds, bool) and num_rounds < done:
        raise ConfigError(
            "num_rounds",
            num_rounds,
            f"an integer >= {done}: the checkpoint resumed ({where}) is at round {done}",
            "Give num_rounds the total number of rounds the resumed run should reach.",
        )


def check_model(ckpt: dict, reference: ArrayRecord, where: str) -> None:
    """Raise ``ConfigError`` on ``resume`` when the checkpoint's model is not the configured one (``reference``):
    other parameter names, shapes or dtypes."""
    why = fields.check_model(ckpt["arrays"], reference)
    if why:
        raise ConfigError(
            "resume",
            where,
            "a checkpoint of the configured model",
            f"{why[:1].upper()}{why[1:]}; only resume from checkpoints fedsim wrote for this experiment.",
        )


def _strategy_fields(strategy, frozen: bool = False) -> dict:
    """The strategy as a checkpoint holds it: its ``state_dict()`` (``strategy_state``) and its plain-data
    attributes (``strategy_attrs``, :func:`fedsim.strategies.base.plain_state`). Nothing is pickled.

    ``frozen`` (a :func:`mark` held in memory): a copy, which later rounds cannot change in place; a strategy
    without ``state_dict()`` is then copied whole, so a roll-back restores every attribute it has.
    """
    sd = base.state_dict(strategy)
    if frozen and sd is None:
        return {"strategy_state": None, "strategy_attrs": None, "strategy_copy": copy.deepcopy(strategy)}
    fields = {"strategy_state": sd, "strategy_attrs": base.plain_state(strategy)}
    return copy.deepcopy(fields) if frozen else fields


_TEMPORARY = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")  # fedsim.recorder's atomic writes: .NAME.PID-HEX.tmp


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Remove what a killed run left half-written in ``run_dir`` (called holding the folder's lock): hidden
    ``.checkpoint.pt.*.tmp`` files of atomic writes, a client-state snapshot or restore cut short. Returns
    their names."""
    from fedsim.algorithms.state import CHECKPOINT_DIR, STATE_DIR

    run_dir = Path(run_dir)
    gone = []
    if not run_dir.is_dir():
        return gone
    for p in run_dir.iterdir():
        if (p.is_file() and _TEMPORARY.match(p.name)) or p.name == STATE_DIR + ".restoring":
            gone.append(p.name)
    snaps = run_dir / CHECKPOINT_DIR
    if snaps.is_dir():
        gone += [f"{CHECKPOINT_DIR}/{p.name}" for p in snaps.iterdir() if p.name.endswith(".tmp")]
    for name in gone:
        p = run_dir / name
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if gone:
        log.warning("removed what an interrupted run left half-written: %s", ", ".join(sorted(gone)[:5]))
    return gone


def _plain_extra(extra: dict) -> dict:
    """The loop's extra state as plain data (the async loop's continuation is a live view until saved)."""
    loop = extra.get("async")
    to_plain = getattr(loop, "to_plain", None)
    return {**extra, "async": to_plain() if callable(to_plain) else loop}


def save(
    path: Path,
    state,
    strategy,
    history: dict | list[dict],
    config: dict | None = None,
    clients: dict | None = None,
) -> None:
    """Write a checkpoint of ``state``, ``strategy`` and the run's resolved ``config`` to ``path`` (temp + rename).

    ``history`` is what it keeps of metrics.jsonl (``fedsim.recorder.Recorder.history``: count, bytes and
    sha256 of the records up to its round). ``clients`` describes the clients' state saved beside it
    (``fedsim.algorithms.state.checkpoint``, with each file's sha256), which a resume then requires; None when
    the clients keep no state. A list of records (the form before format 5) is taken too: its history is
    computed from them (the lines metrics.jsonl beside the checkpoint must then hold).
    """
    if isinstance(history, list):
        history = fields.history_of(history)
    atomic_torch_save(
        {
            "format": FORMAT,
            "round": state.round,
            "sim_time": state.sim_time,
            "extra": _plain_extra(state.carried()),
            "arrays": global_state(state.arrays),  # parsed once a round (the evaluation parsed it already)
            **_strategy_fields(strategy),
            "history": history,
            "config": config,
            "client_state": clients,
        },
        Path(path),
    )


# ---------------------------------------------------------------------------------------------- safe reading


def _numpy_globals() -> list:
    """What ``torch.load(weights_only=True)`` needs beyond tensors and containers: numpy arrays and scalars
    (under numpy 1 or 2 names) and ``dict`` (format 2 pickled the async loop's state as a call of it)."""
    ma = _multiarray()
    out: list = [ma._reconstruct, ma.scalar, np.ndarray, np.dtype, dict]  # dict: format 2's async state
    out += [type(np.dtype(c)) for c in _DTYPE_CODES]
    for prefix in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(ma._reconstruct, f"{prefix}._reconstruct"), (ma.scalar, f"{prefix}.scalar")]
    return out


def _torch_load(p: Path) -> object:
    """``torch.load`` of plain data: tensors, numbers, strings, containers, numpy arrays; nothing is called."""
    ctx = getattr(torch.serialization, "safe_globals", None)
    if ctx is None:  # pragma: no cover  (torch < 2.5)
        torch.serialization.add_safe_globals(_numpy_globals())
        return torch.load(p, map_location="cpu", weights_only=True)
    with ctx(_numpy_globals()):
        return torch.load(p, map_location="cpu", weights_only=True)


def _unreadable(path, allowed: str, hint: str) -> ConfigError:
    return ConfigError("resume", str(path), allowed, hint)


def load(path: str | Path) -> dict:
    """Read a checkpoint without running any code it holds.

    Raises
    ------
    ConfigError
        On ``resume``, one line naming the file: missing, damaged (truncated, empty, not a checkpoint), of
        another format, or holding objects other than plain data (a crafted file: nothing of it was run).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise ConfigError("resume", str(path), "a checkpoint.pt file (or a run folder holding one)")
    if not zipfile.is_zipfile(p):  # every fedsim checkpoint is torch's zip format
        raise _unreadable(
            p, "a fedsim checkpoint", "The file is damaged or not a checkpoint (not a torch zip file)."
        )
    try:
        ckpt = _torch_load(p)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "weights_only" in text or "Unsupported global" in text or "not an allowed global" in text:
            raise _unreadable(
                p,
                "a fedsim checkpoint of plain data",
                f"The file holds objects that loading would have to run ({_unsafe_names(p)}); it was not loaded. "
                "Only resume from checkpoints fedsim wrote.",
            ) from None
        raise _unreadable(
            p, "a fedsim checkpoint", f"The file is damaged or not a checkpoint ({_first(e)})."
        ) from None
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, KeyError, TypeError) as e:
        raise _unreadable(
            p, "a fedsim checkpoint", f"The file is damaged or not a checkpoint ({_first(e)})."
        ) from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise ConfigError("resume", str(path), f"a fedsim checkpoint (format {FORMAT})")
    if ckpt["format"] not in READABLE:
        raise ConfigError(
            "resume",
            str(path),
            f"a fedsim checkpoint of format {', '.join(map(str, READABLE))}",
            f"This file has format {ckpt['format']!r}: it was written by another fedsim version.",
        )
    listed = "history" if ckpt["format"] >= 5 else "records"
    missing = [k for k in ("round", "sim_time", "arrays", listed) if k not in ckpt]
    if missing:
        raise _unreadable(p, "a complete fedsim checkpoint", f"The file lacks {', '.join(missing)}.")
    if ckpt["format"] == 1:
        ckpt["config"] = _upgrade(ckpt.get("config"))
    _check_content(p, ckpt)
    if ckpt["format"] >= 5:
        ckpt["records"] = _history(p, ckpt)
    return ckpt


def _check_content(p: Path, ckpt: dict) -> None:
    """Every field of ``ckpt`` as fedsim writes it (:func:`fedsim.checkpoint_fields.check`), pickled strategies
    of formats 1-3 read as data; ``ConfigError`` on ``resume`` naming the file and the first field that is not."""
    try:
        if ckpt.get("strategy_pickle") is not None:  # formats 1-2: read as data, never as objects
            ckpt["strategy_attrs"] = strategy_from_pickle(ckpt["strategy_pickle"])
        ckpt["strategy_pickle"] = None
        convert_inner_pickles(ckpt.get("strategy_state"))
        if ckpt.get("strategy_attrs") is not None:
            base.check_plain_state(ckpt["strategy_attrs"])
        if ckpt.get("strategy_state") is not None and not isinstance(ckpt["strategy_state"], dict):
            raise ValueError("strategy_state is not a dict")
        fields.check(ckpt)
    except UnsafePickle as e:
        raise _unreadable(
            p,
            "a fedsim checkpoint of plain data",
            f"The file holds a pickled {e} that fedsim does not load; nothing of it was run.",
        ) from None
    except ValueError as e:
        raise _unreadable(
            p, "a fedsim checkpoint", f"The file is damaged or not a checkpoint ({_first(e)})."
        ) from None


def _history(p: Path, ckpt: dict) -> list[dict]:
    """The records a checkpoint of format 5 was written after, from metrics.jsonl beside it (checked against
    the count and digest it keeps)."""
    try:
        return fields.read_history(ckpt["history"], p.parent, ckpt["round"])
    except fields.HistoryMismatch as e:
        raise _unreadable(
            p,
            f"a checkpoint together with the {fields.HISTORY} it was written after",
            f"{e}: resume from the run folder that holds both (copy {fields.HISTORY} with checkpoint.pt).",
        ) from None
    except ValueError as e:
        raise _unreadable(
            p, "a fedsim checkpoint", f"The records beside it are damaged ({_first(e)})."
        ) from None


def _unsafe_names(p: Path) -> str:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(p)
    except Exception:  # noqa: BLE001  (only for the message)
        return "objects torch does not load as plain data"
    names = [n for n in names if not n.startswith("numpy")]
    return ", ".join(names[:5]) or "objects torch does not load as plain data"


def restore(ckpt: dict, state, strategy):
    """Put a checkpoint's content (from :func:`load`, or a :func:`mark`) into ``state``; return the strategy.

    ``strategy`` is the one the run built from its config; it is kept and given the checkpoint's plain-data
    attributes, then its ``state_dict()``. A :func:`mark` of a strategy without ``state_dict()`` returns its
    copy instead.

    Raises
    ------
    ConfigError
        On ``resume`` when the checkpoint's strategy is of another class than the configured one.
    """
    arrays = ckpt["arrays"]
    state.arrays = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)
    state.round = int(ckpt["round"])
    state.sim_time = float(ckpt["sim_time"])
    state.carry(ckpt.get("extra") or {})
    if ckpt.get("strategy_copy") is not None:  # a mark held in memory
        return copy.deepcopy(ckpt["strategy_copy"])
    try:
        _restore_strategy(ckpt, strategy)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ConfigError(
            "resume",
            f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "a checkpoint of the configured strategy",
            f"Its strategy state does not fit ({_first(e)}); only resume from checkpoints fedsim wrote.",
        ) from None
    return strategy


def _restore_strategy(ckpt: dict, strategy) -> None:
    if ckpt.get("strategy_attrs") is not None:
        base.load_plain_state(strategy, ckpt["strategy_attrs"])
    if ckpt.get("strategy_state") is not None:
        if not isinstance(strategy, base.Stateful):
            name = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
            raise ConfigError(
                "resume",
                name,
                "the strategy the checkpoint was written by (its state is a state_dict(); this one has none)",
                "Resume with the checkpointed run's overrides (its .hydra/overrides.yaml, less a <secret> noise seed: the checkpoint keeps it).",
            )
        strategy.load_state_dict(ckpt["strategy_state"])


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

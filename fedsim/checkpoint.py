"""Checkpoints: everything needed to continue a run, written atomically, read without running code.

A checkpoint holds the global model, the round (or server model version) and simulated clock, the loop's
extra state (e.g. the async loop's bookkeeping), the strategy's state (its ``state_dict()``: server-optimiser
moments, momentum, buffers, clip norm, accountant) and the metrics recorded so far. Every random draw in fedsim
is derived from ``(seed, purpose, round, client)`` rather than from a running generator, so no RNG stream needs
saving beyond what strategies keep.

Everything in the file is plain data (numbers, strings, lists, dicts, tensors, numpy arrays), so it is read with
``torch.load(weights_only=True)``: a crafted file cannot run code. A strategy without ``state_dict()`` keeps no
state between rounds (fedsim's FedAvg, FedProx, FedMedian, FedTrimmedAvg and Krum): the resumed run rebuilds it
from the config, which :func:`check_config` holds equal to the checkpointed one. Formats 1 and 2 pickled such
strategies; those pickles (and any pickle a strategy state holds) are read by :class:`SafeUnpickler`, which
only rebuilds strategy classes of ``fedsim.strategies`` and Flower, and numpy arrays, and calls nothing else.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import copy
import importlib
import io
import logging
import pickle
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsim.errors import ConfigError
from fedsim.recorder import atomic_torch_save
from fedsim.strategies import base

log = logging.getLogger("fedsim")

# 3: plain data only (weights_only), no pickled strategy; 2: strategies live in ``fedsim.strategies``
# (format 1 named them ``strategies.*``)
FORMAT = 3
READABLE = (1, 2, 3)


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
            "Resume with the checkpointed run's overrides (its .hydra/overrides.yaml); only "
            "num_rounds, logging, targets, timeouts, engine and placement may change.",
        )


_WARNED: set[str] = set()


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


def _strategy_fields(strategy, frozen: bool = False) -> dict:
    """The strategy as a checkpoint holds it: its ``state_dict()``, or nothing for a stateless strategy.

    ``frozen`` (a :func:`mark` held in memory): a copy of the state, which later rounds cannot change in place;
    a strategy without ``state_dict()`` is then copied whole, so a roll-back restores even one that keeps
    state. On disk such a strategy is rebuilt from the config instead (see the module docstring).
    """
    sd = base.state_dict(strategy)
    if sd is not None:
        return {"strategy_state": copy.deepcopy(sd) if frozen else sd, "strategy_pickle": None}
    if frozen:
        return {"strategy_state": None, "strategy_pickle": None, "strategy_copy": copy.deepcopy(strategy)}
    name = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
    if not name.startswith(("fedsim.strategies.", "flwr.")) and name not in _WARNED:
        _WARNED.add(name)
        log.warning(
            "strategy %s has no state_dict(): checkpoints keep none of its state (a resumed run rebuilds it "
            "from the config)",
            name,
        )
    return {"strategy_state": None, "strategy_pickle": None}


def _plain_extra(extra: dict) -> dict:
    """The loop's extra state as plain data (the async loop's continuation is a live view until saved)."""
    loop = extra.get("async")
    to_plain = getattr(loop, "to_plain", None)
    return {**extra, "async": to_plain() if callable(to_plain) else loop}


def save(path: Path, state, strategy, records: list[dict], config: dict | None = None) -> None:
    """Write a checkpoint of ``state``, ``strategy`` and the run's resolved ``config`` to ``path`` (temp + rename)."""
    atomic_torch_save(
        {
            "format": FORMAT,
            "round": state.round,
            "sim_time": state.sim_time,
            "extra": _plain_extra(state.carried()),
            "arrays": state.arrays.to_torch_state_dict(),
            **_strategy_fields(strategy),
            "records": records,
            "config": config,
        },
        Path(path),
    )


# ---------------------------------------------------------------------------------------------- safe reading
def _multiarray():
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # pragma: no cover  (numpy 1)
        from numpy.core import multiarray
    return multiarray


_DTYPE_CODES = "?bhilqBHILQefdgFDG"  # bool, integers, floats, complex: no object, string or void arrays


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
    missing = [k for k in ("round", "sim_time", "arrays", "records") if k not in ckpt]
    if missing:
        raise _unreadable(p, "a complete fedsim checkpoint", f"The file lacks {', '.join(missing)}.")
    if ckpt["format"] == 1:
        ckpt["config"] = _upgrade(ckpt.get("config"))
    try:
        if ckpt.get("strategy_pickle") is not None:
            ckpt["strategy_pickle"] = safe_loads(ckpt["strategy_pickle"])
        _check_embedded_pickles(ckpt.get("strategy_state"))
    except UnsafePickle as e:
        raise _unreadable(
            p,
            "a fedsim checkpoint whose strategy is one of fedsim's or Flower's",
            f"The file holds a pickled {e} that fedsim does not load; nothing of it was run.",
        ) from None
    return ckpt


def _first(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


def _unsafe_names(p: Path) -> str:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(p)
    except Exception:  # noqa: BLE001  (only for the message)
        return "objects torch does not load as plain data"
    names = [n for n in names if not n.startswith("numpy")]
    return ", ".join(names[:5]) or "objects torch does not load as plain data"


class UnsafePickle(pickle.UnpicklingError):
    """A pickle that would rebuild or call something :class:`SafeUnpickler` does not allow."""


_ALLOWED_MODULES = ("fedsim.strategies.", "flwr.serverapp.strategy.")


def _safe_reconstructor(cls, base_cls, state):
    """``copyreg._reconstructor`` for plain objects only (it would call ``base_cls.__init__`` otherwise)."""
    if base_cls is not object:
        raise UnsafePickle(f"object of {cls.__module__}.{cls.__qualname__} built on {base_cls!r}")
    return object.__new__(cls)


def _safe_names() -> dict:
    ma = _multiarray()
    names = {
        ("copyreg", "_reconstructor"): _safe_reconstructor,
        ("collections", "OrderedDict"): OrderedDict,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        names[(mod, "_reconstruct")] = ma._reconstruct
        names[(mod, "scalar")] = ma.scalar
    for t in (type(np.dtype(c)) for c in _DTYPE_CODES):
        names[("numpy.dtypes", t.__name__)] = t
    for name in ("set", "frozenset", "complex", "slice", "bytearray", "object", "dict", "list", "tuple"):
        names[("builtins", name)] = getattr(builtins, name)
    return names


_SAFE: dict = {}


def _safe() -> dict:
    if not _SAFE:
        _SAFE.update(_safe_names())
    return _SAFE


class SafeUnpickler(pickle._Unpickler):
    """An unpickler that rebuilds only data: numpy arrays, containers, and objects of the strategy classes of
    ``fedsim.strategies`` and ``flwr.serverapp.strategy`` (without calling their constructors), referencing
    functions of those modules. It calls no other function (``REDUCE`` only on numpy's and the containers'
    rebuilders), so a crafted pickle raises :class:`UnsafePickle` instead of running code.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as pickle's own find_class maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        if module == "strategies" or module.startswith("strategies."):  # format 1: strategies.* -> fedsim.*
            module = "fedsim." + module
        safe = _safe()
        if (module, name) in safe:
            return safe[(module, name)]
        if "." in name or not (module + ".").startswith(_ALLOWED_MODULES) or name.startswith("__"):
            raise UnsafePickle(f"{module}.{name}")
        try:
            obj = getattr(sys.modules.get(module) or importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise UnsafePickle(f"{module}.{name} (not found)") from None
        home = getattr(obj, "__module__", "") or ""
        if not (isinstance(obj, type) or callable(obj)) or not (home + ".").startswith(_ALLOWED_MODULES):
            raise UnsafePickle(f"{module}.{name}")
        return obj

    def persistent_load(self, pid):
        raise UnsafePickle("a persistent reference")

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is f for f in _safe().values()):
            name = getattr(func, "__qualname__", type(func).__name__)
            raise UnsafePickle(f"a call of {getattr(func, '__module__', '?')}.{name}")
        self.stack[-1] = func(*args)

    dispatch[pickle.REDUCE[0]] = load_reduce


def safe_loads(data: bytes):
    """Unpickle ``data`` with :class:`SafeUnpickler` (``UnsafePickle`` when it would rebuild anything else)."""
    return SafeUnpickler(io.BytesIO(data)).load()


def _check_embedded_pickles(node) -> None:
    """Every pickle inside a strategy state (e.g. a wrapper's inner strategy) must be one :func:`safe_loads` reads.

    Byte strings that are no pickle at all are left alone (they are the strategy's data).
    """
    if isinstance(node, dict):
        for v in node.values():
            _check_embedded_pickles(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _check_embedded_pickles(v)
    elif isinstance(node, (bytes, bytearray)):
        try:
            safe_loads(bytes(node))
        except UnsafePickle:
            raise
        except Exception:  # noqa: BLE001  (not a pickle: plain bytes)
            pass


def restore(ckpt: dict, state, strategy):
    """Put a checkpoint's content (from :func:`load`, or a :func:`mark`) into ``state``; return the strategy.

    ``strategy`` is the one the run built from its config; it is kept (and given the checkpoint's state when
    there is one). Format 1 and 2 files hold a pickled strategy, which :func:`load` read safely.
    """
    arrays = ckpt["arrays"]
    state.arrays = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)
    state.round = int(ckpt["round"])
    state.sim_time = float(ckpt["sim_time"])
    state.carry(ckpt.get("extra") or {})
    if ckpt.get("strategy_state") is not None:
        strategy.load_state_dict(ckpt["strategy_state"])
        return strategy
    if ckpt.get("strategy_copy") is not None:  # a mark held in memory
        return copy.deepcopy(ckpt["strategy_copy"])
    old = ckpt.get("strategy_pickle")
    if old is not None and not isinstance(old, (bytes, bytearray)):  # format 1/2, unpickled safely by load()
        return old
    return strategy


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

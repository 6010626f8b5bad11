"""Checkpoints: everything needed to continue a run, written atomically, read without running code.

A checkpoint holds the global model, the round (or server model version) and simulated clock, the loop's
extra state (e.g. the async loop's bookkeeping), the strategy's state (its ``state_dict()``: server-optimiser
moments, momentum, buffers, clip norm, accountant) and the metrics recorded so far. Every random draw in fedsim
is derived from ``(seed, purpose, round, client)`` rather than from a running generator, so no RNG stream needs
saving beyond what strategies keep.

Everything in the file is plain data (numbers, strings, lists, dicts, tensors, numpy arrays), so it is read with
``torch.load(weights_only=True)``: a crafted file cannot run code. The strategy is rebuilt from the config
(which :func:`check_config` holds equal to the checkpointed one) and then given its state: its plain-data
attributes (:func:`fedsim.strategies.base.plain_state`, so a user's strategy that counts rounds in an
attribute keeps counting) and its ``state_dict()`` when it has one. Formats 1-3 pickled strategies without
``state_dict()``; those pickles are read by :class:`SafeUnpickler` as data (a class name and the attributes it
would have had), calling nothing but constructors of plain data and importing nothing.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import copy
import io
import logging
import pickle
import re
import shutil
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

# 4: a strategy's plain-data attributes (``strategy_attrs``) and the clients' state it needs (``client_state``);
# 3: plain data only (weights_only), a wrapped strategy without state_dict() pickled (``inner_pickle``);
# 2: the strategy pickled (``strategy_pickle``) in ``fedsim.strategies``; 1: named ``strategies.*``
# Pickles of formats 1-3 are read as data by SafeUnpickler (records=True), never as objects.
FORMAT = 4
READABLE = (1, 2, 3, 4)


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
    records: list[dict],
    config: dict | None = None,
    clients: dict | None = None,
) -> None:
    """Write a checkpoint of ``state``, ``strategy`` and the run's resolved ``config`` to ``path`` (temp + rename).

    ``clients`` describes the clients' state saved beside it (``fedsim.algorithms.state.checkpoint``), which
    a resume then requires; None when the clients keep no state.
    """
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
            "client_state": clients,
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
        if ckpt.get("strategy_pickle") is not None:  # formats 1-2: read as data, never as objects
            ckpt["strategy_attrs"] = _strategy_from_pickle(ckpt["strategy_pickle"])
        ckpt["strategy_pickle"] = None
        _convert_inner_pickles(ckpt.get("strategy_state"))
        if ckpt.get("strategy_attrs") is not None:
            base.check_plain_state(ckpt["strategy_attrs"])
        if ckpt.get("strategy_state") is not None and not isinstance(ckpt["strategy_state"], dict):
            raise ValueError("strategy_state is not a dict")
        _check_clients(ckpt.get("client_state"))
    except UnsafePickle as e:
        raise _unreadable(
            p,
            "a fedsim checkpoint of plain data",
            f"The file holds a pickled {e} that fedsim does not load; nothing of it was run.",
        ) from None
    except ValueError as e:
        raise _unreadable(
            p, "a fedsim checkpoint", f"The file is damaged or not a checkpoint ({e})."
        ) from None
    return ckpt


def _check_clients(clients) -> None:
    if clients is None:
        return
    ok = isinstance(clients, dict) and isinstance(clients.get("round"), int)
    ok = ok and isinstance(clients.get("files"), list) and all(isinstance(f, str) for f in clients["files"])
    if not ok:
        raise ValueError("client_state is not {'round': int, 'files': [str]}")


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
    """A pickle that would call or rebuild something :class:`SafeUnpickler` does not allow."""


class _Ref:
    """A name a pickle refers to (``module.qualname``): never imported, never called."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


class _Record:
    """An object a pickle describes, kept as data: the name of its class and the state it would have had."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: _Ref) -> None:
        self.cls, self.state = cls, None


def _reconstructor(cls, base_cls, state):
    """``copyreg._reconstructor`` (protocols 0 and 1) of an object named by a :class:`_Ref`: a record, no call."""
    if not isinstance(cls, _Ref) or base_cls is not object or state is not None:
        raise UnsafePickle(f"a call of copyreg._reconstructor on {cls}")
    return _Record(cls)


def _latin1(text, encoding="latin1"):
    """``_codecs.encode(text, "latin1")``: how protocols 0-2 write bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickle("a call of _codecs.encode with other than (str, 'latin1')")
    return text.encode("latin1")


def _plain_dtype(*args):
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise UnsafePickle(f"a numpy dtype of Python objects ({dtype})")
    return dtype


def _plain_reconstruct(cls, *args):
    if cls is not np.ndarray:  # a subclass could run its own __setstate__ / __array_finalize__
        raise UnsafePickle(f"a numpy array of type {getattr(cls, '__qualname__', cls)}")
    return _multiarray()._reconstruct(cls, *args)


def _plain_scalar(dtype, *args):
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise UnsafePickle(f"a numpy scalar of {dtype}")
    return _multiarray().scalar(dtype, *args)


def _safe_names() -> dict:
    """The only callables a pickle may call: constructors of plain data, each checking its arguments."""
    names = {
        ("copyreg", "_reconstructor"): _reconstructor,
        ("_codecs", "encode"): _latin1,
        ("collections", "OrderedDict"): OrderedDict,
        ("numpy", "dtype"): _plain_dtype,
        ("numpy", "ndarray"): np.ndarray,  # named as _reconstruct's first argument
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        names[(mod, "_reconstruct")] = _plain_reconstruct
        names[(mod, "scalar")] = _plain_scalar
    for t in (type(np.dtype(c)) for c in _DTYPE_CODES):
        names[("numpy.dtypes", t.__name__)] = t
    for name in ("set", "frozenset", "complex", "bytearray", "bytes", "list", "tuple", "dict", "object"):
        names[("builtins", name)] = getattr(builtins, name)
    return names


_SAFE: dict = {}


def _safe() -> dict:
    if not _SAFE:
        _SAFE.update(_safe_names())
    return _SAFE


# Modules a pickled strategy never names (the standard library, numpy, torch, fedsim outside its strategies):
# a pickle naming them is refused at once, even though names are never imported or called.
_NEVER = frozenset(sys.stdlib_module_names) | {"numpy", "torch", "fedsim", "flwr", "_codecs", "copyreg"}
_STRATEGY_HOMES = ("fedsim.strategies.", "flwr.serverapp.strategy.", "flwr.serverapp.")


class SafeUnpickler(pickle._Unpickler):
    """An unpickler that calls nothing but the plain-data constructors of :func:`_safe_names` (containers,
    ``bytes``, numpy arrays, dtypes and scalars of numbers) and imports nothing.

    ``REDUCE`` calls only those; ``OBJ``, ``INST``, ``EXT*`` and persistent references are refused outright;
    ``BUILD`` sets state only on numpy arrays and dtypes (numpy's own ``__setstate__``, data only). With
    ``records=True`` (a strategy pickled by checkpoint formats 1-3) a class the pickle names outside the
    standard library, numpy and torch becomes an inert :class:`_Ref`; ``NEWOBJ`` / ``NEWOBJ_EX`` /
    ``copyreg._reconstructor`` of it give a :class:`_Record` (its name and state as data), never an
    instance: no class of the file is imported, constructed or given its state. Anything else raises
    :class:`UnsafePickle` naming it, and nothing of the pickle has run.
    """

    records = False
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
        named = all(part.isidentifier() for part in (*module.split("."), *name.split(".")))
        top = module.split(".")[0]
        home = (module + ".").startswith(_STRATEGY_HOMES) or top not in _NEVER
        if not self.records or not named or name.startswith("_") or not home:
            raise UnsafePickle(f"{module}.{name}")
        return _Ref(module, name)

    def persistent_load(self, pid):
        raise UnsafePickle("a persistent reference")

    def _refuse(self, what: str):
        raise UnsafePickle(what)

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if isinstance(func, _Ref) or not any(func is f for f in _safe().values()):
            raise UnsafePickle(f"a call of {_name_of(func)}")
        if not isinstance(args, tuple):
            raise UnsafePickle(f"a call of {_name_of(func)} without an argument tuple")
        self.stack[-1] = func(*args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._record(cls, args, {}))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._record(cls, args, kwargs))

    def _record(self, cls, args, kwargs) -> _Record:
        if not isinstance(cls, _Ref):
            raise UnsafePickle(f"a construction of {_name_of(cls)}")
        if args or kwargs:
            raise UnsafePickle(f"a construction of {cls} with arguments")
        return _Record(cls)

    def load_obj(self):
        items = self.pop_mark()
        raise UnsafePickle(f"a call of {_name_of(items[0]) if items else 'an object'} (OBJ)")

    def load_inst(self):
        module = self.readline()[:-1].decode("ascii", "replace")
        name = self.readline()[:-1].decode("ascii", "replace")
        raise UnsafePickle(f"a call of {module}.{name} (INST)")

    def load_ext(self):
        raise UnsafePickle("an extension-registry reference")

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, _Record):
            if inst.state is not None:
                raise UnsafePickle(f"a second state for {inst.cls}")
            inst.state = state
        elif type(inst) is np.ndarray or isinstance(inst, np.dtype):
            inst.__setstate__(state)  # numpy's own: shape, dtype and raw bytes
            if inst.dtype.hasobject if isinstance(inst, np.ndarray) else inst.hasobject:
                raise UnsafePickle("a numpy array or dtype of Python objects")
        else:
            raise UnsafePickle(f"a state set on {_name_of(type(inst))}")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.OBJ[0]] = load_obj
    dispatch[pickle.INST[0]] = load_inst
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = load_ext


class _StrategyPickleReader(SafeUnpickler):
    """:class:`SafeUnpickler` for the strategies that checkpoint formats 1-3 pickled: their objects as records."""

    records = True


def _name_of(obj) -> str:
    if isinstance(obj, _Ref):
        return str(obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def safe_loads(data: bytes):
    """Unpickle plain data with :class:`SafeUnpickler` (``UnsafePickle`` when it would call anything else)."""
    return SafeUnpickler(io.BytesIO(data)).load()


def _plain_from_record(rec: _Record) -> dict:
    """What :func:`fedsim.strategies.base.plain_state` would have kept of a strategy pickled by formats 1-3."""
    state = rec.state
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
        state = {**(state[0] or {}), **(state[1] or {})}
    attrs = {}
    for name, value in (state or {}).items() if isinstance(state, dict) else ():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
            continue
        if isinstance(value, _Record):
            attrs[name] = ["strategy", _plain_from_record(value)]
        elif base.is_plain(value):
            attrs[name] = ["plain", value]
    return {"class": str(rec.cls), "attrs": attrs}


def _strategy_from_pickle(data) -> dict:
    """A strategy pickled by formats 1-3, read as data (:class:`_StrategyPickleReader`), as plain attributes."""
    if not isinstance(data, (bytes, bytearray)):
        raise UnsafePickle(f"a strategy pickle that is not bytes ({type(data).__name__})")
    try:
        obj = _StrategyPickleReader(io.BytesIO(bytes(data))).load()
    except UnsafePickle:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged pickle: refused as such)
        raise UnsafePickle(f"damaged strategy pickle ({_first(e)})") from None
    if not isinstance(obj, _Record):
        raise UnsafePickle(f"strategy pickle holding a {type(obj).__name__}, not a strategy")
    return _plain_from_record(obj)


def _convert_inner_pickles(node) -> None:
    """Formats 2-3: a wrapper's ``inner_pickle`` (the wrapped strategy pickled) becomes ``inner_attrs``."""
    if isinstance(node, dict):
        if node.get("inner_pickle") is not None:
            node["inner_attrs"] = _strategy_from_pickle(node["inner_pickle"])
        node.pop("inner_pickle", None)
        for v in node.values():
            _convert_inner_pickles(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _convert_inner_pickles(v)


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

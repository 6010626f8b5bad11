"""Reading pickles as data: :class:`SafeUnpickler` calls nothing but constructors of plain data and imports
nothing; the strategies that checkpoint formats 1-3 pickled are read by it as records (a class name and the
attributes it would have had), never as objects (:func:`strategy_from_pickle`)."""

from __future__ import annotations

import _compat_pickle
import builtins
import io
import pickle
import sys
from collections import OrderedDict

import numpy as np


def is_plain(value: object) -> bool:
    """True for plain data: None, bool, int, float, complex, str, bytes, numeric numpy arrays and scalars,
    torch tensors, and lists, tuples, sets and dicts (string or integer keys) of those."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.kind in "biufc"
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_plain(v) for k, v in value.items())
    return False


def _multiarray():
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # pragma: no cover  (numpy 1)
        from numpy.core import multiarray
    return multiarray


_DTYPE_CODES = "?bhilqBHILQefdgFDG"  # bool, integers, floats, complex: no object, string or void arrays


def _first(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


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
        elif is_plain(value):
            attrs[name] = ["plain", value]
    return {"class": str(rec.cls), "attrs": attrs}


def strategy_from_pickle(data) -> dict:
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


def convert_inner_pickles(node) -> None:
    """Formats 2-3: a wrapper's ``inner_pickle`` (the wrapped strategy pickled) becomes ``inner_attrs``."""
    if isinstance(node, dict):
        if node.get("inner_pickle") is not None:
            node["inner_attrs"] = strategy_from_pickle(node["inner_pickle"])
        node.pop("inner_pickle", None)
        for v in node.values():
            convert_inner_pickles(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            convert_inner_pickles(v)

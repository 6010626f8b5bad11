"""A train instruction and a train reply, read and written in one place.

The ClientApp (every engine) and the vectorized engine (which trains a cohort without calling the ClientApp)
both go through :func:`parse_train` and :func:`train_reply`, so a new client-side key cannot be honoured on
one path and silently ignored on the other: a key that the batched path does not handle is listed in
:attr:`TrainInstruction.unhandled`, and the vectorized engine then runs that message through the ClientApp.
"""

from __future__ import annotations

import functools
import io
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsim import keys
from fedsim.seeds import Purpose, torch_generator
from fedsim.strategies.records import to_numpy

# Train-config keys with a meaning on the client; anything else is "unhandled" (see TrainInstruction).
DRAW_INDEX_KEYS = (keys.TASK_ID, keys.MODEL_VERSION, keys.SERVER_ROUND)
KNOWN_TRAIN_KEYS = frozenset(
    {keys.RUN_SPEC, keys.PROXIMAL_MU, keys.MAX_STEPS, keys.CLIP_NORM, *DRAW_INDEX_KEYS}
)


@dataclass(frozen=True)
class TrainInstruction:
    """What a train message asks of a client, parsed from its ConfigRecord.

    Attributes
    ----------
    spec : str
        The run's client spec (JSON): data, model and local training.
    draw_index : int
        Indexes the client's random draws: the task index in the asynchronous loop, else the model version or
        the server round.
    proximal_mu : float
        Weight of FedProx's proximal term (0: off).
    max_steps : int or None
        At most this many local steps (partial work before a deadline).
    clip_norm : float or None
        Clip the update to this L2 norm before replying (client-side clipping).
    unhandled : dict
        Config entries fedsim's client does not know (a user's strategy may send some to its own ClientApp).
    """

    spec: str
    draw_index: int = 0
    proximal_mu: float = 0.0
    max_steps: int | None = None
    clip_norm: float | None = None
    unhandled: dict = field(default_factory=dict)

    def generator(self, seed: int, partition_id: int) -> torch.Generator:
        """The generator of this client's minibatch order (the same on every engine)."""
        return torch_generator(seed, Purpose.LOCAL_SHUFFLE, self.draw_index, partition_id)


def parse_train(config: ConfigRecord) -> TrainInstruction:
    """Read a train message's ConfigRecord (``KeyError`` when it holds no run spec)."""
    index = next((config[k] for k in DRAW_INDEX_KEYS if k in config), 0)
    return TrainInstruction(
        spec=str(config[keys.RUN_SPEC]),
        draw_index=int(index),
        proximal_mu=float(config.get(keys.PROXIMAL_MU, 0.0)),
        max_steps=int(config[keys.MAX_STEPS]) if keys.MAX_STEPS in config else None,
        clip_norm=float(config[keys.CLIP_NORM]) if keys.CLIP_NORM in config else None,
        unhandled={k: v for k, v in config.items() if k not in KNOWN_TRAIN_KEYS},
    )


def incoming_arrays(content: RecordDict) -> dict[str, dict]:
    """The extra ArrayRecords of a train message (besides the model), as numpy arrays by record and name."""
    return {name: to_numpy(rec) for name, rec in content.array_records.items() if name != keys.ARRAYS}


def train_reply(
    msg: Message,
    state: dict[str, torch.Tensor],
    *,
    num_examples: int,
    loss: float,
    partition_id: int,
    steps: int,
    examples_processed: int,
    extra: dict | None = None,
    outgoing: dict[str, dict] | None = None,
) -> Message:
    """The reply to train message ``msg``: the client's weights and fedsim's train metrics (plus ``extra``).

    ``outgoing``: extra arrays for the server (a client algorithm's), one ArrayRecord per name.
    """
    metrics = {
        keys.NUM_EXAMPLES: int(num_examples),
        keys.TRAIN_LOSS: float(loss),
        keys.PARTITION_ID: int(partition_id),
        keys.NUM_STEPS: int(steps),
        keys.EXAMPLES_PROCESSED: int(examples_processed),
        **(extra or {}),
    }
    records = {keys.ARRAYS: array_record(state), keys.METRICS: MetricRecord(metrics)}
    for name, arrays in (outgoing or {}).items():
        records[name] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return Message(RecordDict(records), reply_to=msg)


# ------------------------------------------------------------------------ ArrayRecord conversions, fewer copies
@functools.lru_cache(maxsize=256)
def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
    return buf.getvalue()[: -int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize or None]


def to_array(t: torch.Tensor) -> Array:
    """``Array(t)`` with one copy instead of ``np.save``'s two (header cached per dtype and shape).

    The bytes are those ``np.save`` writes for the tensor's values in C order, so ``Array.numpy()`` and every
    Flower serialiser read them unchanged.
    """
    x = t.detach().cpu().numpy()
    x = x if x.flags.c_contiguous else np.ascontiguousarray(x)  # (ascontiguousarray makes 0-d arrays 1-d)
    header = _npy_header(x.dtype.str, x.shape)
    return Array(dtype=str(x.dtype), shape=tuple(x.shape), stype="numpy.ndarray", data=header + x.tobytes())


def array_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord of a state dict (``ArrayRecord(state)``, built by :func:`to_array`)."""
    return ArrayRecord({k: to_array(v) for k, v in state.items()})


_LAST_GLOBAL: list = [None, None, None]  # weak reference to a record, its arrays' identity, its state dict


def global_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()``, converted once per record object: local engines hand one ArrayRecord
    object to every client of a cohort, so the cohort parses the global model once instead of once per client.

    The tensors are shared: load them (``load_state_dict`` copies), never modify them.
    """
    ident = tuple((k, id(a), id(a.data)) for k, a in arrays.items())  # an Array replaced or rewritten: miss
    ref, known, state = _LAST_GLOBAL
    if ref is not None and ref() is arrays and known == ident:
        return state
    state = arrays.to_torch_state_dict()
    _LAST_GLOBAL[:] = [weakref.ref(arrays), ident, state]
    return state

"""A train instruction and a train reply, read and written in one place.

The ClientApp (every engine) and the vectorized engine (which trains a cohort without calling the ClientApp)
both go through :func:`parse_train` and :func:`train_reply`, so a new client-side key cannot be honoured on
one path and silently ignored on the other: a key that the batched path does not handle is listed in
:attr:`TrainInstruction.unhandled`, and the vectorized engine then runs that message through the ClientApp.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsim import keys
from fedsim.errors import ConfigError
from fedsim.local import LocalTraining
from fedsim.records import array_values, npy_header, to_numpy
from fedsim.seeds import Purpose, torch_generator

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
        return torch_generator(*self.generator_row(seed, partition_id))

    def generator_row(self, seed: int, partition_id: int) -> tuple[int, ...]:
        """What seeds :meth:`generator`: ``(seed, purpose, draw index, partition id)``
        (``fedsim.seeds.torch_generators`` seeds a cohort's together)."""
        return (int(seed), int(Purpose.LOCAL_SHUFFLE), int(self.draw_index), int(partition_id))


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
    metrics = train_metrics(
        num_examples=num_examples,
        loss=loss,
        partition_id=partition_id,
        steps=steps,
        examples_processed=examples_processed,
        extra=extra,
    )
    return reply_message(msg, state, metrics, outgoing)


def train_metrics(
    *, num_examples: int, loss: float, partition_id: int, steps: int, examples_processed: int, extra=None
) -> dict:
    """The metrics of a train reply (the MetricRecord's entries), as :func:`train_reply` writes them."""
    return {
        keys.NUM_EXAMPLES: int(num_examples),
        keys.TRAIN_LOSS: float(loss),
        keys.PARTITION_ID: int(partition_id),
        keys.NUM_STEPS: int(steps),
        keys.EXAMPLES_PROCESSED: int(examples_processed),
        **(extra or {}),
    }


def reply_message(
    msg: Message, state: dict[str, torch.Tensor], metrics: dict, outgoing: dict[str, dict] | None = None
) -> Message:
    """The reply to train message ``msg`` holding ``state`` and ``metrics`` (see :func:`train_reply`)."""
    records = {keys.ARRAYS: array_record(state), keys.METRICS: MetricRecord(metrics)}
    for name, arrays in (outgoing or {}).items():
        records[name] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return Message(RecordDict(records), reply_to=msg)


# ------------------------------------------------------------------------ ArrayRecord conversions, fewer copies
def to_array(t: torch.Tensor) -> Array:
    """``Array(t)`` with one copy instead of ``np.save``'s two (header cached per dtype and shape).

    The bytes are those ``np.save`` writes for the tensor's values in C order, so ``Array.numpy()`` and every
    Flower serialiser read them unchanged.
    """
    x = t.detach().cpu().numpy()
    x = x if x.flags.c_contiguous else np.ascontiguousarray(x)  # (ascontiguousarray makes 0-d arrays 1-d)
    header = npy_header(x.dtype.str, x.shape)
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
    state = {k: torch.from_numpy(array_values(a)) for k, a in arrays.items()}  # to_torch_state_dict's values
    _LAST_GLOBAL[:] = [weakref.ref(arrays), ident, state]
    return state


# ------------------------------------------------------------------------ a round's train replies: the cohort
@dataclass
class Cohort:
    """The valid train replies of a round, one row per client: what the server side of a round sees.

    Row ``i`` comes from node ``node_ids[i]``: its model is ``arrays[name][i]`` for every parameter (tensors
    ``(rows, *shape)`` on the device the cohort sits on) and its metrics are ``metrics[i]`` (the entries
    :func:`train_reply` writes). The grid boundary makes one, once: the batched engine trains a cohort straight
    into one (``messages[i]`` is then the train message row ``i`` answers), and the replies of per-client engines
    and deployed nodes are stacked into one (:meth:`from_replies`; ``messages[i]`` is then the reply itself).
    Aggregators and wrappers are written against it; :meth:`replies` gives the per-client Flower Messages it
    stands for (the replies themselves while the rows are unchanged), for a strategy that reads Messages.
    """

    messages: list[Message]
    arrays: dict[str, torch.Tensor]
    metrics: list[dict]
    from_replies_: bool = False  # messages are the replies themselves (not the train messages they answer)
    changed: bool = False  # the rows' models or metrics differ from those of ``messages``

    def __len__(self) -> int:
        return len(self.metrics)

    @staticmethod
    def from_replies(replies: list[Message]) -> Cohort:
        """The cohort of per-client train replies of one layout (screened): their models stacked on the CPU.

        The model is the reply's ArrayRecord ``arrays`` (or its only one); its other records stay in the replies.
        """
        replies = list(replies)
        models = [_model_record(r) for r in replies]
        names = list(models[0].keys()) if models else []
        arrays = {
            n: torch.from_numpy(np.stack([array_values(m[n], writable=False) for m in models])) for n in names
        }
        metrics = [dict(r.content[keys.METRICS].items()) for r in replies]
        return Cohort(replies, arrays, metrics, from_replies_=True)

    def replace(self, arrays: dict | None = None, metrics: list[dict] | None = None) -> Cohort:
        """The same rows with new models (``arrays``, the same names and rows) and/or metrics."""
        return Cohort(
            self.messages,
            self.arrays if arrays is None else arrays,
            self.metrics if metrics is None else metrics,
            self.from_replies_,
            True,
        )

    @property
    def partition_ids(self) -> list[int]:
        return [int(m[keys.PARTITION_ID]) for m in self.metrics]

    @property
    def node_ids(self) -> list[int]:
        """The node each row comes from."""
        if self.from_replies_:
            return [int(msg.metadata.src_node_id) for msg in self.messages]
        return [int(msg.metadata.dst_node_id) for msg in self.messages]

    def take(self, rows: list[int]) -> Cohort:
        """The rows ``rows``, in that order."""
        if rows == list(range(len(self))):
            return self
        index = torch.tensor(rows, dtype=torch.long)
        return Cohort(
            [self.messages[i] for i in rows],
            {n: t.index_select(0, index.to(t.device)) for n, t in self.arrays.items()},
            [self.metrics[i] for i in rows],
            self.from_replies_,
            self.changed,
        )

    def to(self, device: str | torch.device) -> Cohort:
        """The same rows with their models on ``device``."""
        arrays = {n: t.to(device) for n, t in self.arrays.items()}
        return Cohort(self.messages, arrays, self.metrics, self.from_replies_, self.changed)

    @staticmethod
    def concat(parts: list[Cohort], rows: list[int] | None = None) -> Cohort | None:
        """The rows of ``parts`` one after the other (on the CPU when the parts sit on different devices); None
        when they do not stack (other parameters, shapes or dtypes). ``rows`` (every row once): those rows in
        that order, ``concat(parts).take(rows)`` in one copy."""
        first = parts[0]
        layout = {n: (t.shape[1:], t.dtype) for n, t in first.arrays.items()}
        if any({n: (t.shape[1:], t.dtype) for n, t in p.arrays.items()} != layout for p in parts):
            return None
        if len(parts) == 1:
            return first if rows is None else first.take(rows)
        devices = {t.device for p in parts for t in p.arrays.values()}
        if len(devices) > 1:
            parts = [p.to("cpu") for p in parts]
        messages = [m for p in parts for m in p.messages]
        metrics = [m for p in parts for m in p.metrics]
        if rows is None:
            arrays = {n: torch.cat([p.arrays[n] for p in parts]) for n in first.arrays}
        else:
            if sorted(rows) != list(range(len(messages))):
                raise ValueError(f"rows must name each of the {len(messages)} rows once, got {rows}")
            at = torch.empty(len(rows), dtype=torch.long)  # where each row of the parts goes
            at[torch.tensor(rows, dtype=torch.long)] = torch.arange(len(rows))
            arrays = {}
            for n, t in first.arrays.items():
                out = arrays[n] = t.new_empty((len(rows), *t.shape[1:]))
                start = 0
                for p in parts:
                    part = p.arrays[n]
                    out.index_copy_(0, at[start : start + len(part)].to(out.device), part)
                    start += len(part)
            messages, metrics = [messages[i] for i in rows], [metrics[i] for i in rows]
        return Cohort(messages, arrays, metrics, first.from_replies_, any(p.changed for p in parts))

    def replies(self) -> list[Message]:
        """One Flower reply Message per row: the replies themselves while unchanged, else made from the rows (one
        copy off the device per parameter; a reply's other records and metadata are kept)."""
        if self.from_replies_ and not self.changed:
            return list(self.messages)
        host = {n: t.detach().cpu() for n, t in self.arrays.items()}
        if not self.from_replies_:
            return [
                reply_message(msg, {n: t[i] for n, t in host.items()}, metrics)
                for i, (msg, metrics) in enumerate(zip(self.messages, self.metrics))
            ]
        return [
            _rebuilt(rep, {n: t[i] for n, t in host.items()}, metrics)
            for i, (rep, metrics) in enumerate(zip(self.messages, self.metrics))
        ]

    def metric_contents(self) -> list[RecordDict]:
        """Each row's metrics as the content of a reply holding only its MetricRecord (what Flower's metric
        aggregation functions read)."""
        return [RecordDict({keys.METRICS: MetricRecord(m)}) for m in self.metrics]

    def host_models(self) -> list[dict[str, np.ndarray]]:
        """Each row's model as numpy arrays of its own dtypes (what ``reply_arrays`` gives of its reply)."""
        host = {n: t.detach().cpu().numpy() for n, t in self.arrays.items()}
        return [{n: a[i] for n, a in host.items()} for i in range(len(self))]

    def host_arrays(self) -> dict[str, np.ndarray]:
        """The stacked models as numpy arrays ``(rows, *shape)`` in the host's memory, floating-point ones in float64
        (the values ``np.asarray(a, np.float64)`` gives of each row's array)."""
        return {
            n: (t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu()).numpy()
            for n, t in self.arrays.items()
        }

    def dtypes(self) -> dict[str, np.ndarray]:
        """An empty numpy array of each parameter's dtype (what ``cast_like`` needs to know of a reply)."""
        from fedsim.comm import torch_numpy_dtype

        return {n: np.empty(0, torch_numpy_dtype(t.dtype)) for n, t in self.arrays.items()}

    def weighted_mean(self, weights) -> dict[str, np.ndarray]:
        """``sum_i w_i x_i / sum_i w_i`` per parameter in float64, computed where the rows are, as numpy arrays.

        On the CPU the same products and sums in the same order as
        ``fedsim.aggregate.weighted_mean`` of the rows' models, so the same bits; on a GPU matrix
        products (float64 rounding apart).
        """
        from fedsim.aggregate import normalised_weights

        if len(weights) != len(self):
            raise ValueError(f"need one weight per row, got {len(self)} rows and {len(weights)} weights")
        w = normalised_weights(weights)
        tensors = {n: t.detach() for n, t in self.arrays.items()}
        if all(x.device.type == "cpu" for x in tensors.values()):
            return host_mean(tensors, w)
        return {
            n: host_mean({n: x}, w)[n] if x.device.type == "cpu" else device_mean(x, w).cpu().numpy()
            for n, x in tensors.items()
        }


# float64 values of the work matrix of :func:`host_mean` (512 KiB): a block of rows at a time, and of a row a
# window of columns where one row of the model is larger, so the matrix stays in the CPU's cache while it is
# summed and is reused from round to round (the whole stack at once was a 40 MB float64 copy at 100 MLP clients
# of 28x28)
HOST_MEAN_BLOCK = 1 << 16


_SCRATCH = threading.local()


def _scratch(rows: int, cols: int) -> np.ndarray:
    """A ``(rows, cols)`` float64 work matrix, this thread's, reused from round to round (a fresh one costs its
    page faults again)."""
    n = rows * cols
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        buf = _SCRATCH.buf = np.empty(n)
    return buf[:n].reshape(rows, cols)


def host_mean(tensors: dict[str, torch.Tensor], w: np.ndarray) -> dict[str, np.ndarray]:
    """``sum_i w[i] x[i]`` in float64 of CPU tensors ``(rows, *shape)``, with numpy (one thread, whatever torch's
    thread count): every tensor at once as one ``(rows, values)`` matrix, each value the same products and sums in
    the same order as ``fedsim.aggregate.weighted_mean`` (``acc = w[0] x[0]``, then ``+= w[i] x[i]``), taken
    :data:`HOST_MEAN_BLOCK` float64 values at a time (a block of rows, or a window of one row's columns: a copy
    of a few rows, never of the stack). The results are views into one buffer."""
    flat = [x.numpy().reshape(len(w), -1) for x in tensors.values()]
    bounds = np.cumsum([0, *(f.shape[1] for f in flat)]).tolist()
    acc = np.empty(bounds[-1])
    width = max(1, min(bounds[-1], HOST_MEAN_BLOCK))  # columns of a window
    step = max(1, HOST_MEAN_BLOCK // width)  # rows of a block
    for c0 in range(0, bounds[-1], width):
        c1 = min(c0 + width, bounds[-1])
        pieces = [
            f[:, max(c0, a) - a : min(c1, b) - a]
            for f, a, b in zip(flat, bounds, bounds[1:])
            if a < c1 and b > c0
        ]
        window = acc[c0:c1]
        for r0 in range(0, len(w), step):
            r1 = min(r0 + step, len(w))
            terms = _scratch(r1 - r0, c1 - c0)
            np.concatenate([p[r0:r1] for p in pieces], axis=1, out=terms)  # cast to float64 as copied (exact)
            terms *= w[r0:r1, None]
            rows = iter(terms)
            if r0 == 0:
                window[:] = next(rows)
            for term in rows:
                window += term
    return {n: acc[a:b].reshape(x.shape[1:]) for (n, x), a, b in zip(tensors.items(), bounds, bounds[1:])}


def _model_record(reply: Message) -> ArrayRecord:
    """A train reply's model: its ArrayRecord ``arrays``, or its only ArrayRecord."""
    records = reply.content.array_records
    return records[keys.ARRAYS] if keys.ARRAYS in records else next(iter(records.values()))


def _rebuilt(reply: Message, state: dict[str, torch.Tensor], metrics: dict) -> Message:
    """A copy of ``reply`` (metadata and other records kept) with its model ``state`` and its metrics ``metrics``."""
    model = (
        keys.ARRAYS if keys.ARRAYS in reply.content.array_records else next(iter(reply.content.array_records))
    )
    records = {}
    for name, rec in reply.content.items():
        if name == model:
            rec = array_record(state)
        elif name == keys.METRICS:
            rec = MetricRecord(metrics)
        records[name] = rec
    return Message(content=RecordDict(records), metadata=copy.deepcopy(reply.metadata))


def device_mean(x: torch.Tensor, w: np.ndarray, rows: int = 64) -> torch.Tensor:
    """``sum_i w[i] x[i]`` in float64 where ``x`` is, as matrix products of ``rows`` rows at a time (float64
    copies of a few rows, not of the whole stack)."""
    wt = torch.as_tensor(w, dtype=torch.float64, device=x.device)
    acc = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
    for i in range(0, len(w), rows):
        acc += torch.tensordot(wt[i : i + rows], x[i : i + rows].double(), dims=1)
    return acc


# ---------------------------------------------------------------- Flower's own train-config keys
log = logging.getLogger("fedsim")

# Flower's quickstart keys for local training: ``lr`` in the train config, ``local-epochs`` in the train config
# or the run config (its ClientApp reads ``context.run_config["local-epochs"]``)
FLOWER_LR, FLOWER_EPOCHS = "lr", "local-epochs"
_HONOURED = frozenset({FLOWER_LR, FLOWER_EPOCHS, keys.FLOWER_CLIPPING_NORM})
_WARNED: set[tuple[str, ...]] = set()


def flower_train_config(local: LocalTraining, unhandled: dict, run_config, foreign: bool) -> LocalTraining:
    """``local`` with Flower's conventional ``lr`` and ``local-epochs`` applied, where a message (or, under a
    ServerApp that is not fedsim's, the run config) sets them; a bad value is one ``ConfigError`` line.

    Under a ServerApp that is not fedsim's, the other train-config keys that nothing in fedsim reads are named
    in one warning (once per set of keys), never ignored silently.
    """
    changes = {}
    if FLOWER_LR in unhandled:
        changes["lr"] = _number(FLOWER_LR, unhandled[FLOWER_LR])
    epochs = unhandled.get(FLOWER_EPOCHS, run_config.get(FLOWER_EPOCHS) if foreign else None)
    if epochs is not None:
        value = _number(FLOWER_EPOCHS, epochs)
        if value != int(value):
            raise ConfigError(FLOWER_EPOCHS, epochs, "an integer >= 1")
        changes.update(local_epochs=int(value), local_steps=0)
    if foreign:
        ignored = tuple(sorted(k for k in unhandled if k not in _HONOURED))
        if ignored and ignored not in _WARNED:
            _WARNED.add(ignored)
            log.warning(
                "fedsim's ClientApp ignores train-config key(s) %s (it reads %s, and %s)",
                ", ".join(repr(k) for k in ignored),
                f"{FLOWER_LR!r}, {FLOWER_EPOCHS!r}",
                f"{keys.FLOWER_CLIPPING_NORM!r}; the rest of local training comes from run_config 'overrides'",
            )
    return dataclasses.replace(local, **changes) if changes else local


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, "a number (train config)")
    return float(value)

"""Helpers around Flower's ``Grid``: a sampled view, node discovery, reply screening."""

from __future__ import annotations

import functools
import io
import logging
import math
import time
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedsim import keys
from fedsim.errors import RunError, reply_error
from fedsim.records import array_values
from fedsim.screen import Row, _names, check_metrics, together

log = logging.getLogger("fedsim")

# Flower's error codes for a message or node that went away (ErrorCode.MESSAGE_UNAVAILABLE,
# REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE): counted as kind "unavailable", not as a client error.
UNAVAILABLE_CODES = (
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.NODE_UNAVAILABLE,
)


class GridView(Grid):
    """A ``Grid`` that forwards every call to ``grid``; subclasses change what they need."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def set_run(self, run):
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self):
        return self._grid.get_nodes()  # Grid's own default drops the nodes' names and public keys

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self._grid.send_and_receive(messages, timeout=timeout)


class SampledGrid(GridView):
    """A view of ``grid`` whose ``get_node_ids`` returns only the sampled cohort.

    fedsim samples clients itself (seeded, by partition id) and hands Flower strategies this view, so any
    ``flwr.serverapp.strategy`` class sends to exactly the sampled nodes.
    """

    def __init__(self, grid: Grid, node_ids: Iterable[int]) -> None:
        super().__init__(grid)
        self._nodes = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)


class RunStopped(RuntimeError):
    """Raised in a server loop running in another thread (Ray's ServerApp thread) once the run is stopped."""


class StoppableView(GridView):
    """A view of ``grid`` whose every call raises :class:`RunStopped` once ``stop`` is set.

    The Ray engine runs the server loop in a thread of its own; when the main thread is interrupted, setting
    ``stop`` ends that thread at its next grid call (it polls every ``poll`` seconds while it waits for
    replies), so it neither changes the run's state while the outputs are written nor keeps the process alive.
    """

    def __init__(self, grid: Grid, stop, poll: float = 0.05) -> None:
        super().__init__(grid)
        self._stop, self._poll = stop, poll

    def _check(self) -> None:
        if self._stop.is_set():
            raise RunStopped("the run was stopped")

    def get_node_ids(self) -> Iterable[int]:
        self._check()
        return self._grid.get_node_ids()

    def push_messages(self, messages):
        self._check()
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        self._check()
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return push_and_pull(self, messages, timeout, self._poll)


def push_and_pull(grid: Grid, messages, timeout: float | None, poll: float) -> list[Message]:
    """``send_and_receive`` with replies pulled every ``poll`` seconds.

    Flower's deployed Grid sleeps 3 s between pulls (``GrpcGrid.send_and_receive`` in Flower 1.42), so a reply
    that arrives just after a pull waits up to 3 s; fedsim's ServerApp pulls every 0.1 s instead (one cheap
    call to the SuperLink; the replies are fetched once they are there). Stops at ``timeout`` seconds with the
    replies so far, as Flower's does.
    """
    ids = set(grid.push_messages(list(messages)))
    end = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while ids and (end is None or time.monotonic() < end):
        got = list(grid.pull_messages(list(ids)))
        replies += got
        ids -= {r.metadata.reply_to_message_id for r in got}
        if ids:
            time.sleep(poll)
    return replies


def wait_for_nodes(grid: Grid, expected: int, timeout: float) -> list[int]:
    """Wait until ``expected`` nodes are connected; raise ``RunError`` after ``timeout`` seconds.

    Counts the nodes ``grid.get_node_ids()`` lists: behind a deployment's node binding, only nodes it may use.
    """
    start = time.monotonic()
    end, told = start + timeout, start
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        now = time.monotonic()
        if now > end:
            refused = len(getattr(grid, "refused", ()))
            also = f" ({refused} other node(s) refused: see nodes.json)" if refused else ""
            raise RunError(f"only {len(nodes)} of {expected} clients connected within {timeout:.0f} s{also}")
        if now - told >= WAIT_NOTICE:  # say what the run waits for, never silently
            told = now
            log.info(
                "waiting for SuperNodes: %d of %d connected (num_clients=%d; gives up in %.0f s, node_timeout)",
                len(nodes),
                expected,
                expected,
                end - now,
            )
        time.sleep(0.05)
    return nodes


WAIT_NOTICE = 10.0  # seconds between the lines of wait_for_nodes


def _foreign_reason(rep: Message) -> str | None:
    """Why a query reply says its node runs a ClientApp that is not fedsim's (None: it is fedsim's, or broken).

    Such a client has no query handler (Flower answers with an error naming it), or answers the query without
    a ``partition-id`` and ``num-examples`` (a handler of its own).
    """
    if rep.has_error():
        reason = str(rep.error.reason)
        return "it has no query handler" if "No query function registered" in reason else None
    m = rep.content.get(keys.METRICS) if rep.has_content() else None
    ok = isinstance(m, MetricRecord) and all(
        isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)
        for k in (keys.PARTITION_ID, keys.NUM_EXAMPLES)
    )
    if ok:
        return None
    what = f"metrics {_names(m.keys())}" if isinstance(m, MetricRecord) else "no MetricRecord"
    return f"its query reply holds {what}, no {keys.PARTITION_ID!r}"


def discover(
    grid: Grid,
    node_ids: list[int],
    spec: str,
    timeout: float,
    found: dict[int, tuple[int, int]] | None = None,
    num_partitions: int | None = None,
) -> dict[int, tuple[int, int]]:
    """Ask every node for its partition id and size: ``{partition_id: (node_id, num_examples)}``.

    ``found`` (updated and returned) holds partitions already taken. A node whose claim cannot stand gets no
    work and never stops the run: one warning line each, through ``grid.refuse(node, partition, reason)``
    when the grid has it (a deployment's node gate, which also judges claims with ``grid.check_claim``). A
    partition claimed twice stays with the node listed first in ``node_ids`` (or asked earlier).

    A node whose ClientApp is not fedsim's (a stock Flower ClientApp: no query handler, or a query reply
    without ``partition-id``) is identified by its node id: after the nodes that claim a partition, each such
    node in turn takes the partition a node gate binds it to, else the lowest free one below
    ``num_partitions``, with size 0 (unknown); one log line names them. Its replies then get that partition
    (:func:`screen_replies`). Any other error reply (fedsim's client failed to start) stops discovery with
    ``RunError``.
    """
    msgs = [
        Message(RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec})}), nid, MessageType.QUERY)
        for nid in node_ids
    ]
    found = {} if found is None else found
    check, refuse, accept = (getattr(grid, a, None) for a in ("check_claim", "refuse", "accept"))
    order = {nid: i for i, nid in enumerate(node_ids)}
    replies = sorted(
        grid.send_and_receive(msgs, timeout=timeout),
        key=lambda r: order.get(r.metadata.src_node_id, len(order)),
    )
    claims, foreign = [], []
    for rep in replies:
        nid = rep.metadata.src_node_id
        why = _foreign_reason(rep)
        if why is not None:
            foreign.append((nid, why))
        elif rep.has_error():
            raise RunError(f"client on node {nid} failed to start: {first_line(str(rep.error.reason))}")
        else:
            m = rep.content[keys.METRICS]
            claims.append((nid, int(m[keys.PARTITION_ID]), int(m[keys.NUM_EXAMPLES])))
    bound = getattr(grid, "bound", {})  # a deployment's node gate: node id -> the partition it is bound to
    taken = set(found) | {pid for _, pid, _ in claims}
    limit = num_partitions if num_partitions is not None else len(taken) + len(foreign)
    free = (p for p in range(limit) if p not in taken)  # lazy: sees the partitions taken meanwhile
    for i, (nid, why) in enumerate(foreign):
        pid = bound.get(nid)
        pid = next(free, None) if pid is None else pid
        if pid is None:
            foreign[i] = (nid, f"{why}; no partition left for it, it gets no work")
            continue
        taken.add(pid)
        claims.append((nid, pid, 0))
        foreign[i] = (nid, f"{why}; partition {pid}")
    if foreign:
        log.warning(
            "%d node(s) run a ClientApp that is not fedsim's, identified by node id: %s",
            len(foreign),
            "; ".join(f"node {nid} ({why})" for nid, why in foreign[:5])
            + (" ..." if len(foreign) > 5 else ""),
        )
    for nid, pid, size in claims:
        reason = check(nid, pid) if check is not None else None
        if reason is None and pid in found:
            reason = f"claims partition-id={pid}, which node {found[pid][0]} holds (two nodes claim it)"
        if reason is not None:
            if refuse is not None:
                refuse(nid, pid, reason)
            else:
                log.warning("node %d refused, it gets no work: %s", nid, reason)
            continue
        found[pid] = (nid, size)
        if accept is not None:
            accept(nid, pid)
    return found


def first_line(reason: str) -> str:
    """An error reply's reason as one line: the exception type and the start of its whole message
    (``fedsim.errors.reply_error``)."""
    return reply_error(reason)


def _node(rep: Message) -> str:
    return f"node {rep.metadata.src_node_id}"


@functools.lru_cache(maxsize=1024)
def _npy_layout(head: bytes) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype of an ``np.save`` header (numpy's own parser), or None when it is no header of plain
    numbers (Python objects, an unknown format version, garbage)."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, _, dtype = read[version](f)
    except (KeyError, ValueError, TypeError, SyntaxError, EOFError):
        return None
    if dtype.hasobject or any(not isinstance(d, int) or d < 0 for d in shape):
        return None
    return tuple(shape), dtype


def array_problem(name: str, a: Array) -> str | None:
    """Why an Array's bytes are not the numpy array its metadata declares (None when they are).

    Flower decodes an Array with ``np.load`` on its bytes and trusts neither its ``dtype`` nor its ``shape``;
    a reply whose bytes are truncated, random, or of another dtype or shape than declared would fail (or
    silently differ) inside a strategy. Checked here from the bytes' own header, without decoding the values.
    """
    if a.stype != "numpy.ndarray":
        return f"{name!r} is a {a.stype!r} array, not a numpy array"
    data = a.data
    if not isinstance(data, bytes) or data[:6] != b"\x93NUMPY" or len(data) < 10 or data[6] not in (1, 2):
        return f"the bytes of {name!r} are not a numpy array"
    size = int.from_bytes(data[8:10], "little") if data[6] == 1 else int.from_bytes(data[8:12], "little")
    end = (10 if data[6] == 1 else 12) + size
    layout = _npy_layout(bytes(data[:end])) if len(data) >= end else None
    if layout is None:
        return f"the bytes of {name!r} are not a numpy array of numbers"
    shape, dtype = layout
    if len(data) - end != math.prod(shape) * dtype.itemsize:
        return f"the bytes of {name!r} hold {len(data) - end} bytes of values, not the {shape} {dtype} of their header"
    if str(dtype) != str(a.dtype) or shape != tuple(a.shape):
        return f"the bytes of {name!r} are {dtype} {shape}, but it declares {a.dtype} {tuple(a.shape)}"
    return None


def check_reply_content(
    rep: Message, reference: dict[str, tuple[tuple, np.dtype]], partition: int | None = None
) -> tuple[str, str] | None:
    """Why a (non-error) train reply cannot be aggregated: ``(kind, detail)``, or None when it can.

    ``reference`` maps each array name of the global model to its ``(shape, dtype)``; ``partition`` is the
    partition the replying node holds (from discovery), when known. The detail names the node and what is
    missing or different, so a client that is not fedsim's (or trains another model) is recognisable in the log.
    """
    c = rep.content
    arrs, metrics = c.get(keys.ARRAYS), c.get(keys.METRICS)
    if not isinstance(arrs, ArrayRecord) or not isinstance(metrics, MetricRecord):
        what = [f"an ArrayRecord {keys.ARRAYS!r}"] if not isinstance(arrs, ArrayRecord) else []
        what += [f"a MetricRecord {keys.METRICS!r}"] if not isinstance(metrics, MetricRecord) else []
        return (
            "malformed",
            f"reply from {_node(rep)} lacks {' and '.join(what)} (records: {_names(c.keys())})",
        )
    problem = check_metrics(_node(rep), metrics, partition)
    if problem is not None:
        return problem
    for rec in c.array_records.values():
        for k, a in rec.items():
            why = array_problem(k, a)
            if why is not None:
                return "malformed", f"reply from {_node(rep)}: {why}"
    got = {k: (tuple(a.shape), a.dtype) for k, a in arrs.items()}
    if set(got) != set(reference):
        missing, extra = set(reference) - set(got), set(got) - set(reference)
        parts = ([f"missing {_names(missing)}"] if missing else []) + (
            [f"unexpected {_names(extra)}"] if extra else []
        )
        return (
            "shape",
            f"reply from {_node(rep)}: array names differ from the global model's ({'; '.join(parts)})",
        )
    for k, (shape, _) in reference.items():
        if got[k][0] != shape:
            return (
                "shape",
                f"reply from {_node(rep)}: {k!r} has shape {got[k][0]}, the global model's {shape}",
            )
    for k, (_, dtype) in reference.items():
        if got[k][1] != dtype:
            return "dtype", f"reply from {_node(rep)}: {k!r} is {got[k][1]}, the global model's is {dtype}"
    loss = metrics.get(keys.TRAIN_LOSS, 0.0)
    if isinstance(loss, (int, float)) and not math.isfinite(float(loss)):
        return "nonfinite", f"NaN or Inf train loss from {_node(rep)}"
    for rec in c.array_records.values():
        if not all(np.isfinite(array_values(a, writable=False)).all() for a in rec.values()):
            return "nonfinite", f"NaN or Inf in the update from {_node(rep)}"
    return None


def _layout(rep: Message) -> tuple:
    """What every reply of a round must share for Flower's aggregation: record names and kinds, metric keys."""
    c = rep.content
    records = tuple(sorted((k, type(r).__name__) for k, r in c.items()))
    return records, tuple(sorted(c[keys.METRICS].keys()))


def screen_replies(
    replies: Iterable[Message], reference: ArrayRecord, partitions: Mapping[int, int] | None = None
) -> tuple[list[Message], list[tuple[str, str]]]:
    """Split train replies into valid ones and failures ``(kind, detail)``: nothing a strategy is given can make
    it fail.

    A reply fails if it is an error (kind ``error``; ``timeout`` for a simulated one; ``unavailable`` when
    the SuperLink reports the node or message gone), or (``malformed``) lacks its ArrayRecord or MetricRecord,
    or the metrics ``partition-id`` and ``num-examples`` (a client that is not fedsim's), holds a partition id
    that is not a whole number, not its node's partition, or another reply's; a ``num-examples`` that is not a
    whole number in ``[0, MAX_NUM_EXAMPLES]``; a metric that is not a number; an array whose bytes are not the
    numpy array its metadata declares (truncated, random, another dtype or shape, not numpy); records or metric
    keys unlike the round's other replies (those most replies share); or when every reply has
    ``num-examples`` 0 (nothing to weight by). It fails too if its array names or shapes (``shape``) or dtypes
    (``dtype``) differ from ``reference``, or it holds NaN/Inf in its arrays or train loss (``nonfinite``).
    Each detail names the node and what is missing or different.

    ``partitions`` maps node ids to partition ids (from discovery): a reply without ``partition-id`` from a
    node listed there (a stock Flower ClientApp) gets its node's partition in a new MetricRecord, and a reply
    from a node that is not listed fails. When a stock ClientApp's arrays do not fit ``reference``, no round can
    ever use that client: ``RunError``, one line naming the mismatch.
    """
    ref = {k: (tuple(a.shape), a.dtype) for k, a in reference.items()}
    valid, failures = [], []
    for rep in replies:
        if rep.has_error():
            reason = str(rep.error.reason)
            if int(rep.error.code) in UNAVAILABLE_CODES:  # the SuperLink lost the node (no heartbeat)
                kind = "unavailable"
            else:
                kind = "timeout" if "SimulatedTimeout" in reason else "error"
            failures.append((kind, first_line(reason)))
            continue
        node = int(rep.metadata.src_node_id)
        if partitions and node not in partitions:
            failures.append(("malformed", f"reply from {_node(rep)}, which is not one of the run's clients"))
            continue
        foreign = rep.has_content() and partitions is not None and _adopt(rep, partitions)
        expected = partitions.get(node) if partitions else None
        problem = (
            check_reply_content(rep, ref, expected) if rep.has_content() else ("malformed", "an empty reply")
        )
        if problem is not None and foreign and problem[0] in ("shape", "dtype"):
            raise RunError(
                f"{problem[1]}: its ClientApp (not fedsim's) trains another model than the configured one; "
                "configure that model (model=..., and the dataset= that gives its input shape)"
            )
        if problem is not None:
            failures.append(problem)
            continue
        valid.append(rep)
    return _screen_together(valid, failures)


def _screen_together(valid: list[Message], failures: list) -> tuple[list[Message], list[tuple[str, str]]]:
    """The checks across a round's replies (``fedsim.screen.together``) of Messages."""
    rows = [
        Row(
            rep,
            int(rep.content[keys.METRICS][keys.PARTITION_ID]),
            _node(rep),
            _layout(rep),
            rep.content[keys.METRICS][keys.NUM_EXAMPLES],
        )
        for rep in valid
    ]
    return [r.item for r in together(rows, failures)], failures


def _adopt(rep: Message, partitions: Mapping[int, int]) -> bool:
    """Give a reply without ``partition-id`` its node's partition (True when it did: a foreign client's)."""
    m = rep.content.get(keys.METRICS)
    pid = partitions.get(int(rep.metadata.src_node_id))
    if not isinstance(m, MetricRecord) or keys.PARTITION_ID in m or pid is None:
        return False
    rep.content[keys.METRICS] = MetricRecord({**dict(m.items()), keys.PARTITION_ID: int(pid)})
    return True


def nonfinite_arrays(arrays: ArrayRecord) -> list[str]:
    """Names of the floating-point arrays of ``arrays`` that hold NaN or Inf."""
    bad = []
    for k, a in arrays.items():
        x = array_values(a, writable=False)
        if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all():
            bad.append(k)
    return bad


def diverged_message(rnd: int, bad: list[str], unit: str = "round", loss: float | None = None) -> str:
    """The one line of a run whose global model is no longer finite: NaN or Inf in the arrays ``bad``, or
    (``bad`` empty) an evaluation ``loss`` that is."""
    what = f"NaN or Inf in {_names(bad)}" if bad else f"its evaluation loss is {loss}"
    return (
        f"the global model is no longer finite after {unit} {rnd}: {what}; the training diverged "
        "(try a smaller learning rate: client.lr, or the strategy's server learning rate)"
    )

"""The ``inprocess`` engine's Grid: the ClientApp in the server's process, or in a pool of worker processes.

``PoolGrid(workers=1)`` runs every message sequentially in the server's process, like ``InProcessGrid``.
With ``workers=N > 1`` it starts N persistent worker processes (``spawn`` by default: torch and ``fork`` do
not mix) that each import the ClientApp once and keep their model and partitions alive between messages
(``fedsim.build.client_task`` caches them per process). A batch of messages is scheduled longest client
first: each free worker takes the largest pending client, sizes being known from the query replies.
Messages and contexts cross the process boundary as Flower protobuf bytes, never as pickled objects.

Replies are the ClientApp's own (per-client seeds make them independent of which worker ran them); an
exception in the ClientApp becomes an error reply, a crashed worker an error reply with Flower's
``CLIENT_APP_CRASHED`` code (the worker is restarted). Workers stop on ``close()``, when the grid is
garbage-collected, at interpreter exit, and on their own when the server process dies.

Query messages (the server's discovery of partition ids and sizes) are answered from the partition table
of the run spec after the first one of each spec has gone through the ClientApp, so a population of 10^5
virtual nodes is discovered without building 10^5 client tasks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from uuid import uuid4

from flwr.app import Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from typing_extensions import Self

from fedsim import keys
from fedsim.build import WORKER_INDEX_ENV
from fedsim.checks import integer

CLIENT_APP_RAISED_EXCEPTION = 2  # Flower's error codes
CLIENT_APP_CRASHED = 8
DEFAULT_APP = "fedsim.client_app:app"


def load_app(ref: str):
    """Import ``module:attribute`` (a ClientApp)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def encode(msg: Message) -> bytes:
    """A Message as protobuf bytes."""
    return message_to_proto(msg).SerializeToString()


def decode(data: bytes) -> Message:
    """A Message from protobuf bytes."""
    return message_from_proto(ProtoMessage.FromString(data))


def error_reply(msg: Message, code: int, exc: BaseException | str) -> Message:
    """An error reply to ``msg``, worded as Flower's engines word it."""
    if isinstance(exc, BaseException):
        reason = f"<class '{type(exc).__name__}'>:<'{exc}'>\n{traceback.format_exc(limit=3)}"
    else:
        reason = exc
    return Message(Error(code, reason), reply_to=msg)


def run_app(app, msg: Message, ctx: Context) -> Message:
    """Run the ClientApp on one message; an exception becomes an error reply, as in Flower's engines."""
    try:
        return app(msg, ctx)
    except Exception as exc:  # noqa: BLE001  (a failing client must not take the server down)
        return error_reply(msg, CLIENT_APP_RAISED_EXCEPTION, exc)


def worker_main(read_fd: int, write_fd: int, app_ref: str) -> None:
    """Worker process: run ClientApp messages until told to stop or the server process goes away."""
    import torch

    torch.set_num_threads(1)  # client_task sets placement.threads_per_client once a task is built
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    app = load_app(app_ref)
    import torch._dynamo  # warm: torch.optim imports it on the first optimiser (about 1 s)

    while True:
        try:
            item = inbox.recv()
        except (EOFError, OSError):
            return  # the server process is gone
        if item[0] == "stop":
            return
        _, mid, ctx_bytes, msg_bytes = item
        ctx = context_from_proto(ProtoContext.FromString(ctx_bytes))
        reply = run_app(app, decode(msg_bytes), ctx)
        outbox.send((mid, encode(reply), recorddict_to_proto(ctx.state).SerializeToString()))


@dataclass
class _Worker:
    proc: subprocess.Popen
    inbox: Connection  # the worker reads it
    outbox: Connection  # the worker writes it; EOF when the worker dies


def _start_worker(app_ref: str, index: int = 0) -> _Worker:
    """A fresh interpreter running ``worker_main`` on two pipes (only those fds are inherited).

    ``index`` is the worker's number: it picks the worker's GPU (``fedsim.build.resolve_device``).
    """
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "  # Ctrl-C is the server's to handle
        f"from fedsim.engines.pool import worker_main; worker_main({to_r}, {from_w}, {app_ref!r})"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),  # the server's import path
        WORKER_INDEX_ENV: str(index),
    }
    # its own session: a terminal's Ctrl-C goes to the server, which writes its checkpoint and stops the workers
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        pass_fds=(to_r, from_w),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(to_r)
    os.close(from_w)
    return _Worker(proc, Connection(to_w, readable=False), Connection(from_r, writable=False))


def _stop(workers: list[_Worker], grace: float = 3.0) -> None:
    """Stop worker processes: ask, wait up to ``grace`` seconds, then kill; close the pipes."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            w.inbox.send(("stop",))
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.inbox.close()
        w.outbox.close()
    workers.clear()


@functools.lru_cache(maxsize=4)
def _partition_sizes(spec: str) -> tuple[int, ...]:
    """Training-set size of every partition of a run spec (from the cached partition table)."""
    from fedsim.build import build_splits

    return tuple(build_splits(json.loads(spec)).sizes().tolist())


class PoolGrid(Grid):
    """Runs ``client_app`` for ``num_nodes`` virtual nodes (node id ``k + 1`` holds partition ``k``).

    Parameters
    ----------
    num_nodes : int
        Population size.
    workers : int
        1: sequential in this process. N > 1: N persistent worker processes.
    app_ref : str
        ``module:attribute`` of the ClientApp (workers import it by this name).
    node_config : dict, optional
        Extra ``node_config`` entries for every node.
    """

    def __init__(
        self, num_nodes: int, workers: int = 1, app_ref: str = DEFAULT_APP, node_config: dict | None = None
    ) -> None:
        integer("engine.workers", workers, 1, what="an integer >= 1 (1: sequential in this process)")
        self._n, self._num_workers, self._app_ref = int(num_nodes), workers, app_ref
        self._node_config = dict(node_config or {})
        self._run = Run.create_empty(run_id=1)
        # Flower's Message() reads the sender's identity from here, as a ServerApp process would set it
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self._contexts: dict[int, Context] = {}  # made on first use: 10^5 nodes cost nothing up front
        self._pending: dict[str, Message] = {}
        # message ids: unique per grid (a random prefix) and across its messages (a counter); a uuid4 per message
        # cost a few microseconds each
        self._id_prefix, self._id_count = f"{uuid4()}-", itertools.count()
        self._sizes: dict[int, int] = {}  # node id -> training examples (from query replies)
        self._checked_specs: set[str] = set()
        self._app = None
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers)  # also runs at interpreter exit
        if workers > 1:  # start now: their imports overlap with the server's discovery and first evaluation
            self._workers.extend(_start_worker(app_ref, i) for i in range(workers))

    # ------------------------------------------------------------------------------------- Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(range(1, self._n + 1))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if not 1 <= msg.metadata.dst_node_id <= self._n:
                continue  # like Flower's simulation: unknown destinations are dropped
            mid = f"{self._id_prefix}{next(self._id_count)}"
            msg.metadata.__dict__["_message_id"] = mid
            self._pending[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str], *, timeout: float | None = None) -> Iterable[Message]:
        """Run the pending messages among ``message_ids`` now and return their replies, in that order."""
        ids = [mid for mid in message_ids if mid in self._pending]
        batch = [self._pending.pop(mid) for mid in ids]
        done = self._run_batch(batch, None if timeout is None else time.monotonic() + timeout)
        return [done[mid] for mid in ids if mid in done]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Run every message now; with workers, replies missing at ``timeout`` seconds are dropped."""
        return self.pull_messages(list(self.push_messages(messages)), timeout=timeout)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def partition_of(self, node_id: int) -> int:
        """The partition id node ``node_id`` holds (known without asking the node or making its Context)."""
        return int(self._node_config.get(keys.NODE_PARTITION_ID, node_id - 1))

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty when sequential or closed)."""
        return [w.proc.pid for w in self._workers]

    # ------------------------------------------------------------------------------------ execution
    def _context(self, node_id: int) -> Context:
        ctx = self._contexts.get(node_id)
        if ctx is None:
            ctx = Context(
                run_id=1,
                node_id=node_id,
                state=RecordDict(),
                run_config={},
                node_config={
                    keys.NODE_PARTITION_ID: self.partition_of(node_id),
                    keys.NODE_NUM_PARTITIONS: self._n,
                    **self._node_config,
                },
            )
            self._contexts[node_id] = ctx
        return ctx

    def _run_batch(self, batch: list[Message], deadline: float | None) -> dict[str, Message]:
        """Replies to ``batch`` keyed by message id (a message may have none after the deadline)."""
        done: dict[str, Message] = {}
        work = []
        for msg in batch:
            reply = self._answer_query(msg)
            if reply is None:
                work.append(msg)
            else:
                done[msg.metadata.message_id] = reply
        if self._num_workers == 1:
            for msg in work:
                done[msg.metadata.message_id] = self._record(
                    run_app(self._local_app(), msg, self._context(msg.metadata.dst_node_id))
                )
        else:  # longest clients first; ties keep the push order
            work.sort(key=lambda m: -self._sizes.get(m.metadata.dst_node_id, 0))
            done.update(self._run_on_workers(work, deadline))
        return done

    def _local_app(self):
        if self._app is None:
            self._app = load_app(self._app_ref)
        return self._app

    def _record(self, reply: Message) -> Message:
        """Remember the client size a query reply reports (for scheduling)."""
        if reply.metadata.message_type == MessageType.QUERY and reply.has_content():
            m = reply.content.get(keys.METRICS)
            if m is not None and keys.NUM_EXAMPLES in m:
                self._sizes[reply.metadata.src_node_id] = int(m[keys.NUM_EXAMPLES])
        return reply

    def _answer_query(self, msg: Message) -> Message | None:
        """Answer a discovery query from the partition table, once the ClientApp answered one for the spec."""
        if msg.metadata.message_type != MessageType.QUERY or not msg.has_content():
            return None
        cfg = msg.content.get(keys.CONFIG)
        spec = cfg.get(keys.RUN_SPEC) if cfg is not None else None
        if not isinstance(spec, str) or spec not in self._checked_specs:
            if isinstance(spec, str):
                reply = self._record(run_app(self._local_app(), msg, self._context(msg.metadata.dst_node_id)))
                if not reply.has_error():
                    self._checked_specs.add(spec)
                return reply
            return None
        nid = msg.metadata.dst_node_id
        pid = self.partition_of(nid)
        self._sizes[nid] = size = _partition_sizes(spec)[pid]
        return Message(
            RecordDict({keys.METRICS: MetricRecord({keys.PARTITION_ID: pid, keys.NUM_EXAMPLES: size})}),
            reply_to=msg,
        )

    # -------------------------------------------------------------------------------------- workers
    def _run_on_workers(self, work: list[Message], deadline: float | None) -> dict[str, Message]:
        """Dispatch ``work`` (already in priority order) to free workers, one message each; collect replies."""
        if not self._workers and work:
            raise RuntimeError("the worker pool is closed")
        done: dict[str, Message] = {}
        queue = list(reversed(work))  # pop() from the end = next longest
        free = list(range(len(self._workers)))[::-1]
        busy: dict[int, Message] = {}  # one message per worker: no pipe can fill up both ways
        while queue or busy:
            while queue and free:
                w, msg = free.pop(), queue.pop()
                ctx = context_to_proto(self._context(msg.metadata.dst_node_id)).SerializeToString()
                try:
                    self._workers[w].inbox.send(("run", msg.metadata.message_id, ctx, encode(msg)))
                except OSError:  # died while idle: restart it and retry
                    self._restart(w)
                    queue.append(msg)
                    free.append(w)
                    continue
                busy[w] = msg
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            outboxes = {self._workers[w].outbox: w for w in busy}
            ready = wait(list(outboxes), timeout=left)
            if not ready:  # deadline: drop what is left, restart the workers still busy
                for w in busy:
                    self._restart(w)
                break
            for box in ready:
                w = outboxes[box]
                msg = busy.pop(w)
                try:
                    mid, reply_bytes, state_bytes = box.recv()
                except (EOFError, OSError):
                    code = self._workers[w].proc.wait()
                    done[msg.metadata.message_id] = error_reply(
                        msg,
                        CLIENT_APP_CRASHED,
                        f"worker process died (exit code {code}) running this message",
                    )
                    self._restart(w)
                else:
                    self._context(msg.metadata.dst_node_id).state = recorddict_from_proto(
                        ProtoRecordDict.FromString(state_bytes)
                    )
                    done[mid] = self._record(decode(reply_bytes))
                free.append(w)
        return done

    def _restart(self, w: int) -> None:
        old = self._workers[w]
        old.proc.kill()
        old.proc.wait()
        old.inbox.close()
        old.outbox.close()
        self._workers[w] = _start_worker(self._app_ref, w)

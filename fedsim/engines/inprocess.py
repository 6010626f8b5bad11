"""The ``inprocess`` engine: a Flower ``Grid`` that runs the ClientApp in the server's own process.

No Ray and no network: ``push_messages`` queues instructions, ``pull_messages`` executes the queued ones for
the requested ids in order and returns their replies. Each virtual node keeps its own ``Context`` (so
``context.state`` persists across messages, as on a SuperNode). Exceptions in the ClientApp become error
replies, exactly as in Flower's engines.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

CLIENT_APP_RAISED_EXCEPTION = 2  # Flower's error code for an exception inside a ClientApp
MESSAGE_UNAVAILABLE = 3


class InProcessGrid(Grid):
    """Runs ``client_app`` for ``num_nodes`` virtual nodes, node id ``k + 1`` holding partition ``k``."""

    def __init__(self, client_app: ClientApp, num_nodes: int, node_config: dict | None = None) -> None:
        self._app = client_app
        self._run = Run.create_empty(run_id=1)
        # Flower's Message() reads the sender's identity from here, as a ServerApp process would set it
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self._contexts = {
            pid + 1: Context(
                run_id=1, node_id=pid + 1,
                node_config={"partition-id": pid, "num-partitions": num_nodes, **(node_config or {})},
                state=RecordDict(), run_config={},
            )
            for pid in range(num_nodes)
        }
        self._pending: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:  # noqa: D102
        self._run = run

    @property
    def run(self) -> Run:  # noqa: D102
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: D102
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self._contexts:
                continue  # like Flower's simulation: unknown destinations are dropped
            mid = str(uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self._pending[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        replies = []
        for mid in message_ids:
            msg = self._pending.pop(mid, None)
            if msg is not None:
                replies.append(self._execute(msg))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Run every message now; ``timeout`` is not needed since execution is synchronous."""
        return self.pull_messages(list(self.push_messages(messages)))

    def _execute(self, msg: Message) -> Message:
        ctx = self._contexts[msg.metadata.dst_node_id]
        try:
            reply = self._app(msg, ctx)
        except Exception as exc:  # a failing client must not take the server down
            reason = f"<class '{type(exc).__name__}'>:<'{exc}'>\n{traceback.format_exc(limit=3)}"
            return Message(Error(CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
        return reply

"""Helpers around Flower's ``Grid``: a sampled view, node discovery, reply screening."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedsim import keys
from fedsim.errors import RunError

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


def wait_for_nodes(grid: Grid, expected: int, timeout: float) -> list[int]:
    """Wait until ``expected`` nodes are connected; raise ``RunError`` after ``timeout`` seconds.

    Counts the nodes ``grid.get_node_ids()`` lists: behind a deployment's node binding, only nodes it may use.
    """
    end = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        if time.monotonic() > end:
            refused = len(getattr(grid, "refused", ()))
            also = f" ({refused} other node(s) refused: see nodes.json)" if refused else ""
            raise RunError(f"only {len(nodes)} of {expected} clients connected within {timeout:.0f} s{also}")
        time.sleep(0.05)
    return nodes


def discover(
    grid: Grid,
    node_ids: list[int],
    spec: str,
    timeout: float,
    found: dict[int, tuple[int, int]] | None = None,
) -> dict[int, tuple[int, int]]:
    """Ask every node for its partition id and size: ``{partition_id: (node_id, num_examples)}``.

    ``found`` (updated and returned) holds partitions already taken. A node whose claim cannot stand gets no
    work and never stops the run: one warning line each, through ``grid.refuse(node, partition, reason)``
    when the grid has it (a deployment's node gate, which also judges claims with ``grid.check_claim``). A
    partition claimed twice stays with the node listed first in ``node_ids`` (or asked earlier).
    A node whose client fails to start (an error reply) stops discovery with ``RunError``.
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
    for rep in replies:
        if rep.has_error():
            raise RunError(
                f"client on node {rep.metadata.src_node_id} failed to start: {first_line(str(rep.error.reason))}"
            )
        nid = rep.metadata.src_node_id
        m = rep.content[keys.METRICS]
        pid = int(m[keys.PARTITION_ID])
        reason = check(nid, pid) if check is not None else None
        if reason is None and pid in found:
            reason = f"claims partition-id={pid}, which node {found[pid][0]} holds (two nodes claim it)"
        if reason is not None:
            if refuse is not None:
                refuse(nid, pid, reason)
            else:
                import logging

                logging.getLogger("fedsim").warning("node %d refused, it gets no work: %s", nid, reason)
            continue
        found[pid] = (nid, int(m[keys.NUM_EXAMPLES]))
        if accept is not None:
            accept(nid, pid)
    return found


def first_line(reason: str) -> str:
    """The most informative single line of a (possibly Ray-wrapped) error reason."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return (lines[-1] if lines else "unknown error")[:300]


def screen_replies(
    replies: Iterable[Message], reference: ArrayRecord
) -> tuple[list[Message], list[tuple[str, str]]]:
    """Split train replies into valid ones and failures ``(kind, detail)``.

    A reply fails if it is an error (kind ``error``; ``timeout`` for a simulated one; ``unavailable`` when
    the SuperLink reports the node or message gone), lacks arrays or metrics
    (``malformed``), has arrays whose keys or shapes (``shape``) or dtypes (``dtype``) differ from ``reference``,
    or holds NaN/Inf in its arrays or train loss (``nonfinite``).
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
        c = rep.content
        if keys.ARRAYS not in c or keys.METRICS not in c:
            failures.append(("malformed", "reply lacks arrays or metrics"))
            continue
        arrs = c[keys.ARRAYS]
        got = {k: (tuple(a.shape), a.dtype) for k, a in arrs.items()}
        if {k: s for k, (s, _) in got.items()} != {k: s for k, (s, _) in ref.items()}:
            failures.append(("shape", "arrays differ from the global model in keys or shapes"))
            continue
        if got != ref:
            failures.append(("dtype", "arrays differ from the global model in dtype"))
            continue
        loss = c[keys.METRICS].get(keys.TRAIN_LOSS, 0.0)
        if not math.isfinite(float(loss)) or not all(np.isfinite(a.numpy()).all() for a in arrs.values()):
            failures.append(("nonfinite", "NaN or Inf in the update"))
            continue
        valid.append(rep)
    return valid, failures

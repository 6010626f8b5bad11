"""What a deployed run records for a node that does not reply in time (fast: a fake grid, no services).

The namespace tests (tests/test_netns.py) cut a node's link mid-run; these check the record they rely on:
replies.jsonl gets one ``timeout:`` line per message of a synchronous round left without a reply, naming the
node it was sent to and whether the SuperLink still listed that node as connected.
"""

from __future__ import annotations

import json

from flwr.app import MetricRecord, RecordDict
from test_deploy import message

from fedsim import keys
from fedsim.server_app import ReplyLog


class SilentGrid:
    """A grid where only the nodes in ``answering`` reply; ``online`` are the nodes the SuperLink lists."""

    def __init__(self, answering: set[int], online: set[int]) -> None:
        self.answering, self.online, self.sent = answering, online, {}

    def push_messages(self, messages):
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent[m.metadata.message_id] = m
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids):
        out = []
        for i in ids:
            dst = int(self.sent[i].metadata.dst_node_id)
            if dst in self.answering:
                content = RecordDict(
                    {keys.METRICS: MetricRecord({keys.PARTITION_ID: dst, keys.NUM_EXAMPLES: 5})}
                )
                out.append(message(dst, 0, i, content=content))
                self.answering = self.answering - {dst}  # one reply per message
        return out

    def get_node_ids(self):
        return sorted(self.online)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_message_without_reply_gets_a_timeout_line_naming_its_node(tmp_path):
    path = tmp_path / "replies.jsonl"
    grid = SilentGrid(answering={1, 3}, online={1, 2, 3})  # node 2 is silent but listed, node 4 gone
    log = ReplyLog(grid, path)
    replies = log.send_and_receive([message(0, n, content=RecordDict()) for n in (1, 2, 3, 4)], timeout=0.3)
    log.close()
    assert sorted(int(r.metadata.src_node_id) for r in replies) == [1, 3]
    lines = _lines(path)
    assert sorted((x["node_id"], x["partition_id"]) for x in lines if not x["error"]) == [(1, 1), (3, 3)]
    silent = {x["node_id"]: x["error"] for x in lines if x["error"]}
    assert silent == {
        2: "timeout: no reply within 0.3 s (the SuperLink lists the node as connected)",
        4: "timeout: no reply within 0.3 s (the SuperLink lists the node as offline)",
    }


def test_every_reply_in_time_leaves_no_timeout_line(tmp_path):
    path = tmp_path / "replies.jsonl"
    log = ReplyLog(SilentGrid(answering={1, 2}, online={1, 2}), path)
    log.send_and_receive([message(0, n, content=RecordDict()) for n in (1, 2)], timeout=5)
    log.close()
    assert [x["error"] for x in _lines(path)] == [None, None]

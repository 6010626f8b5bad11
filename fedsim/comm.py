"""Communication cost: the serialised size of the messages a round sends and receives.

A message's size is that of its RecordDict in Flower's protobuf encoding (``recorddict_to_proto``), which is
what travels between a SuperLink and a SuperNode (arrays, the train config with fedsim's run spec, metrics);
the routing metadata (about a hundred bytes) is left out. Flower's strategies hand every message of a round
the same RecordDict object, so each distinct object is encoded once.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.common.serde import recorddict_to_proto


def message_bytes(messages: Iterable[Message]) -> int:
    """Total serialised size in bytes of the messages' contents (those without content count 0)."""
    sizes: dict[int, int] = {}
    total = 0
    for msg in messages:
        if not msg.has_content():
            continue
        key = id(msg.content)
        if key not in sizes:
            sizes[key] = recorddict_to_proto(msg.content).ByteSize()
        total += sizes[key]
    return total

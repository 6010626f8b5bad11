"""The client half of ``compression=``: the update sent encoded (top-k with error feedback, or QSGD), with the
codecs of ``fedsim.codecs``; top-k keeps its residual in the client's persistent state."""

from __future__ import annotations

from typing import Any

from fedsim import codecs
from fedsim.algorithms.halves import ClientHalf, Reply


class Compress(ClientHalf):
    """``compression=``'s client half: send the update encoded (top-k with error feedback, or QSGD); top-k keeps
    its residual in the client's state."""

    needs_start = True

    def active(self, ins: Any) -> bool:
        return codecs.wanted(ins.unhandled)

    def keeps_state(self, ins: Any) -> bool:
        return True

    def on_reply(self, reply: Reply) -> None:
        encoded, kept = codecs.encode_reply(
            reply.model,
            reply.start,
            reply.ins.unhandled,
            reply.state,
            reply.seed,
            reply.ins.draw_index,
            reply.partition_id,
        )
        reply.model.clear()
        reply.model.update(encoded)
        reply.state.update(kept)

"""Client-side clipping, the client half of clipping and DP: the update ``model - start`` clipped to L2 norm
``C`` before it is sent, when the train config asks for it (fedsim's ``clip-norm``, set by
``fedsim.features.clipping.server``'s wrappers, or Flower's ``clipping_norm`` from Flower's client-side DP
strategies). ``fedsim.build`` puts it in every run's chain: a Flower strategy that is not fedsim's may ask.
"""

from __future__ import annotations

from typing import Any

import torch

from fedsim import keys
from fedsim.algorithms.halves import ClientHalf, Reply, Rows


class ClientClipping(ClientHalf):
    """Clip the update ``model - start`` to L2 norm ``C`` (fedsim's ``clip-norm``, or Flower's ``clipping_norm``
    from Flower's client-side DP strategies) and report the norm before clipping and whether it clipped."""

    needs_start = True
    keys = (keys.CLIP_NORM,)

    def active(self, ins: Any) -> bool:
        return clip_norm(ins) is not None

    def on_rows(self, rows: Rows) -> None:
        """As :meth:`on_reply` on each row that asks for it, on the stack: the norms are one float64 reduction
        per parameter over the rows (equal to the per-row sums to float64 rounding); the clipped rows become
        ``start + (y - start) * (C / norm)`` in the parameters' dtype."""
        bounds = [clip_norm(ins) for ins in rows.ins]
        if all(b is None for b in bounds):
            return
        k, starts = len(rows), rows.start()
        device = next(iter(rows.model.values())).device
        deltas = {n: rows.model[n] - starts[n] for n in starts if torch.is_floating_point(starts[n])}
        squares = torch.zeros(k, dtype=torch.float64, device=device)
        for d in deltas.values():
            squares += d.double().square().reshape(k, -1).sum(1)
        norms = squares.sqrt().tolist()
        clipped = [b is not None and norm > b and norm != 0.0 for b, norm in zip(bounds, norms)]
        if any(clipped):
            idx = torch.tensor([i for i, c in enumerate(clipped) if c], device=device)
            scale = [bounds[i] / norms[i] for i in idx.tolist()]
            for n, d in deltas.items():
                factor = torch.tensor(scale, dtype=d.dtype, device=device).view(-1, *([1] * (d.dim() - 1)))
                rows.model[n].index_copy_(
                    0, idx, starts[n].index_select(0, idx) + d.index_select(0, idx) * factor
                )
        for i, (b, norm, c) in enumerate(zip(bounds, norms, clipped)):
            if b is not None:  # the algorithm's metrics are not sent (as on_reply)
                rows.metrics[i] = {keys.UPDATE_NORM: norm, keys.CLIPPED: float(c)}

    def on_reply(self, reply: Reply) -> None:
        """:meth:`on_rows` on the reply as one row (one definition of the clipping for both forms)."""
        floats = [k for k in reply.start if torch.is_floating_point(reply.start[k])]
        with torch.no_grad():
            rows = Rows(
                {k: reply.model[k].unsqueeze(0).clone() for k in floats},  # the model's own storage stays
                lambda: {k: reply.start[k].unsqueeze(0) for k in floats},
                [reply.ins],
                [reply.partition_id],
                [reply.seed],
                [reply.faults],
            )
            self.on_rows(rows)
        for k in floats:
            reply.model[k] = rows.model[k][0]
        reply.metrics = rows.metrics[0]


def clip_norm(ins: Any) -> float | None:
    """The clipping bound asked for: fedsim's ``clip-norm``, else Flower's ``clipping_norm``."""
    if ins.clip_norm is not None:
        return ins.clip_norm
    value = ins.unhandled.get(keys.FLOWER_CLIPPING_NORM)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{keys.FLOWER_CLIPPING_NORM}={value!r} in the train config: expected a number > 0")
    return float(value)

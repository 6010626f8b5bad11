"""Compression of client updates (``compression=``): top-k with error feedback, and QSGD.

The server-side wrapper (:class:`TopK`, :class:`QSGD`) asks every client in its train config to compress;
fedsim's ClientApp then sends, instead of its model, an encoding of its update ``d = w_after - w_global``
(over the floating-point arrays, flattened in the model's order; other arrays travel as they are), and the
loop decodes each reply back into a model, ``w_global + decode(...)``, before screening and aggregation. So
``bytes_up`` in metrics.jsonl is the size of what the clients actually sent.

* **top-k** (Stich, Cordonnier, Jaggi, "Sparsified SGD with memory", NeurIPS 2018, arXiv 1809.07599): the
  client adds its error-feedback residual ``e`` (per-client state, kept between its tasks and across resume)
  to its update, sends the ``k = ceil(ratio * size)`` entries of largest magnitude of ``d + e`` (int32
  indices, float32 values: 8 k bytes for 4 size) and keeps the rest, ``e <- d + e - topk(d + e)``.
* **QSGD** (Alistarh et al., NeurIPS 2017, arXiv 1610.02132): ``s`` levels, stochastic rounding, unbiased:
  ``Q(v)_i = |v| sign(v_i) xi_i / s`` with ``xi_i = floor(s |v_i| / |v|) + Bernoulli(frac)``; the client sends
  ``|v|`` (float32) and the signed levels (int8 for ``s <= 127``), seeded per (round, client).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import Strategy

from fedsim.aggregate import cast_like, is_float
from fedsim.checks import integer, number
from fedsim.codecs import (  # noqa: F401  (the codecs, re-exported: this module is the feature's home)
    _RAW,
    KIND,
    LEVELS,
    RATIO,
    RESIDUAL,
    encode_reply,
    qsgd,
    qsgd_decode,
    topk,
    topk_decode,
    wanted,
)
from fedsim.features.attacks.server import with_model
from fedsim.features.compression.client import Compress
from fedsim.records import reply_arrays, to_numpy
from fedsim.strategies.wrapper import Wrapper


# ---------------------------------------------------------------- the server's side
class _Compression(Wrapper):
    """Ask clients to compress (config keys), decode their replies before the loop screens them."""

    async_reason = "the synchronous loop decodes the replies"
    client_half = Compress
    fold_order = 20  # replies are decoded before the attack crafts from them and clipping clips them

    def settings(self) -> dict[str, Any]:
        """The train-config entries that ask for this compression."""
        raise NotImplementedError

    def decode(self, arrays: dict[str, np.ndarray], size: int) -> np.ndarray:
        """The ``(size,)`` update of one reply's encoded arrays."""
        raise NotImplementedError

    def decode_replies(self, replies: Iterable[Message], current: ArrayRecord) -> list[Message]:
        """Each compressed reply as the model it stands for, ``current + decode``; others unchanged."""
        x = to_numpy(current)
        floats = [k for k, a in x.items() if is_float(a)]
        size = sum(x[k].size for k in floats)
        out = []
        for msg in replies:
            if msg.has_error() or not msg.has_content() or not msg.content.array_records:
                out.append(msg)
                continue
            enc = reply_arrays(msg)
            if not any(k.startswith(("topk/", "qsgd/")) for k in enc):
                out.append(msg)
                continue
            d, model, at = self.decode(enc, size), {}, 0
            for k in floats:
                model[k] = x[k].astype(np.float64) + d[at : at + x[k].size].reshape(x[k].shape)
                at += x[k].size
            model.update({k: enc[_RAW + k] for k in x if k not in floats and _RAW + k in enc})
            out.append(with_model(msg, cast_like({**x, **model}, x)))
        return out

    def configure_train(self, server_round, arrays, config, grid):
        config = ConfigRecord({**dict(config.items()), **self.settings()})
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def own_summary_fields(self) -> dict[str, Any]:
        return {"compression": dict(self.settings())}


class TopK(_Compression):
    """Top-k sparsification of each update with error feedback in the client's state (Stich et al. 2018)."""

    def __init__(self, strategy: Strategy, ratio: float = 0.1) -> None:
        self.ratio = number("ratio", ratio, 0.0, 1.0, lo_open=True)
        super().__init__(strategy)

    def settings(self) -> dict[str, Any]:
        return {KIND: "topk", RATIO: self.ratio}

    def decode(self, arrays, size):
        return topk_decode(arrays["topk/idx"], arrays["topk/val"], size)


class QSGD(_Compression):
    """QSGD: unbiased stochastic quantisation of each update to ``levels`` levels (Alistarh et al. 2017)."""

    def __init__(self, strategy: Strategy, levels: int = 16) -> None:
        self.levels = integer("levels", levels, 1, 2**31 - 1)
        super().__init__(strategy)

    def settings(self) -> dict[str, Any]:
        return {KIND: "qsgd", LEVELS: self.levels}

    def decode(self, arrays, size):
        return qsgd_decode(float(arrays["qsgd/norm"][0]), arrays["qsgd/levels"], self.levels)

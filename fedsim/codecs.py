"""The update codecs of ``compression=`` (``fedsim.features.compression``): top-k with error feedback and
QSGD, as pure functions, and the client's encoding of its reply. A bottom-layer module: the client half
(``fedsim.features.compression.client.Compress``) and the server wrapper both use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsim.aggregate import is_float
from fedsim.records import to_numpy
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng


def _numpy(arrays: ArrayRecord | Mapping[str, Any]) -> dict[str, np.ndarray]:
    if isinstance(arrays, ArrayRecord):
        return to_numpy(arrays)
    return {k: v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v) for k, v in arrays.items()}


KIND, RATIO, LEVELS = "compress", "compress-ratio", "compress-levels"  # train-config keys
RESIDUAL = "compression/residual"  # the client's error-feedback state
_RAW = "raw/"  # non-float arrays, sent as they are


# ---------------------------------------------------------------- pure functions
def topk(v: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (int32, ascending) and values (float32) of the ``k`` largest-magnitude entries of ``v`` ``(d,)``."""
    idx = np.sort(np.argsort(-np.abs(v), kind="stable")[:k]).astype(np.int32)
    return idx, v[idx].astype(np.float32)


def topk_decode(idx: np.ndarray, values: np.ndarray, d: int) -> np.ndarray:
    """The dense ``(d,)`` vector holding ``values`` at ``idx`` and zeros elsewhere."""
    out = np.zeros(d, np.float64)
    out[idx.astype(np.int64)] = values
    return out


def qsgd(v: np.ndarray, s: int, rng: np.random.Generator) -> tuple[np.float32, np.ndarray]:
    """QSGD's ``(|v|, signed levels in [-s, s])`` of ``v`` ``(d,)``; unbiased: ``E[decode] = v``.

    The norm is sent as float32 rounded *up*, so that ``|v_i| / norm <= 1`` and no level exceeds ``s`` (rounded
    to nearest it could fall below ``max |v_i|``, giving level ``s + 1``: 128 wraps to -128 in int8).
    """
    exact = np.linalg.norm(np.asarray(v, np.float64))
    norm = np.float32(exact)
    if norm < exact:
        norm = np.nextafter(norm, np.float32(np.inf))
    if norm == 0:
        return norm, np.zeros(v.shape, np.int8 if s <= 127 else np.int32)
    scaled = np.minimum(np.abs(v) / np.float64(norm) * s, s)  # in [0, s]
    low = np.floor(scaled)
    level = low + (rng.random(v.shape) < scaled - low)
    return norm, (np.sign(v) * level).astype(np.int8 if s <= 127 else np.int32)


def qsgd_decode(norm: float, levels: np.ndarray, s: int) -> np.ndarray:
    """The ``(d,)`` vector ``|v| * levels / s``."""
    return np.float64(norm) * levels.astype(np.float64) / s


# ---------------------------------------------------------------- the client's side (fedsim's ClientApp)
def wanted(unhandled: Mapping[str, Any]) -> bool:
    """True when the train config asks this client to compress its update."""
    return KIND in unhandled


def encode_reply(
    model: Mapping[str, torch.Tensor],
    global_arrays: ArrayRecord | Mapping[str, Any],
    config: Mapping[str, Any],
    state: Mapping[str, np.ndarray],
    seed: int,
    index: int,
    partition_id: int,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The reply's arrays (the encoded update) and the client's new state entries (top-k's residual).

    ``global_arrays``: the global model the update is taken from (an ArrayRecord, or arrays/tensors by name).
    """
    start = _numpy(global_arrays)
    floats = [k for k, a in start.items() if is_float(a)]
    after = {k: v.detach().cpu().numpy() for k, v in model.items()}
    d = np.concatenate([(after[k].astype(np.float64) - start[k]).ravel() for k in floats])  # (size,)
    out = {_RAW + k: torch.as_tensor(np.ascontiguousarray(after[k])) for k in after if k not in floats}
    kind = str(config[KIND])
    if kind == "topk":
        residual = np.asarray(state.get(RESIDUAL, np.zeros_like(d)), np.float64)
        if residual.shape != d.shape:
            residual = np.zeros_like(d)
        corrected = d + residual
        idx, values = topk(corrected, max(1, math.ceil(float(config[RATIO]) * d.size)))
        out.update({"topk/idx": torch.from_numpy(idx), "topk/val": torch.from_numpy(values)})
        return out, {RESIDUAL: corrected - topk_decode(idx, values, d.size)}
    rng = seeded_rng(seed, Purpose.COMPRESSION, index, partition_id)
    norm, levels = qsgd(d, int(config[LEVELS]), rng)
    out.update({"qsgd/norm": torch.tensor([norm]), "qsgd/levels": torch.from_numpy(levels)})
    return out, {}

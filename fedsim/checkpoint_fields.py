"""Every field of a checkpoint checked before a resume adopts any of it, and the metrics history it points to.

A checkpoint of format 5 keeps no records: they are in ``metrics.jsonl`` beside it, and the checkpoint keeps
their count, byte length and sha256 (``history``), so its size does not grow with the run. A resume reads the
first ``count`` lines of that file and refuses a folder whose lines differ. Formats 1-4 hold the records
themselves; they are checked the same way (dicts of JSON data, rounds in order, none past the checkpoint's).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch

HISTORY = "metrics.jsonl"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_STATE_FILE = re.compile(r"^\d+-\d+\.npz$")  # fedsim.algorithms.state's <partition>-<version>.npz
_REACHED = {"target", "round", "sim_time", "wall_time"}


class HistoryMismatch(ValueError):
    """``metrics.jsonl`` beside a checkpoint is missing or differs from the records it was written after."""


def _show(v) -> str:
    text = repr(v) if not isinstance(v, (bytes, bytearray)) else f"{len(v)} bytes"
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(v, name: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} is {_show(v)}, not an integer >= {lo}")
    return v


def _number(v, name: str, none: bool = False) -> None:
    if v is None and none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} is {_show(v)}, not a finite number >= 0")


def check(ckpt: dict) -> None:
    """Raise ``ValueError`` naming the first field of ``ckpt`` (from ``torch.load``) fedsim never writes:
    round, clock, model arrays, the loop's extra state, the records or history, the clients' state record."""
    rnd = _whole(ckpt["round"], "round")
    _number(ckpt["sim_time"], "sim_time")
    check_arrays(ckpt["arrays"], "arrays")
    _extra(ckpt.get("extra"))
    if ckpt.get("config") is not None and not isinstance(ckpt["config"], dict):
        raise ValueError(f"config is {_show(ckpt['config'])}, not a dict")
    if "history" in ckpt:
        _history(ckpt["history"], rnd)
    else:
        check_records(ckpt["records"], rnd, "records")
    check_clients(ckpt.get("client_state"), rnd)


def check_arrays(arrays, name: str) -> None:
    """``arrays``: a non-empty dict of named real tensors, the floating ones finite."""
    if not isinstance(arrays, dict) or not arrays:
        raise ValueError(f"{name} is not a dict of named tensors")
    for key, value in arrays.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}[{_show(key)}] is {type(value).__name__}, not a tensor")
        if value.is_complex():
            raise ValueError(f"{name}[{key!r}] is complex ({value.dtype})")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name}[{key!r}] holds NaN or Inf")


def check_model(arrays: dict, reference) -> str | None:
    """Why the checkpoint's model ``arrays`` cannot be the configured model ``reference`` (an ArrayRecord):
    other names, shapes or dtypes; None when it fits."""
    want = {k: (tuple(a.shape), str(a.dtype)) for k, a in reference.items()}
    have = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in arrays.items()}
    if set(have) != set(want):
        lost, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        return f"its model lacks {lost[:3]} / has {extra[:3]} beside the configured model's parameters"
    for key, (shape, dtype) in want.items():
        if have[key] != (shape, dtype):
            got = have[key]
            return f"its model's {key} is {got[1]} of shape {list(got[0])}, the configured one {dtype} {list(shape)}"
    return None


def _extra(extra) -> None:
    """The loop's extra state (``RunState.carried``): flags, the stop reason, the target reached, the async loop."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ValueError(f"extra is {_show(extra)}, not a dict")
    if not isinstance(extra.get("initial_recorded", False), bool):
        raise ValueError(f"extra.initial_recorded is {_show(extra['initial_recorded'])}, not true or false")
    if not isinstance(extra.get("stop_reason") or "", str):
        raise ValueError(f"extra.stop_reason is {_show(extra['stop_reason'])}, not text")
    reached = extra.get("target_reached")
    if reached is not None:
        if not isinstance(reached, dict) or set(reached) != _REACHED:
            raise ValueError(f"extra.target_reached is {_show(reached)}, not {sorted(_REACHED)}")
        _number(reached["target"], "extra.target_reached.target")
        _whole(reached["round"], "extra.target_reached.round")
        for key in ("sim_time", "wall_time"):
            _number(reached[key], f"extra.target_reached.{key}", none=True)
    loop = extra.get("async")
    if loop is not None:
        ok = isinstance(loop, dict) and isinstance(loop.get("models", {}), dict)
        ok = ok and isinstance(loop.get("inflight", []), list)
        ok = ok and all(isinstance(t, dict) and all(isinstance(k, str) for k in t) for t in loop["inflight"])
        if not ok:
            raise ValueError("extra.async is not the asynchronous loop's state")
        _whole(loop.get("next_task", 0), "extra.async.next_task")
        for version, model in loop["models"].items():
            check_arrays(model, f"extra.async.models[{_show(version)}]")


def check_records(records, rnd: int, name: str) -> list[dict]:
    """``records``: dicts of JSON data with integer rounds in order, none past round ``rnd``."""
    if not isinstance(records, list):
        raise ValueError(f"{name} is {_show(records)}, not a list of records")
    prev = 0
    for i, r in enumerate(records):
        if not isinstance(r, dict) or not all(isinstance(k, str) for k in r):
            raise ValueError(f"{name}[{i}] is {_show(r)}, not a record")
        r_round = _whole(r.get("round"), f"{name}[{i}].round")
        if not prev <= r_round <= rnd:
            raise ValueError(f"{name}[{i}] is of round {r_round}, after round {prev}, checkpoint round {rnd}")
        prev = r_round
        try:
            json.dumps(r)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}[{i}] is not JSON data ({e})") from None
    return records


def _history(hist, rnd: int) -> None:
    if not isinstance(hist, dict):
        raise ValueError(f"history is {_show(hist)}, not a dict")
    count = _whole(hist.get("count"), "history.count")
    _whole(hist.get("bytes"), "history.bytes", lo=count)
    if not isinstance(hist.get("sha256"), str) or not _HEX.match(hist["sha256"]):
        raise ValueError(f"history.sha256 is {_show(hist.get('sha256'))}, not a sha256 digest")
    if count:
        last = _whole(hist.get("last_round"), "history.last_round")
        if last > rnd:
            raise ValueError(f"history.last_round is {last}, after the checkpoint's round {rnd}")


def history_digest(data: bytes) -> str:
    """sha256 (hex) of the first lines of metrics.jsonl a checkpoint was written after."""
    return hashlib.sha256(data).hexdigest()


def history_of(records: list[dict]) -> dict:
    """The history a checkpoint keeps of ``records`` (``fedsim.recorder.Recorder.history`` computes the same
    from the lines as it writes them)."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    last = records[-1]["round"] if records else None
    return {"count": len(records), "bytes": len(data), "sha256": history_digest(data), "last_round": last}


def read_history(hist: dict, folder: Path, rnd: int) -> list[dict]:
    """The records a checkpoint of format 5 was written after: the first ``hist["count"]`` lines of
    ``folder/metrics.jsonl``, which must have the byte length and sha256 it recorded.

    Raises
    ------
    HistoryMismatch
        The file is missing, unreadable, shorter, or its lines differ; ``ValueError`` when they are not records.
    """
    count, size = hist["count"], hist["bytes"]
    if count == 0:
        return []
    path = Path(folder) / HISTORY
    try:
        with open(path, "rb") as f:
            head = f.read(size)
    except OSError as e:
        raise HistoryMismatch(f"{HISTORY} beside it cannot be read ({e.strerror or e})") from None
    if len(head) < size:
        raise HistoryMismatch(
            f"{HISTORY} beside it holds {len(head)} bytes, fewer than the {size} of the {count} records the "
            "checkpoint was written after"
        )
    lines = head.split(b"\n")
    if history_digest(head) != hist["sha256"] or len(lines) != count + 1 or lines[-1]:
        raise HistoryMismatch(
            f"the first {count} records of {HISTORY} beside it differ from those the checkpoint was written after"
        )
    try:
        records = [json.loads(line) for line in lines[:-1]]
    except ValueError as e:
        raise ValueError(f"{HISTORY} is not JSON lines ({e})") from None
    check_records(records, rnd, HISTORY)
    if records[-1]["round"] != hist["last_round"]:
        raise ValueError(
            f"{HISTORY}'s record {count} is of round {records[-1]['round']}, not {hist['last_round']}"
        )
    return records


def check_clients(clients, rnd: int) -> None:
    """The clients' state record: ``{"round": rnd, "files": [<pid>-<version>.npz, ...], "sha256": {file: hex}}``
    (``sha256`` absent in checkpoints written before it was kept)."""
    if clients is None:
        return
    ok = isinstance(clients, dict) and isinstance(clients.get("files"), list)
    ok = ok and all(isinstance(f, str) and _STATE_FILE.match(f) for f in clients["files"])
    if not ok:
        raise ValueError("client_state is not {'round': int, 'files': [<partition>-<version>.npz, ...]}")
    if _whole(clients.get("round"), "client_state.round") != rnd:
        raise ValueError(f"client_state.round is {clients['round']}, not the checkpoint's round {rnd}")
    digests = clients.get("sha256")
    if digests is not None:
        ok = isinstance(digests, dict) and set(digests) == set(clients["files"])
        if not ok or not all(isinstance(d, str) and _HEX.match(d) for d in digests.values()):
            raise ValueError("client_state.sha256 is not a sha256 digest of each of its files")

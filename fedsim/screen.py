"""The screen of a round's train replies across engines: the checks across replies, and the screen of a cohort
the engine trained batched (``fedsim.messages.Cohort``), which drops what :func:`fedsim.grid_utils.screen_replies`
drops of the Messages the cohort stands for, with the same kinds and details, without making them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord

from fedsim import keys

# The most examples one reply may claim (``num-examples``): far above any partition fedsim can hold in memory,
# far below what would let one reply outweigh the rest in float64 (1e308 turned the global model to zeros).
MAX_NUM_EXAMPLES = 10**9


def _names(keys_: Iterable[str], limit: int = 3) -> str:
    keys_ = sorted(keys_)
    more = f" and {len(keys_) - limit} more" if len(keys_) > limit else ""
    return ", ".join(repr(k) for k in keys_[:limit]) + more


def _whole(v: object, low: float, high: float) -> bool:
    """A whole number (int, or float without a fraction) in ``[low, high]``; not a bool."""
    if type(v) is int:  # the usual value, at once
        return low <= v <= high
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) and v == int(v) and low <= v <= high


def check_metrics(node: str, metrics: Mapping, partition: int | None = None) -> tuple[str, str] | None:
    """Why a train reply's metrics cannot be aggregated: ``(kind, detail)``, or None when they can. The one check
    of a reply's metrics, for Messages (:func:`fedsim.grid_utils.check_reply_content`) and a batched cohort's rows
    (:func:`screen_cohort`) alike; ``node`` names the reply's node (``"node 3"``)."""
    for key in (keys.PARTITION_ID, keys.NUM_EXAMPLES):
        v = metrics.get(key)
        if type(v) is int and v >= 0:  # the usual value, at once
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            return "malformed", (
                f"reply from {node} lacks a number >= 0 for metric {key!r} "
                f"(metrics: {_names(metrics.keys())}); is it fedsim's ClientApp?"
            )
    pid, n = metrics[keys.PARTITION_ID], metrics[keys.NUM_EXAMPLES]
    if not _whole(pid, 0, 2**31):
        return "malformed", f"reply from {node}: partition-id {pid!r} is not a whole number in [0, 2^31]"
    if partition is not None and int(pid) != partition:
        return (
            "malformed",
            f"reply from {node}: partition-id {int(pid)}, but the node holds partition {partition}",
        )
    if not _whole(n, 0, MAX_NUM_EXAMPLES):
        return "malformed", (
            f"reply from {node}: num-examples {n!r} is not a whole number in [0, {MAX_NUM_EXAMPLES:.0e}]"
        )
    for k, v in metrics.items():
        if type(v) is float or type(v) is int:  # the usual value, at once (a bool's type is bool)
            continue
        ok = isinstance(v, (int, float)) or (
            isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
        )
        if not ok or isinstance(v, bool):
            return "malformed", f"reply from {node}: metric {k!r} is not a number ({type(v).__name__})"
    return None


def screen_cohort(cohort, reference: ArrayRecord, partitions: Mapping[int, int] | None = None):
    """:func:`screen_replies` for a cohort the engine trained batched (``fedsim.messages.Cohort``), without
    per-client Messages: ``(valid rows, failures)``, the same drops with the same kinds and details; None when
    the stack's array names, shapes or dtypes are not ``reference``'s (the message screen names them).

    The engine made every row's arrays itself, so what the message screen checks of their bytes holds by
    construction; the rest is the same checks: each row's node and metrics (:func:`check_metrics`), NaN or Inf
    in its train loss or model (one vectorised check per parameter), then across the rows (one per partition,
    one set of metric keys, some examples to weight by).
    """
    from fedsim.comm import torch_numpy_dtype

    ref = {k: (tuple(a.shape), a.dtype) for k, a in reference.items()}
    got = {n: (tuple(t.shape[1:]), str(torch_numpy_dtype(t.dtype))) for n, t in cohort.arrays.items()}
    if got != ref:
        return None
    finite, nodes = _finite_rows(cohort), cohort.node_ids
    keep, failures = [], []
    for i, (node, metrics) in enumerate(zip(nodes, cohort.metrics)):
        problem = _row_problem(node, metrics, finite[i], partitions)
        if problem is None:
            keep.append(i)
        else:
            failures.append(problem)
    rows, layouts = [], {}  # (one sorted layout per key order: the rows' metrics mostly share one)
    for i in keep:
        m = cohort.metrics[i]
        order = tuple(m)
        layout = layouts.get(order) or layouts.setdefault(order, (_ROW_RECORDS, tuple(sorted(order))))
        rows.append(Row(i, int(m[keys.PARTITION_ID]), f"node {nodes[i]}", layout, m[keys.NUM_EXAMPLES]))
    return cohort.take([r.item for r in together(rows, failures)]), failures


# the records of a reply made from a cohort's row (``fedsim.messages.reply_message``), as ``_layout`` lists them
_ROW_RECORDS = ((keys.ARRAYS, "ArrayRecord"), (keys.METRICS, "MetricRecord"))


def _row_problem(number: int, metrics: Mapping, finite: bool, partitions: Mapping[int, int] | None):
    """Why the row of node ``number`` in a batched cohort fails: what :func:`screen_replies` says of its reply,
    or None."""
    if partitions and number not in partitions:
        return "malformed", f"reply from node {number}, which is not one of the run's clients"
    problem = check_metrics(f"node {number}", metrics, partitions.get(number) if partitions else None)
    if problem is not None:
        return problem
    loss = metrics.get(keys.TRAIN_LOSS, 0.0)
    if isinstance(loss, (int, float)) and not math.isfinite(float(loss)):
        return "nonfinite", f"NaN or Inf train loss from node {number}"
    if not finite:
        return "nonfinite", f"NaN or Inf in the update from node {number}"
    return None


def _finite_rows(cohort) -> np.ndarray:
    """Whether each row's model holds only finite values (one check per parameter)."""
    import torch

    finite = np.ones(len(cohort), dtype=bool)
    for t in cohort.arrays.values():
        t = t.detach()
        if t.device.type == "cpu":  # numpy: one thread, whatever torch's thread count
            finite &= np.isfinite(t.numpy()).reshape(len(cohort), -1).all(1)
        else:
            finite &= torch.isfinite(t).flatten(1).all(1).cpu().numpy()
    return finite


class Row:
    """What the checks across a round's replies read of one reply (a Message or a cohort's row)."""

    def __init__(self, item, pid: int, node: str, layout, examples) -> None:
        self.item, self.pid, self.node, self.layout, self.examples = item, pid, node, layout, examples


def together(rows: list[Row], failures: list) -> list[Row]:
    """The checks across a round's replies: one reply per partition, one layout, some examples to weight by."""
    seen: dict[int, str] = {}
    unique = []
    for row in rows:
        if row.pid in seen:
            failures.append(
                (
                    "malformed",
                    f"reply from {row.node}: partition-id {row.pid} is {seen[row.pid]}'s reply's too",
                )
            )
            continue
        seen[row.pid] = row.node
        unique.append(row)
    if len(unique) > 1:
        counts = Counter(r.layout for r in unique)
        top = max(counts.values())  # the layout most replies share; on a tie the one with the fewest keys
        layout = min((lay for lay, c in counts.items() if c == top), key=lambda lay: (len(lay[1]), lay))
        failures += [("malformed", _differs(r.node, r.layout, layout)) for r in unique if r.layout != layout]
        unique = [r for r in unique if r.layout == layout]
    if unique and all(r.examples == 0 for r in unique):
        failures += [
            ("malformed", f"reply from {r.node}: num-examples is 0 in every reply (nothing to weight by)")
            for r in unique
        ]
        unique = []
    return unique


def _differs(node: str, mine: tuple, layout: tuple) -> str:
    parts = []
    for what, have, want in (("records", mine[0], layout[0]), ("metrics", mine[1], layout[1])):
        extra, missing = set(have) - set(want), set(want) - set(have)
        name = (lambda x: x[0]) if what == "records" else (lambda x: x)
        if extra:
            parts.append(f"extra {what} {_names(name(x) for x in extra)}")
        if missing:
            parts.append(f"no {what} {_names(name(x) for x in missing)}")
    return f"reply from {node}: unlike the round's other replies it has {'; '.join(parts)}"

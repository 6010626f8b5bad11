"""Run-folder outputs: metrics.jsonl, summary.json, model.pt, curves.png, and the console progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fedsim import schema


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename, so readers never see half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a temp file and a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Recorder:
    """Collects one record per round (or server model version) and writes the run folder."""

    def __init__(
        self, out_dir: Path, num_rounds: int, quiet: bool = False, records: list[dict] | None = None
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.num_rounds = num_rounds
        self.quiet = quiet
        self.records: list[dict] = list(records or [])  # a resumed run starts with the rounds already done
        offset = self.records[-1][schema.WALL_TIME] if self.records else 0.0
        self.t0 = time.perf_counter() - offset
        self._metrics = open(self.out_dir / "metrics.jsonl", "w", encoding="utf-8")
        self._rewrite()

    def _rewrite(self) -> None:
        """metrics.jsonl from scratch: one line per record so far."""
        self._metrics.seek(0)
        self._metrics.truncate()
        for r in self.records:
            self._metrics.write(json.dumps(r) + "\n")
        self._metrics.flush()

    def log(self, record: dict) -> None:
        """Append one record to metrics.jsonl (flushed at once) and print the progress line."""
        record = {
            schema.ROUND: record[schema.ROUND],
            schema.WALL_TIME: time.perf_counter() - self.t0,
            **record,
        }
        record = {k: _clean(v) for k, v in record.items()}
        self.records.append(record)
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if not self.quiet:
            print(self.progress_line(record), file=sys.stderr, flush=True)

    def amend(self, fields: dict) -> None:
        """Add ``fields`` to the last record and rewrite metrics.jsonl (e.g. the evaluation of a stopped run)."""
        self.records[-1].update({k: _clean(v) for k, v in fields.items()})
        self._rewrite()
        if not self.quiet:
            print(self.progress_line(self.records[-1]), file=sys.stderr, flush=True)

    def progress_line(self, r: dict) -> str:
        """``[round 5/30] acc 0.873  loss 0.412  clients 10  sim 12.3s  elapsed 3.2s`` (+ extras)."""
        parts = [f"[round {r['round']:>{len(str(self.num_rounds))}}/{self.num_rounds}]"]
        if r.get(schema.EVAL_ACCURACY) is not None:
            parts.append(f"acc {r['eval_accuracy']:.4f}  loss {r['eval_loss']:.4f}")
        if r.get(schema.TRAIN_LOSS) is not None:
            parts.append(f"train_loss {r['train_loss']:.4f}")
        parts.append(f"clients {r.get('num_clients', 0)}")
        for key, fmt in (
            (schema.FAILURES, "{}"),
            (schema.CLIP_NORM, "{:.3g}"),
            (schema.EPSILON, "{:.3g}"),
            (schema.STALENESS_MEAN, "{:.2f}"),
        ):
            if r.get(key):
                parts.append(f"{key} " + fmt.format(r[key]))
        if r.get(schema.SKIPPED):
            parts.append("SKIPPED")
        parts.append(f"sim {r.get('sim_time', 0.0):.1f}s  elapsed {r['wall_time']:.1f}s")
        return "  ".join(parts)

    def close(self) -> None:
        """Close metrics.jsonl."""
        self._metrics.close()

    def summary(self, extra: dict) -> dict:
        """Final and best metrics over the recorded rounds, plus ``extra`` (config choices, versions...)."""
        evals = [r for r in self.records if r.get(schema.EVAL_ACCURACY) is not None]
        last = self.records[-1] if self.records else {}
        best = max(evals, key=lambda r: r[schema.EVAL_ACCURACY], default={})
        final_eval = evals[-1] if evals else {}
        return {
            "rounds_done": last.get(schema.ROUND, 0),
            "final_eval_accuracy": final_eval.get(schema.EVAL_ACCURACY),
            "final_eval_loss": final_eval.get(schema.EVAL_LOSS),
            "best_eval_accuracy": best.get(schema.EVAL_ACCURACY),
            "best_round": best.get(schema.ROUND),
            "final_train_loss": last.get(schema.TRAIN_LOSS),
            schema.SIM_TIME: last.get(schema.SIM_TIME),
            schema.WALL_TIME: time.perf_counter() - self.t0,
            "total_failures": sum(int(r.get(schema.FAILURES) or 0) for r in self.records),
            "final_epsilon": next(
                (r[schema.EPSILON] for r in reversed(self.records) if r.get(schema.EPSILON) is not None), None
            ),
            **extra,
        }

    def write_summary(self, summary: dict) -> None:
        """Write summary.json atomically."""
        atomic_write_bytes(self.out_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())

    def plot(self, title: str = "") -> None:
        """curves.png: accuracy and loss against round and against simulated time."""
        plot_curves(self.records, self.out_dir / "curves.png", title)


def plot_curves(records: list[dict], path: Path, title: str = "") -> None:
    """Plot eval accuracy and loss against round (top) and simulated time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [r for r in records if r.get(schema.EVAL_ACCURACY) is not None]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for row, xkey, xlabel in (
        (0, schema.ROUND, "round (server model version)"),
        (1, schema.SIM_TIME, "simulated time (s)"),
    ):
        xs = [r.get(xkey, 0.0) for r in ev]
        axes[row, 0].plot(xs, [r[schema.EVAL_ACCURACY] for r in ev], marker=".")
        axes[row, 0].set(xlabel=xlabel, ylabel="eval accuracy")
        axes[row, 1].plot(
            xs, [r[schema.EVAL_LOSS] for r in ev], marker=".", color="tab:red", label="eval loss"
        )
        tr = [r for r in records if r.get(schema.TRAIN_LOSS) is not None]
        axes[row, 1].plot(
            [r.get(xkey, 0.0) for r in tr],
            [r[schema.TRAIN_LOSS] for r in tr],
            color="tab:gray",
            label="train loss",
        )
        axes[row, 1].set(xlabel=xlabel, ylabel="loss")
        axes[row, 1].legend()
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)

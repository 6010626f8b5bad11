"""Run-folder outputs: metrics.jsonl, summary.json, model.pt, curves.png, the console progress line, and the
lock that keeps two live runs out of one folder.

Every file but metrics.jsonl is written through a temporary file in the same folder and a rename, inside a
section no signal interrupts (:func:`fedsim.errors.critical`), so a reader never sees half a file and no
temporary file is left behind. A failed write raises :class:`fedsim.errors.OutputError`: one line naming the
file and the cause (``the disk is full``, ``Read-only file system``, ...).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from fedsim import progress, schema
from fedsim.errors import ConfigError, critical, write_error
from fedsim.figures import plot_curves
from fedsim.tasks import CLASSIFICATION, Task

try:
    import fcntl
except ImportError:  # pragma: no cover  (Windows: no folder lock)
    fcntl = None

log = logging.getLogger("fedsim")
# every progress line, also under quiet=true, for the run's log file (the fedsim command gives it the file
# handler of Hydra's job logging: cli.log); not propagated, so the console shows each line once
progress_log = logging.getLogger("fedsim.progress")
progress_log.propagate = False
LOCK_NAME = ".fedsim.lock"
_HELD: dict[str, list] = {}  # run folder -> [lock file descriptor, users] held by this process


def lock_run_folder(folder: str | Path, key: str = "hydra.run.dir") -> None:
    """Hold the run folder's lock (``.fedsim.lock``, creating the folder) until :func:`unlock_run_folder`.

    The lock is an exclusive ``flock`` on a file in the folder: the kernel drops it when the process ends, even
    by SIGKILL, so a dead run never keeps a folder locked. Taking it again in the same process only counts.

    Raises
    ------
    ConfigError
        Naming ``key`` when another live process holds the folder, or when it cannot be created or written.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        name = str(folder.resolve())
        if name in _HELD:
            _HELD[name][1] += 1
            return
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(
            key, str(folder), "a folder fedsim can create and write in", f"({e.strerror or e})."
        ) from None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(
                key,
                str(folder),
                "a run folder that no other live fedsim run is writing to",
                f"Process {holder or '?'} is running in it: wait for it to end, or choose another folder.",
            ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[name] = [fd, 1]


def unlock_run_folder(folder: str | Path) -> None:
    """Give back what :func:`lock_run_folder` took (the lock is released when its last user gives it back)."""
    name = str(Path(folder).resolve())
    held = _HELD.get(name)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _HELD[name]
        with contextlib.suppress(OSError):
            os.close(held[0])


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename, so readers never see half a file."""
    _atomic(Path(path), lambda f: f.write(data))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a temp file and a rename (and no temp file left behind on failure)."""
    import torch

    _atomic(Path(path), lambda f: torch.save(obj, f))


def _atomic(path: Path, write) -> None:
    """Run ``write(file)`` on a new temp file next to ``path``, sync it, rename it to ``path``.

    No signal interrupts it; on any failure the temp file is removed and an OSError (or torch's error on a
    full disk) becomes an ``OutputError`` naming ``path``.
    """
    with critical():
        tmp = None
        try:
            tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
            with os.fdopen(fd, "wb") as f:
                try:
                    write(f)
                    f.flush()
                except (
                    RuntimeError
                ) as e:  # torch's zip writer hides the cause ("unexpected pos ..."): ask the OS
                    raise _write_cause(f) or e from None
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except (OSError, RuntimeError) as e:
            raise write_error(path, e) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _write_cause(f) -> OSError | None:
    """The OS's reason why writing to ``f`` fails now (full disk, file size limit...), or None if it does not."""
    try:
        f.seek(0, os.SEEK_END)
        os.write(f.fileno(), b"\0")
    except OSError as e:
        return e
    return None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _total(records: list[dict], field: str) -> int | None:
    """The sum of a per-round byte count over the records (None when no record has it)."""
    values = [int(r[field]) for r in records if r.get(field) is not None]
    return sum(values) if values else None


def _num(v: Any, fmt: str) -> str:
    """``v`` formatted, or ``nan`` when it is missing (a diverged model's loss is recorded as null)."""
    return "nan" if v is None else format(v, fmt)


class Recorder:
    """Collects one record per round (or server model version) and writes the run folder."""

    def __init__(
        self,
        out_dir: Path,
        num_rounds: int,
        quiet: bool = False,
        records: list[dict] | None = None,
        task: Task = CLASSIFICATION,
        progress: str = "lines",
    ):
        self.task = task  # its metric names the evaluation fields (eval_accuracy, eval_r2, ...)
        self.metric = schema.eval_field(task.metric)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.num_rounds = num_rounds
        self.quiet = quiet
        self.records: list[dict] = list(records or [])  # a resumed run starts with the rounds already done
        offset = self.records[-1][schema.WALL_TIME] if self.records else 0.0
        self.t0 = time.perf_counter() - offset
        self.metrics_path = self.out_dir / "metrics.jsonl"
        try:
            self._fd: int | None = os.open(
                self.metrics_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644
            )
        except OSError as e:
            raise write_error(self.metrics_path, e) from None
        self._good = 0  # bytes of metrics.jsonl known to be whole lines
        self._sha = hashlib.sha256()  # of those bytes (what a checkpoint keeps of them: history())
        self._rewrite()
        self.bar = None  # a progress bar with ETA (``progress=bar``, or ``auto`` on a terminal)
        if not quiet and (progress == "bar" or (progress == "auto" and sys.stderr.isatty())):
            self.bar = self._bar(num_rounds)

    def _bar(self, num_rounds: int):
        """tqdm's bar below a sweep's bar, or None (one line per round) when tqdm cannot be imported."""
        try:
            from tqdm import tqdm
        except ImportError:  # a dependency, but a broken environment should still run: plain lines
            log.warning("no progress bar (tqdm cannot be imported): one line per round instead")
            return None
        done = self.records[-1][schema.ROUND] if self.records else 0
        nested = progress.SWEEP_BAR is not None  # below the sweep's bar
        return tqdm(
            total=num_rounds,
            initial=done,
            unit="round",
            file=sys.stderr,
            **progress.bar_shape(),
            position=1 if nested else None,
            leave=not nested,
        )

    def _append(self, text: str) -> None:
        """Append whole lines to metrics.jsonl; on failure cut the file back to its last whole line."""
        data = text.encode()
        try:
            if self._fd is None:
                raise OSError(9, "the file is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._good)
            raise write_error(self.metrics_path, e) from None
        self._good += len(data)
        self._sha.update(data)

    def _rewrite(self) -> None:
        """metrics.jsonl from scratch: one line per record so far."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError as e:
                raise write_error(self.metrics_path, e) from None
        self._good, self._sha = 0, hashlib.sha256()
        self._append("".join(json.dumps(r) + "\n" for r in self.records))

    def history(self, up_to: int) -> dict:
        """What a checkpoint of round ``up_to`` keeps of metrics.jsonl instead of its records: their ``count``,
        ``bytes``, ``sha256`` and ``last_round`` (``fedsim.checkpoint_fields.read_history`` checks them).

        O(1) when no record is past ``up_to`` (the digest is kept as the lines are written).
        """
        if not self.records or self.records[-1][schema.ROUND] <= up_to:
            count, size, digest = len(self.records), self._good, self._sha.hexdigest()
        else:
            kept = [r for r in self.records if r[schema.ROUND] <= up_to]
            data = "".join(json.dumps(r) + "\n" for r in kept).encode()  # as checkpoint_fields.history_of
            count, size, digest = len(kept), len(data), hashlib.sha256(data).hexdigest()
        last = self.records[count - 1][schema.ROUND] if count else None
        return {"count": count, "bytes": size, "sha256": digest, "last_round": last}

    def truncate(self, last_round: int) -> None:
        """Forget the records after ``last_round`` (an interrupted or failed round) and rewrite metrics.jsonl."""
        if any(r[schema.ROUND] > last_round for r in self.records):
            self.records = [r for r in self.records if r[schema.ROUND] <= last_round]
            self._rewrite()

    def log(self, record: dict) -> None:
        """Append one record to metrics.jsonl (flushed at once) and print the progress line."""
        record = {
            schema.ROUND: record[schema.ROUND],
            schema.WALL_TIME: time.perf_counter() - self.t0,
            **record,
        }
        record = {k: _clean(v) for k, v in record.items()}
        self._append(json.dumps(record) + "\n")
        self.records.append(record)
        self._show(record)

    def _show(self, record: dict) -> None:
        """The progress line of a record, or the bar moved to its round with the line's figures beside it."""
        line = self.progress_line(record)
        progress_log.info(line)
        if self.quiet:
            return
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
            return
        self.bar.update(max(0, int(record[schema.ROUND]) - self.bar.n))
        self.bar.set_postfix_str(line.split("]", 1)[1].split("  sim ")[0].strip(), refresh=True)

    def amend(self, fields: dict) -> None:
        """Add ``fields`` to the last record and rewrite metrics.jsonl (e.g. the evaluation of a stopped run)."""
        self.records[-1].update({k: _clean(v) for k, v in fields.items()})
        self._rewrite()
        self._show(self.records[-1])

    def progress_line(self, r: dict) -> str:
        """``[round 5/30] acc 0.873  loss 0.412  clients 10  sim 12.3s  elapsed 3.2s`` (+ extras); a task's
        other metric shows under its own name (``r2 0.412``)."""
        parts = [f"[round {r['round']:>{len(str(self.num_rounds))}}/{self.num_rounds}]"]
        if r.get(self.metric) is not None:
            name = "acc" if self.task.metric == "accuracy" else self.task.metric
            parts.append(f"{name} {_num(r[self.metric], '.4f')}  loss {_num(r.get(schema.EVAL_LOSS), '.4f')}")
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
        parts.append(f"sim {_num(r.get(schema.SIM_TIME, 0.0), '.1f')}s  elapsed {r[schema.WALL_TIME]:.1f}s")
        return "  ".join(parts)

    def close(self) -> None:
        """Close metrics.jsonl (and the progress bar)."""
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def summary(self, extra: dict) -> dict:
        """Final and best metrics over the recorded rounds, plus ``extra`` (config choices, versions...)."""
        m = self.metric
        evals = [r for r in self.records if r.get(m) is not None and r[m] == r[m]]  # (NaN: no best)
        last = self.records[-1] if self.records else {}
        best: dict = {}
        for r in evals:  # the first round of the best value
            if not best or (r[m] != best[m] and self.task.better(r[m], best[m])):
                best = r
        final_eval = evals[-1] if evals else {}
        return {
            "rounds_done": last.get(schema.ROUND, 0),
            f"final_{m}": final_eval.get(m),
            "final_eval_loss": final_eval.get(schema.EVAL_LOSS),
            f"best_{m}": best.get(m),
            "best_round": best.get(schema.ROUND),
            "final_train_loss": last.get(schema.TRAIN_LOSS),
            schema.SIM_TIME: last.get(schema.SIM_TIME),
            schema.WALL_TIME: time.perf_counter() - self.t0,
            "total_failures": sum(int(r.get(schema.FAILURES) or 0) for r in self.records),
            "total_bytes_up": _total(self.records, schema.BYTES_UP),
            "total_bytes_down": _total(self.records, schema.BYTES_DOWN),
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
        plot_curves(self.records, self.out_dir / "curves.png", title, self.task.metric)

"""The run folder's pictures (``partitions.png``, ``curves.png``), drawn by a separate Python process.

A run starts a :class:`FigureWorker` when it begins: a Python with the run's ``sys.path`` that imports matplotlib
and draws ``partitions.png`` while the run trains, then ``curves.png`` from the records the run sends when it
ends. The run's own process never imports matplotlib (its import and the two drawings take about 1.2 s of a
one-minute run on 2 cores); where no process can start, the run draws the pictures itself. Requests and answers
are JSON lines on the worker's stdin and stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fedsim import schema

__all__ = ["FigureWorker", "draw_here", "plot_curves"]


class FigureWorker:
    """A process that draws the run's pictures; :meth:`draw` asks for one, :meth:`finish` waits for all.

    Raises ``OSError`` when the process cannot be started.
    """

    def __init__(self) -> None:
        path = os.pathsep.join(
            p for p in sys.path if p
        )  # fedsim and its dependencies, wherever they came from
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            text=True,
            start_new_session=True,  # a Ctrl-C at the terminal is the run's to handle; it then asks for curves
        )
        self.asked: list[str] = []
        self.unanswered: list[str] = []  # after finish(): pictures the worker ended without answering

    def draw(self, kind: str, png: str | Path, **request) -> bool:
        """Ask for ``partitions`` (``stats``: the path of partitions.json) or ``curves`` (``records``, ``title``,
        ``metric``: :func:`plot_curves`'s arguments) written to ``png``; False when the worker is gone."""
        try:
            self.proc.stdin.write(json.dumps({"kind": kind, "png": str(png), **request}) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the worker has ended (broken pipe) or was finished
            return False
        self.asked.append(str(png))
        return True

    def finish(self, timeout: float = 300.0) -> dict[str, str | None]:
        """Wait for every picture asked for; ``{png: None}`` for one written, else why it is not (one line).
        Those the worker ended without answering (it died, or did not start drawing) are in ``unanswered``."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            out, err = "", f"drawing took more than {timeout:.0f} s"
        answered = {}
        for line in out.splitlines():
            try:
                answer = json.loads(line)
                answered[answer["png"]] = answer["error"]
            except (ValueError, KeyError, TypeError):
                continue
        lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
        gone = lines[-1] if lines else f"the drawing process ended with status {self.proc.returncode}"
        self.unanswered = [png for png in self.asked if png not in answered]
        return {png: answered.get(png, gone) for png in self.asked}

    def cancel(self) -> None:
        """End the worker if it still runs (a run that stops without its outputs)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def draw_here(png: Path, records: list[dict], title: str = "", metric: str = "accuracy") -> str | None:
    """Draw ``curves.png`` (from ``records``) or ``partitions.png`` (from ``partitions.json`` beside it) in this
    process, as the worker would; None when written, else why not (one line)."""
    try:
        if png.name == "partitions.png":
            from fedsim.data.stats import plot_partitions

            plot_partitions(json.loads((png.parent / "partitions.json").read_text()), png)
        else:
            plot_curves(records, png, title, metric)
    except Exception as e:  # noqa: BLE001  (an optional picture)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _watch_parent(poll: float = 0.5) -> None:
    """End this worker as soon as the run's process is gone (even SIGKILLed mid-drawing): a picture nobody
    waits for is not worth the memory and the CPU it may still take."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="fedsim-parent-watch").start()


def _serve() -> None:
    """The worker: draw each requested picture, answer one JSON line for each, end at the end of stdin (or as
    soon as the run's process is gone)."""
    _watch_parent()
    from fedsim.data.stats import plot_partitions

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["kind"] == "partitions":
                plot_partitions(json.loads(Path(req["stats"]).read_text()), req["png"])
            else:
                plot_curves(
                    req["records"], Path(req["png"]), req.get("title", ""), req.get("metric", "accuracy")
                )
            error = None
        except Exception as e:  # noqa: BLE001  (reported to the run, which warns)
            error = f"{type(e).__name__}: {e}".splitlines()[0]
        print(json.dumps({"png": req["png"], "error": error}), flush=True)


_SERVE = "from fedsim.figures import _serve; _serve()"


def wrap_title(title: str, width_inches: float, fontsize: float = 10) -> str:
    """``title`` broken into lines that fit ``width_inches`` at ``fontsize`` points (at most 3; longer ones end
    in an ellipsis), at spaces where it has them."""
    import textwrap

    per_line = max(20, int(width_inches * 72 / (0.62 * fontsize)))  # ~0.6 em a character, with a margin
    lines = textwrap.wrap(title, per_line, break_long_words=True, break_on_hyphens=False)
    if len(lines) > 3:
        lines = lines[:3]
        lines[-1] = lines[-1][: per_line - 3] + "..."
    return "\n".join(lines)


def plot_curves(records: list[dict], path: Path, title: str = "", metric: str = "accuracy") -> None:
    """Plot the task's eval metric (accuracy by default) and loss against round (top) and simulated time
    (bottom)."""
    field = schema.eval_field(metric)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [dict(r) for r in records]  # copies: the cumulative-traffic axis is added to them below
    ev = [r for r in records if r.get(field) is not None]
    rows = [(schema.ROUND, "round (server model version)"), (schema.SIM_TIME, "simulated time (s)")]
    if any(r.get(schema.BYTES_UP) is not None for r in records):  # communication: against cumulative traffic
        total = 0
        for r in records:
            total += int(r.get(schema.BYTES_UP) or 0) + int(r.get(schema.BYTES_DOWN) or 0)
            r["_megabytes"] = total / 1e6
        rows.append(("_megabytes", "cumulative bytes up + down (MB)"))
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.5 * len(rows)), constrained_layout=True)
    for row, (xkey, xlabel) in enumerate(rows):
        xs = [r.get(xkey, 0.0) for r in ev]
        axes[row, 0].plot(xs, [r[field] for r in ev], marker=".")
        axes[row, 0].set(xlabel=xlabel, ylabel=f"eval {metric}")
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
    if title:  # the run's choices: wrapped to the figure's width, never cut at its edges
        fig.suptitle(wrap_title(title, fig.get_figwidth()), fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)

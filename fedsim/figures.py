"""The run folder's pictures (``partitions.png``, ``curves.png``), drawn by a separate Python process.

A run asks for its pictures of a :class:`FigureWorker`: a Python with the run's ``sys.path`` that imports
matplotlib and draws ``partitions.png`` while the run trains, then ``curves.png`` from the records the run sends
when it ends. The run's own process never imports matplotlib (its import and the two drawings take about 1.2 s
of CPU, a one-minute run's 2 %, a tiny run's most). One worker serves every run of a Python process in turn (a
sweep's jobs, a notebook's runs: :func:`for_run`), so the import is paid once a process; it ends with the
process. Where no process can start, the run draws the pictures itself. Requests and answers are JSON lines on
the worker's stdin and stdout.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedsim import schema

__all__ = ["FigureWorker", "RunPictures", "draw_here", "end_worker", "for_run", "plot_curves"]


class FigureWorker:
    """A process that draws pictures; :meth:`draw` asks for one, :meth:`finish` waits for all and ends it.

    A run asks through a :class:`RunPictures` (:func:`for_run`), which waits for its own pictures only and leaves
    the worker to the process's next run. Raises ``OSError`` when the process cannot be started.
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
        self.pid = os.getpid()  # the process that started it (a forked child starts its own)
        self.asked: list[str] = []  # request n (from 1) asked for asked[n - 1]
        self.unanswered: list[str] = []  # after finish(): pictures the worker ended without answering
        self._answers: dict[int, str | None] = {}  # request number -> None (drawn) or why not
        self._answered = threading.Condition()
        self._ended = False  # its stdout closed: it answers no more
        self._closed = False  # finish() or cancel() was called: it takes no more requests
        self._errors: collections.deque[str] = collections.deque(maxlen=5)  # its last stderr lines
        self._write = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read_answers, daemon=True, name="fedsim-figures-out"),
            threading.Thread(target=self._read_errors, daemon=True, name="fedsim-figures-err"),
        ]
        for t in self._readers:
            t.start()

    def request(self, kind: str, png: str | Path, **request) -> int | None:
        """Ask for ``partitions`` (``stats``: the path of partitions.json) or ``curves`` (``records``, ``title``,
        ``metric``: :func:`plot_curves`'s arguments) written to ``png``: the request's number, or None when the
        worker is gone or finished."""
        with self._write:
            if self._closed or self._ended:
                return None
            number = len(self.asked) + 1
            try:
                self.proc.stdin.write(
                    json.dumps({"id": number, "kind": kind, "png": str(png), **request}) + "\n"
                )
                self.proc.stdin.flush()
            except (OSError, ValueError):  # the worker has ended (broken pipe)
                return None
            self.asked.append(str(png))
            return number

    def draw(self, kind: str, png: str | Path, **request) -> bool:
        """:meth:`request`: False when the worker is gone or finished."""
        return self.request(kind, png, **request) is not None

    def wait(self, numbers: list[int], timeout: float) -> dict[int, str | None] | None:
        """The answers to requests ``numbers`` (None: drawn, else why not) once all are in or the worker has
        ended (those it never answered are missing); None when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._answered:
            while not self._ended and not all(n in self._answers for n in numbers):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._answered.wait(left)
            return {n: self._answers[n] for n in numbers if n in self._answers}

    def pending(self, numbers: list[int]) -> bool:
        """Whether a request of ``numbers`` is still unanswered by a worker that runs."""
        with self._answered:
            return not self._ended and any(n not in self._answers for n in numbers)

    def why_gone(self) -> str:
        """Why a request was not answered: the worker's last line on stderr, else its exit status."""
        if self._ended:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self._readers[1].join(timeout=5)
        if self._errors:
            return self._errors[-1]
        return f"the drawing process ended with status {self.proc.returncode}"

    def alive(self) -> bool:
        """Whether it still takes requests."""
        return not (self._closed or self._ended) and self.proc.poll() is None

    def finish(self, timeout: float = 300.0) -> dict[str, str | None]:
        """End the worker once every picture asked for is drawn; ``{png: None}`` for one written, else why it is
        not (one line). Those the worker ended without answering (it died, or did not start drawing) are in
        ``unanswered``."""
        with self._write:
            self._closed = True
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        drawn, self.unanswered = self.collect(list(enumerate(self.asked, 1)), timeout)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.cancel()
        return drawn

    def collect(
        self, asked: list[tuple[int, str]], timeout: float
    ) -> tuple[dict[str, str | None], list[str]]:
        """Wait for the requests ``asked`` (``(number, png)``): ``{png: None}`` for one drawn, else why not (one
        line), and the pictures the worker ended without answering. A worker that takes longer than ``timeout``
        is ended."""
        answers = self.wait([n for n, _ in asked], timeout)
        gone = ""
        if answers is None:
            self.cancel()
            answers, gone = {}, f"drawing took more than {timeout:.0f} s"
        unanswered = [png for n, png in asked if n not in answers]
        if unanswered and not gone:
            gone = self.why_gone()
        return {png: answers.get(n, gone) for n, png in asked}, unanswered

    def cancel(self) -> None:
        """End the worker if it still runs (a run that stops without its outputs)."""
        with self._write:
            self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for t in self._readers:
            t.join(timeout=5)

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
                number, error = int(answer["id"]), answer["error"]
            except (ValueError, KeyError, TypeError):
                continue
            with self._answered:
                self._answers[number] = error
                self._answered.notify_all()
        with self._answered:
            self._ended = True
            self._answered.notify_all()

    def _read_errors(self) -> None:
        for line in self.proc.stderr:
            if line.strip():
                self._errors.append(line.strip())


class RunPictures:
    """One run's pictures, asked of a :class:`FigureWorker` that other runs of the process share in turn:
    :meth:`finish` waits for this run's pictures only and leaves the worker running."""

    def __init__(self, worker: FigureWorker) -> None:
        self.worker = worker
        self.asked: list[tuple[int, str]] = []
        self.unanswered: list[str] = []  # after finish(): pictures the worker ended without answering

    def draw(self, kind: str, png: str | Path, **request) -> bool:
        """Ask for a picture (:meth:`FigureWorker.request`); False when the worker is gone."""
        number = self.worker.request(kind, png, **request)
        if number is None:
            return False
        self.asked.append((number, str(png)))
        return True

    def finish(self, timeout: float = 300.0) -> dict[str, str | None]:
        """Wait for this run's pictures: ``{png: None}`` for one written, else why it is not (one line); those the
        worker ended without answering are in ``unanswered``. A worker that takes longer than ``timeout`` is
        ended."""
        drawn, self.unanswered = self.worker.collect(self.asked, timeout)
        return drawn

    def cancel(self) -> None:
        """A run that stops without its outputs: the worker is ended if it still draws for this run (a
        picture nobody waits for is not worth its CPU; the process's next run starts a fresh one)."""
        if self.worker.pending([n for n, _ in self.asked]):
            self.worker.cancel()


_SHARED: list[FigureWorker] = []  # the worker this process's runs share
_SHARED_LOCK = threading.Lock()


def for_run() -> RunPictures:
    """A run's pictures, drawn by this process's shared worker (started on first use, and again when the one
    before has ended). Raises ``OSError`` when no process can start."""
    with _SHARED_LOCK:
        if not (_SHARED and _SHARED[0].pid == os.getpid() and _SHARED[0].alive()):
            _SHARED[:] = [FigureWorker()]
        return RunPictures(_SHARED[0])


@atexit.register
def end_worker(timeout: float = 5.0) -> None:
    """End this process's shared worker once it has drawn what it was asked (at exit it ends with the process;
    a notebook may end it sooner to give its memory back). The next run starts a fresh one."""
    with _SHARED_LOCK:
        workers, _SHARED[:] = list(_SHARED), []
    for w in workers:
        if w.pid == os.getpid() and w.proc.poll() is None:
            w.finish(timeout=timeout)


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
        print(json.dumps({"id": req.get("id"), "png": req["png"], "error": error}), flush=True)


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

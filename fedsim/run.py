"""One experiment from a composed config, in four phases: build, open the run folder, loop, finish.

``run_experiment`` reads top to bottom:

1. :func:`fedsim.experiment.build_experiment` turns the config into objects and checks every value;
   :class:`fedsim.engines.EngineRunner` checks what the chosen engine can check without running.
   Nothing has been written yet, so a bad config leaves no run folder behind.
2. :class:`Run` opens the run folder: partition statistics, the resumed checkpoint if any, the recorder, and
   the round hooks (target accuracy, periodic checkpoints).
   It first takes the folder's lock: a second live run aimed at the same folder is refused before it writes.
3. :meth:`Run.execute` runs the synchronous or asynchronous loop on the engine. An interrupt (Ctrl-C, SIGTERM,
   SIGHUP) or a failure rolls back to the end of the last completed round and writes a checkpoint, so a resume
   repeats nothing and every output describes the same round.
4. :meth:`Run.finish` writes model.pt, summary.json and, last and optional, curves.png, whatever happened
   before. A run that aggregated no update at all ends ``failed``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import signal
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from fedsim import __version__, build, checkpoint, errors, schema
from fedsim.algorithms import state as client_state
from fedsim.callbacks import Callbacks, redact
from fedsim.config import keep_freed_memory, quiet_loggers
from fedsim.engines import EngineRunner
from fedsim.errors import ConfigError, Interrupted, OutputError, RunError, signals, where_it_failed
from fedsim.experiment import Experiment, build_experiment
from fedsim.figures import RunPictures, draw_here, for_run
from fedsim.grid_utils import StoppableView
from fedsim.recorder import (
    Recorder,
    atomic_torch_save,
    atomic_write_bytes,
    lock_run_folder,
    unlock_run_folder,
)
from fedsim.server import run_sync
from fedsim.state import RunState, TargetReached
from fedsim.strategies import base
from fedsim.tasks import CLASSIFICATION, Task

log = logging.getLogger("fedsim")


def run_experiment(
    cfg: DictConfig, out_dir: str | Path, choices: dict | None = None, grid: Grid | None = None
) -> dict:
    """Run the experiment ``cfg``, write its outputs to ``out_dir`` and return its summary.

    ``grid`` is given by a deployed ServerApp (the SuperLink's Grid); otherwise ``cfg.engine`` picks the engine.
    Ctrl-C, SIGTERM and SIGHUP end the run as ``interrupted`` (summary ``signal``) with its outputs written.

    Raises
    ------
    ConfigError
        A bad value, a resume that does not fit, or a run folder another live run holds (nothing written).
    RunError
        The run could not go on, aggregated no update, diverged, or could not write an output; the outputs of
        the rounds done are in ``out_dir`` (summary ``status`` is ``failed``, ``error`` says why).
    """
    if grid is None:  # the Python API too: Flower's INFO lines off (a deployed ServerApp's log keeps them)
        quiet_loggers()
    keep_freed_memory()
    with contextlib.nullcontext() if grid is not None else signals() as guard:
        exp = build_experiment(cfg, deployed=grid is not None)
        engine = EngineRunner(
            exp.engine, exp.placement, exp.loop.num_clients, grid, state_dir=Path(out_dir) / "client_state"
        )
        run = Run(exp, Path(out_dir), choices or {})
        try:
            status, raised = "failed", True
            try:
                status = run.execute(engine, guard)
                raised = False
            except BaseException as e:
                run.error = run.error or _one_line(e)
                raise
            finally:
                if guard is not None:
                    guard.stopping()
                summary = run.finish(status, engine.name)
        finally:
            run.close()
    if summary["status"] == "failed" and not raised:
        raise RunError(summary["error"])
    return summary


@contextlib.contextmanager
def _sigterm_kept_from_ray(active: bool):
    """Keep fedsim's SIGTERM handler while Ray starts: ``ray.init`` replaces it with ``sys.exit(15)``, which
    would end the run as failed (and abort the process) instead of interrupted with its outputs written."""
    if not active:
        yield
        return
    try:
        from ray._private import utils as ray_utils

        replace = ray_utils.set_sigterm_handler
    except (ImportError, AttributeError):  # another Ray: its handler stays
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = replace


def _one_line(e: BaseException) -> str:
    if isinstance(e, (ConfigError, RunError)):
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return where_it_failed(e)  # FILE:LINE: Type: message, the line of the user's code where there is one


PROGRESS_MODES = ("auto", "bar", "lines")


def progress_mode(value) -> str:
    """``progress``: a bar with ETA (``bar``), one line per round (``lines``), or the bar on a terminal only."""
    if value not in PROGRESS_MODES:
        raise ConfigError("progress", value, f"one of {', '.join(PROGRESS_MODES)}")
    return str(value)


class TargetWatch:
    """Round hook: note the first round whose evaluation reaches ``target_<metric>`` (``target_accuracy``, or the
    task's own metric: ``target_r2``); optionally stop there."""

    def __init__(self, target: float | None, stop: bool, task: Task = CLASSIFICATION) -> None:
        self.target, self.stop, self.task = target, stop, task

    def __call__(self, record: dict, state: RunState, wall_time: float) -> None:
        score = record.get(schema.eval_field(self.task.metric))
        if self.target is None or score is None or state.target_reached is not None:
            return
        if not self.task.better(score, self.target):
            return
        sim = record.get(schema.SIM_TIME)
        state.target_reached = TargetReached(self.target, record[schema.ROUND], sim, wall_time)
        log.warning(
            "target %s %.4g reached at round %d (simulated time %.1f s)",
            self.task.metric,
            self.target,
            record[schema.ROUND],
            sim or 0.0,
        )
        if self.stop:
            state.stop_reason = f"target {self.task.metric} {self.target} reached"


class FailedRounds:
    """Round hook: count consecutive rounds in which clients were asked to train and every one failed (no valid
    reply, some failure); at ``limit`` of them (``max_failed_rounds``; 0: never) the run ends ``failed``.

    Calling it with a round's record returns True once the limit is reached; ``why`` then says so in one line.
    """

    def __init__(self, limit) -> None:
        self.limit, self.streak, self.kinds, self.why = int(limit or 0), 0, Counter(), None

    def __call__(self, record: dict) -> bool:
        if record.get(schema.ROUND, 0) < 1:
            return False
        if record.get(schema.NUM_CLIENTS) or not record.get(schema.FAILURES):
            self.streak, self.kinds = 0, Counter()
            return False
        self.streak += 1
        self.kinds.update(record.get(schema.FAILURE_KINDS) or {})
        if not self.limit or self.streak < self.limit:
            return False
        kinds = ", ".join(f"{k}: {n}" for k, n in self.kinds.most_common())
        first = record[schema.ROUND] - self.streak + 1
        self.why = (
            f"every client failed in {self.streak} consecutive rounds ({first}-{record[schema.ROUND]}; {kinds}), "
            f"max_failed_rounds={self.limit}: the run stopped training; check the clients' log lines above"
        )
        return True


class Run:
    """One experiment's run folder and the state of its loop (see the module docstring)."""

    def __init__(self, exp: Experiment, out_dir: Path, choices: dict) -> None:
        self.exp, self.out_dir, self.choices = exp, out_dir, choices
        self.strategy = exp.strategy
        self.state = RunState(arrays=ArrayRecord(exp.initial_model.state_dict()))
        self.error: str | None = None  # why a failed run failed
        self.figures: RunPictures | None = None  # this run's pictures, drawn by the process's figure worker
        self.signal: int | None = None  # the signal that interrupted it
        self.ckpt_round: int | None = None  # round of the last checkpoint.pt this run wrote
        self.give_up = FailedRounds(exp.cfg.get("max_failed_rounds", 10))
        cfg = exp.cfg
        records: list[dict] = []
        lock_run_folder(out_dir)  # first: a folder another live run writes to is refused before any write
        try:
            checkpoint.remove_stale_temporaries(
                out_dir
            )  # what a killed run was writing; this run holds the lock
            self.figures = start_figures()  # first: it imports matplotlib while the run sets up
            target = cfg.get(f"target_{exp.task.metric}")
            self.watch = TargetWatch(target, bool(cfg.get("stop_at_target")), exp.task)
            if cfg.get("resume"):
                records = self._resume(str(cfg.resume))
            self.every = int(cfg.get("checkpoint_every") or 0)
            self.ckpt_path = out_dir / "checkpoint.pt"
            self.recorder = Recorder(
                out_dir,
                exp.loop.num_rounds,
                quiet=bool(cfg.get("quiet", False)),
                records=records,
                task=exp.task,
                progress=progress_mode(cfg.get("progress", "auto")),
            )
            for r in records:  # a resumed run goes on counting the failed rounds it ended with
                self.give_up(r)
            self.give_up.why = None
            self.callbacks = Callbacks(exp.callbacks)
            self.callbacks.start(out_dir, exp.resolved, list(records))
            ds = exp.dataset  # real-valued targets are counted by decile
            bins = ds.num_classes if ds.targets == "classes" else 10
            write_partition_stats(out_dir, exp.client_shares, ds.partition_labels(bins), bins, self.figures)
        except BaseException:
            if self.figures is not None:
                self.figures.cancel()
            if hasattr(self, "recorder"):
                self.recorder.close()
            unlock_run_folder(out_dir)
            raise

    def close(self) -> None:
        """Close metrics.jsonl, end pictures still being drawn and give the run folder's lock back."""
        if self.figures is not None:
            self.figures.cancel()
        self.recorder.close()
        unlock_run_folder(self.out_dir)

    def _resume(self, path: str) -> list[dict]:
        """Take the checkpoint at ``path``; return the records it was written after.

        Everything is checked before anything in the run folder changes: every field of the checkpoint and the
        records in metrics.jsonl beside it (:func:`fedsim.checkpoint.load`), the config, the model's names,
        shapes and dtypes, the strategy's state, and each client-state file against its sha256; only then is
        ``client_state/`` replaced (and, by the Recorder, metrics.jsonl rewritten). A refusal changes no file.
        """
        ckpt = checkpoint.load(path)
        checkpoint.check_config(ckpt, self.exp.resolved, path)
        checkpoint.check_rounds(ckpt, self.exp.loop.num_rounds, path)
        checkpoint.check_model(ckpt, self.state.arrays, path)
        self.strategy = checkpoint.restore(ckpt, self.state, self.strategy)
        where = Path(path).expanduser()
        try:
            client_state.resume(
                where if where.is_dir() else where.parent,
                self.state.round,
                self.out_dir,
                ckpt.get("client_state"),
                recorded="client_state" in ckpt,
                stateful=build.client_algorithm(json.loads(self.exp.spec_json)).stateful,
            )
        except client_state.MissingState as e:
            damaged = isinstance(e, client_state.DamagedState)
            consequence = (
                "no client's state was adopted. Resume from a run folder whose snapshot is whole"
                if damaged
                else "resuming would restart every client's state from zero. Resume from the run folder that "
                f"holds both (copy {client_state.CHECKPOINT_DIR}/ with checkpoint.pt)"
            )
            raise ConfigError(
                "resume",
                path,
                "a checkpoint together with its clients' state as it was written",
                f"{str(e)[:1].upper()}{str(e)[1:]}: {consequence}.",
            ) from None
        if self.state.target_reached is not None and self.state.target_reached.target != self.watch.target:
            self.state.target_reached = None  # reached for another target
        log.warning("resuming from %s at round %d", path, self.state.round)
        return ckpt["records"]

    # ------------------------------------------------------------------ the loop
    def on_round(self, record: dict, state: RunState) -> None:
        """After every round (or server model version): record, watch the target, checkpoint periodically."""
        self.recorder.log(record)
        self.callbacks.round(self.recorder.records[-1])
        self.watch(record, state, self.recorder.records[-1][schema.WALL_TIME])
        if self.give_up(record) and not state.stop_reason:
            state.stop_reason = self.give_up.why
        last = self.exp.loop.num_rounds
        if self.every and state.round > 0 and (state.round % self.every == 0 or state.round == last):
            self.save_checkpoint()
        errors.check_signals()  # a signal a finaliser swallowed ends the run here

    def save_checkpoint(self) -> None:
        """checkpoint.pt of the current state, with the count and digest of the records up to it (which stay in
        metrics.jsonl: the file does not grow with the run)."""
        history = self.recorder.history(self.state.round)
        # one unit: the clients' state of the round first, then checkpoint.pt, and only then older snapshots go
        clients = client_state.checkpoint(self.out_dir, self.state.round)
        checkpoint.save(self.ckpt_path, self.state, self.strategy, history, self.exp.resolved, clients)
        client_state.prune(self.out_dir, self.state.round)
        self.ckpt_round = self.state.round

    def server_main(self, grid: Grid, deployed: bool) -> None:
        """The synchronous or asynchronous loop on ``grid``."""
        e = self.exp
        if base.is_async(self.strategy):
            from fedsim.async_server import run_async

            wall = True if deployed else None  # deployment: real arrival order and wall-clock time
            args = (
                grid,
                e.loop,
                self.strategy,
                self.state,
                e.spec_json,
                e.evaluate_fn,
                e.clock,
                self.on_round,
            )
            run_async(*args, wall_clock=wall)
        else:
            run_sync(
                grid, e.loop, self.strategy, self.state, e.spec_json, e.evaluate_fn, e.clock, self.on_round
            )

    def execute(self, engine: EngineRunner, guard=None) -> str:
        """Run the loop on ``engine``; return the status (``completed``, ``stopped`` or ``interrupted``).

        An interrupt returns ``interrupted`` after rolling back to the end of the last completed round and
        writing a checkpoint there; any other exception rolls back the same way and propagates.
        """
        threaded = engine.name == "ray"  # Flower runs the ServerApp in a thread of its own there
        try:
            with _sigterm_kept_from_ray(threaded and guard is not None):
                engine.run(self._threaded_main(engine) if threaded else self._main(engine))
            errors.check_signals()
            if self.state.stop_reason:
                self._close_early_stop()
                return "stopped"
            return "completed"
        except KeyboardInterrupt as e:
            if guard is not None:
                guard.stopping()
            self._stop_server_thread()
            self.signal = e.signum if isinstance(e, Interrupted) else int(signal.SIGINT)
            self._roll_back()
            log.warning(
                "interrupted (%s): writing a checkpoint and the outputs of the %d rounds done",
                signal.Signals(self.signal).name,
                self.state.round,
            )
            self.save_checkpoint()
            return "interrupted"
        except BaseException:
            if guard is not None:
                guard.stopping()
            self._stop_server_thread()
            self._roll_back()
            raise

    def _main(self, engine: EngineRunner):
        return lambda grid: self.server_main(grid, engine.deployed)

    def _threaded_main(self, engine: EngineRunner):
        """The server loop for an engine that runs it in another thread: stoppable, and joined on a stop."""
        self._stop, self._server_started, self._server_done = (threading.Event() for _ in range(3))

        def main(grid: Grid) -> None:
            self._server_started.set()
            try:
                self.server_main(StoppableView(grid, self._stop), engine.deployed)
            finally:
                self._server_done.set()

        return main

    def _stop_server_thread(self, wait: float = 60.0) -> None:
        """Stop a server loop running in another thread and wait for it, before the state is rolled back."""
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        if self._server_started.is_set() and not self._server_done.wait(wait):
            log.warning("the server loop did not stop within %.0f s; writing the outputs anyway", wait)
        # Flower's simulation threads (message workers) end once its stop event is set; Ray is shut down only
        # when they have: shutting it down under a thread still waiting on an actor can crash the process
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join(timeout=10)
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception as e:  # noqa: BLE001  (the outputs matter more than a clean Ray exit)
            log.warning("Ray did not shut down cleanly: %s", _one_line(e))

    def _roll_back(self) -> None:
        """Return to the end of the last completed round (where resume continues) and forget later records."""
        if self.state.rollback is not None:
            self.strategy = checkpoint.restore(self.state.rollback, self.state, self.strategy)
        with contextlib.suppress(OutputError):  # reported when the outputs are written
            self.recorder.truncate(self.state.round)

    def _close_early_stop(self) -> None:
        """A stop before num_rounds: the final model is evaluated (eval_every or not) and checkpointed."""
        records = self.recorder.records
        if not records or records[-1][schema.ROUND] != self.state.round:
            return
        field = schema.eval_field(self.exp.task.metric)
        if records[-1].get(field) is None:
            loss, score = self.exp.evaluate_fn(self.state.arrays)
            self.recorder.amend({schema.EVAL_LOSS: loss, field: score})
        self.save_checkpoint()

    def trained_nothing(self) -> str | None:
        """Why a run whose every round was skipped failed (None when some round aggregated an update)."""
        done = [r for r in self.recorder.records if r[schema.ROUND] >= 1]
        if not done or any(r.get(schema.NUM_CLIENTS) and not r.get(schema.SKIPPED) for r in done):
            return None
        why: Counter = Counter()
        for r in done:
            why.update({f"client failures ({k})": n for k, n in (r.get(schema.FAILURE_KINDS) or {}).items()})
            why["dropped out"] += int(r.get(schema.DROPPED_OUT) or 0)
            why["past the deadline"] += int(r.get(schema.DROPPED_LATE) or 0)
            nobody = (
                r.get(schema.BYTES_DOWN) == 0
                and not r.get(schema.DROPPED_OUT)
                and not r.get(schema.DROPPED_LATE)
            )
            why["empty cohort"] += nobody  # nothing sent: e.g. DP's Poisson sampling drew no client
        causes = ", ".join(f"{k}: {n}" for k, n in why.items() if n) or "no valid replies"
        # under DP (noise) a round without a valid reply is not skipped: it releases the model plus its noise
        fate = (
            "were skipped"
            if all(r.get(schema.SKIPPED) for r in done)
            else "released DP noise alone or were skipped"
        )
        return (
            f"no round aggregated an update: all {len(done)} round(s) {fate} ({causes}); "
            f"check faults, heterogeneity (dropout_prob, deadline), min_replies and the clients"
        )

    # ------------------------------------------------------------------ outputs
    def finish(self, status: str, engine: str) -> dict:
        """model.pt, checkpoint.pt when due, summary.json, then curves.png and partitions.png (drawn by another
        process since the run began); return the summary.

        Each output is tried whatever happened before; a write failure is one line naming the file (the run
        then ends ``failed``); the plot is optional (a failure is a warning).
        """
        rec = self.recorder
        if status in ("completed", "stopped") and (why := self.give_up.why or self.trained_nothing()):
            status, self.error = "failed", why
        problems = []
        if rec.records:
            try:
                atomic_torch_save(self.state.arrays.to_torch_state_dict(), self.out_dir / "model.pt")
            except OutputError as e:
                problems.append(str(e))
        # checkpoint.pt always describes the run's last round: written on a failure too, and a checkpoint left in
        # the folder by an earlier run (or the one an in-place resume started from) is replaced
        stale = self.ckpt_path.exists() and self.ckpt_round != self.state.round
        if self.ckpt_round != self.state.round and (stale or (status == "failed" and self.state.round > 0)):
            try:
                self.save_checkpoint()
            except OutputError as e:
                problems.append(str(e))
        if problems and status in ("completed", "stopped"):
            status = "failed"
        if problems:
            self.error = "; ".join(([self.error] if self.error else []) + problems)
        reached = self.state.target_reached
        summary = rec.summary(
            {
                "status": status,
                "stop_reason": self.state.stop_reason,
                "error": self.error if status in ("failed", "interrupted") else None,
                "signal": signal.Signals(self.signal).name
                if status == "interrupted" and self.signal
                else None,
                "engine": engine,
                "choices": self.choices,
                f"target_{self.exp.task.metric}": self.watch.target,
                "target_round": reached.round if reached else None,
                "target_sim_time": reached.sim_time if reached else None,
                "target_wall_time": reached.wall_time if reached else None,
                **base.summary_fields(self.strategy),
                "config": redact(self.exp.resolved),  # without its secrets (schema.SECRET_KEYS)
                "versions": versions(),
            }
        )
        try:
            rec.write_summary(summary)
        except OutputError as e:
            summary["status"] = "failed"
            summary["error"] = "; ".join(x for x in (summary.get("error"), str(e)) if x)
        self.callbacks.end(summary)
        if self.callbacks.errors:  # tracking failed: the results are whole, the run's tracking is not
            summary["callback_errors"] = list(self.callbacks.errors)
            try:
                rec.write_summary(summary)
            except OutputError as e:
                log.warning("summary.json not updated with the callback errors: %s", e)
        title = " ".join(f"{k}={v}" for k, v in self.choices.items())
        curves = self.out_dir / "curves.png"
        asked = rec.records and self.figures is not None
        asked = asked and self.figures.draw(
            "curves", curves, records=rec.records, title=title, metric=rec.task.metric
        )
        if rec.records and not asked:
            try:
                rec.plot(title=title)
            except Exception as e:  # noqa: BLE001  (curves.png is optional: the run's results are written)
                curves.unlink(missing_ok=True)
                log.warning("curves.png not written: %s", _one_line(e))
        if self.figures is not None:
            worker, self.figures = self.figures, None
            drawn = worker.finish()
            for png in worker.unanswered:  # the worker ended before drawing them: drawn here instead
                drawn[png] = draw_here(Path(png), rec.records, title, rec.task.metric)
            for png, why in drawn.items():
                if why:  # optional pictures: the run's results are written
                    Path(png).unlink(missing_ok=True)
                    log.warning("%s not written: %s", Path(png).name, why)
        return summary


def versions() -> dict:
    """Versions of fedsim and its main dependencies, for summary.json."""
    import flwr

    return {
        "fedsim": __version__,
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def write_partition_stats(
    out_dir: Path,
    shares: list[np.ndarray],
    labels: np.ndarray,
    num_classes: int,
    figures: RunPictures | None = None,
) -> None:
    """partitions.json and partitions.png: size and label histogram of each client's share (before its
    train/validation split, which is made only for the clients a run samples).

    The picture is asked of ``figures`` (drawn while the run goes on; its ``finish()`` says whether it was
    written), else drawn here.
    """
    from fedsim.data.stats import partition_stats

    stats = partition_stats(shares, labels, num_classes)
    atomic_write_bytes(out_dir / "partitions.json", (json.dumps(stats) + "\n").encode())
    if figures is not None and figures.draw(
        "partitions", out_dir / "partitions.png", stats=str(out_dir / "partitions.json")
    ):
        return
    try:
        from fedsim.data.stats import plot_partitions

        plot_partitions(stats, out_dir / "partitions.png")
    except Exception as e:  # noqa: BLE001  (an optional figure)
        log.warning("partitions.png not written: %s", _one_line(e))


def start_figures() -> RunPictures | None:
    """The run's pictures, drawn by the process's figure worker (``fedsim.figures.for_run``), or None (they are
    drawn in the run's process) when none starts."""
    try:
        return for_run()
    except OSError as e:
        log.debug("pictures drawn in the run's process: %s", e)
        return None

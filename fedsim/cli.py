"""The ``fedsim`` command: Hydra's CLI around ``fedsim.run.run_experiment``.

``fedsim key=value ...`` runs one experiment; ``fedsim -m a=1,2 b=x,y`` sweeps (Hydra multirun) and writes
``sweep_summary.csv`` and ``sweep.png`` into the sweep folder. A bad config value stops the run before any
training with one line naming the key, the value and what is allowed, and exit status 2.

Exit status: 0 completed (or stopped early on purpose), 1 failed (one line ``fedsim: run failed: ...``; in a
sweep: any job failed), 2 config error, 128 + N interrupted by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)
with the outputs written.

Before Hydra writes anything (``.hydra/``, the log file), :func:`main` settles the run folder: it takes the
folder's lock (a second live run aimed at the same folder is refused with one line and exit 2, touching nothing),
gives a timestamped default folder that already exists a ``-1``, ``-2``, ... suffix (two runs started in the same
second get their own folders), and checks a ``resume`` against its checkpoint.
"""

from __future__ import annotations

import sys

if sys.argv and sys.argv[0].endswith(("/fedsim", "\\fedsim", "/fedsim/__main__.py")):  # the command itself:
    from fedsim.errors import interrupt_from_now_on  # a signal while the imports below run is a clean exit

    interrupt_from_now_on(importing=True)

import contextlib
import gc
import logging
import os
import signal
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedsim import errors, override_check
from fedsim.config import flower_env, quiet_loggers
from fedsim.errors import ConfigError, Interrupted, RunError
from fedsim.override_check import null_group
from fedsim.run_folder import COMPOSED, RUN_FOLDER, prepare_folders, undo_hydra_files  # noqa: F401

flower_env()
os.environ.setdefault("HYDRA_FULL_ERROR", "0")

EXIT_CONFIG = 2
EXIT_STATUS = 0  # set by the task: 128 + N for a run interrupted by signal N
TRACKING_FAILED: list[str] = []  # run folders whose callbacks (tracking) failed: the command exits 1


def progress_to_log_file() -> None:
    """Send the progress lines (``fedsim.progress``) to the job's log file (Hydra's ``cli.log``) too."""
    from fedsim.recorder import progress_log

    progress_log.setLevel(logging.INFO)
    progress_log.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def _task(cfg: DictConfig) -> float | None:
    """One Hydra job: run the experiment; return its objective for a sweeper (see :func:`objective`)."""
    redact_logs()  # also in a launcher's job process
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        summary = _run_job(cfg)
    else:
        from fedsim.sweep import job_slot

        with job_slot(hc.sweep.dir) as why:
            if why is not None:  # the sweep was stopped while this job waited in its launcher's queue
                _record_failure(Path(hc.runtime.output_dir), f"not started: the sweep was stopped by {why}")
                return None
            summary = _run_job(cfg)
    return None if summary is None else objective(summary, cfg)


def objective(summary: dict, cfg: DictConfig) -> float | None:
    """The float a sweeper optimises (Optuna's ``hydra/sweeper=optuna``): the summary field ``optimize_metric``
    names, by default the task's final metric (``final_eval_accuracy``); None when the run has no such value."""
    from fedsim.experiment import objective_key

    if summary.get("status") in ("failed", "interrupted"):
        return None
    value = summary.get(objective_key(cfg))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _warn_direction(cfg: DictConfig, hc) -> None:
    """Optuna minimises unless told otherwise; say so when the objective is a higher-is-better metric."""
    from fedsim.experiment import objective_higher_is_better, objective_key

    sweeper = hc.sweeper
    if "optuna" not in str(sweeper.get("_target_", "")).lower() or hc.job.get("num", 0) != 0:
        return
    direction = str(sweeper.get("direction", "minimize")).lower()
    if objective_higher_is_better(cfg) != direction.endswith("maximize"):
        key = objective_key(cfg)
        want = "maximize" if objective_higher_is_better(cfg) else "minimize"
        logging.getLogger("fedsim").warning(
            "the Optuna sweeper will %s %s; add hydra.sweeper.direction=%s to %s it",
            direction.rsplit(".", 1)[-1],
            key,
            want,
            want,
        )


def hide_secrets(cfg: DictConfig, hc) -> None:
    """Put ``<secret>`` in place of the secrets' values (``schema.SECRET_KEYS``) in the files Hydra wrote for this
    job (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) and the sweep's ``multirun.yaml`` (every
    value of a swept secret): the checkpoint keeps them, the run folder can be shared."""
    from fedsim import schema

    if not any(OmegaConf.select(cfg, key) is not None for key in schema.SECRET_KEYS):
        return
    files = list((Path(hc.runtime.output_dir) / ".hydra").glob("*.yaml"))
    if hc.mode == RunMode.MULTIRUN:
        files.append(Path(hc.sweep.dir) / "multirun.yaml")
    for path in files:
        schema.redact_file(path)


def redact_logs() -> None:
    """From now on every log record shows ``<secret>`` in place of a secret's value (Hydra's launchers log each
    job's overrides to the console and the log files)."""
    from fedsim import schema

    make = logging.getLogRecordFactory()
    if getattr(make, "redacting", False):
        return

    def factory(*args, **kwargs):
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001  (a record that cannot be formatted is logging's to report)
            return record
        hidden = schema.redact_text(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return record

    factory.redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def say(line: str) -> None:
    """Print one line of the command's to stderr, without a secret's value."""
    from fedsim import schema

    print(schema.redact_text(line), file=sys.stderr, flush=True)


def _run_job(cfg: DictConfig) -> dict | None:
    global EXIT_STATUS
    hc = HydraConfig.get()
    hide_secrets(cfg, hc)
    quiet_loggers()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:  # a sweep folder used again: no earlier job's result may stand for this one
        _warn_direction(cfg, hc)
        for name in ("summary.json", "error.txt"):
            (Path(hc.runtime.output_dir) / name).unlink(missing_ok=True)
    try:
        from fedsim.validate import validate

        validate(cfg)  # the run's own knobs first: a config error comes before torch and Flower are imported
        progress_to_log_file()
        from fedsim.run import run_experiment

        errors.raise_pending()
        summary = run_experiment(cfg, hc.runtime.output_dir, choices)
    except ConfigError as e:
        say(f"fedsim: config error: {e}")
        if not multirun:
            undo_hydra_files()
            sys.exit(EXIT_CONFIG)
        _record_failure(Path(hc.runtime.output_dir), f"config error: {e}")
    except RunError as e:
        say(f"fedsim: run failed: {e}")
        if not multirun:
            sys.exit(1)
        _record_failure(Path(hc.runtime.output_dir), f"run failed: {e}")
    except Exception as e:
        if not multirun:
            if os.environ.get("FEDSIM_TRACEBACK"):
                raise
            _single_run_failed(Path(hc.runtime.output_dir), e)
        logging.getLogger("fedsim").exception("run %s failed", hc.job.num)
        _record_failure(Path(hc.runtime.output_dir), f"{type(e).__name__}: {e}")
    else:
        if summary.get("status") == "interrupted":
            signum = _signal_number(summary.get("signal"))
            print(
                f"fedsim: interrupted by {signal.Signals(signum).name}: the outputs of the "
                f"{summary.get('rounds_done', 0)} rounds done are in {hc.runtime.output_dir} "
                f"(resume=PATH continues)",
                file=sys.stderr,
                flush=True,
            )
            EXIT_STATUS = 128 + signum
            from fedsim.sweep import BASIC_LAUNCHER

            # stop the sweep: the jobs after this one do not start (a launcher that runs jobs in other
            # processes is stopped by its parent, fedsim.sweep.SweepStop: the job just ends, its outputs written)
            if multirun and hc.launcher._target_ == BASIC_LAUNCHER:
                raise Interrupted(signum)
        else:
            if summary.get("callback_errors"):
                TRACKING_FAILED.append(str(Path(hc.runtime.output_dir).resolve()))
            line = outputs_line(summary, hc.runtime.output_dir)
            logging.getLogger("fedsim.progress").info(line)
            if not multirun:
                print(line, file=sys.stderr, flush=True)
        return summary
    return None


def outputs_line(summary: dict, out_dir: str | Path) -> str:
    """The run's last line: how it ended and where its outputs are (relative to the working directory)."""
    folder = Path(out_dir)
    with contextlib.suppress(ValueError):
        folder = folder.resolve().relative_to(Path.cwd())
    metric = next((k for k in summary if k.startswith("final_eval_") and summary[k] is not None), None)
    score = f", {metric[len('final_eval_') :]} {summary[metric]:.4f}" if metric else ""
    files = [f for f in ("metrics.jsonl", "summary.json", "model.pt", "curves.png") if (folder / f).exists()]
    return (
        f"fedsim: {summary.get('status')} after {summary.get('rounds_done', 0)} rounds{score}; "
        f"outputs in {folder}/ ({', '.join(files)})"
    )


def _single_run_failed(out_dir: Path, e: Exception) -> None:
    """A run that raised (the user's loader, model, task or callback; a bug): one line naming the file and line
    of the original error, exit status 1, and no half-written run folder: a folder holding only what Hydra wrote
    is put back as it was, any other gets a summary.json saying ``failed`` and why (unless the run wrote one).
    ``FEDSIM_TRACEBACK=1`` shows the whole traceback instead."""
    import json

    why = errors.where_it_failed(e)
    say(f"fedsim: run failed: {why} (FEDSIM_TRACEBACK=1 shows the traceback)")
    undo_hydra_files()
    summary = out_dir / "summary.json"
    if out_dir.is_dir() and not summary.exists():
        with contextlib.suppress(OSError):
            summary.write_text(json.dumps({"status": "failed", "error": why}, indent=2) + "\n")
    sys.exit(1)


def _signal_number(name: str | None) -> int:
    try:
        return int(signal.Signals[name]) if name else int(signal.SIGINT)
    except KeyError:
        return int(signal.SIGINT)


FAILED_JOBS: list[str] = []


def _record_failure(out_dir: Path, message: str) -> None:
    """In a sweep, a failed job leaves error.txt and a summary.json saying so; the other jobs go on."""
    import json

    from fedsim import schema

    message = schema.redact_text(message)
    FAILED_JOBS.append(str(out_dir.resolve()))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "error.txt").write_text(message + "\n")
    summary = out_dir / "summary.json"  # this job's own (removed at its start), with the rounds it did
    data = json.loads(summary.read_text()) if summary.exists() else {}
    data.update(status="failed", error=message)
    summary.write_text(json.dumps(data, indent=2) + "\n")


CONFIG_PATH = f"pkg://{override_check.CONFIG_MODULE}"


@hydra.main(version_base=None, config_path=CONFIG_PATH, config_name=override_check.CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> float | None:
    return _task(cfg)


def unknown_key(argv: list[str], remember: bool = False) -> str | None:
    """``fedsim.override_check.unknown_key``; with ``remember``, a command line that composes leaves its config
    in ``COMPOSED`` for :func:`prepare_folders` and :func:`run_composed` (the command's only composition)."""
    if remember:  # the job's name (hydra.job.name, the log file's name) as Hydra's own composition gives it
        from hydra.core.utils import JobRuntime

        JobRuntime().set("name", _task_name())
    return override_check.unknown_key(argv, into=COMPOSED if remember else None)


def _task_name() -> str:
    """The job name Hydra gives ``fedsim``'s task function (``cli``: the log file is ``cli.log``)."""
    from hydra._internal.utils import detect_calling_file_or_module_from_task_function, detect_task_name

    return detect_task_name(*detect_calling_file_or_module_from_task_function(_hydra_main.__wrapped__))


def plain_run(argv: list[str]) -> DictConfig | None:
    """The config the unknown-key check composed for ``argv``, when ``argv`` is a plain single run that
    :func:`run_composed` can run on it (no flag, no sweep, no debug logging of Hydra's); else None."""
    cfg = COMPOSED.pop(tuple(argv), None)
    if cfg is None or any(a.startswith("-") for a in argv):
        return None
    if cfg.hydra.mode not in (None, RunMode.RUN) or cfg.hydra.verbose:
        return None
    return cfg


def run_composed(cfg: DictConfig, extra: list[str]) -> None:
    """What ``@hydra.main`` does for a plain run (``_run_hydra``, ``Hydra.run``), on a config composed already.

    ``cfg`` is the unknown-key check's composition of the command line (run mode); ``extra`` are the hydra
    overrides :func:`prepare_folders` added to the command line, applied here as Hydra's composition applies them,
    followed by ``hydra.mode=RUN`` as Hydra adds it: the job's config and ``.hydra/`` files are those of
    ``@hydra.main``'s own composition, which is not made (it took 0.1-0.2 CPU s, twice).
    """
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        run_and_report,
    )
    from hydra.core.global_hydra import GlobalHydra

    calling = detect_calling_file_or_module_from_task_function(_hydra_main.__wrapped__)
    search_path = create_automatic_config_search_path(*calling, CONFIG_PATH)
    app = run_and_report(
        lambda: Hydra.create_main_hydra2(task_name=_task_name(), config_search_path=search_path)
    )
    try:
        run_and_report(
            lambda: _hydra_run(app, cfg, [*extra, *([] if cfg.hydra.mode else ["hydra.mode=RUN"])])
        )
    finally:
        GlobalHydra.instance().clear()


def _add_hydra_overrides(cfg: DictConfig, lines: list[str]) -> None:
    """Apply ``hydra.*`` override ``lines`` to a composed config as Hydra's composition does (recorded in
    ``hydra.overrides.hydra``, after the command line's own)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(lines)
    ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
    cfg.hydra.overrides.hydra.extend(lines)


def _hydra_run(app, cfg: DictConfig, overrides: list[str]) -> None:
    """``hydra._internal.hydra.Hydra.run`` after its composition (``overrides``, the hydra overrides the command
    line gained since, applied to ``cfg`` first): logging, callbacks, the job."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    _add_hydra_overrides(cfg, overrides)
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name=override_check.CONFIG_NAME)
    ret = run_job(
        hydra_context=HydraContext(config_loader=app.config_loader, callbacks=callbacks),
        task_function=_hydra_main.__wrapped__,
        config=cfg,
        job_dir_key="hydra.run.dir",
        job_subdir_key=None,
        configure_logging=True,
    )
    callbacks.on_run_end(config=cfg, config_name=override_check.CONFIG_NAME, job_return=ret)
    _ = ret.return_value  # a job that raised raises here, as in Hydra's run


def main() -> None:
    """Console entry point (``fedsim``)."""
    errors.interrupt_from_now_on()  # (already, when this module was imported by the command: see its top)
    try:
        _main()
    except KeyboardInterrupt as e:  # while it starts (imports, the config check), before _main handles it
        signum = e.signum if isinstance(e, Interrupted) else int(signal.SIGINT)
        print(f"fedsim: interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            undo_hydra_files()
        sys.exit(128 + signum)
    finally:
        skip_exit_collection()


def skip_exit_collection() -> None:
    """Let the interpreter end without its last garbage collection.

    Called when the command is done: the run's outputs are written and closed, and every file, lock and worker
    has been let go by its own code or by an ``atexit`` handler, which still run. The collection would walk every
    object torch, Flower, Hydra and matplotlib made (0.5-1 s of a one-minute run on 2 cores) to free memory that
    the operating system takes back at once. ``gc.freeze`` moves them out of its reach.
    """
    gc.freeze()


def _main() -> None:
    from fedsim import errors, sweep

    errors.IGNORE_AFTER_INTERRUPT = True
    argv = sys.argv[1:]
    redact_logs()
    msg = unknown_key(argv, remember=True) or null_group(argv)
    if msg:
        say(f"fedsim: config error: {msg}")
        sys.exit(EXIT_CONFIG)
    try:
        errors.raise_pending()  # check points of the start: a SIGTERM noted so far ends the command here
        extra = prepare_folders(argv)
        sys.argv += extra
        cfg = plain_run(argv)
        if cfg is not None:
            run_composed(cfg, extra)  # the config the check composed: no second and third composition
        else:
            _hydra_main()
        errors.raise_pending()  # one that came after the last run (or between its end and the exit)
    except ConfigError as e:
        say(f"fedsim: config error: {e}")
        sys.exit(EXIT_CONFIG)
    except BaseException as e:
        if sweep.STOP.signum is None and not isinstance(e, KeyboardInterrupt):
            if (
                sweep.STOP.sweep_dir is None
                or not isinstance(e, Exception)
                or os.environ.get("FEDSIM_TRACEBACK")
            ):
                raise
            _launcher_failed(e)
        # a signal: in this process's run (basic launcher), or passed on to the launcher's job processes,
        # whose end (a job interrupted, a worker gone) ends the launcher too
        signum = sweep.STOP.signum or (e.signum if isinstance(e, Interrupted) else int(signal.SIGINT))
        if not EXIT_STATUS:  # before any run had its outputs written: no folder of Hydra's files alone
            print(f"fedsim: interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                undo_hydra_files()
        if sweep.LAST_SWEEP is not None:
            sweep.LAST_SWEEP.summarise()
        _exit(128 + signum)
    if sweep.STOP.signum is not None:  # every job ended by itself after the signal reached it
        print(
            f"fedsim: sweep stopped by {signal.Signals(sweep.STOP.signum).name}", file=sys.stderr, flush=True
        )
        _exit(128 + sweep.STOP.signum)
    failed = sorted(set(FAILED_JOBS) | set(sweep.FAILED_JOBS))
    if failed:
        print(f"fedsim: {len(failed)} run(s) of the sweep failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    untracked = sorted(set(TRACKING_FAILED) | set(sweep.TRACKING_FAILED))
    if untracked:
        print(
            f"fedsim: tracking (logger= or callbacks=) failed for {len(untracked)} run(s); their results are "
            f"complete, their callback_errors in summary.json say why: {', '.join(untracked)}",
            file=sys.stderr,
        )
        sys.exit(1)
    if EXIT_STATUS:
        _exit(EXIT_STATUS)


def _launcher_failed(e: Exception) -> None:
    """A launcher that runs jobs in other processes raised (a job process ended without a result, e.g. killed by
    a signal while it started): one line, the sweep summary of what ran, exit status 1."""
    from fedsim import sweep

    why = errors.where_it_failed(e)
    if type(e).__name__ == "UncompletedJobError":
        why = f"a job process ended without a result (killed while it started?): {why}"
    say(f"fedsim: sweep failed: {why} (FEDSIM_TRACEBACK=1 shows the traceback)")
    if sweep.LAST_SWEEP is not None:
        with contextlib.suppress(Exception):
            sweep.LAST_SWEEP.summarise()
    sys.exit(1)


def _exit(status: int) -> None:
    """Exit with ``status`` after an interrupted run, whose outputs are written.

    With Ray loaded, its C++ runtime aborts the interpreter's teardown after a signal (exit status -6 instead
    of 128 + N): once the simulation's threads have stopped, Ray is shut down here (so that its processes do
    not outlive the run) and the process ends without that teardown.
    """
    if "ray" not in sys.modules:
        sys.exit(status)
    import threading

    for thread in threading.enumerate():  # Flower's simulation threads stop once their stop event is set
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=10)
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception as e:  # noqa: BLE001  (the outputs are written; this only tidies up)
        print(f"fedsim: Ray did not shut down cleanly: {e}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()

"""Hydra callback that summarises a multirun: ``sweep_summary.csv`` and ``sweep.png`` in the sweep folder."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fedsim import progress, schema
from fedsim.procs import descendants, is_own, start_time

COLUMNS = (
    "job",
    "overrides",
    "status",
    "final_eval_accuracy",  # the task's metric: final_eval_r2 and best_eval_r2 under task=regression
    "best_eval_accuracy",
    "rounds_done",
    schema.SIM_TIME,
    schema.WALL_TIME,
    "target_round",
    "target_sim_time",
    "final_epsilon",
    "total_bytes_up",
    "total_bytes_down",
    "delta",
    "accountant",
    "sampling",
    "error",
    "callback_errors",  # tracking that failed (the run's results are complete)
)


def collect(sweep_dir: Path, jobs: set[int] | None = None) -> list[dict]:
    """One row per job folder under ``sweep_dir`` (only the numbers in ``jobs`` when given): its overrides and
    the figures from its summary.json."""
    rows = []
    folders = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and p.name.isdigit() and (jobs is None or int(p.name) in jobs)
    ]
    for job in sorted(folders, key=lambda p: int(p.name)):
        over_file = job / ".hydra" / "overrides.yaml"
        given = [str(o) for o in OmegaConf.load(over_file)] if over_file.exists() else []
        row: dict[str, Any] = {
            "job": int(job.name),
            "overrides": " ".join(map(_redacted, given)),
            PARAMS: _params(given),
        }
        summ = job / "summary.json"
        if summ.exists():
            s = json.loads(summ.read_text())
            row.update({k: s.get(k) for k in COLUMNS if k in s})
            if isinstance(row.get("callback_errors"), list):
                row["callback_errors"] = "; ".join(row["callback_errors"])
            row.update({k: v for k, v in s.items() if _is_metric_column(k)})
            if row.get("status") == "failed" and (job / "error.txt").exists():
                row["error"] = (job / "error.txt").read_text().strip()
        else:
            err = job / "error.txt"
            row["status"] = "failed"
            row["error"] = err.read_text().strip() if err.exists() else "no summary.json (the job failed)"
        rows.append(row)
    return rows


PARAMS = "_params"  # a row's overrides as {key: value} (not a column)


SECRET_KEYS = ("noise_seed",)  # override keys whose values the summary never shows (a DP run's noise seed)


def _redacted(override: str) -> str:
    """An override as given, with a secret's value as ``<secret>``."""
    key, sep, _ = override.partition("=")
    return f"{key}=<secret>" if sep and key.lstrip("+~").rsplit(".", 1)[-1] in SECRET_KEYS else override


def _params(overrides: list[str]) -> dict[str, str]:
    """``["strategy=fedprox", "client.lr=0.1"]`` as ``{"strategy": "fedprox", "client.lr": "0.1"}`` (a secret's
    value as ``<secret>``)."""
    pairs = (_redacted(o).partition("=") for o in overrides)
    return {key.lstrip("+~"): value for key, sep, value in pairs if sep}


def swept_keys(rows: list[dict]) -> list[str]:
    """The override keys whose value differs between the rows (every override key of a one-job sweep), in
    the order they were given."""
    keys = list(dict.fromkeys(k for r in rows for k in r.get(PARAMS, {})))
    if len(rows) <= 1:
        return keys
    return [k for k in keys if len({r.get(PARAMS, {}).get(k) for r in rows}) > 1]


def write_summary(sweep_dir: Path, jobs: set[int] | None = None) -> list[dict]:
    """Write sweep_summary.csv and sweep.png for ``sweep_dir`` (the ``jobs`` of one multirun); return the rows.

    The CSV has one column per swept key (named as the key; ``param:KEY`` where that name is a summary
    column already) after ``job``, then the overrides and the figures.
    """
    rows = collect(sweep_dir, jobs)
    swept = swept_keys(rows)
    names = {k: (f"param:{k}" if k in COLUMNS or k.startswith(("final_", "best_")) else k) for k in swept}
    columns = columns_for(rows)
    columns = columns[:1] + [names[k] for k in swept] + columns[1:]
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            values = {names[k]: r[PARAMS].get(k, "") for k in swept}
            w.writerow({k: values.get(k, r.get(k, "")) for k in columns})
    plot_sweep(sweep_dir, rows, swept)
    return rows


def _is_metric_column(key: str) -> bool:
    return key.startswith(("final_eval_", "best_eval_")) and key != "final_eval_loss"


def metrics_of(rows: list[dict]) -> list[str]:
    """The tasks' metrics in the rows' summaries, in order of appearance (``accuracy`` when none has one)."""
    found = [k.removeprefix("final_eval_") for r in rows for k in r if k.startswith("final_eval_")]
    return list(dict.fromkeys(found)) or ["accuracy"]


def columns_for(rows: list[dict]) -> list[str]:
    """:data:`COLUMNS` with the accuracy columns replaced by the final and best value of each task metric."""
    head, tail = list(COLUMNS[:3]), list(COLUMNS[5:])
    return head + [f"{w}_eval_{m}" for m in metrics_of(rows) for w in ("final", "best")] + tail


def plot_sweep(sweep_dir: Path, rows: list[dict], swept: list[str] | None = None) -> list[str]:
    """sweep.png: each run's accuracy (the task's metric) against round and against simulated time; a curve is
    labelled by its swept values only, in a legend below the plots; return the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = metrics_of(rows)[0]
    field = schema.eval_field(metric)
    swept = swept_keys(rows) if swept is None else swept
    legend_rows = -(-len(rows) // 4)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5 + 0.25 * legend_rows), layout="constrained")
    for r in rows:
        path = sweep_dir / str(r["job"]) / "metrics.jsonl"
        if r.get("status") == "failed" or not path.exists():
            continue
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ev = [x for x in recs if x.get(field) is not None]
        values = [f"{k}={r.get(PARAMS, {}).get(k, '')}" for k in swept]
        label = " ".join(values) or f"job {r['job']}"
        axes[0].plot([x[schema.ROUND] for x in ev], [x[field] for x in ev], label=label)
        axes[1].plot([x.get(schema.SIM_TIME, 0) for x in ev], [x[field] for x in ev], label=label)
    axes[0].set(xlabel="round", ylabel=f"eval {metric}")
    axes[1].set(xlabel="simulated time (s)", ylabel=f"eval {metric}")
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # below both plots, never over a curve
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.savefig(sweep_dir / "sweep.png", dpi=100)
    plt.close(fig)
    return labels


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
FAILED_JOBS: list[str] = []  # job folders of the last summarised sweep that failed (any launcher)
TRACKING_FAILED: list[str] = []  # job folders whose tracking callbacks failed (results complete)
LAST_SWEEP: SweepSummary | None = None  # the multirun in progress (summarised by the CLI if it is cut short)


def expected_jobs(config: DictConfig, started: float | None = None) -> set[int] | None:
    """The job numbers of this multirun, whatever process its launcher ran them in.

    Hydra's basic sweeper numbers the jobs 0..N-1 over the cartesian product of the sweep overrides (and
    ``hydra.sweeper.params``), so N is computed from them. With another sweeper, the job folders whose
    ``.hydra/overrides.yaml`` was written after ``started`` are this multirun's. None when neither works.
    """
    try:
        if OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER:
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
            from hydra.core.override_parser.overrides_parser import OverridesParser

            params = OmegaConf.select(config, "hydra.sweeper.params") or {}
            args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
            batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
            return set(range(sum(len(b) for b in batches)))
    except Exception:  # noqa: BLE001  (fall back on the folders' times)
        pass
    if started is None:
        return None
    sweep_dir = Path(config.hydra.sweep.dir)
    found = set()
    for job in sweep_dir.iterdir() if sweep_dir.is_dir() else []:
        marker = job / ".hydra" / "overrides.yaml"
        if job.name.isdigit() and marker.exists() and marker.stat().st_mtime >= started - 2.0:
            found.add(int(job.name))
    return found or None


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def sweep_bar(config: DictConfig):
    """A progress bar over the sweep's jobs (``progress=bar``, or ``auto`` on a terminal), or None.

    Only where the jobs run in this process (Hydra's basic launcher), which is where their ends are seen; its
    length is the basic sweeper's job count or Optuna's ``n_trials`` (unknown otherwise: a counter).
    """
    import sys

    def chosen(key: str, default: Any) -> Any:  # the sweep's overrides are not in the config it starts with
        given = [
            o.split("=", 1)[1]
            for o in (OmegaConf.select(config, "hydra.overrides.task") or [])
            if o.startswith(f"{key}=")
        ]
        return given[-1] if given else OmegaConf.select(config, key, default=default)

    mode = str(chosen("progress", "auto"))
    if str(chosen("quiet", False)).lower() == "true" or mode == "lines":
        return None
    if mode != "bar" and not sys.stderr.isatty():
        return None
    if OmegaConf.select(config, "hydra.launcher._target_") != BASIC_LAUNCHER:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency; a broken environment still runs, without the sweep's bar
        return None

    jobs = (
        expected_jobs(config) if OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER else None
    )
    total = len(jobs) if jobs else OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
    return tqdm(total=total, unit="run", desc="sweep", position=0, file=sys.stderr, **progress.bar_shape())


class SweepSummary(Callback):
    """Writes the sweep summary when a multirun ends (failed jobs appear with their error).

    Only this multirun's jobs are summarised, also when ``hydra.sweep.dir`` already holds an earlier sweep's
    job folders, and also under launchers that run jobs in other processes (joblib, submitit), whose job
    callbacks this object never sees (:func:`expected_jobs`). The failed jobs are left in :data:`FAILED_JOBS`,
    so that the command exits non-zero whatever launcher ran them.
    """

    def __init__(self) -> None:
        self.jobs: set[int] = set()
        self.config: DictConfig | None = None
        self.started: float | None = None
        self.bar = None  # the sweep's progress bar (jobs done, ETA); each job's round bar sits below it

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global LAST_SWEEP
        self.jobs, self.config, self.started = set(), config, time.time()
        LAST_SWEEP = self
        self.bar = progress.SWEEP_BAR = sweep_bar(config)
        if OmegaConf.select(config, "hydra.launcher._target_") != BASIC_LAUNCHER:
            STOP.arm(Path(config.hydra.sweep.dir))  # jobs in other processes: the parent must pass signals on

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        num = OmegaConf.select(config, "hydra.job.num")
        if num is not None:
            self.jobs.add(int(num))

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            progress.SWEEP_BAR = None
            bar.close()
        self.summarise(config)

    def summarise(self, config: DictConfig | None = None) -> None:
        """Write sweep_summary.csv and sweep.png for this multirun's jobs; note the failed ones."""
        global LAST_SWEEP
        config = config if config is not None else self.config
        LAST_SWEEP = None
        if config is None:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        clean_jobs(sweep_dir)  # the entries of jobs killed outright (their own removal never ran)
        schema.redact_file(sweep_dir / "multirun.yaml")  # also when no job got to redact it (all refused)
        jobs = self.jobs or expected_jobs(config, self.started)
        rows = write_summary(sweep_dir, jobs)
        FAILED_JOBS[:] = [
            str((sweep_dir / str(r["job"])).resolve()) for r in rows if r.get("status") == "failed"
        ]
        TRACKING_FAILED[:] = [
            str((sweep_dir / str(r["job"])).resolve()) for r in rows if r.get("callback_errors")
        ]
        print(f"fedsim: sweep summary of {len(rows)} runs in {sweep_dir / 'sweep_summary.csv'}")


STOP_MARKER = ".fedsim-stop"  # in the sweep folder: the sweep was stopped; jobs not started yet do not start
JOBS_FOLDER = (
    ".fedsim-jobs"  # in the sweep folder: one file per running job, named by its process id, holding
)
# its start time (fedsim.procs.start_time): the parent signals only a process that is still that one and its own


def job_entries(sweep_dir: Path) -> list[tuple[Path, int, str]]:
    """The job list's entries: (file, process id, start time); a name that is not a process id counts as 0."""
    folder = sweep_dir / JOBS_FOLDER
    found = []
    for entry in folder.iterdir() if folder.is_dir() else []:
        if entry.name.startswith("."):  # an entry being written (see job_slot)
            continue
        try:
            pid, started = int(entry.name) if entry.name.isdigit() else 0, entry.read_text().strip()
        except OSError:
            continue
        found.append((entry, pid, started))
    return found


def clean_jobs(sweep_dir: Path) -> None:
    """Remove the entries whose process has ended (a job killed by SIGKILL, the OOM killer, leaves its entry):
    its number may be given to another process, which must never be signalled as a job."""
    import contextlib

    for entry, pid, started in job_entries(sweep_dir):
        if pid <= 1 or not started or start_time(pid) != started:
            with contextlib.suppress(OSError):
                entry.unlink()


class SweepStop:
    """Signals to the parent of a sweep whose launcher runs the jobs in other processes (joblib, submitit).

    SIGINT, SIGTERM and SIGHUP to the parent are passed on to every running job (each then ends as a single
    run does: outputs written, summary ``interrupted``), a marker in the sweep folder keeps queued jobs from
    starting, the sweep summary is written, and the command exits 128 + the signal. A second signal kills
    every process the parent started at once.
    """

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.signum: int | None = None
        self.sweep_dir: Path | None = None

    def arm(self, sweep_dir: Path) -> None:
        import os
        import signal
        import threading

        self.sweep_dir, self.signum = sweep_dir, None
        (sweep_dir / STOP_MARKER).unlink(missing_ok=True)
        clean_jobs(sweep_dir)
        # What escapes the launcher (a job process killed while it started: submitit's UncompletedJobError) is
        # left to the command's one line (fedsim.cli), not printed by Hydra as a traceback of its own.
        os.environ["HYDRA_FULL_ERROR"] = "1"
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.NAMES:
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        import contextlib
        import os
        import signal

        if self.signum is not None:  # a second signal: no more waiting
            for pid in descendants(os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        self.signum = signum
        if self.sweep_dir is None:
            return
        with contextlib.suppress(OSError):  # first the marker, then the running jobs (see job_slot)
            (self.sweep_dir / STOP_MARKER).write_text(signal.Signals(signum).name + "\n")
        me = os.getpid()
        family = set(descendants(me))
        for _, pid, started in job_entries(self.sweep_dir):
            if is_own(pid, started, me, family):  # never a stale entry's number, 0, -1, or a stranger
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
        clean_jobs(self.sweep_dir)


def stopped(sweep_dir: str | Path) -> str | None:
    """The signal that stopped the sweep in ``sweep_dir``, or None."""
    try:
        return (Path(sweep_dir) / STOP_MARKER).read_text().strip() or "a signal"
    except OSError:
        return None


def job_slot(sweep_dir: str | Path):
    """Context manager around one sweep job: the run's signal guard from the start, the job's process listed
    in the sweep folder for the parent to signal, and (as the value) the signal that stopped the sweep
    before this job began, or None.

    The job lists itself before it reads the stop marker, and the parent writes the marker before it reads
    the list: a job either sees the marker or receives the signal.
    """
    import contextlib
    import os

    from fedsim.errors import signals

    @contextlib.contextmanager
    def slot():
        folder = Path(sweep_dir) / JOBS_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        mine, tmp = folder / str(pid), folder / f".{pid}.tmp"
        with signals():
            tmp.write_text(f"{start_time(pid) or ''}\n")
            os.replace(tmp, mine)  # the parent reads a whole entry or none
            try:
                yield stopped(sweep_dir)
            finally:
                mine.unlink(missing_ok=True)

    return slot()


STOP = SweepStop()

"""Per-round callbacks: live tracking (TensorBoard, Weights & Biases, MLflow) and a user's own hooks.

A callback is any object with these methods (subclass :class:`Callback` and override what you need):

- ``on_run_start(out_dir, config, records)``: the run folder, the resolved config (a plain dict) and, for a
  resumed run, the records of the rounds already done;
- ``on_round(record)``: every metrics.jsonl record as it is written (round or server model version);
- ``on_run_end(summary)``: summary.json's content, once it is written.

The config names them: ``logger=tensorboard`` (or ``wandb``, ``mlflow``; ``none`` is the default) and
``callbacks=[{_target_: mymodule.MyCallback, key: value}]`` for your own. A callback that raises is reported
once, as a warning naming it, and not called again: tracking never costs a run its results. The failure is
kept in summary.json (``callback_errors``) and the ``fedsim`` command (a sweep too) then exits non-zero, so a
run whose tracking is incomplete is never mistaken for a fully logged one.

No callback sees a secret: the config and the summary they receive are :func:`redact`-ed (``SECRET_KEYS``,
e.g. the DP noise seed, which would let anyone remove the noise).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from fedsim import schema

log = logging.getLogger("fedsim")

__all__ = ["Callback", "Callbacks", "MLflow", "TensorBoard", "WandB", "flat_config", "redact", "scalars"]

SECRET_KEYS = (*schema.SECRET_KEYS, "noise_seed")  # dotted config paths, then summary fields: never exported


def redact(node: dict, prefix: str = "") -> dict:
    """A copy of a config or summary without the ``SECRET_KEYS`` (at any depth for a summary's ``config``)."""
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if key in SECRET_KEYS or (not prefix and k in SECRET_KEYS):
            continue
        out[k] = redact(v, f"{key}.") if isinstance(v, dict) else v
    return out


class Callback:
    """Does nothing; override the hooks you need (see the module docstring)."""

    def on_run_start(self, out_dir: Path, config: dict, records: list[dict]) -> None:
        """The run starts writing to ``out_dir``; ``records`` are those of a resumed run's earlier rounds."""

    def on_round(self, record: dict) -> None:
        """A round's (or server model version's) record, as written to metrics.jsonl."""

    def on_run_end(self, summary: dict) -> None:
        """The run's summary.json content."""


class Callbacks:
    """Calls every callback in order; one that raises is warned about once and dropped."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = list(callbacks)
        self.errors: list[str] = []  # "Name.hook: error", one per callback that failed (summary.json)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in list(self.callbacks):
            try:
                getattr(cb, hook)(*args)
            except Exception as e:  # noqa: BLE001  (tracking must not cost the run its results)
                self._failed(cb, hook, e)
                self.callbacks.remove(cb)

    def _failed(self, cb: Any, hook: str, e: BaseException) -> None:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        self.errors.append(f"{type(cb).__name__}.{hook}: {type(e).__name__}: {first}")
        log.warning("callback %s failed in %s and is off for this run: %s", type(cb).__name__, hook, first)

    def start(self, out_dir: Path, config: dict, records: list[dict]) -> None:
        self._call("on_run_start", out_dir, redact(config), records)

    def round(self, record: dict) -> None:
        self._call("on_round", record)

    def end(self, summary: dict) -> None:
        summary = {
            **redact(summary),
            **({"config": redact(summary["config"])} if "config" in summary else {}),
        }
        self._call("on_run_end", summary)
        for cb in self.callbacks:  # a logger's files are complete once the run has ended
            close = getattr(cb, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    self._failed(cb, "close", e)


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric fields of a record (nested dicts flattened as ``a/b``; booleans as 0/1; None left out)."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)):  # (booleans too: 0 or 1)
            out[f"{prefix}{k}"] = float(v)
    return out


def results(summary: dict) -> dict:
    """summary.json without the config, versions and choices it also holds (the run's results only)."""
    return {k: v for k, v in summary.items() if k not in ("config", "versions", "choices")}


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """The resolved config as ``dotted.key: value`` with values a tracker takes (numbers, strings, booleans);
    never a ``SECRET_KEYS`` entry."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if key in SECRET_KEYS:
            continue
        if isinstance(v, dict):
            out.update(flat_config(v, f"{key}."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif v is not None:
            out[key] = str(v)
    return out


def _need(module: str, extra: str, logger: str):
    """Import an optional tracker, or a one-line ConfigError naming the extra to install."""
    import importlib

    from fedsim.errors import ConfigError

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            "logger",
            logger,
            f'an installed tracker: pip install -e ".[{extra}]" (in the fedsim checkout)',
            f"{module} is not installed.",
        ) from None


class TensorBoard(Callback):
    """Event files in the run folder (``tensorboard --logdir outputs``): every metrics.jsonl field as a scalar
    against the round, and the run's hyperparameters (the resolved config) with the final metrics.

    Parameters
    ----------
    subdir : str
        Folder inside the run folder for the event files.
    """

    def __init__(self, subdir: str = "tensorboard") -> None:
        _need("tensorboard", "tensorboard", "tensorboard")
        self.subdir = subdir
        self.writer = None
        self.config: dict = {}

    def on_run_start(self, out_dir: Path, config: dict, records: list[dict]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / self.subdir))
        self.config = config
        for r in records:
            self.on_round(r)

    def on_round(self, record: dict) -> None:
        step = int(record.get("round", 0))
        for tag, value in scalars(record).items():
            if tag != "round" and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # live: TensorBoard shows each round as it ends

    def on_run_end(self, summary: dict) -> None:
        final = {f"hparam/{k}": v for k, v in scalars(results(summary)).items() if math.isfinite(v)}
        self.writer.add_hparams(flat_config(self.config), final or {"hparam/rounds_done": 0.0}, run_name=".")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Callback):
    """Weights & Biases (``pip install -e ".[wandb]"``): one wandb run per fedsim run, in ``mode`` (``offline``
    by default: files under the run folder, ``wandb sync`` uploads them later)."""

    def __init__(self, project: str = "fedsim", mode: str = "offline", entity: str | None = None) -> None:
        self.wandb = _need("wandb", "wandb", "wandb")
        self.project, self.mode, self.entity = project, mode, entity
        self.run = None

    def on_run_start(self, out_dir: Path, config: dict, records: list[dict]) -> None:
        self.run = self.wandb.init(
            project=self.project, entity=self.entity, mode=self.mode, dir=str(out_dir), config=config
        )
        for r in records:
            self.on_round(r)

    def on_round(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record.get("round", 0)))

    def on_run_end(self, summary: dict) -> None:
        self.run.summary.update(scalars(results(summary)))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MLflow(Callback):
    """MLflow (``pip install -e ".[mlflow]"``): params, per-round metrics and final metrics in a tracking store.

    ``tracking_uri`` null: a SQLite store ``mlflow.db`` in the run folder, or, in a sweep, one store in the
    sweep folder that all its jobs share (one MLflow run per job). Every call on a SQLite store holds a lock
    file beside it (``mlflow.db.lock``), so parallel jobs (``hydra/launcher=joblib``, ``submitit_local``) can
    share one store: SQLite and MLflow's schema migration do not take concurrent writers.
    """

    def __init__(self, experiment: str = "fedsim", tracking_uri: str | None = None) -> None:
        self.mlflow = _need("mlflow", "mlflow", "mlflow")
        self.experiment, self.tracking_uri = experiment, tracking_uri
        self.run_id: str | None = None
        self._lock_path: Path | None = None

    def on_run_start(self, out_dir: Path, config: dict, records: list[dict]) -> None:
        uri = self.tracking_uri or f"sqlite:///{default_store(Path(out_dir))}"
        if uri.startswith("sqlite:///"):
            self._lock_path = Path(uri[len("sqlite:///") :] + ".lock")
        with self._locked():
            self.mlflow.set_tracking_uri(uri)
            self.mlflow.set_experiment(self.experiment)
            run = self.mlflow.start_run(run_name=Path(out_dir).name)
            self.run_id = run.info.run_id
            params = flat_config(config)
            self.mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        for r in records:
            self.on_round(r)

    def _locked(self):
        """An exclusive lock on the SQLite store's lock file (a no-op for other stores)."""
        import contextlib

        if self._lock_path is None:
            return contextlib.nullcontext()
        return _file_lock(self._lock_path)

    def on_round(self, record: dict) -> None:
        values = {k.replace("/", "."): v for k, v in scalars(record).items() if math.isfinite(v)}
        with self._locked():
            self.mlflow.log_metrics(values, step=int(record.get("round", 0)), run_id=self.run_id)

    def on_run_end(self, summary: dict) -> None:
        values = {f"final.{k}": v for k, v in scalars(results(summary)).items() if math.isfinite(v)}
        with self._locked():
            self.mlflow.log_metrics(values, run_id=self.run_id)

    def close(self) -> None:
        if self.run_id is not None:
            with self._locked():
                self.mlflow.end_run()


def default_store(out_dir: Path) -> Path:
    """Where ``logger=mlflow`` keeps its SQLite store: the sweep folder in a Hydra multirun, else the run folder."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and Path(out_dir).resolve().parent == Path(hc.sweep.dir).resolve():
            return Path(hc.sweep.dir).resolve() / "mlflow.db"
    except ValueError:  # no Hydra job (the Python API)
        pass
    return Path(out_dir).resolve() / "mlflow.db"


class _file_lock:
    """``with _file_lock(path):`` holds an exclusive ``flock`` on ``path`` (created), across processes."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, None

    def __enter__(self):
        import fcntl
        import os

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        import os

        os.close(self.fd)  # closing the descriptor releases the lock

"""The ``fedsim`` command: Hydra's CLI around ``fedsim.run.run_experiment``.

``fedsim key=value ...`` runs one experiment; ``fedsim -m a=1,2 b=x,y`` sweeps (Hydra multirun) and writes
``sweep_summary.csv`` and ``sweep.png`` into the sweep folder. A bad config value stops the run before any
training with one line naming the key, the value and what is allowed, and exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fedsim.config import compose, flower_env
from fedsim.errors import ConfigError, RunError

flower_env()
os.environ.setdefault("HYDRA_FULL_ERROR", "0")

EXIT_CONFIG = 2


def quiet_loggers() -> None:
    """Keep the console to fedsim's progress lines: Flower's INFO chatter and deprecation notices off."""
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(logging.ERROR)
    flwr_log.propagate = False
    for name in ("alembic", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _task(cfg: DictConfig) -> dict | None:
    from fedsim.run import run_experiment

    hc = HydraConfig.get()
    quiet_loggers()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:  # a sweep folder used again: no earlier job's result may stand for this one
        for name in ("summary.json", "error.txt"):
            (Path(hc.runtime.output_dir) / name).unlink(missing_ok=True)
    try:
        return run_experiment(cfg, hc.runtime.output_dir, choices)
    except ConfigError as e:
        print(f"fedsim: config error: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(EXIT_CONFIG)
        _record_failure(Path(hc.runtime.output_dir), f"config error: {e}")
    except RunError as e:
        print(f"fedsim: run failed: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(1)
        _record_failure(Path(hc.runtime.output_dir), f"run failed: {e}")
    except Exception as e:
        if not multirun:
            raise
        logging.getLogger("fedsim").exception("run %s failed", hc.job.num)
        _record_failure(Path(hc.runtime.output_dir), f"{type(e).__name__}: {e}")
    return None


FAILED_JOBS: list[str] = []


def _record_failure(out_dir: Path, message: str) -> None:
    """In a sweep, a failed job leaves error.txt and a summary.json saying so; the other jobs go on."""
    import json

    FAILED_JOBS.append(str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "error.txt").write_text(message + "\n")
    summary = out_dir / "summary.json"  # this job's own (removed at its start), with the rounds it did
    data = json.loads(summary.read_text()) if summary.exists() else {}
    data.update(status="failed", error=message)
    summary.write_text(json.dumps(data, indent=2) + "\n")


@hydra.main(version_base=None, config_path="pkg://fedsim.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> dict | None:
    return _task(cfg)


def _all_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        path = f"{prefix}{k}"
        keys.append(path)
        if isinstance(v, DictConfig):
            keys += _all_keys(v, path + ".")
    return keys


def unknown_key(argv: list[str]) -> str | None:
    """A message for the first ``key=value`` override whose key is not in the config, with the closest key."""
    import difflib
    from importlib.resources import files

    from omegaconf import OmegaConf

    overrides = [a for a in argv if "=" in a and not a.startswith(("-", "+", "~", "hydra.", "hydra/"))]
    conf = files("fedsim.conf")
    groups = {p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")}
    for o in overrides:  # every option named for a group (each one of a sweep's a,b,c) must exist
        group, _, value = o.partition("=")
        if group not in groups or "(" in value or "$" in value:
            continue  # Hydra's sweep functions (choice(...), range(...)) and interpolations: left to Hydra
        options = sorted(
            f.name.rsplit(".", 1)[0] for f in (conf / group).iterdir() if f.name.endswith(".yaml")
        )
        for v in value.split(","):
            if v.strip() not in (*options, "null"):
                return f"{group}={v.strip()!r} is not allowed: expected one of {', '.join(options)}"
    picks = [o.split(",")[0] for o in overrides if o.split("=", 1)[0] in groups]
    try:
        cfg = compose(*picks)
    except Exception:  # noqa: BLE001  (an unknown group option: Hydra's own message lists the options)
        return None
    known = _all_keys(cfg)
    for o in overrides:
        key = o.split("=", 1)[0]
        if key in groups or OmegaConf.select(cfg, key, default="__missing__") != "__missing__":
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return (
            f"unknown config key '{key}'{hint}; `fedsim --cfg job` prints every key "
            f"(use +{key}=... to add a new one on purpose)"
        )
    return None


def main() -> None:
    """Console entry point (``fedsim``)."""
    msg = unknown_key(sys.argv[1:])
    if msg:
        print(f"fedsim: config error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    _hydra_main()
    if FAILED_JOBS:
        print(
            f"fedsim: {len(FAILED_JOBS)} run(s) of the sweep failed: {', '.join(FAILED_JOBS)}",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()

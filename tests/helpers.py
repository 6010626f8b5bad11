"""Helpers shared by the tests: fedsim's config composed with overrides, tiny runs, reading a run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fedsim import schema
from fedsim.config import FLOWER_ENV, compose

# Small enough for a 2-core machine: a few clients, two rounds.
TINY = ["num_clients=6", "clients_per_round=3", "num_rounds=2", "quiet=true"]


def compose_cfg(*overrides: str):
    """fedsim's config with ``overrides`` (as on the command line)."""
    return compose(*overrides)


class NoPictures:
    """Stands in for the process that draws a run's ``partitions.png`` and ``curves.png`` (fedsim.figures): the run
    asks for its pictures as always and nothing draws them (tests/conftest.py puts it in for every test not
    marked ``pictures``)."""

    unanswered: tuple = ()  # pictures the worker left undrawn (fedsim.run draws those itself)

    def draw(self, *args, **kwargs) -> bool:
        return True

    def finish(self, timeout: float = 0.0) -> dict:
        return {}

    def cancel(self) -> None:
        pass


def run_tiny(out_dir: Path, *overrides: str) -> dict:
    """Run a tiny experiment in-process; return its summary."""
    from fedsim.run import run_experiment

    return run_experiment(compose_cfg(*TINY, *overrides), out_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def without_wall_time(records: list[dict]) -> list[dict]:
    """Records with the wall-clock fields removed (they differ between identical runs)."""
    return [{k: v for k, v in r.items() if k not in schema.WALL_CLOCK} for r in records]


def fedsim_cli(*args: str, cwd: Path, background: bool = False, timeout: float = 600, **popen):
    """Run the ``fedsim`` command in ``cwd``: its ``CompletedProcess``, or the running ``Popen`` (``background``).

    ``popen`` goes to ``subprocess`` (e.g. ``preexec_fn`` to set a resource limit).
    """
    cmd = [sys.executable, "-m", "fedsim", *args]
    env = {**os.environ, **FLOWER_ENV}
    if background:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **popen)

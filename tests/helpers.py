"""Helpers shared by the tests: fedsim's config composed with overrides, tiny runs, reading a run folder."""

from __future__ import annotations

import json
from pathlib import Path

from fedsim import schema
from fedsim.config import compose

# Small enough for a 2-core machine: a few clients, two rounds.
TINY = ["num_clients=6", "clients_per_round=3", "num_rounds=2", "quiet=true"]


def compose_cfg(*overrides: str):
    """fedsim's config with ``overrides`` (as on the command line)."""
    return compose(*overrides)


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

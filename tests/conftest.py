"""Shared fixtures: offline Flower settings, Hydra composition of fedsim's configs, tiny runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

for _var, _val in (
    ("FLWR_TELEMETRY_ENABLED", "0"),
    ("FLWR_DISABLE_UPDATE_CHECK", "1"),
    ("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1"),
    ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0"),
):
    os.environ.setdefault(_var, _val)

import pytest  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

# Small enough for a 2-core machine: a few clients, two rounds.
TINY = ["num_clients=6", "clients_per_round=3", "num_rounds=2", "quiet=true"]


def compose_cfg(*overrides: str):
    """Compose fedsim's config with ``overrides`` (Hydra's compose API)."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="fedsim.conf", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def run_tiny(out_dir: Path, *overrides: str) -> dict:
    """Run a tiny experiment in-process; return its summary."""
    from fedsim.run import run_experiment

    cfg = compose_cfg(*TINY, *overrides)
    return run_experiment(cfg, out_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def without_wall_time(records: list[dict]) -> list[dict]:
    """Records with the wall-clock fields removed (they differ between identical runs)."""
    return [{k: v for k, v in r.items() if k not in ("wall_time", "round_time")} for r in records]


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture
def tiny_run():
    return run_tiny

"""The ``fedsim`` command: Hydra's CLI around ``fedsim.run.run_experiment``.

``fedsim key=value ...`` runs one experiment; ``fedsim -m a=1,2 b=x,y`` sweeps (Hydra multirun) and writes
``sweep_summary.csv`` and ``sweep.png`` into the sweep folder. A bad config value stops the run before any
training with one line naming the key, the value and what is allowed, and exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys

for _var, _val in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"),
                   ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0"), ("HYDRA_FULL_ERROR", "0")):
    os.environ.setdefault(_var, _val)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from fedsim.errors import ConfigError  # noqa: E402

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
    try:
        return run_experiment(cfg, hc.runtime.output_dir, choices)
    except ConfigError as e:
        print(f"fedsim: config error: {e}", file=sys.stderr, flush=True)
        if hc.mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and the sweep goes on; the summary marks it
        sys.exit(EXIT_CONFIG)


@hydra.main(version_base=None, config_path="pkg://fedsim.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> dict | None:
    return _task(cfg)


def main() -> None:
    """Console entry point (``fedsim``)."""
    _hydra_main()


if __name__ == "__main__":
    main()

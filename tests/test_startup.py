"""Start-up: the ``fedsim`` command imports only what a run uses (behaviour, not timing).

``import fedsim.cli`` (what the command runs first) must not import torch, Flower or numpy: a config error is
reported before them. The default command, run to its end in a fresh process, must not import what only other
settings use: plotting (in a separate process), scikit-learn and SciPy (data sets that need them), DP
accounting, Ray and Flower's simulation (``engine=ray``), the loggers' clients (``logger=...``), the sweepers'
and launchers' libraries, and torch's compiler stack (``placement.deterministic`` alone imports it).
"""

import json
import os
import subprocess
import sys

import pytest

from fedsim.config import FLOWER_ENV

NOT_ON_THE_CLI_PATH = ("torch", "flwr", "numpy", "matplotlib", "sklearn", "scipy", "ray")
NOT_IN_A_DEFAULT_RUN = (
    "matplotlib",
    "sklearn",
    "scipy",
    "pandas",
    "PIL",
    "torchvision",
    "dp_accounting",
    "ray",
    "flwr.simulation",
    "tensorboard",
    "torch.utils.tensorboard",
    "wandb",
    "mlflow",
    "optuna",
    "joblib",
    "submitit",
    "torch._dynamo",
    "torch._inductor",
)


def _modules(code: str, *args: str, cwd=None) -> set[str]:
    env = {**os.environ, **FLOWER_ENV, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def _loaded(modules: set[str], name: str) -> bool:
    return name in modules or any(m.startswith(name + ".") for m in modules)


def test_importing_the_cli_loads_no_heavy_module():
    mods = _modules("import json, sys, fedsim.cli; print(json.dumps(sorted(sys.modules)))")
    assert "fedsim.cli" in mods and "hydra" in mods  # the probe sees what was imported
    assert [m for m in NOT_ON_THE_CLI_PATH if _loaded(mods, m)] == []


@pytest.mark.slow  # one short run of the fedsim command in a fresh process
def test_the_default_command_imports_nothing_it_does_not_use(tmp_path):
    code = (
        "import json, sys\n"
        "import fedsim.cli as cli\n"
        "sys.argv = ['fedsim', 'num_rounds=2', 'quiet=true', 'hydra.run.dir=' + sys.argv[1]]\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    mods = _modules(code, str(tmp_path / "run"), cwd=tmp_path)
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert "torch" in mods and "fedsim.engines.vectorized" in mods  # the run ran in this process
    assert [m for m in NOT_IN_A_DEFAULT_RUN if _loaded(mods, m)] == []

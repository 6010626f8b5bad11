"""fedsim: federated-learning simulation on Flower, PyTorch and Hydra.

Run an experiment from Python::

    from fedsim.config import compose
    from fedsim.run import run_experiment

    summary = run_experiment(compose("strategy=fedprox", "num_rounds=5"), "outputs/fedprox")
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__version__ = "0.2.0"


def _sibling_strategies() -> None:
    """Serve ``fedsim.strategies`` from ``strategies/`` beside this package, where that folder exists.

    The wheel installs the repository's top-level ``strategies/`` as ``fedsim/strategies``. A source checkout
    used without installing, or a Flower App bundle unpacked on a SuperLink (which puts its own ``fedsim/`` first
    on the path), has the folder beside the package instead.
    """
    here = Path(__file__).resolve().parent
    folder = here.parent / "strategies"
    if (
        (here / "strategies").is_dir()
        or not (folder / "base.py").is_file()
        or "fedsim.strategies" in sys.modules
    ):
        return
    spec = importlib.util.spec_from_file_location(
        "fedsim.strategies", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fedsim.strategies"] = module
    spec.loader.exec_module(module)


_sibling_strategies()

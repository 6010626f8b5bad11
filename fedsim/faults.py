"""The old import path of fault injection (``fedsim.faults.FaultRates`` in users' code), kept as names only:
the feature lives in ``fedsim.features.faults``."""

from fedsim.features.faults.client import KINDS, FaultRates, SimulatedTimeout  # noqa: F401

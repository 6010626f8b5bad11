"""Constructor checks for strategies: fedsim's one set of range checks (``fedsim.checks``)."""

from fedsim.checks import integer, number

__all__ = ["integer", "number"]

"""Range checks of config values: each raises one ``ConfigError`` naming the key, the value and what is allowed.

Every group (strategies, data sets, partitioners, heterogeneity, engines, the run's own knobs) checks its
numbers through these two functions. Booleans are never numbers here; numpy scalars are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsim.errors import ConfigError


def is_number(value: Any) -> bool:
    """True for an int, float or numpy number that is not a boolean."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def is_integer(value: Any) -> bool:
    """True for an int or numpy integer that is not a boolean."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def number(
    key: str,
    value: Any,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
    allow_none: bool = False,
) -> float | None:
    """``value`` as a float if it is a finite number in the interval, else ``ConfigError(key, ...)``.

    ``what`` replaces the generated description of what is allowed; ``allow_none`` lets ``None`` through.
    """
    if value is None and allow_none:
        return None
    ok = is_number(value) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left = "(" if lo_open or lo == -math.inf else "["  # an infinite end is never in the interval
        right = ")" if hi_open or hi == math.inf else "]"
        raise ConfigError(key, value, what or f"a number in {left}{lo:g}, {hi:g}{right}")
    return float(value)


def integer(
    key: str, value: Any, lo: int, hi: int | None = None, *, what: str = "", allow_none: bool = False
) -> int | None:
    """``value`` if it is an integer in ``[lo, hi]``, else ``ConfigError(key, ...)`` (see :func:`number`)."""
    if value is None and allow_none:
        return None
    if not is_integer(value) or value < lo or (hi is not None and value > hi):
        raise ConfigError(
            key, value, what or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
        )
    return int(value)

"""Constructor checks that raise ``ConfigError`` naming the YAML key and the allowed range."""

from __future__ import annotations

import math
from typing import Any

from fedsim.errors import ConfigError


def number(
    key: str,
    value: Any,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite number in the interval, else ``ConfigError(key, ...)``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(key, value, f"a number in {left}{lo:g}, {hi:g}{right}")
    return float(value)


def integer(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` if it is an integer in ``[lo, hi]``, else ``ConfigError(key, ...)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise ConfigError(key, value, f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
    return value

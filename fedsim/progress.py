"""Progress bars on stderr: their size, and the sweep's bar a run's bar sits below.

A bottom-layer module (no fedsim imports): ``fedsim.sweep`` opens the sweep's bar and records it here;
``fedsim.recorder`` draws each run's bar below it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SWEEP_BAR: Any = None  # the bar of the multirun in progress (set by fedsim.sweep), or None


def bar_shape() -> dict:
    """tqdm's size arguments for stderr: its own (it follows the window) on a terminal with a size; a fixed
    100x24 on one that reports none (a pseudo-terminal without a window), where tqdm would draw nothing."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        sized = size.columns > 0 and size.lines > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    return {"dynamic_ncols": True} if sized else {"ncols": 100, "nrows": 24}

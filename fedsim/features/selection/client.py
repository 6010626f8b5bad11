"""The client half of ``selection=power_of_choice``: a loss probe is answered on the training split."""

from __future__ import annotations

from typing import Any

from fedsim import keys
from fedsim.algorithms.halves import ClientHalf


class ProbeTrain(ClientHalf):
    """Power of choice's client half: a loss probe (``probe-train-loss``) is answered on the training split."""

    def eval_data(self, config: Any, x_train, y_train, x_val, y_val) -> tuple | None:
        return (x_train, y_train) if config.get(keys.PROBE_TRAIN) else None

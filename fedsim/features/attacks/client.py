"""The client half of ``attack=label_flip``: the attackers named in the train config train on flipped labels.

The server half (``fedsim.features.attacks.server.LabelFlip``) names the attackers' partition ids in every
train message; this half flips a client's labels when its own id is among them.
"""

from __future__ import annotations

from typing import Any

import torch

from fedsim import keys
from fedsim.algorithms.halves import ClientHalf


class FlipLabels(ClientHalf):
    """``attack=label_flip``'s client half: the attackers named in the train config train on ``C - 1 - y``
    (batched too: the engine asks every client's labels)."""

    keys = (keys.LABEL_FLIP,)

    def active(self, ins: Any) -> bool:
        return bool(ins.unhandled.get(keys.LABEL_FLIP))

    def labels(self, ins: Any, partition_id: int, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        if partition_id not in (ins.unhandled.get(keys.LABEL_FLIP) or ()):
            return y
        return flip_labels(y, num_classes)


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Label flipping: class ``c`` becomes ``num_classes - 1 - c``."""
    return (num_classes - 1) - y

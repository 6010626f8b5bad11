"""The old import path of client selection (``fedsim.selection.PowerOfChoice`` in users' configs and code),
kept as names only: the feature lives in ``fedsim.features.selection`` (``server``: the wrapper; ``client``:
the loss probe's half)."""

from fedsim.features.selection.server import PowerOfChoice, draw_candidates, highest_loss  # noqa: F401

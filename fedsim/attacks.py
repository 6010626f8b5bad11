"""The old import path of the attacks (``fedsim.attacks.SignFlip`` in users' configs and code), kept as names
only: the feature lives in ``fedsim.features.attacks`` (``server``: the wrappers; ``client``: label flipping's
client half)."""

from fedsim.features.attacks.server import (  # noqa: F401  (re-exported)
    ALIE,
    IPM,
    Attack,
    Gaussian,
    LabelFlip,
    Scale,
    SignFlip,
    alie,
    alie_z,
    ipm,
    malicious_clients,
)

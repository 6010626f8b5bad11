"""The old import path of compression (``fedsim.compression.TopK`` in users' configs and code), kept as names
only: the feature lives in ``fedsim.features.compression`` (``server``: the wrappers; ``client``: the
encoder; the codecs are ``fedsim.codecs``)."""

from fedsim.features.compression.server import QSGD, TopK, qsgd, qsgd_decode, topk, topk_decode  # noqa: F401

"""Client algorithms: the client half of an FL algorithm, the way a strategy is the server half.

See :mod:`fedsim.algorithms.base` for the contract; :class:`~fedsim.algorithms.base.LocalSGD` (every local
optimiser, FedProx's proximal term, averaged SGD) and
:class:`~fedsim.features.scaffold.client.Scaffold` use it.
"""

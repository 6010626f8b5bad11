"""Features, each in one folder with both its halves.

``client.py`` is what a client runs for the feature (a client half, ``fedsim.algorithms.halves.ClientHalf``,
or a client algorithm, ``fedsim.algorithms.base.ClientAlgorithm``); ``server.py`` is what the server runs (an
update wrapper, ``fedsim.strategies.wrapper.Wrapper``, or a strategy). The server half imports its client half
and names it (``client_half = FlipLabels``, ``client_algorithm``); a client half imports nothing server-side.
No ``__init__`` here imports anything, so a ClientApp that builds a client half loads no server code.
"""

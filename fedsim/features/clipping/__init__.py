"""Clipping and DP (``clipping=``): the server's wrappers (``server``: FixedClipping, AdaptiveClipping, on the
round pipeline of ``wrapper`` with ``rows`` and ``accounting``; ``privacy_table``: the privacy page's table)
and the client half (``client``: client-side clipping, in every run's chain)."""

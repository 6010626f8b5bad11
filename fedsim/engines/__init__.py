"""Engines: what executes the ClientApp for the server loop.

Local engines are Flower ``Grid`` implementations living in the server's process; ``ray`` is Flower's
simulation engine (``fedsim.engines.ray``); deployment gets its Grid from the SuperLink.
"""

from __future__ import annotations

from flwr.serverapp import Grid

LOCAL_ENGINES = ("inprocess",)


def local_grid(name: str, num_clients: int, params: dict) -> Grid:
    """The Grid of local engine ``name`` for ``num_clients`` virtual nodes; ``params`` is the ``engine`` group."""
    from fedsim.client_app import app as client_app

    if name == "inprocess":
        from fedsim.engines.inprocess import InProcessGrid

        return InProcessGrid(client_app, num_clients)
    raise ValueError(f"unknown local engine {name!r}")

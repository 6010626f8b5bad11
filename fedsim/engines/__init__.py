"""Engines: what executes the ClientApp for the server loop.

Local engines are Flower ``Grid`` implementations living in the server's process; ``ray`` is Flower's
simulation engine (``fedsim.engines.ray``); deployment gets its Grid from the SuperLink.

* ``inprocess``: ``fedsim.engines.pool.PoolGrid``, the ClientApp sequentially in the server's process
  (``engine.workers: 1``) or in N persistent worker processes (``engine.workers: N``).
* ``vectorized``: ``fedsim.engines.vectorized.VectorizedGrid``, a cohort's train messages as one batched
  model (``torch.func.vmap``); whatever it cannot batch runs like ``inprocess``.
"""

from __future__ import annotations

from flwr.serverapp import Grid

LOCAL_ENGINES = ("inprocess", "vectorized")


def local_grid(name: str, num_clients: int, params: dict) -> Grid:
    """The Grid of local engine ``name`` for ``num_clients`` virtual nodes; ``params`` is the ``engine`` group.

    The Grid may hold worker processes: call its ``close()`` when done (it also closes itself when garbage
    collected and at interpreter exit).
    """
    workers = params.get("workers", 1)
    if name == "inprocess":
        from fedsim.engines.pool import PoolGrid

        return PoolGrid(num_clients, workers=workers)
    if name == "vectorized":
        from fedsim.engines.vectorized import VectorizedGrid

        return VectorizedGrid(
            num_clients,
            threads=params.get("threads"),
            max_cohort=params.get("max_cohort") or 0,
            vmap_conv_cpu=bool(params.get("vmap_conv_cpu", False)),
        )
    raise ValueError(f"unknown local engine {name!r}")

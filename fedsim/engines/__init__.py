"""Engines: what executes the ClientApp for the server loop. :class:`EngineRunner` owns the choice.

Local engines are Flower ``Grid`` implementations living in the server's process; ``ray`` is Flower's
simulation engine (``fedsim.engines.ray``); deployment gets its Grid from the SuperLink.

* ``inprocess``: ``fedsim.engines.pool.PoolGrid``, the ClientApp sequentially in the server's process
  (``engine.workers: 1``) or in N persistent worker processes (``engine.workers: N``).
* ``vectorized``: ``fedsim.engines.vectorized.VectorizedGrid``, a cohort's train messages as one batched
  model (``torch.func.vmap``, or grouped convolutions for Sequential conv nets on the CPU); whatever it cannot
  batch runs like ``inprocess``.
* ``auto`` (the default): the fastest local engine for the run's client work. Every train message that can be
  batched is (the vectorized engine), the rest go through the ClientApp (on ``engine.workers`` processes when
  > 1): measured per round on 2 CPU cores, batching is 1.3-2x faster than per-client training for the MLP and
  the small CNN, and never slower, since what it cannot batch takes the per-client path anyway. Batched
  results equal the per-client ones to float rounding (summation order), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.serverapp import Grid

from fedsim.groups import EngineSettings, Placement, resolve_threads
from fedsim.keys import NODE_STATE_DIR

LOCAL_ENGINES = ("auto", "inprocess", "vectorized")


def local_grid(settings: EngineSettings, num_clients: int, node_config: dict | None = None) -> Grid:
    """The Grid of local engine ``settings.name`` for ``num_clients`` virtual nodes.

    The Grid may hold worker processes: call its ``close()`` when done (it also closes itself when garbage
    collected and at interpreter exit).
    """
    if settings.name == "inprocess":
        from fedsim.engines.pool import PoolGrid

        return PoolGrid(num_clients, workers=settings.workers, node_config=node_config)
    if settings.name in ("vectorized", "auto"):
        from fedsim.engines.vectorized import VectorizedGrid

        return VectorizedGrid(
            num_clients,
            workers=settings.workers if settings.name == "auto" else 1,
            threads=resolve_threads(settings.threads),  # None: the cores free now
            max_cohort=settings.max_cohort,
            vmap_conv_cpu=settings.vmap_conv_cpu,
            node_config=node_config,
        )
    raise ValueError(f"unknown local engine {settings.name!r}")


class EngineRunner:
    """Runs the server's main function on the chosen engine: a local grid, Ray, or a deployment's grid.

    Everything an engine can check without running (Ray's address and resources) is checked here, when the
    runner is made, before the run writes any output.
    """

    def __init__(
        self,
        settings: EngineSettings,
        placement: Placement,
        num_clients: int,
        grid: Grid | None = None,
        state_dir: str | None = None,
    ):
        self.settings, self.num_clients, self.grid = settings, num_clients, grid
        # local engines keep the clients' persistent state in the run folder (O(cohort) memory)
        self.node_config = {NODE_STATE_DIR: str(state_dir)} if state_dir else {}
        self.name = "deployment" if grid is not None else settings.name
        self.backend: dict | None = None
        if self.name == "ray":
            from fedsim.engines import ray

            self.backend = ray.backend_config(
                placement.num_cpus_per_client,
                placement.num_gpus_per_client,
                address=settings.address,
                num_cpus=settings.num_cpus,
                num_gpus=settings.num_gpus,
            )
            ray.check_placement(placement)
            ray.preflight(self.backend)

    @property
    def deployed(self) -> bool:
        """True when real SuperNodes run the clients (wall-clock time, real arrival order)."""
        return self.grid is not None

    def run(self, server_main: Callable[[Grid], None]) -> None:
        """Call ``server_main(grid)`` with this engine's grid; stop the engine's workers afterwards."""
        if self.grid is not None:
            server_main(self.grid)
        elif self.name == "ray":
            from fedsim.engines import ray

            ray.run(self.num_clients, server_main, self.backend)
        else:
            local = local_grid(self.settings, self.num_clients, self.node_config)
            try:
                server_main(local)
            finally:
                getattr(local, "close", lambda: None)()  # stop worker processes, also after errors
                from fedsim.build import release_client_tasks

                release_client_tasks()  # the clients' data leaves the device when the run (or sweep job) ends
